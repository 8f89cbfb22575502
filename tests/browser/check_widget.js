const { chromium } = require('playwright-core');
(async () => {
  const browser = await chromium.launch({ executablePath: '/usr/bin/chromium',
    args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking', '--disable-component-update', '--disable-sync', '--no-first-run'] });
  const page = await browser.newPage({ viewport: { width: 1400, height: 1000 } });
  const nb = process.env.NB || '08_slots_queue_and_continuous_batching';   // NB=07_... for another notebook
  await page.goto(`http://localhost:8899/lab/tree/${nb}.ipynb`);
  await page.locator('.jp-Notebook').last().waitFor({ timeout: 60000 });   // (a restored workspace may hold others)
  await page.waitForTimeout(8000);
  await page.click('text=Run', { timeout: 10000 });
  await page.click('text=Run All Cells', { timeout: 10000 });
  // wait until the kernel is idle and the widget appears
  const slider = await page.waitForSelector('.widget-slider .noUi-handle, .widget-slider input, .jupyter-widgets .widget-hslider', { timeout: 240000 });
  await page.waitForTimeout(5000);
  const imgs = async () => await page.$$eval('.jp-OutputArea-output img', els => els.map(e => e.src.length + ':' + e.src.slice(-40)));
  const plays = await page.$$('.widget-play, .jupyter-widgets button');
  console.log('sliders found', (await page.$$('.widget-slider')).length, 'play/buttons', plays.length);
  const before = await imgs();
  await slider.scrollIntoViewIfNeeded();
  await page.screenshot({ path: `./${nb}_widget_before.png` });
  await slider.click();
  for (let i = 0; i < 5; i++) await page.keyboard.press('ArrowRight');
  await page.waitForTimeout(6000);
  const after = await imgs();
  const label = await page.$$eval('.widget-readout', els => els.map(e => e.textContent));
  console.log('readouts', JSON.stringify(label));
  console.log('images before', before.length, 'after', after.length);
  const changed = before.filter((x, i) => after[i] !== x).length + Math.abs(after.length - before.length);
  console.log('images changed:', changed);
  await slider.scrollIntoViewIfNeeded(); await page.waitForTimeout(1000); await page.screenshot({ path: `./${nb}_widget_after.png` });
  const errors = await page.$$eval('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]', els => els.map(e => e.textContent.slice(0, 200)));
  console.log('stderr outputs:', JSON.stringify(errors).slice(0, 600));
  await browser.close();
})().catch(e => { console.error('FAILED', e); process.exit(1); });

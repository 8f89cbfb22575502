// The trace explorer in a real browser (headless Chromium, playwright-core): it plays with no
// kernel. Two modes:
//   HTML=/path/to/export.html node check_explorer.js    a static `jupyter nbconvert --to html` export
//   NB=08_slots_queue_and_continuous_batching node check_explorer.js
//                                                       JupyterLab on :8899: Run All, then play the
//                                                       explorer while the kernel runs the later cells
// For every explorer on the page (ALL=0: the first only): the controls appear (its script ran),
// play moves the frame on its own, pause stops it, next / ArrowRight / Home / the slider move it,
// the keys do not move the notebook's active cell, ids are unique, and nothing is fetched from
// the network. Screenshots: <name>_explorer_before.png, <name>_explorer_after.png (OUT=. by default).
// Exit status 1 when a check fails.
const { chromium } = require('playwright-core');
const path = require('path');

(async () => {
  const out = process.env.OUT || '.';
  const html = process.env.HTML;
  const nb = process.env.NB || '08_slots_queue_and_continuous_batching';
  const name = html ? path.basename(html, '.html') + '_html' : nb + '_lab';
  const browser = await chromium.launch({ executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
    args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking',
           '--disable-component-update', '--disable-sync', '--no-first-run'] });
  const page = await browser.newPage({ viewport: { width: 1400, height: 1000 } });
  const errors = [], fetched = [];
  page.on('pageerror', e => errors.push('pageerror: ' + e.message));
  page.on('console', m => { if (m.type() === 'error' && !m.text().startsWith('Failed to load resource'))
    errors.push('console: ' + m.text().slice(0, 200)); });
  // What the page around the explorer asks for is not the explorer's: nbconvert's template
  // (require.js, MathJax, the widget manager for other outputs), the Colab badge. Anything else fails.
  const around = /require\.js|mathjax|@jupyter-widgets\/html-manager|colab-badge\.svg/i;
  page.on('request', r => { const u = r.url();
    if (!/^(file|data|blob):/.test(u) && !u.startsWith('http://localhost:8899') && !around.test(u)) fetched.push(u); });
  const failures = [];
  const check = (ok, what) => { console.log((ok ? 'ok   ' : 'FAIL ') + what); if (!ok) failures.push(what); };

  let kernelBusyAtPlay = null;
  if (html) {
    await page.goto('file://' + path.resolve(html));
    await page.waitForSelector('.pagedlab-explorer .pl-controls', { state: 'visible', timeout: 30000 });
  } else {
    await page.goto(`http://localhost:8899/lab/tree/${nb}.ipynb`);
    await page.locator('.jp-Notebook').last().waitFor({ timeout: 60000 });
    await page.waitForTimeout(8000);
    await page.click('text=Run', { timeout: 10000 });
    await page.click('text=Run All Cells', { timeout: 10000 });
    await page.waitForSelector('.pagedlab-explorer .pl-controls', { state: 'visible', timeout: 300000 });
  }

  const ids = await page.$$eval('.pagedlab-explorer', els => els.map(e => e.id));
  console.log('explorers:', ids.length, JSON.stringify(ids));
  check(ids.length >= 1 && new Set(ids).size === ids.length, 'explorers found, ids unique');
  const which = process.env.ALL === '0' ? ids.slice(0, 1) : ids;

  for (const [k, id] of which.entries()) {
    const root = page.locator('#' + id);
    const state = () => root.evaluate(r => {
      const vis = [...r.querySelectorAll('img.pl-frame')].filter(i => getComputedStyle(i).display !== 'none');
      const cells = [...document.querySelectorAll('.jp-Notebook .jp-Cell')];
      return { frame: Number(r.getAttribute('data-frame')), frames: r.querySelectorAll('img.pl-frame').length,
               visible: vis.map(i => Number(i.getAttribute('data-index'))), step: vis.map(i => i.getAttribute('data-step')).join(),
               src: vis.map(i => i.src.length + ':' + i.src.slice(-16)).join(), label: r.querySelector('.pl-label').textContent,
               play: r.querySelector('.pl-play').textContent,
               staticNote: getComputedStyle(r.querySelector('.pl-static')).display,
               activeCell: cells.findIndex(c => c.classList.contains('jp-mod-active')),
               kernel: (document.querySelector('.jp-Notebook-ExecutionIndicator') || { getAttribute: () => null }).getAttribute('data-status') };
    });
    await root.scrollIntoViewIfNeeded();
    const s0 = await state();
    console.log(`[${id}] start`, JSON.stringify(s0));
    check(s0.visible.length === 1 && s0.staticNote === 'none', `[${k}] one frame shown, controls on, no-JavaScript note hidden`);
    if (k === 0) {
      await root.evaluate(r => r.scrollIntoView({ block: 'start' }));
      await page.screenshot({ path: path.join(out, `${name}_explorer_before.png`) });
    }

    await root.locator('button[data-act="first"]').click();
    await root.locator('button[data-act="play"]').click();
    kernelBusyAtPlay = (await state()).kernel;
    await page.waitForTimeout(2000);
    const s1 = await state();
    const others = await page.$$eval('.pagedlab-explorer', (els, me) => els.filter(e => e.id !== me)
      .map(e => e.getAttribute('data-frame')), id);
    console.log(`[${id}] after 2 s of play`, JSON.stringify(s1));
    check(s1.frame >= Math.min(3, s0.frames - 1) && s1.src !== s0.src || s0.frames < 2,
          `[${k}] play advances the picture on its own (frame 0 -> ${s1.frame} in 2 s at 400 ms a frame)`);
    const othersAfter = await page.$$eval('.pagedlab-explorer', (els, me) => els.filter(e => e.id !== me)
      .map(e => e.getAttribute('data-frame')), id);
    if (others.length) check(JSON.stringify(others) === JSON.stringify(othersAfter),
                             `[${k}] the other explorers stay where they are (${JSON.stringify(othersAfter)})`);
    await root.locator('button[data-act="play"]').click();                 // pause
    const s2 = await state();
    await page.waitForTimeout(1200);
    const s3 = await state();
    check(s3.frame === s2.frame && s3.play.includes('play'), `[${k}] pause stops it (frame ${s2.frame} stays)`);

    await root.locator('button[data-act="next"]').click();
    const s4 = await state();
    check(s4.frame === Math.min(s3.frame + 1, s0.frames - 1) && s4.label.startsWith('step ' + s4.step + ' '),
          `[${k}] next: frame ${s3.frame} -> ${s4.frame}, label "${s4.label}"`);
    await page.keyboard.press('ArrowRight');                                // focus is on the next button, inside the explorer
    const s5 = await state();
    check(s5.frame === Math.min(s4.frame + 1, s0.frames - 1), `[${k}] ArrowRight: frame ${s4.frame} -> ${s5.frame}`);
    if (!html) check(s5.activeCell === s4.activeCell, `[${k}] the arrow key did not move the notebook's active cell (${s4.activeCell} -> ${s5.activeCell})`);
    await page.keyboard.press('Home');
    const s6 = await state();
    check(s6.frame === 0, `[${k}] Home: frame ${s6.frame}`);
    await root.locator('input.pl-slider').fill(String(s0.frames - 1));
    const s7 = await state();
    check(s7.frame === s0.frames - 1, `[${k}] slider to the end: frame ${s7.frame}, label "${s7.label}"`);
    await root.locator('input.pl-slider').fill(String(s0.frame));
    if (k === 0) {
      await root.locator('button[data-act="next"]').click();
      await page.waitForTimeout(300);
      await root.evaluate(r => r.scrollIntoView({ block: 'start' }));
      await page.screenshot({ path: path.join(out, `${name}_explorer_after.png`) });
    }
  }
  if (!html) console.log('kernel status when play was pressed:', kernelBusyAtPlay);
  check(errors.length === 0, 'no page errors: ' + JSON.stringify(errors).slice(0, 600));
  check(fetched.length === 0, 'nothing fetched from the network: ' + JSON.stringify(fetched.slice(0, 5)));
  await browser.close();
  console.log(failures.length ? `${failures.length} check(s) failed` : 'all checks passed');
  process.exit(failures.length ? 1 : 0);
})().catch(e => { console.error('FAILED', e); process.exit(1); });

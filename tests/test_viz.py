"""pagedlab.viz (pagedlab.course.viz) and pagedlab.course.figures: the drawings work on real traces, headless."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from pagedlab import LLM, course, viz  # noqa: E402


@pytest.fixture(scope="module")
def trace():
    llm = LLM("random:tiny", device="cpu", max_num_seqs=3, num_blocks=10, trace=True,
              show_progress=False, attention_backend="torch")
    prompts, params = course.toy_workload(6, prompt_len=(10, 30), new_tokens=(10, 30), seed=3)
    llm.generate(prompts, params)
    return llm.trace


def test_toy_workload_is_deterministic():
    a, b = course.toy_workload(5, seed=7), course.toy_workload(5, seed=7)
    assert a[0] == b[0] and [p.max_new_tokens for p in a[1]] == [p.max_new_tokens for p in b[1]]
    assert all(3 <= t < 500 for p in a[0] for t in p)


def test_choose_model_small(monkeypatch):
    monkeypatch.delenv("PAGEDLAB_MODEL", raising=False)
    assert course.choose_model(small=True, verbose=False) == "random:tiny"
    monkeypatch.setenv("PAGEDLAB_MODEL", "random:llama-3.2-1b")
    assert course.choose_model(small=True, verbose=False) == "random:llama-3.2-1b"


def test_drawings(trace):
    figs = [viz.draw_timeline(trace), viz.draw_timelines({"a": trace, "b": trace}),
            viz.draw_utilization({"a": trace}), viz.draw_pool_usage(trace),
            viz.draw_block_table(trace[5].block_table, trace[5].slot_request),
            viz.draw_step(trace, 0), viz.draw_step(trace, len(trace) - 1),
            viz.draw_bars({"x": 1.0, "y": 2.0}, "units"),
            viz.draw_fragmentation({"c": 10, "p": 10}, {"c": 40, "p": 12}),
            viz.draw_bandwidth({"gqa": {"1x64": 10.0}, "naive": {"1x64": 2.0}}, 20.0),
            viz.draw_lines({"a": ([1, 2], [3, 4])}, "x", "y"),
            viz.draw_safetensors_layout(100, [("a", 0, 50), ("b", 50, 80)], 188),
            viz.draw_overlap(0.13, 0.91)]
    for f in figs:
        assert len(viz.fig_to_png(f)) > 1000
        plt.close(f)


def test_pool_owners_match_pool_used(trace):
    for s in trace.steps:
        owners = viz.pool_owners(s.block_table, s.slot_request, s.pool_total)
        assert sum(o is not None for o in owners) == s.pool_used


def test_explore_trace_static_fallback(trace, monkeypatch):
    monkeypatch.setenv("PAGEDLAB_STATIC", "1")
    fig = viz.explore_trace(trace, start=3)
    assert fig is not None
    plt.close(fig)
    with pytest.raises(ValueError):
        viz.explore_trace(type(trace)(2, 16, 4))


def test_figures_command(tmp_path):
    from pagedlab.course import figures
    paths = figures.make_all(tmp_path)
    assert {p.name for p in paths} >= {"slot_timeline.png", "static_vs_continuous.png",
                                        "block_table.png", "trace_step.png", "preemption_pool.png",
                                        "paging_concept.png", "slot_states.png", "preemption_cycle.png",
                                        "gqa_heads.png", "online_softmax.png", "llama_layer.png"}
    assert all(p.stat().st_size > 5000 for p in paths)


@pytest.mark.parametrize("host,gpu", [(0.13, 0.91), (0.5, 0.3), (0.2, 0.2)])
def test_overlap_schedule(host, gpu):
    n = 7
    seq = viz.overlap_schedule(host, gpu, n, overlap=False)
    ovl = viz.overlap_schedule(host, gpu, n, overlap=True)
    assert max(s[3] for s in seq) == pytest.approx(n * (host + gpu))
    # overlapped: bound by the slower side, plus one of the other to fill the pipe
    assert max(s[3] for s in ovl) == pytest.approx(min(host, gpu) + n * max(host, gpu))
    for spans in (seq, ovl):
        gpu_spans = sorted((a, b) for lane, _, a, b in spans if lane == "GPU")
        host_spans = sorted((a, b) for lane, _, a, b in spans if lane == "host")
        for lane in (gpu_spans, host_spans):           # a lane does one thing at a time
            assert all(b0 <= a1 + 1e-12 for (_, b0), (a1, _) in zip(lane, lane[1:]))
        for k in range(n):                              # a step runs after its host work
            h = [s for s in spans if s[0] == "host" and s[1] == k][0]
            g = [s for s in spans if s[0] == "GPU" and s[1] == k][0]
            assert g[2] >= h[3] - 1e-12
            if k >= 2:       # the host reads step k-2's token before its work for step k ends
                assert h[3] >= [s for s in spans if s[0] == "GPU" and s[1] == k - 2][0][3]


# ----------------------------------------------------------------------------- the explorer's promises
def test_palette_distinct_for_64_requests():
    colors = [viz.request_color(r) for r in range(64)]
    assert len(set(colors)) == 64
    assert viz.IDLE not in colors and viz.FREE not in colors and viz.SHARED not in colors
    assert viz.request_color(64) == viz.request_color(0)          # then it repeats, by id modulo 64
    assert viz.req_name(7) == "req 7"


@pytest.fixture(scope="module")
def tight_trace():
    llm = LLM("random:tiny", device="cpu", max_num_seqs=4, num_blocks=9, trace=True,
              show_progress=False, attention_backend="torch")
    prompts, params = course.toy_workload(8, seed=3, prompt_len=(10, 30), new_tokens=(20, 40))
    outs = llm.generate(prompts, params)
    assert sum(o.num_preemptions for o in outs) > 0                  # the fixture must preempt
    return llm.trace


def test_timeline_marks_preemptions_where_the_trace_records_them(tight_trace):
    t = tight_trace
    fig = viz.draw_timeline(t)
    ax = fig.axes[0]
    marks = [c for c in ax.collections if c.get_gid() == "preemption"]
    assert len(marks) == 1
    xs = sorted(round(float(x)) for x, _ in marks[0].get_offsets())
    want = sorted(i for i, s in enumerate(t.steps) for _ in s.preempted)
    assert xs == want and want
    for x, y in marks[0].get_offsets():             # in the row of the slot the victim held just before
        x, row = round(float(x)), int(y)
        assert any(t.steps[x - 1].slot_request[row] == rid for rid in t.steps[x].preempted)
    assert ax.get_legend() is not None and any("preempted" in tx.get_text() for tx in ax.get_legend().get_texts())
    plt.close(fig)


def test_step_has_legend_naming_requests_and_colours_them_apart(tight_trace):
    t = tight_trace
    i = next(i for i, s in enumerate(t.steps) if s.preempted)
    fig = viz.draw_step(t, i, show_time=False)
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    texts = [tx.get_text() for lg in legends for tx in lg.get_texts()]
    s = t.steps[i]
    in_view = {r for r in list(s.slot_request) + list(s.queue) if r is not None}
    assert {f"req {r}" for r in in_view} <= set(texts)
    assert "free block" in texts and "past the pool" in texts and "preempted" in texts
    swatches = {tx.get_text(): h.get_facecolor() for lg in legends
                for tx, h in zip(lg.get_texts(), lg.legend_handles) if tx.get_text().startswith("req ")}
    assert len({tuple(c) for c in swatches.values()}) == len(swatches)   # distinct requests, distinct colours
    plt.close(fig)


@pytest.mark.parametrize("n", [9, 64, 100, 1000])
def test_pool_panel_any_size(n):
    owners = [None] * n
    for b in range(0, n, 3):
        owners[b] = b % 5
    fig = viz.draw_pool(owners)
    ax = fig.axes[0]
    if n <= viz.SMALL_POOL:                 # numbered grid; the cells past the pool are not "free"
        free = [p for p in ax.patches if p.get_gid() == "free"]
        missing = [p for p in ax.patches if p.get_gid() == "missing"]
        assert len(free) == sum(o is None for o in owners)
        ncols = round(ax.get_xlim()[1])
        assert len(missing) == (-n) % ncols
        assert all(p.get_facecolor() != free[0].get_facecolor() for p in missing)
        assert {tx.get_text().split("\n")[0] for tx in ax.texts} == {str(b) for b in range(n)}
    else:                                   # a compact bar, one column per block
        assert ax.images and ax.images[0].get_array().shape[1] == n and not ax.texts
    assert len(viz.fig_to_png(fig)) > 1000
    plt.close(fig)


# ----------------------------------------------------------------------------- the browser explorer
import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
from html.parser import HTMLParser  # noqa: E402
from pathlib import Path  # noqa: E402

from pagedlab.trace import Trace  # noqa: E402


@pytest.fixture(scope="module")
def ring(trace):
    """The tiny trace's last 12 steps in a ring that dropped the older ones: step numbers that are
    not the indices (trace[0].step == 37)."""
    r = Trace(trace.num_slots, trace.block_size, trace.num_blocks, max_steps=12)
    for s in trace.steps:
        r.append(s)
    assert len(r) == 12 and r[0].step == len(trace) - 12
    return r


@pytest.fixture(scope="module")
def explorer(ring):
    return viz.explore_trace(ring, start=4, progress=False)


def _frames(html: str) -> list[dict]:
    class P(HTMLParser):
        def __init__(self):
            super().__init__()
            self.imgs = []

        def handle_starttag(self, tag, attrs):
            a = dict(attrs)
            if tag == "img" and "pl-frame" in a.get("class", ""):
                self.imgs.append(a)
    p = P()
    p.feed(html)
    return p.imgs


def test_explorer_one_frame_per_step_labelled_with_the_engines_step(ring, explorer):
    e = explorer
    assert isinstance(e, viz.TraceExplorer) and e._repr_html_() == e.html
    imgs = _frames(e.html)
    assert len(imgs) == len(ring) == e.html.count("data:image/png;base64,")
    assert [int(a["data-step"]) for a in imgs] == [s.step for s in ring.steps] == e.steps
    assert e.steps[0] == ring[0].step != 0                       # the engine's numbers, not indices
    assert all(a["src"].startswith("data:image/png;base64,") for a in imgs)
    visible = [a for a in imgs if "display:block" in a["style"]]
    assert len(visible) == 1 and int(visible[0]["data-index"]) == 4      # `start` is an index
    assert "Frames skipped" not in e.html and not e.skipped
    # self-contained: one inline script, nothing fetched, no widgets
    assert e.html.count("<script") == 1 and "<script src" not in e.html
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", e.html)
    assert "widget" not in e.html
    assert 1_000 < e.nbytes < 60_000 * len(ring)                 # ~20 KB a frame at dpi 80
    assert "12 frames of 12 steps" in repr(e)


def test_explorer_frame_subsampling_keeps_first_last_and_start():
    for n in (1, 2, 5, 49, 100, 101, 439, 10_000):
        for m in (2, 3, 10, 100):
            for keep in (0, n // 3, n - 1):
                got = viz.explorer_frames(n, m, keep=keep)
                assert got == sorted(set(got)) and got[0] == 0 and got[-1] == n - 1
                assert len(got) == min(n, m)
                if m > 2 or n <= m:
                    assert keep in got, (n, m, keep)
    assert viz.explorer_frames(7, None) == list(range(7))
    with pytest.raises(ValueError):
        viz.explorer_frames(10, 1)


def test_explorer_subsampled_html(trace):
    e = viz.explore_trace(trace, start=20, max_frames=5, progress=False)
    events = viz.event_steps(trace)
    want = viz.explorer_frames(len(trace), 5, keep=20, events=events)
    imgs = _frames(e.html)
    assert [int(a["data-index"]) for a in imgs] == want and 20 in want
    assert set(events) <= set(want) and len(want) < len(trace)      # no finish or preemption skipped
    assert [int(a["data-step"]) for a in imgs] == [trace[i].step for i in want] == e.steps
    assert e.skipped and f"Frames skipped: {len(want)} of the trace's 49 steps" in e.html
    assert "every step where a request is preempted or finishes" in e.html


def test_explorer_frames_keep_every_event_and_stay_bounded():
    events = [3, 4, 5, 77, 78, 500, 9_998]
    got = viz.explorer_frames(10_000, 10, keep=5_000, events=events)
    assert set(events) <= set(got) and {0, 5_000, 9_999} <= set(got) and len(got) <= 10 + len(events)
    many = list(range(0, 10_000, 3))                                 # more events than can be drawn
    got = viz.explorer_frames(10_000, 10, events=many)
    assert len(got) <= 10 + viz.EXPLORER_MAX_EVENT_FRAMES and got[0] == 0 and got[-1] == 9_999


def test_explorer_frames_match_a_fresh_drawing(tight_trace):
    """The explorer paints every frame with one figure, updated in place and blitted: each frame
    must look like draw_step's fresh figure of that step (a stale title, label or cell would not)."""
    import io

    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from PIL import Image
    t = tight_trace
    idx = [0, next(i for i, s in enumerate(t.steps) if s.preempted), len(t) // 2, len(t) - 1]
    fig = Figure(figsize=(12, 7.2))
    FigureCanvasAgg(fig)
    painter = viz.StepPainter(t, fig)
    box = fig.bbox_inches
    frames = [np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=int)
              for png in painter.frames(idx, box, dpi=60, colors=None)]
    for i, got in zip(idx, frames):
        fresh = Figure(figsize=(12, 7.2))
        FigureCanvasAgg(fresh)
        viz.draw_step(t, i, fig=fresh)
        want = np.asarray(Image.open(io.BytesIO(viz.fig_to_png(fresh, dpi=60, bbox_inches=None))).convert("RGB"),
                          dtype=int)
        assert got.shape == want.shape
        differ = (np.abs(got - want).sum(-1) > 60).mean()
        assert differ < 0.0004, (i, differ)
    assert (np.abs(frames[0] - frames[1]).sum(-1) > 60).mean() > 0.005      # and the frames do change


def test_why_a_slot_waits(tight_trace):
    t = tight_trace
    waits = [i for i, s in enumerate(t.steps) if None in s.slot_request and s.queue]
    assert waits, "the fixture must have a free slot while requests wait"
    for i, s in enumerate(t.steps):
        line = viz.why_waiting(t, i)
        assert bool(line) == (i in waits)
        if line:
            assert f"while {len(s.queue)} wait" in line and viz.req_name(s.queue[0]) in line
            if s.queue[0] in s.preempted:
                assert "preempted" in line
            elif i + 1 < len(t) and s.queue[0] in t.steps[i + 1].slot_request:
                assert "next step" in line
            else:
                assert f"{s.pool_total - s.pool_used} free" in line


def test_explorer_ids_unique_per_call(ring):
    a = viz.explore_trace(ring, max_frames=2, progress=False)
    b = viz.explore_trace(ring, max_frames=2, progress=False)
    assert a.id != b.id
    for e in (a, b):
        ids = re.findall(r'\bid="([^"]+)"', e.html)
        assert ids == [e.id]                                      # one id, and the script looks it up
        assert f'getElementById("{e.id}")' in e.html
    both = a.html + b.html
    assert len(re.findall(r'\bid="([^"]+)"', both)) == len(set(re.findall(r'\bid="([^"]+)"', both))) == 2


def test_explorer_defaults_and_fallbacks(ring, monkeypatch, tmp_path):
    # live=True outside a kernel: the browser player (the widget needs a kernel)
    e = viz.explore_trace(ring, live=True, max_frames=2, progress=False)
    assert isinstance(e, viz.TraceExplorer)
    page = Path(e.save(tmp_path / "x.html")).read_text()
    assert page.startswith("<!DOCTYPE html>") and e.html in page
    monkeypatch.setenv("PAGEDLAB_STATIC", "1")                   # one static figure, as before
    fig = viz.explore_trace(ring, start=3, max_frames=2)
    assert hasattr(fig, "savefig")
    plt.close(fig)


NODE_DOM = r"""
// A minimal DOM for the explorer's script: the elements of its HTML (parsed in Python), the
// selectors it uses (".cls", "tag.cls", "tag[attr]"), events and timers by hand.
const spec = JSON.parse(require("fs").readFileSync(process.argv[2], "utf8"));
function El(tag, attrs) {
  this.tagName = tag.toUpperCase(); this.attrs = attrs; this.style = {}; this.listeners = {};
  this.textContent = ""; this.value = attrs.value || "";
  const st = attrs.style || "";
  st.split(";").forEach(kv => { const i = kv.indexOf(":"); if (i > 0) this.style[kv.slice(0, i).trim()] = kv.slice(i + 1).trim(); });
}
El.prototype.getAttribute = function (k) { return k in this.attrs ? this.attrs[k] : null; };
El.prototype.setAttribute = function (k, v) { this.attrs[k] = String(v); };
El.prototype.addEventListener = function (t, f) { (this.listeners[t] = this.listeners[t] || []).push(f); };
El.prototype.fire = function (t, extra) {
  const ev = Object.assign({ type: t, target: this, defaultPrevented: false, stopped: false,
    preventDefault() { this.defaultPrevented = true; }, stopPropagation() { this.stopped = true; } }, extra || {});
  for (let el = this; el; el = el.parent) {            // bubble up to the root
    (el.listeners[t] || []).forEach(f => f(ev));
    if (ev.stopped) break;
  }
  return ev;
};
const els = spec.elements.map(e => new El(e.tag, e.attrs));
const root = els[0];
els.slice(1).forEach(e => { e.parent = root; });
function matches(e, sel) {
  const m = sel.match(/^([a-z]*)(?:\.([\w-]+))?(?:\[([\w-]+)\])?$/);
  if (!m) throw new Error("selector the stub does not know: " + sel);
  return (!m[1] || e.tagName === m[1].toUpperCase()) && (!m[2] || (e.attrs["class"] || "").split(/\s+/).includes(m[2]))
      && (!m[3] || m[3] in e.attrs);
}
root.querySelectorAll = sel => els.slice(1).filter(e => matches(e, sel));
root.querySelector = sel => root.querySelectorAll(sel)[0] || null;
const timers = {}; let nextTimer = 1;
global.setInterval = (f, ms) => { timers[nextTimer] = { f, ms }; return nextTimer++; };
global.clearInterval = id => { delete timers[id]; };
global.document = { getElementById: id => (id === root.attrs.id ? root : null) };
eval(spec.script);
const frames = root.querySelectorAll("img.pl-frame");
const q = s => root.querySelector(s);
const state = () => ({ frame: Number(root.getAttribute("data-frame")),
  visible: frames.map((f, i) => f.style.display === "block" ? i : -1).filter(i => i >= 0),
  src: frames.filter(f => f.style.display === "block").map(f => f.getAttribute("src").slice(-24)),
  label: q(".pl-label").textContent, play: q(".pl-play").textContent, timers: Object.values(timers).map(t => t.ms),
  controls: q(".pl-controls").style.display, static: q(".pl-static").style.display });
const btn = act => root.querySelectorAll("button[data-act]").find(b => b.getAttribute("data-act") === act);
const log = {};
log.initial = state();
btn("next").fire("click"); log.next = state();
btn("prev").fire("click"); btn("prev").fire("click"); log.prev2 = state();
log.arrow = root.fire("keydown", { key: "ArrowRight" }).defaultPrevented; log.afterArrow = state();
q(".pl-slider").value = "0"; q(".pl-slider").fire("input"); log.slider0 = state();
btn("play").fire("click"); log.playing = state();
q(".pl-speed").value = "2"; q(".pl-speed").fire("change"); log.faster = state();
for (let k = 0; k < 100 && Object.keys(timers).length; k++) Object.values(timers)[0].f();
log.played = state();
btn("first").fire("click"); log.first = state();
btn("last").fire("click"); log.last = state();
root.fire("keydown", { key: " " }); log.space = state();
console.log(JSON.stringify(log));
"""


def _dom_spec(html: str) -> dict:
    class P(HTMLParser):
        def __init__(self):
            super().__init__()
            self.elements, self.script, self._in_script = [], "", False

        def handle_starttag(self, tag, attrs):
            self._in_script = tag == "script"
            a = {k: (v or "") for k, v in attrs}
            if tag == "option" and "selected" in a:              # a <select>'s value: its selected option
                next(e for e in reversed(self.elements) if e["tag"] == "select")["attrs"]["value"] = a["value"]
            elif tag != "script":
                self.elements.append({"tag": tag, "attrs": a})

        def handle_endtag(self, tag):
            self._in_script = False

        def handle_data(self, data):
            if self._in_script:
                self.script += data
    p = P()
    p.feed(html)
    return {"elements": p.elements, "script": p.script}


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node")
def test_explorer_script_runs_in_node(explorer, tmp_path):
    """The explorer's own script, run by node against a stub DOM built from its own HTML: the
    controls appear, next/prev/slider/keys/play change the frame shown, play stops at the end."""
    spec = _dom_spec(explorer.html)
    assert spec["elements"][0]["attrs"]["id"] == explorer.id and spec["script"].strip()
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "dom.js").write_text(NODE_DOM)
    r = subprocess.run(["node", str(tmp_path / "dom.js"), str(tmp_path / "spec.json")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    log = json.loads(r.stdout)
    steps, n = explorer.steps, len(explorer.steps)
    init = log["initial"]
    assert init["controls"] == "flex" and init["static"] == "none"      # JS on: controls in, note out
    assert init["visible"] == [4] and init["label"].startswith(f"step {steps[4]} ")
    assert log["next"]["visible"] == [5] and log["next"]["label"].startswith(f"step {steps[5]} ")
    assert log["next"]["src"] != init["src"]                            # another picture is shown
    assert log["prev2"]["visible"] == [3]
    assert log["arrow"] is True and log["afterArrow"]["visible"] == [4]
    assert log["slider0"]["visible"] == [0] and log["slider0"]["frame"] == 0
    assert log["playing"]["timers"] == [400] and "pause" in log["playing"]["play"]
    assert log["faster"]["timers"] == [200]
    assert log["played"]["visible"] == [n - 1] and log["played"]["timers"] == [] and "play" in log["played"]["play"]
    assert log["first"]["visible"] == [0] and log["last"]["visible"] == [n - 1]
    assert log["space"]["visible"] == [0] and log["space"]["timers"] == [200]   # play at the end restarts, 2x

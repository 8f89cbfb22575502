"""The trace explorer: every frame of a recorded Trace (trace_views.draw_step) rendered once to a
PNG and embedded in one HTML block, with the controls in JavaScript (explorer.js, shipped beside
this file): it plays in the browser with no kernel and no widgets -- during Run All, in Colab, in
VS Code and in a static HTML export. explore_trace(..., live=True) is the ipywidgets version
(Play + IntSlider, frames drawn by the kernel on demand); PAGEDLAB_STATIC=1 shows one static
figure instead of either."""
from __future__ import annotations

import base64
import importlib.util
import os
from pathlib import Path

import matplotlib.pyplot as plt

from .style import fig_to_png
from .trace_views import StepPainter, draw_step

# the player's JavaScript; %(id)s, %(start)d and %(interval)d are filled in per explorer
EXPLORER_JS = (Path(__file__).resolve().parent / "explorer.js").read_text()


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
        ip = get_ipython()
        return ip is not None and getattr(ip, "kernel", None) is not None
    except ImportError:
        return False


def widgets_available() -> bool:
    if os.environ.get("PAGEDLAB_STATIC", "0") == "1" or not _in_kernel():
        return False
    return importlib.util.find_spec("ipywidgets") is not None


EXPLORER_MAX_FRAMES = 100     # frames one explorer renders at most (~25 KB of HTML each at dpi 80)


EXPLORER_DPI = 80


EXPLORER_MAX_EVENT_FRAMES = 400   # event steps (preemption, finish) rendered at most, beyond max_frames


def explorer_frames(n: int, max_frames: int | None = EXPLORER_MAX_FRAMES, keep: int | None = None,
                    events=()) -> list[int]:
    """Which of n steps (indices 0..n-1) the explorer renders: all of them when n <= max_frames,
    else max_frames evenly spaced ones -- always the first and the last, and `keep` (the start
    step) in place of the sampled index nearest to it -- plus every index in `events` (the steps
    where a request is preempted or finishes: never skipped; at most EXPLORER_MAX_EVENT_FRAMES of
    them, evenly spaced, so that any trace renders in bounded time)."""
    if n <= 0:
        return []
    if max_frames is None or n <= max_frames:
        return list(range(n))
    if max_frames < 2:
        raise ValueError(f"max_frames must be at least 2 (the first and the last step), got {max_frames}")
    picked = sorted({round(k * (n - 1) / (max_frames - 1)) for k in range(max_frames)})
    if keep is not None and 0 <= keep < n and keep not in picked:
        inner = range(1, len(picked) - 1)
        if inner:
            j = min(inner, key=lambda j: abs(picked[j] - keep))
            picked[j] = keep
            picked.sort()
    ev = sorted({e for e in events if 0 <= e < n})
    if len(ev) > EXPLORER_MAX_EVENT_FRAMES:
        ev = [ev[round(k * (len(ev) - 1) / (EXPLORER_MAX_EVENT_FRAMES - 1))] for k in range(EXPLORER_MAX_EVENT_FRAMES)]
    return sorted(set(picked) | set(ev))


def event_steps(trace) -> list[int]:
    """Indices of the steps where a request is preempted or finishes."""
    return [i for i, s in enumerate(trace.steps) if s.preempted or s.finished]


class TraceExplorer:
    """A trace explorer that runs in the browser: every frame (draw_step) rendered once to a PNG
    and embedded, with a few lines of JavaScript for the controls -- no kernel, no ipywidgets.
    Jupyter shows it through _repr_html_ (JupyterLab, classic notebook, Colab, VS Code, and the
    HTML that `jupyter nbconvert --to html` writes); save(path) writes a standalone page.

    Attributes: html (the block), id (its element id, unique per explorer), steps (the engine's
    step number of each frame), indices (each frame's index in the trace), num_steps (steps in
    the trace), nbytes (size of the HTML)."""

    def __init__(self, html: str, id: str, steps: list[int], indices: list[int], num_steps: int):
        self.html, self.id, self.steps, self.indices, self.num_steps = html, id, steps, indices, num_steps

    @property
    def nbytes(self) -> int:
        return len(self.html.encode())

    @property
    def skipped(self) -> bool:
        return len(self.steps) < self.num_steps

    def _repr_html_(self) -> str:
        return self.html

    def __repr__(self) -> str:
        return (f"trace explorer: {len(self.steps)} frames of {self.num_steps} steps "
                f"(steps {self.steps[0]}..{self.steps[-1]}), {self.nbytes / 1e6:.1f} MB of HTML")

    def save(self, path) -> str:
        """A standalone HTML page with the explorer (opens in any browser, offline)."""
        from pathlib import Path
        Path(path).write_text("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>pagedlab trace "
                              f"explorer</title></head><body>\n{self.html}\n</body></html>\n")
        return str(path)


def explorer_html(trace, start: int = 0, interval_ms: int = 400, max_frames: int | None = EXPLORER_MAX_FRAMES,
                  dpi: int = EXPLORER_DPI, progress: bool = True) -> TraceExplorer:
    """Render the frames of `trace` (draw_step, at most max_frames, evenly spaced, the first, the
    last and `start` kept) and build the client-side explorer around them. start: the index in the
    trace of the frame shown first. A tqdm bar counts the frames as they render."""
    import html as _html
    import uuid

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.transforms import Bbox
    from tqdm.auto import tqdm

    n = len(trace)
    if not n:
        raise ValueError("the trace is empty: run the engine with trace=True first")
    start = max(0, min(int(start), n - 1))
    indices = explorer_frames(n, max_frames, keep=start, events=event_steps(trace))
    first_shown = min(range(len(indices)), key=lambda k: abs(indices[k] - start))
    steps = trace.steps
    # one figure, redrawn for every frame, cropped to one box (the union of the first and the
    # last frame's drawn area): every frame has the same size, so the picture does not jump
    fig = Figure(figsize=(12, 7.2))
    canvas = FigureCanvasAgg(fig)
    painter = StepPainter(trace, fig)
    boxes = []
    for i in {indices[0], indices[-1]}:
        painter.paint(i)
        canvas.draw()
        boxes.append(fig.get_tightbbox(canvas.get_renderer()))
    # ... and the line under the picture, whatever its length at other steps
    boxes.append(painter.ax_why.get_position().transformed(fig.transFigure).transformed(fig.dpi_scale_trans.inverted()))
    box = Bbox.union(boxes).padded(0.1)
    uid = "pagedlab-explorer-" + uuid.uuid4().hex[:12]
    imgs = []
    bar = tqdm(indices, desc="explorer frames", unit="frame", leave=False, disable=not progress)
    for k, (i, frame) in enumerate(zip(bar, painter.frames(indices, box, dpi=dpi))):
        png = base64.b64encode(frame).decode()
        imgs.append(f'<img class="pl-frame" data-step="{steps[i].step}" data-index="{i}" alt="engine step '
                    f'{steps[i].step}" style="display:{"block" if k == first_shown else "none"};max-width:100%;'
                    f'height:auto" src="data:image/png;base64,{png}">')
    fig.clear()
    shown = [steps[i].step for i in indices]
    note = ""
    if len(indices) < n:
        gap = (n - 1) / max(1, len(indices) - 1)
        kept = set(indices)
        missed = sum(1 for e in event_steps(trace) if e not in kept)
        note = (f"Frames skipped: {len(indices)} of the trace's {n} steps are shown, about one in every "
                f"{gap:.1f} (evenly spaced; the first, the last and step {steps[start].step} always, and "
                + ("every step where a request is preempted or finishes" if not missed else
                   f"{missed} of the steps where a request is preempted or finishes are skipped too: there are "
                   "too many to draw") + "); the label names each frame's engine step. "
                "explore_trace(trace, max_frames=None) renders every step.")
    s0 = steps[indices[first_shown]].step
    button = ('<button type="button" data-act="{0}" class="pl-{0}" title="{1}" style="padding:1px 8px;'
              'cursor:pointer">{2}</button>')
    controls = "".join(button.format(*b) for b in (
        ("first", "first step (Home)", "&#x25C0;&#x25C0;"), ("prev", "previous step (&#x2190;)", "&#x25C0;"),
        ("play", "play / pause (space)", "&#x25B6; play"), ("next", "next step (&#x2192;)", "&#x25B6;"),
        ("last", "last step (End)", "&#x25B6;&#x25B6;")))
    speeds = "".join(f'<option value="{v}"{" selected" if v == 1 else ""}>{v:g}&#xD7;</option>'
                     for v in (0.25, 0.5, 1, 2, 4, 8))
    html = (
        f'<div id="{uid}" class="pagedlab-explorer" tabindex="0" data-lm-suppress-shortcuts="true" '
        f'data-frames="{len(indices)}" data-steps="{n}" style="font-family:sans-serif;font-size:13px;outline:none">\n'
        f'<div class="pl-controls" style="display:none;align-items:center;gap:6px;flex-wrap:wrap;margin:2px 0 4px">'
        f'{controls}<input class="pl-slider" type="range" min="0" max="{len(indices) - 1}" step="1" '
        f'value="{first_shown}" aria-label="frame" style="flex:1;min-width:160px;max-width:520px">'
        f'<span class="pl-label" style="font-family:monospace;min-width:16em">step {s0}</span>'
        f'<label style="color:#555">speed <select class="pl-speed">{speeds}</select></label>'
        f'<span style="color:#888;font-size:11px">keys: &#x2190; &#x2192; step, space play/pause</span></div>\n'
        f'<div class="pl-static" style="color:#555;font-size:12px">trace explorer: step {s0} shown; the player '
        f'(play, slider) runs in the browser and needs JavaScript: open the notebook in Jupyter, Colab or '
        f'VS Code, or its HTML export.</div>\n'
        + (f'<div class="pl-note" style="color:#8a5a00;font-size:12px">{_html.escape(note, quote=False)}</div>\n' if note else "")
        + "\n".join(imgs)
        + f"\n<script>{EXPLORER_JS % {'id': uid, 'start': first_shown, 'interval': max(1, int(interval_ms))}}"
        f"</script>\n</div>")
    return TraceExplorer(html, uid, shown, indices, n)


def explore_trace(trace, start: int = 0, interval_ms: int = 400, *, live: bool = False,
                  max_frames: int | None = EXPLORER_MAX_FRAMES, dpi: int = EXPLORER_DPI, progress: bool = True):
    """Step through a recorded trace: play/pause, a slider, the step number, a speed control and
    the arrow keys, over draw_step's picture of each step.

    By default the frames are rendered here, once, and the player runs in the browser (a
    TraceExplorer, shown by Jupyter as HTML): it needs no kernel and no widgets, so it animates
    during Run All, in Colab, in VS Code and in a static HTML export. At most `max_frames` frames
    (evenly spaced; the first, the last and `start` always; None: every step) at `dpi` -- about
    25 KB of HTML a frame (notebook 08: 54 frames, 1.4 MB), so 100 frames are about 2.5 MB. start:
    the index in the trace shown first.

    live=True: the ipywidgets version (Play + IntSlider, each frame drawn by the kernel when asked;
    needs a running kernel; falls back to the browser player where widgets cannot run).
    PAGEDLAB_STATIC=1: only the static figure of step `start` (returns the Figure)."""
    if not len(trace):
        raise ValueError("the trace is empty: run the engine with trace=True first")
    start = max(0, min(start, len(trace) - 1))
    if os.environ.get("PAGEDLAB_STATIC", "0") == "1":
        return draw_step(trace, start)
    if live and widgets_available():
        return _explore_live(trace, start, interval_ms)
    return explorer_html(trace, start=start, interval_ms=interval_ms, max_frames=max_frames, dpi=dpi,
                         progress=progress)


def _explore_live(trace, start: int, interval_ms: int):
    """The kernel-driven explorer: a play button and a slider (linked) redraw draw_step in an
    Output. Displayed with a PNG of the start frame beside it, so a static view of the notebook
    shows that figure where the widget cannot render."""
    import ipywidgets as widgets
    from IPython.display import clear_output, display

    play = widgets.Play(value=start, min=0, max=len(trace) - 1, step=1, interval=interval_ms,
                        description="play")
    slider = widgets.IntSlider(value=start, min=0, max=len(trace) - 1, description="step",
                               continuous_update=True, layout=widgets.Layout(width="60%"))
    widgets.link((play, "value"), (slider, "value"))
    out = widgets.Output()

    def render(change=None):
        with out:
            clear_output(wait=True)
            fig = draw_step(trace, slider.value)
            display(fig)
            plt.close(fig)

    slider.observe(render, names="value")
    render()
    box = widgets.VBox([widgets.HBox([play, slider]), out])
    first = draw_step(trace, start)
    png = base64.b64encode(fig_to_png(first)).decode()
    plt.close(first)
    display({"application/vnd.jupyter.widget-view+json": {"version_major": 2, "version_minor": 0,
                                                          "model_id": box.model_id},
             "image/png": png,
             "text/plain": f"trace explorer ({len(trace)} steps)"}, raw=True)
    return None

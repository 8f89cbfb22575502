"""Drawings for the notebooks: the slot timeline, the block table, the KV pool, one engine step,
and an explorer that steps through a recorded Trace with a slider and a play button.

Everything draws with matplotlib and returns the Figure, so the same call works in a notebook, in
a script (`python -m pagedlab.figures` saves them as PNGs) and in a test. The explorer
(explore_trace) renders each step's figure to a PNG once and embeds them all in one HTML block
with a few lines of JavaScript for the controls: it plays in the browser with no kernel and no
widgets -- during Run All, in Colab, in VS Code and in a static HTML export. explore_trace(...,
live=True) is the older ipywidgets version (Play + IntSlider, frames drawn by the kernel on
demand); PAGEDLAB_STATIC=1 shows one static figure instead of either.
"""
from __future__ import annotations

import base64
import importlib.util
import io
import os

import matplotlib

if os.environ.get("MPLBACKEND") is None and "ipykernel" not in __import__("sys").modules:
    matplotlib.use("Agg")          # scripts and tests: no display needed

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

IDLE = "#f2f2f2"
FREE = "#ffffff"
SHARED = "#ffd24d"        # a block held by several requests (prefix caching): same colour in every row
CACHED = "#e3e3e3"        # a block nobody holds that keeps a cached prefix
MISSING = "#d9d9d9"       # past the end of the pool (only there to fill the grid): hatched grey
PREEMPT = "#d62728"       # the preemption marker


def _make_palette(n: int = 64) -> list:
    """n colours, all different and none close to another or to the idle/free/shared colours:
    tab10 first (the familiar ones), then other qualitative matplotlib maps, pale and grey ones out."""
    import colorsys

    import matplotlib.colors as mc
    taken = [mc.to_rgb(c) for c in (IDLE, SHARED, CACHED, MISSING)]
    out = []
    for name in ("tab10", "tab20b", "tab20c", "Dark2", "Set1", "Paired", "Set2", "Accent", "tab20"):
        cs = list(plt.get_cmap(name).colors)
        if name in ("tab20b", "tab20c"):        # 5 hues x 4 shades: hues first, so neighbours differ
            cs = [cs[4 * h + k] for k in range(4) for h in range(len(cs) // 4)]
        for c in cs:
            rgb = mc.to_rgb(c)
            _, light, sat = colorsys.rgb_to_hls(*rgb)
            if sat < 0.25 or light > 0.9:
                continue
            if any(sum(abs(a - b) for a, b in zip(rgb, t)) < 0.12 for t in taken + out):
                continue
            out.append(rgb)
    return [mc.to_hex(c) for c in out[:n]]


_PALETTE = _make_palette()
NUM_COLORS = len(_PALETTE)   # request ids 0..63 all get their own colour; then they repeat (the
                             # number printed on the cells tells requests apart)


# ----------------------------------------------------------------------------- colours
def request_color(rid):
    """The colour of request `rid`: the same in every panel; distinct for ids 0..NUM_COLORS-1, then
    it repeats every NUM_COLORS ids (req 64 looks like req 0: read the number on the cell)."""
    if rid is None:
        return IDLE
    return _PALETTE[rid % NUM_COLORS]


def req_name(rid) -> str:
    """The one name a request has in every drawing: 'req 7'."""
    return f"req {rid}"


def _ink(color) -> str:
    """Black or white text, whichever reads better on `color`."""
    import matplotlib.colors as mc
    r, g, b = mc.to_rgb(color)
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white"


def _tidy(fig, ax, tight: bool = True):
    """The house style every drawing ends with: no top/right frame; tight layout for own figures."""
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    if tight:
        fig.tight_layout()
    return fig


def _new_ax(ax, figsize):
    if ax is None:
        fig, ax = plt.subplots(figsize=figsize)
        return fig, ax
    return ax.figure, ax


# ----------------------------------------------------------------------------- timeline
def preemption_marks(trace, max_steps: int | None = None) -> list[tuple]:
    """(column, slot, request id) for every preemption the trace records: the column of the step
    whose record lists the victim, in the slot the victim held the step before (slot 0 if unknown)."""
    steps = trace.steps if max_steps is None else trace.steps[:max_steps]
    marks = []
    for x, s in enumerate(steps):
        for rid in s.preempted:
            prev = steps[x - 1].slot_request if x > 0 else []
            marks.append((x, prev.index(rid) if rid in prev else 0, rid))
    return marks


def draw_timeline(trace, ax=None, title: str | None = None, cursor: int | None = None,
                  max_steps: int | None = None, letters: bool = True, legend: bool = True):
    """Slots (rows) x engine steps (columns), each cell coloured by the request it holds. A
    prefill cell is hatched and carries the request's number; idle cells are grey; a red X on the
    left edge of a column marks a request preempted at that step, in the slot it had held."""
    steps = trace.steps if max_steps is None else trace.steps[:max_steps]
    n_slots = trace.num_slots
    fig, ax = _new_ax(ax, (min(14, 2 + 0.18 * len(steps)), 0.9 + 0.45 * n_slots))
    # the cells as two collections (plain, hatched prefill): one artist each instead of one patch
    # per cell, so a long trace draws in milliseconds (the explorer draws it once per frame)
    from matplotlib.collections import PolyCollection
    cells = {False: ([], []), True: ([], [])}            # hatched? -> (cell corners, colours)
    for x, s in enumerate(steps):
        for y, (rid, ph) in enumerate(zip(s.slot_request, s.slot_phase)):
            busy = ph is not None
            color = request_color(rid) if busy else IDLE
            rects, colors = cells[ph == "prefill"]
            rects.append(((x, y), (x + 1, y), (x + 1, y + 1), (x, y + 1)))
            colors.append(color)
            first = ph == "prefill" and (x == 0 or steps[x - 1].slot_request[y] != rid
                                         or steps[x - 1].slot_phase[y] != "prefill")
            if letters and busy and first and len(steps) <= 150:
                ax.text(x + 0.5, y + 0.5, str(rid), ha="center", va="center", fontsize=6.5,
                        color=_ink(color), fontweight="bold")
    for hatched, (rects, colors) in cells.items():
        if rects:
            ax.add_collection(PolyCollection(rects, facecolors=colors, edgecolors="white", linewidths=0.6,
                                             hatch="///" if hatched else None, gid="cells"),
                              autolim=False)
    marks = preemption_marks(trace, max_steps)
    if marks:
        ax.scatter([m[0] for m in marks], [m[1] + 0.5 for m in marks], marker="X", s=70,
                   color=PREEMPT, edgecolor="white", linewidth=0.8, zorder=5, gid="preemption",
                   clip_on=False)
    if cursor is not None:
        ax.axvline(cursor + 0.5, color="black", linewidth=1.5)
    ax.set_xlim(0, max(1, len(steps)))
    ax.set_ylim(n_slots, 0)
    ax.set_yticks([i + 0.5 for i in range(n_slots)], [f"slot {i}" for i in range(n_slots)])
    ax.set_xlabel("engine step")
    first_step = steps[0].step if steps else 0
    if first_step:                     # the trace dropped its oldest steps: label the engine's numbers
        from matplotlib.ticker import FuncFormatter
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{int(round(v)) + first_step}"))
    util = sum(p is not None for s in steps for p in s.slot_phase) / max(1, len(steps) * n_slots)
    ax.set_title(title if title is not None else f"slot timeline: {len(steps)} steps, "
                 f"{util:.0%} of slot-steps busy", fontsize=10, loc="left")
    if legend:
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
        handles = [Patch(facecolor="white", edgecolor="grey", hatch="///", label="prefill (number = request)"),
                   Patch(facecolor="#999999", edgecolor="grey", label="decode"),
                   Patch(facecolor=IDLE, edgecolor="grey", label="idle slot")]
        if marks:
            handles.append(Line2D([], [], marker="X", color="white", markerfacecolor=PREEMPT,
                                  markersize=9, label=f"preempted ({len(marks)})"))
        ax.legend(handles=handles, fontsize=7, loc="lower right", bbox_to_anchor=(1, 1.0), ncol=4,
                  frameon=False, borderaxespad=0.1, handlelength=1.6, columnspacing=1.0)
    return _tidy(fig, ax, tight=False)


def draw_timelines(traces: dict, title: str | None = None):
    """Several traces (e.g. {"static": t1, "continuous": t2}) one above the other, same step axis."""
    n = len(traces)
    longest = max(len(t) for t in traces.values())
    heights = [max(1, t.num_slots) for t in traces.values()]
    fig, axes = plt.subplots(n, 1, figsize=(min(14, 2 + 0.18 * longest), 0.9 + 0.5 * sum(heights)),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, (name, t) in zip(axes[:, 0], traces.items()):
        draw_timeline(t, ax=ax, title=f"{name}: {len(t)} steps, slot utilization {t.utilization():.0%}")
        ax.set_xlim(0, longest)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def draw_utilization(traces: dict, ax=None):
    """Bar chart: slot utilization and number of steps for each named trace."""
    fig, ax = _new_ax(ax, (5, 3))
    names = list(traces)
    util = [traces[k].utilization() for k in names]
    bars = ax.bar(names, util, color=["#c44e52", "#4c72b0", "#55a868", "#8172b2"][:len(names)])
    for b, t in zip(bars, traces.values()):
        ax.text(b.get_x() + b.get_width() / 2, b.get_height() + 0.02,
                f"{b.get_height():.0%}\n{len(t)} steps", ha="center", va="bottom", fontsize=9)
    ax.set_ylim(0, 1.25)
    ax.set_ylabel("slot utilization")
    ax.set_title("busy slot-steps / all slot-steps", fontsize=10, loc="left")
    return _tidy(fig, ax)


# ----------------------------------------------------------------------------- block table, pool
def draw_block_table(block_table, slot_request=None, ax=None, num_cols: int | None = None,
                     title: str = "block table: slot x logical block -> physical block",
                     block_refs: dict | None = None):
    """block_table: one list of physical block ids per slot (a StepRecord's .block_table, or
    rows of the device tensor with -1 = empty). Each cell shows the physical id, coloured by the
    request that owns the slot. block_refs (a StepRecord's .block_refs: block -> holders, for
    blocks held by several requests): a shared block is drawn in the SHARED colour in every row
    that holds it, with its holder count ("17\n×3")."""
    block_refs = block_refs or {}
    rows = [[b for b in row if b is not None and b >= 0] for row in
            (r.tolist() if hasattr(r, "tolist") else list(r) for r in block_table)]
    n_slots = len(rows)
    cols = num_cols or max([len(r) for r in rows] + [4])
    fig, ax = _new_ax(ax, (min(14, 1.5 + 0.45 * cols), 0.6 + 0.45 * n_slots))
    for y, row in enumerate(rows):
        rid = slot_request[y] if slot_request is not None else (y if row else None)
        for x in range(cols):
            if x < len(row) and row[x] in block_refs:
                ax.add_patch(Rectangle((x, y), 1, 1, facecolor=SHARED, edgecolor="#7a5c00", linewidth=1.2))
                ax.text(x + 0.5, y + 0.5, f"{row[x]}\n×{block_refs[row[x]]}", ha="center", va="center",
                        fontsize=6.5, linespacing=0.9)
            elif x < len(row):
                ax.add_patch(Rectangle((x, y), 1, 1, facecolor=request_color(rid), edgecolor="white"))
                ax.text(x + 0.5, y + 0.5, str(row[x]), ha="center", va="center", fontsize=8)
            else:
                ax.add_patch(Rectangle((x, y), 1, 1, facecolor=FREE, edgecolor="#dddddd"))
    ax.set_xlim(0, cols)
    ax.set_ylim(n_slots, 0)
    ax.set_yticks([i + 0.5 for i in range(n_slots)],
                  [f"slot {i}" + (f" (req {slot_request[i]})" if slot_request is not None
                                  and slot_request[i] is not None else "") for i in range(n_slots)],
                  fontsize=8)
    step = max(1, cols // 16)
    ax.set_xticks([i + 0.5 for i in range(0, cols, step)], [str(i) for i in range(0, cols, step)], fontsize=8)
    ax.set_xlabel("logical block (token index // block_size)")
    ax.set_title(title, fontsize=10, loc="left")
    return _tidy(fig, ax, tight=False)


def pool_owners(block_table, slot_request, pool_total: int) -> list:
    """Owner (request id) of every physical block, None when free."""
    owners = [None] * pool_total
    for row, rid in zip(block_table, slot_request):
        for b in row:
            if b is not None and 0 <= b < pool_total:
                owners[b] = rid
    return owners


SMALL_POOL = 128   # up to this many blocks the pool is a grid of numbered cells; above, a compact bar


def draw_pool(owners: list, ax=None, ncols: int | None = None, title: str | None = None,
              shared=(), numbers: bool | None = None):
    """The KV pool, one cell per physical block, coloured by the owning request; white = free;
    blocks in `shared` (held by several requests) in the SHARED colour.

    Up to SMALL_POOL blocks: a grid, each cell numbered with its physical block id (owned cells
    also name the owner, "7" under the id) -- the cells that only fill out the last row, past the
    end of the pool, are hatched grey so they cannot be mistaken for free blocks. Above that: a
    compact bar, one thin column per block, in the same colours, the axis in block ids."""
    n = len(owners)
    colors = [FREE if rid is None else SHARED if b in shared else request_color(rid)
              for b, rid in enumerate(owners)]
    used = sum(o is not None for o in owners)
    title = title or f"KV pool: {used}/{n} blocks used"
    if n > SMALL_POOL:                                   # compact bar
        import matplotlib.colors as mc
        import numpy as np
        fig, ax = _new_ax(ax, (10, 1.4))
        img = np.array([[mc.to_rgb(c) for c in colors]])
        ax.imshow(img, aspect="auto", extent=(0, n, 1, 0), interpolation="nearest")
        ax.add_patch(Rectangle((0, 0), n, 1, fill=False, edgecolor="#888888", linewidth=0.8))
        ax.set_xlim(0, n)
        ax.set_ylim(1, 0)
        ax.set_yticks([])
        ax.set_xlabel("physical block id", fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
        ax.set_title(title, fontsize=10, loc="left")
        return fig
    ncols = ncols or min(32, max(8, int(n ** 0.5 * 2)))
    nrows = max(1, -(-n // ncols))
    if numbers is None:
        numbers = ncols <= 32
    fig, ax = _new_ax(ax, (min(12, 0.3 * ncols + 1), 0.3 * nrows + 0.8))
    for b in range(nrows * ncols):
        x, y = b % ncols, b // ncols
        if b >= n:                                       # past the pool: not a block at all
            ax.add_patch(Rectangle((x, y), 1, 1, facecolor=MISSING, edgecolor="white", hatch="////",
                                   linewidth=0.5, gid="missing"))
            continue
        rid = owners[b]
        ax.add_patch(Rectangle((x, y), 1, 1, facecolor=colors[b], edgecolor="#bbbbbb", linewidth=0.5,
                               gid="free" if rid is None else "used"))
        if numbers:
            ink = "#999999" if rid is None else _ink(colors[b])
            what = f"×{shared[b]}" if b in shared and isinstance(shared, dict) else rid
            ax.text(x + 0.5, y + 0.5, str(b) if rid is None else f"{b}\n{what}", ha="center",
                    va="center", fontsize=(7 if ncols <= 16 else 5) - (rid is not None), color=ink,
                    linespacing=0.85)
    ax.set_xlim(0, ncols)
    ax.set_ylim(nrows, 0)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_aspect("equal")
    ax.set_title(title, fontsize=10, loc="left")
    return fig


def _step_legend(fig, s, ax):
    """One legend for a step: a swatch per request in view (slots, then queue), then the codes."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    seen = []
    for rid in list(s.slot_request) + list(s.queue):
        if rid is not None and rid not in seen:
            seen.append(rid)
    shown = seen[:16]
    handles = [Patch(facecolor=request_color(r), label=req_name(r)) for r in shown]
    if len(seen) > len(shown):
        handles.append(Patch(facecolor="white", edgecolor="white", label=f"+{len(seen) - len(shown)} more"))
    handles += [Patch(facecolor="white", edgecolor="grey", hatch="///", label="prefill"),
                Patch(facecolor=FREE, edgecolor="#bbbbbb", label="free block"),
                Patch(facecolor=MISSING, edgecolor="white", hatch="////", label="past the pool")]
    if s.block_refs:
        handles.append(Patch(facecolor=SHARED, edgecolor="#7a5c00", label="shared block"))
    handles.append(Line2D([], [], marker="X", color="white", markerfacecolor=PREEMPT, markersize=9,
                          label="preempted"))
    ax.axis("off")
    return ax.legend(handles=handles, loc="upper left", fontsize=7.5, frameon=False,
                     title="legend", title_fontsize=8, alignment="left", handlelength=1.5)


# ----------------------------------------------------------------------------- one step
STEP_FONT = 10.5     # the step picture's text, in points: readable at JupyterLab's notebook width
# (a frame is ~12 in wide at EXPLORER_DPI = 80, about the width of JupyterLab's notebook column,
# so a point is about a pixel: 7-8 pt text was ~6 px on screen)


def _rgb_table():
    """The palette as an array: row k is request_color(k) for k < NUM_COLORS, then FREE, IDLE,
    SHARED, MISSING at -1, -2, -3, -4 (numpy indexing from the end)."""
    import matplotlib.colors as mc
    import numpy as np
    return np.array([mc.to_rgb(c) for c in _PALETTE] + [mc.to_rgb(c) for c in (MISSING, SHARED, IDLE, FREE)])


def _why_waiting(trace, i) -> str:
    """One line on why a slot is free while requests wait at step i ('' when none is)."""
    s = trace.steps[i]
    free_slots = [y for y, rid in enumerate(s.slot_request) if rid is None]
    if not free_slots or not s.queue:
        return ""
    front = s.queue[0]
    where = f"slot {free_slots[0]} is free while {len(s.queue)} wait"
    if front in s.preempted:
        return (f"{where}: {req_name(front)} was just preempted (the pool ran out); it goes back to the "
                "front of the queue and restarts when its blocks fit")
    nxt = trace.steps[i + 1] if i + 1 < len(trace) else None
    if nxt is not None and front in nxt.slot_request:
        return (f"{where}: it was freed during this step; {req_name(front)} takes it when the next step "
                "is scheduled")
    free_blocks = s.pool_total - s.pool_used
    return (f"{where}: {req_name(front)} (front of the queue) needs more blocks for its prompt than the "
            f"{free_blocks} free, so it waits for a running request to finish")


class _StepPainter:
    """draw_step's picture, built once for a trace and then updated in place for any step: the
    timeline is drawn once (only its cursor moves), the block table and the pool are images, and
    every label is an artist made once whose text and colour change. The explorer paints all its
    frames with one painter, so a frame costs its rendering, not building a figure."""

    QUEUE_SHOWN = 6
    POOL_COLS = 2048        # a larger pool is drawn as this many columns (any used block stays visible)

    def __init__(self, trace, fig=None, show_time: bool = True):
        import numpy as np
        from matplotlib.lines import Line2D
        self.trace, self.show_time = trace, show_time
        self.fig = fig if fig is not None else plt.figure(figsize=(12, 7.2))
        self.fig.clear()
        self.rgb = _rgb_table()
        steps = trace.steps
        n_slots = self.n_slots = trace.num_slots
        self.pool_total = max([s.pool_total for s in steps] + [1])
        gs = self.fig.add_gridspec(4, 4, height_ratios=[1.2, 1.25, 1.3, 0.16],
                                   width_ratios=[1.25, 0.9, 1.5, 0.5], hspace=0.95, wspace=0.6)
        f = STEP_FONT
        # timeline: drawn once, a cursor line moves
        self.ax_tl = self.fig.add_subplot(gs[0, :3])
        draw_timeline(trace, ax=self.ax_tl, legend=False, title="")
        self.ax_tl.tick_params(labelsize=f - 1)
        if not steps or not steps[0].step:          # (a trace that dropped steps labels its own numbers)
            from matplotlib.ticker import MaxNLocator
            self.ax_tl.xaxis.set_major_locator(MaxNLocator(integer=True))
        self.ax_tl.xaxis.label.set_size(f - 0.5)
        self.cursor = self.ax_tl.axvline(0.5, color="black", linewidth=1.8)
        self.dynamic = [self.cursor]        # what paint() changes, in drawing order (see frames())
        # legend
        self.ax_leg = self.fig.add_subplot(gs[:3, 3])
        self.ax_leg.axis("off")
        self._legend_key = None
        # slots: a square and a label per slot
        ax = self.ax_sl = self.fig.add_subplot(gs[1, 0])
        self.slot_box, self.slot_num, self.slot_label = [], [], []
        for y in range(n_slots):
            self.slot_box.append(ax.add_patch(Rectangle((0, y), 0.9, 0.9, facecolor=IDLE, edgecolor="grey")))
            self.slot_num.append(ax.text(0.45, y + 0.45, "", ha="center", va="center", fontsize=f - 1,
                                         fontweight="bold"))
            self.slot_label.append(ax.text(1.15, y + 0.45, "", va="center", fontsize=f - 1))
        self.dynamic += self.slot_box + self.slot_num + self.slot_label
        ax.set_xlim(0, 6)
        ax.set_ylim(max(n_slots, 1), 0)
        ax.axis("off")
        ax.set_title("slots", fontsize=f + 0.5, loc="left")
        # queue: QUEUE_SHOWN squares, the front one first
        ax = self.ax_q = self.fig.add_subplot(gs[1, 1])
        self.q_box, self.q_num = [], []
        for x in range(self.QUEUE_SHOWN):
            self.q_box.append(ax.add_patch(Rectangle((x, 0), 0.9, 0.9, facecolor=FREE, edgecolor="grey")))
            self.q_num.append(ax.text(x + 0.45, 0.45, "", ha="center", va="center", fontsize=f - 2,
                                      fontweight="bold"))
        self.q_pre = ax.scatter([], [], marker="X", s=55, color=PREEMPT, edgecolor="white", zorder=5,
                                clip_on=False)
        self.q_note = ax.text(0, 1.25, "", va="top", fontsize=f - 1, clip_on=False)
        self.dynamic += self.q_box + self.q_num + [self.q_pre, self.q_note]
        ax.set_xlim(0, self.QUEUE_SHOWN)
        ax.set_ylim(1, 0)
        ax.set_aspect("equal", anchor="NW")
        ax.axis("off")
        # block table: an image, a number per cell
        self.cols = max([len(r) for st in steps for r in st.block_table] + [4])
        ax = self.ax_bt = self.fig.add_subplot(gs[1:3, 2])
        self.bt_img = ax.imshow(np.ones((max(n_slots, 1), self.cols, 3)), aspect="auto", interpolation="nearest",
                                extent=(0, self.cols, max(n_slots, 1), 0))
        self.dynamic.append(self.bt_img)
        self.dynamic += [ax.axvline(x, color="white", linewidth=1.2) for x in range(self.cols + 1)]
        self.dynamic += [ax.axhline(y, color="white", linewidth=1.2) for y in range(n_slots + 1)]
        fs = f - 1.5 if self.cols <= 10 else f - 3 if self.cols <= 20 else 0
        self.bt_text = [[ax.text(x + 0.5, y + 0.5, "", ha="center", va="center", fontsize=fs, linespacing=0.9)
                         for x in range(self.cols)] for y in range(n_slots)] if fs else None
        if self.bt_text is not None:
            self.dynamic += [t for row in self.bt_text for t in row]
        self.dynamic += list(ax.spines.values())      # the frame over the image, as in a full drawing
        ax.set_yticks([y + 0.5 for y in range(n_slots)], [f"slot {y}" for y in range(n_slots)], fontsize=f - 1)
        tick = max(1, self.cols // 12)
        ax.set_xticks([x + 0.5 for x in range(0, self.cols, tick)], [str(x) for x in range(0, self.cols, tick)],
                      fontsize=f - 1.5)
        ax.set_xlabel("logical block (token index // block_size)", fontsize=f - 1)
        # pool: an image; a small pool is a grid with its row's first block id on the left
        ax = self.ax_pool = self.fig.add_subplot(gs[2, :2])
        n = self.pool_total
        if n <= SMALL_POOL:
            self.pool_cols = 16 if n > 48 else 8
            self.pool_rows = -(-n // self.pool_cols)
            self.pool_img = ax.imshow(np.ones((self.pool_rows, self.pool_cols, 3)), interpolation="nearest",
                                      extent=(0, self.pool_cols, self.pool_rows, 0))
            self.dynamic.append(self.pool_img)
            self.dynamic += [ax.axvline(x, color="#bbbbbb", linewidth=0.6) for x in range(self.pool_cols + 1)]
            self.dynamic += [ax.axhline(y, color="#bbbbbb", linewidth=0.6) for y in range(self.pool_rows + 1)]
            self.pool_text = [ax.text(b % self.pool_cols + 0.5, b // self.pool_cols + 0.5, "", ha="center",
                                      va="center", fontsize=f - 2.5) for b in range(n)]
            self.dynamic += self.pool_text
            ax.set_yticks([y + 0.5 for y in range(self.pool_rows)],
                          [str(y * self.pool_cols) for y in range(self.pool_rows)], fontsize=f - 2)
            ax.set_xticks([x + 0.5 for x in range(0, self.pool_cols, 4)],
                          [f"+{x}" for x in range(0, self.pool_cols, 4)], fontsize=f - 2)
            ax.tick_params(length=0)
            ax.set_ylabel("block id", fontsize=f - 2)
        else:
            self.pool_cols = min(n, self.POOL_COLS)
            self.pool_img = ax.imshow(np.ones((1, self.pool_cols, 3)), aspect="auto", interpolation="nearest",
                                      extent=(0, n, 1, 0))
            self.pool_text = None
            self.dynamic.append(self.pool_img)
            ax.set_yticks([])
            ax.set_xlabel("physical block id" + (f" ({-(-n // self.pool_cols)} blocks a column)"
                                                 if n > self.pool_cols else ""), fontsize=f - 1)
            ax.tick_params(axis="x", labelsize=f - 1.5)
        self.dynamic += list(ax.spines.values())
        # why a slot waits: one line under everything
        self.ax_why = self.fig.add_subplot(gs[3, :])
        self.ax_why.axis("off")
        self.why = self.ax_why.text(0, 0.5, "", fontsize=f, va="center", color="#8a5a00")
        self.dynamic += [self.why] + [a._left_title for a in (self.ax_tl, self.ax_q, self.ax_bt, self.ax_pool)]   # set_title(loc="left")
        self._legend_handles_const = [
            Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="grey", hatch="///", label="prefill"),
            Rectangle((0, 0), 1, 1, facecolor=FREE, edgecolor="#bbbbbb", label="free block"),
            Rectangle((0, 0), 1, 1, facecolor=MISSING, edgecolor="white", hatch="////", label="past the pool"),
            Line2D([], [], marker="X", color="white", markerfacecolor=PREEMPT, markersize=10, label="preempted")]

    def _colors(self, owners, shared):
        """RGB rows for a sequence of owners (request id, None = free, -4 = past the pool)."""
        import numpy as np
        idx = np.array([-1 if o is None else -4 if o == -4 else o % NUM_COLORS for o in owners], dtype=np.int64)
        for k, b in shared:
            idx[k] = -3
        return self.rgb[idx]

    def paint(self, i: int):
        import numpy as np
        trace, s, f = self.trace, self.trace.steps[i], STEP_FONT
        when = f"t = {s.start_s * 1e3:.1f} ms, " if self.show_time else ""
        self.ax_tl.set_title(f"step {s.step} of {trace[-1].step}   ({when}{s.num_tokens} tokens through the model)",
                             fontsize=f + 0.5, loc="left")
        self.cursor.set_xdata([i + 0.5, i + 0.5])
        # legend: rebuilt only when the requests in view change
        seen = []
        for rid in list(s.slot_request) + list(s.queue):
            if rid is not None and rid not in seen:
                seen.append(rid)
        key = (tuple(seen[:16]), len(seen), bool(s.block_refs))
        if key != self._legend_key:
            from matplotlib.patches import Patch
            handles = [Patch(facecolor=request_color(r), label=req_name(r)) for r in seen[:16]]
            if len(seen) > 16:
                handles.append(Patch(facecolor="white", edgecolor="white", label=f"+{len(seen) - 16} more"))
            handles += self._legend_handles_const[:3]
            if s.block_refs:
                handles.append(Patch(facecolor=SHARED, edgecolor="#7a5c00", label="shared block"))
            handles.append(self._legend_handles_const[3])
            self.legend = self.ax_leg.legend(handles=handles, loc="upper left", fontsize=f - 1, frameon=False,
                                             title="legend", title_fontsize=f, alignment="left", handlelength=1.5)
            self._legend_key = key
        # slots
        for y, (rid, ph) in enumerate(zip(s.slot_request, s.slot_phase)):
            color = request_color(rid) if rid is not None else IDLE
            self.slot_box[y].set_facecolor(color)
            self.slot_box[y].set_hatch("///" if ph == "prefill" else None)
            self.slot_num[y].set_text("" if rid is None else str(rid))
            self.slot_num[y].set_color(_ink(color))
            label = "free" if rid is None else f"{req_name(rid)}: {ph}"
            cached = s.cached_tokens[y] if y < len(s.cached_tokens) else 0
            if rid is not None and cached:
                label += f", {cached} cached"
            if rid in s.emitted:
                label += f" -> {s.emitted[rid]}"
            if rid in s.finished:
                label += "  [stop]"
            self.slot_label[y].set_text(label)
        # queue
        q = s.queue[:self.QUEUE_SHOWN]
        for x in range(self.QUEUE_SHOWN):
            rid = q[x] if x < len(q) else None
            self.q_box[x].set_visible(rid is not None)
            self.q_num[x].set_text("" if rid is None else str(rid))
            if rid is not None:
                self.q_box[x].set_facecolor(request_color(rid))
                self.q_num[x].set_color(_ink(request_color(rid)))
                self.q_num[x].set_fontsize(f - 2 if rid < 100 else f - 4)
        pre = [x + 0.45 for x, rid in enumerate(q) if rid in s.preempted]
        self.q_pre.set_offsets(np.array([[x, 0.05] for x in pre]) if pre else np.empty((0, 2)))
        note = f"+{len(s.queue) - self.QUEUE_SHOWN} more" if len(s.queue) > self.QUEUE_SHOWN else ""
        if s.preempted:
            note += ("\n" if note else "") + "preempted: " + ", ".join(req_name(r) for r in s.preempted)
        self.q_note.set_text(note)
        self.q_note.set_color(PREEMPT if s.preempted else "black")
        self.ax_q.set_title(f"queue: {len(s.queue)} waiting, front first", fontsize=f + 0.5, loc="left")
        # block table
        caching = s.prefix_queries > 0 or bool(s.block_refs)
        owners, shared = [], []
        for y in range(self.n_slots):
            row = s.block_table[y] if y < len(s.block_table) else []
            rid = s.slot_request[y] if y < len(s.slot_request) else None
            for x in range(self.cols):
                b = row[x] if x < len(row) else None
                owners.append(None if b is None else rid)
                if b is not None and b in s.block_refs:
                    shared.append((len(owners) - 1, b))
                if self.bt_text is not None:
                    t = self.bt_text[y][x]
                    t.set_text("" if b is None else f"{b}\n×{s.block_refs[b]}" if b in s.block_refs else str(b))
                    if b is not None:
                        t.set_color("black" if b in s.block_refs else _ink(request_color(rid)))
        self.bt_img.set_data(self._colors(owners, shared).reshape(self.n_slots, self.cols, 3))
        self.ax_bt.set_title("block table (physical block ids)" + (
            f"\nprefix cache hit rate {s.hit_rate:.0%} ({s.prefix_hits}/{s.prefix_queries} tokens)"
            if caching else ""), fontsize=f + 0.5, loc="left")
        # pool
        n = s.pool_total
        if self.pool_text is not None:
            own = pool_owners(s.block_table, s.slot_request, n)
            cells = own + [-4] * (self.pool_rows * self.pool_cols - n)
            img = self._colors(cells, [(b, b) for b in s.block_refs if b < n])
            self.pool_img.set_data(img.reshape(self.pool_rows, self.pool_cols, 3))
            for b, t in enumerate(self.pool_text):
                rid = own[b] if b < n else None
                t.set_text("" if rid is None else f"×{s.block_refs[b]}" if b in s.block_refs else str(rid))
                if rid is not None:
                    t.set_color("black" if b in s.block_refs else _ink(request_color(rid)))
        else:
            o = np.full(n, -1, dtype=np.int64)          # a large pool: no Python loop over its blocks
            for row, rid in zip(s.block_table, s.slot_request):
                row = [b for b in row if b is not None and 0 <= b < n]
                if row and rid is not None:
                    o[row] = rid % NUM_COLORS
            if s.block_refs:
                o[[b for b in s.block_refs if b < n]] = -3
            per = -(-n // self.pool_cols)
            o = np.concatenate([o, np.full(per * self.pool_cols - n, -1)]).reshape(self.pool_cols, per)
            used = o != -1
            first = np.where(used.any(1), used.argmax(1), 0)            # a used block wins its column
            self.pool_img.set_data(self.rgb[o[np.arange(self.pool_cols), first]][None])
        self.ax_pool.set_title(f"KV pool: {s.pool_used}/{n} blocks used"
                               + (f", {len(s.block_refs)} shared, {s.pool_cached} cached" if caching else "")
                               + ("  (cell: owner)" if self.pool_text is not None else ""),
                               fontsize=f + 0.5, loc="left")
        import textwrap
        self.why.set_text(textwrap.fill(_why_waiting(trace, i), 120))
        return self.fig


    def frames(self, indices, box, dpi: int = 80, colors: int | None = 256):
        """PNG bytes of the step picture at each index, cropped to `box` (a Bbox in inches), by
        blitting: everything paint() leaves alone (axes, ticks, the timeline) is rendered once, and
        each frame restores that background and draws only what paint() changed."""
        import numpy as np
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.transforms import Bbox
        from PIL import Image
        fig = self.fig
        canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)
        fig.set_dpi(dpi)
        self.paint(indices[0])
        for a in self.dynamic:
            a.set_animated(True)
        self.legend.set_animated(True)
        canvas.draw()                                   # the background: animated artists left out
        background = canvas.copy_from_bbox(fig.bbox)
        h = int(round(fig.bbox.height))
        crop = (int(box.x0 * dpi), h - int(np.ceil(box.y1 * dpi)), int(np.ceil(box.x1 * dpi)), h - int(box.y0 * dpi))
        crop = (max(0, crop[0]), max(0, crop[1]), min(int(fig.bbox.width), crop[2]), min(h, crop[3]))
        legends = {}                                    # the legend's pixels, per set of requests in view
        for i in indices:
            self.paint(i)
            canvas.restore_region(background)
            if self._legend_key in legends:             # the legend first: its box may reach below
                canvas.restore_region(legends[self._legend_key])
            else:
                self.legend.set_animated(True)
                fig.draw_artist(self.legend)
                legends[self._legend_key] = canvas.copy_from_bbox(
                    Bbox.union([self.ax_leg.bbox, self.legend.get_window_extent(canvas.get_renderer())]))
            for a in self.dynamic:
                if a.get_visible():
                    fig.draw_artist(a)
            img = Image.fromarray(np.asarray(canvas.buffer_rgba())[..., :3]).crop(crop)
            if colors is not None:
                img = img.quantize(colors=colors, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE)
            out = io.BytesIO()
            img.save(out, format="PNG")
            yield out.getvalue()


def draw_step(trace, i: int, fig=None, max_pool: int | None = None, show_time: bool = True):
    """Everything at engine step i: the timeline with a cursor (preemptions marked), the slots
    (request, phase), the queue, the block table, the pool, a legend and, when a slot is free
    while requests wait, a line saying why -- one figure. Every request is called "req N" and has
    one colour in every panel. (max_pool: kept for old callers; the pool panel fits any pool size.)"""
    return _StepPainter(trace, fig, show_time).paint(i)


def fig_to_png(fig, dpi: int = 80, bbox_inches="tight", colors: int | None = None) -> bytes:
    """The figure as PNG bytes. bbox_inches: "tight" (crop to what is drawn), None (the whole
    figure) or a Bbox in inches (the same crop for every frame of an animation). colors: reduce
    to a palette of that many colours (<= 256): the drawings are flat colours, so a 256-colour
    PNG looks the same and is about 3x smaller."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches=bbox_inches)
    if colors is None:
        return buf.getvalue()
    from PIL import Image
    img = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
    out = io.BytesIO()
    img.quantize(colors=colors, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(out, format="PNG")
    return out.getvalue()


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


# ----------------------------------------------------------------------------- the explorer
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


_EXPLORER_JS = r"""
(function () {
  var root = document.getElementById("%(id)s");
  if (!root || root.getAttribute("data-ready")) return;
  root.setAttribute("data-ready", "1");
  function q(sel) { return root.querySelector(sel); }
  var frames = root.querySelectorAll("img.pl-frame");
  var n = frames.length, cur = %(start)d, timer = null, interval = %(interval)d;
  var slider = q(".pl-slider"), label = q(".pl-label"), play = q(".pl-play"), speed = q(".pl-speed");
  function show(k) {
    k = Math.max(0, Math.min(n - 1, k));
    for (var j = 0; j < n; j++) frames[j].style.display = (j === k) ? "block" : "none";
    cur = k;
    slider.value = String(k);
    label.textContent = "step " + frames[k].getAttribute("data-step") + "  (frame " + (k + 1) + " of " + n + ")";
    root.setAttribute("data-frame", String(k));
  }
  function stop() {
    if (timer !== null) { clearInterval(timer); timer = null; }
    play.textContent = "\u25b6 play";
  }
  function tick() { if (cur >= n - 1) stop(); else show(cur + 1); }
  function start() {
    stop();
    if (cur >= n - 1) show(0);
    timer = setInterval(tick, interval / (parseFloat(speed.value) || 1));
    play.textContent = "\u275a\u275a pause";
  }
  var acts = {
    first: function () { stop(); show(0); },
    prev: function () { stop(); show(cur - 1); },
    play: function () { if (timer !== null) stop(); else start(); },
    next: function () { stop(); show(cur + 1); },
    last: function () { stop(); show(n - 1); }
  };
  var buttons = root.querySelectorAll("button[data-act]");
  for (var b = 0; b < buttons.length; b++) {
    buttons[b].addEventListener("click", (function (act) {
      return function (e) { e.preventDefault(); acts[act](); };
    })(buttons[b].getAttribute("data-act")));
  }
  slider.addEventListener("input", function () { stop(); show(parseInt(slider.value, 10)); });
  speed.addEventListener("change", function () { if (timer !== null) start(); });
  var keys = { ArrowRight: "next", ArrowLeft: "prev", Home: "first", End: "last", " ": "play" };
  root.addEventListener("keydown", function (e) {
    var act = keys[e.key], tag = (e.target && e.target.tagName) || "";
    if (!act || tag === "SELECT" || (tag === "BUTTON" && e.key === " ")) return;
    e.preventDefault();
    e.stopPropagation();
    acts[act]();
  });
  q(".pl-controls").style.display = "flex";
  q(".pl-static").style.display = "none";
  show(cur);
})();
"""


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
    painter = _StepPainter(trace, fig)
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
        + f"\n<script>{_EXPLORER_JS % {'id': uid, 'start': first_shown, 'interval': max(1, int(interval_ms))}}"
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


# ----------------------------------------------------------------------------- other plots
def draw_bars(values: dict, ylabel: str, title: str = "", ax=None, fmt: str = "{:.2f}", colors=None):
    fig, ax = _new_ax(ax, (max(4, 1.2 * len(values) + 1.5), 3))
    names = list(values)
    bars = ax.bar(names, [values[k] for k in names],
                  color=colors or ["#4c72b0", "#c44e52", "#55a868", "#8172b2", "#ccb974", "#64b5cd"][:len(names)])
    for b in bars:
        ax.text(b.get_x() + b.get_width() / 2, b.get_height(), fmt.format(b.get_height()),
                ha="center", va="bottom", fontsize=9)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10, loc="left")
    ax.set_ylim(0, max([v for v in values.values()] + [1e-9]) * 1.2)
    return _tidy(fig, ax)


def draw_pool_usage(trace, ax=None, title: str | None = None):
    """Blocks in use at every step, the pool size as a line, preemptions marked."""
    fig, ax = _new_ax(ax, (8, 2.8))
    x = [s.step for s in trace.steps]          # absolute step numbers (the trace may have dropped old steps)
    ax.fill_between(x, [s.pool_used for s in trace.steps], step="mid", alpha=0.5, color="#4c72b0",
                    label="blocks in use")
    total = trace.steps[0].pool_total if len(trace) else 0
    ax.axhline(total, color="black", linestyle="--", linewidth=1, label=f"pool = {total} blocks")
    pre = [s.step for s in trace.steps if s.preempted]
    for j, p in enumerate(pre):
        ax.axvline(p, color="#c44e52", linewidth=1, label="preemption" if j == 0 else None)
    ax.set_xlabel("engine step")
    ax.set_ylabel("KV blocks")
    ax.set_ylim(0, total * 1.45 + 1)
    ax.legend(fontsize=8, loc="upper right", ncol=3)
    ax.set_title(title or "KV pool usage", fontsize=10, loc="left")
    return _tidy(fig, ax)


def draw_fragmentation(used_tokens: dict, reserved_tokens: dict, title: str = "", ax=None):
    """Per scheme: tokens actually stored vs slots reserved but never used. Two panels (when no
    `ax` is given): the slots themselves, and the same bars as shares of what each scheme reserves
    -- so a scheme that reserves 30x less is still readable."""
    names = list(used_tokens)
    used = [used_tokens[k] for k in names]
    waste = [reserved_tokens[k] - used_tokens[k] for k in names]
    if ax is None:
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(9.5, 3.3), gridspec_kw={"width_ratios": [1.2, 1]})
    else:
        fig, ax2 = ax.figure, None
    ax.bar(names, used, color="#4c72b0", label="holds a token")
    ax.bar(names, waste, bottom=used, color="#dd8452", label="reserved, empty")
    for i, k in enumerate(names):
        ax.text(i, reserved_tokens[k], f"{reserved_tokens[k]:,} reserved\n{waste[i]:,} empty",
                ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("KV token slots")
    ax.set_ylim(0, max(reserved_tokens.values()) * 1.3)
    ax.legend(fontsize=8, loc="upper right")
    ax.set_title(title, fontsize=10, loc="left")
    _tidy(fig, ax, tight=False)
    if ax2 is not None:
        share = [w / max(1, reserved_tokens[k]) for w, k in zip(waste, names)]
        ax2.bar(names, [1 - x for x in share], color="#4c72b0")
        ax2.bar(names, share, bottom=[1 - x for x in share], color="#dd8452")
        for i, x in enumerate(share):
            ax2.text(i, 1 - x / 2 if x > 0.08 else 1.01, f"{x:.0%} wasted", ha="center",
                     va="center" if x > 0.08 else "bottom", fontsize=9,
                     color="white" if x > 0.08 else "black", fontweight="bold")
        ax2.set_ylim(0, 1.12)
        from matplotlib.ticker import PercentFormatter
        ax2.yaxis.set_major_formatter(PercentFormatter(1.0))
        ax2.set_ylabel("share of the reserved slots")
        ax2.set_title("the same, as shares", fontsize=10, loc="left")
        _tidy(fig, ax2, tight=False)
    fig.tight_layout()
    return fig


def draw_bandwidth(results: dict, limit_gbs: float | None, title: str = "", ax=None,
                   limit_label: str = "device copy bandwidth"):
    """results: {variant: {x_label: GB/s}} -> grouped bars, with the device's limit as a line."""
    import numpy as np
    fig, ax = _new_ax(ax, (8, 3.4))
    variants = list(results)
    xs = list(next(iter(results.values())).keys()) if results else []
    w = 0.8 / max(1, len(variants))
    for j, v in enumerate(variants):
        ax.bar(np.arange(len(xs)) + j * w - 0.4 + w / 2, [results[v].get(x, 0) for x in xs], w, label=v)
    if limit_gbs:
        ax.axhline(limit_gbs, color="black", linestyle="--", linewidth=1,
                   label=f"{limit_label} {limit_gbs:.0f} GB/s")
    ax.set_xticks(range(len(xs)), [str(x) for x in xs], fontsize=8)
    ax.set_ylabel("K/V bytes read / time (GB/s)")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10, loc="left")
    return _tidy(fig, ax)


def draw_lines(series: dict, xlabel: str, ylabel: str, title: str = "", ax=None, logx: bool = False,
               logy: bool = False):
    """series: {name: (xs, ys)} -> one line per name. logy: a log y axis, for series whose sizes
    differ by orders of magnitude (each line then keeps its shape instead of lying flat on zero)."""
    fig, ax = _new_ax(ax, (5.5, 3.2))
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o" if len(xs) <= 40 else None, label=name)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
        ax.grid(axis="y", which="major", alpha=0.3)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10, loc="left")
    return _tidy(fig, ax)


def draw_safetensors_layout(header_len: int, entries: list, total: int, ax=None, max_labels: int = 12,
                            head: bytes | None = None):
    """The file as one bar: 8-byte length, JSON header, then each tensor's byte range.

    head: the file's first bytes (say 8 + 300). Given, the figure gets a top panel that shows them:
    the 8 length bytes in hex (little-endian, least significant first) and what they decode to,
    then the start of the JSON text -- the header that is a hair's width in the to-scale bar."""
    import struct
    import textwrap
    if head is not None and ax is None:
        fig, (top, ax) = plt.subplots(2, 1, figsize=(10, 3.9), gridspec_kw={"height_ratios": [1.7, 1]})
    else:
        fig, ax = _new_ax(ax, (10, 1.8))
        top = None
    ax.add_patch(Rectangle((0, 0), 8, 1, facecolor="#c44e52"))
    ax.add_patch(Rectangle((8, 0), header_len, 1, facecolor="#ccb974"))
    base = 8 + header_len
    big = sorted(range(len(entries)), key=lambda j: entries[j][1] - entries[j][2])[:max_labels]
    for j, (name, start, end) in enumerate(entries):
        ax.add_patch(Rectangle((base + start, 0), end - start, 1, facecolor=_PALETTE[j % NUM_COLORS],
                               edgecolor="white", linewidth=0.3))
        label = name.replace("model.", "")
        if j in big and len(label) * 0.0068 * total < (end - start):
            ax.text(base + (start + end) / 2, 0.5, label, ha="center", va="center",
                    fontsize=7, color=_ink(_PALETTE[j % NUM_COLORS]), clip_on=True)
    ax.set_xlim(0, total)
    ax.set_ylim(0, 1)
    ax.set_yticks([])
    ax.set_xlabel("byte offset in the file (to scale)")
    ax.set_title(f"the whole file, to scale: 8 + {header_len:,} header bytes ({base / total:.2%} of the "
                 f"file), then {len(entries)} tensors back to back, {total:,} bytes in all",
                 fontsize=9, loc="left")
    if top is not None:
        top.axis("off")
        top.set_xlim(0, 10)
        top.set_ylim(0, 4)
        n = struct.unpack("<Q", head[:8])[0]
        top.text(0, 3.75, "the first bytes of the file, not to scale", fontsize=10, va="center")
        for k in range(8):
            top.add_patch(Rectangle((0.42 * k, 2.5), 0.4, 0.75, facecolor="#c44e52", edgecolor="white"))
            top.text(0.42 * k + 0.2, 2.875, f"{head[k]:02x}", ha="center", va="center", color="white",
                     fontsize=9, family="monospace")
        top.text(3.5, 2.875, f"u64, little-endian: N = {n:,}  ->  the next N bytes are JSON",
                 va="center", fontsize=9)
        text = head[8:8 + min(n, 330)].decode("utf-8", errors="replace")
        shown = "\n".join(textwrap.wrap(text, 110)[:3]) + (" ..." if n > 330 else "")
        top.add_patch(Rectangle((0, 0.05), 10, 2.2, facecolor="#f4efd6", edgecolor="#ccb974"))
        top.text(0.1, 2.05, shown, va="top", fontsize=7.5, family="monospace")
        top.text(0.1, 0.25, "each tensor: dtype, shape, data_offsets = [start, end) counted from the end "
                 "of the header", fontsize=8, style="italic", color="#555555")
    fig.tight_layout()
    return fig


def draw_rope_wavelengths(plain_wl: list, used_wl: list, rope_scaling: dict | None = None, ax=None,
                          title: str = "RoPE: the wavelength of each rotation pair"):
    """One point per rotation pair i (x) and its wavelength 2*pi/inv_freq in tokens (y, log
    scale: the wavelengths span ~6 to ~10^6 tokens, so a linear axis shows only the last few).
    With llama3 scaling: the two thresholds as lines and the three regimes shaded."""
    fig, ax = _new_ax(ax, (7.5, 3.6))
    i = list(range(len(plain_wl)))
    ax.plot(i, plain_wl, "o-", color="#4c72b0", markersize=3.5, label="no scaling")
    ax.plot(i, used_wl, "s-", color="#c44e52", markersize=3.5, label="llama3 scaling", alpha=0.85)
    ax.set_yscale("log")
    if rope_scaling:
        orig = rope_scaling["original_max_position_embeddings"]
        hi_wl = orig / rope_scaling["high_freq_factor"]
        lo_wl = orig / rope_scaling["low_freq_factor"]
        ax.axhspan(min(plain_wl) / 2, hi_wl, color="#55a868", alpha=0.10)
        ax.axhspan(hi_wl, lo_wl, color="#ccb974", alpha=0.18)
        ax.axhspan(lo_wl, max(used_wl) * 3, color="#c44e52", alpha=0.07)
        ax.axhline(orig, color="black", linestyle=":", linewidth=1)
        kw = dict(fontsize=8, transform=ax.get_yaxis_transform(), ha="left")
        ax.text(0.01, hi_wl * 0.7, f"< {hi_wl:.0f} tokens: unchanged", va="top", **kw)
        ax.text(0.01, (hi_wl * lo_wl) ** 0.5, "blended", va="center", **kw)
        ax.text(0.01, lo_wl * 1.4, f"> {lo_wl:.0f} tokens: divided by {rope_scaling['factor']:g} "
                f"(wavelength x{rope_scaling['factor']:g})", va="bottom", **kw)
        ax.text(0.99, orig * 1.15, f"original context {orig:,}", va="bottom", fontsize=8,
                transform=ax.get_yaxis_transform(), ha="right")
        ax.set_ylim(min(plain_wl) / 2, max(used_wl) * 3)
    ax.set_xlabel("rotation pair i (coordinates i and i + head_dim/2)")
    ax.set_ylabel("wavelength (tokens, log)")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(title, fontsize=10, loc="left")
    return _tidy(fig, ax)


# ----------------------------------------------------------------------------- host and GPU
def overlap_schedule(host_ms: float, gpu_ms: float, steps: int, overlap: bool) -> list[tuple]:
    """When each step's host work and GPU work run, as (lane, step, start_ms, end_ms).

    In turn (overlap=False): host work of step k (schedule, inputs, launch, then reading the
    token) and the GPU's step k alternate, so a step costs host + GPU. With overlap the host
    launches step k as soon as its own work for k is done, and its work for step k+1 waits only
    for the token of step k-1 (the one it reads): the GPU never waits while host < GPU."""
    spans, t, g_end = [], 0.0, []
    h_end = 0.0
    for k in range(steps):
        if overlap:
            h0 = max(h_end, g_end[k - 2] if k >= 2 else 0.0)
            h_end = h0 + host_ms
            g0 = max(h_end, g_end[k - 1] if k >= 1 else 0.0)
        else:
            h0, h_end = t, t + host_ms
            g0 = h_end
        g_end.append(g0 + gpu_ms)
        t = g_end[-1]
        spans += [("host", k, h0, h_end), ("GPU", k, g0, g_end[-1])]
    return spans


def draw_overlap(host_ms: float, gpu_ms: float, steps: int = 5, title: str | None = None):
    """Host and GPU lanes for `steps` decode steps, in turn (top) and overlapped (bottom)."""
    fig, axes = plt.subplots(2, 1, figsize=(10, 3.6), sharex=True)
    for ax, overlap in zip(axes, (False, True)):
        spans = overlap_schedule(host_ms, gpu_ms, steps, overlap)
        end = max(s[3] for s in spans)
        for lane, k, a, b in spans:
            y = 1 if lane == "host" else 0
            ax.add_patch(Rectangle((a, y + 0.1), b - a, 0.8, facecolor=request_color(k),
                                   edgecolor="black", linewidth=0.5))
            if b - a > 0.04 * end:
                ax.text((a + b) / 2, y + 0.5, str(k + 1), ha="center", va="center", fontsize=8)
        ax.set_yticks([0.5, 1.5], ["GPU", "host"])
        ax.set_ylim(0, 2)
        ax.set_xlim(0, max(s[3] for s in overlap_schedule(host_ms, gpu_ms, steps, False)) * 1.02)
        ax.set_title(f"{'overlapped: step n+1 launched before step n is read' if overlap else 'in turn'}"
                     f" -- {steps} tokens in {end:.2f} ms = {steps / end * 1e3:,.0f} tokens/s",
                     fontsize=9, loc="left")
    axes[1].set_xlabel("ms")
    fig.suptitle(title or f"host {host_ms:.2f} ms + GPU {gpu_ms:.2f} ms per step", fontsize=10)
    fig.tight_layout()
    return fig

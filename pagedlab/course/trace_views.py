"""Pictures of a recorded engine Trace: the slot timeline (one row per slot, preemptions marked),
its utilization, the block table, the KV pool and its use over time, and one engine step whole
(draw_step: timeline with a cursor, slots, queue, block table, pool, legend, why a slot waits).
Each returns a matplotlib Figure: the same call works in a notebook, a script and a test."""
from __future__ import annotations

import io

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from .style import (FREE, IDLE, MISSING, NUM_COLORS, PALETTE, PREEMPT, SHARED, ink, new_ax,
                    req_name, request_color, tidy)


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
    fig, ax = new_ax(ax, (min(14, 2 + 0.18 * len(steps)), 0.9 + 0.45 * n_slots))
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
                        color=ink(color), fontweight="bold")
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
    return tidy(fig, ax, tight=False)


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
    fig, ax = new_ax(ax, (5, 3))
    names = list(traces)
    util = [traces[k].utilization() for k in names]
    bars = ax.bar(names, util, color=["#c44e52", "#4c72b0", "#55a868", "#8172b2"][:len(names)])
    for b, t in zip(bars, traces.values()):
        ax.text(b.get_x() + b.get_width() / 2, b.get_height() + 0.02,
                f"{b.get_height():.0%}\n{len(t)} steps", ha="center", va="bottom", fontsize=9)
    ax.set_ylim(0, 1.25)
    ax.set_ylabel("slot utilization")
    ax.set_title("busy slot-steps / all slot-steps", fontsize=10, loc="left")
    return tidy(fig, ax)


def draw_pool_usage(trace, ax=None, title: str | None = None):
    """Blocks in use at every step, the pool size as a line, preemptions marked."""
    fig, ax = new_ax(ax, (8, 2.8))
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
    return tidy(fig, ax)


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
    fig, ax = new_ax(ax, (min(14, 1.5 + 0.45 * cols), 0.6 + 0.45 * n_slots))
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
    return tidy(fig, ax, tight=False)


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
        fig, ax = new_ax(ax, (10, 1.4))
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
    fig, ax = new_ax(ax, (min(12, 0.3 * ncols + 1), 0.3 * nrows + 0.8))
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
            text_color = "#999999" if rid is None else ink(colors[b])
            what = f"×{shared[b]}" if b in shared and isinstance(shared, dict) else rid
            ax.text(x + 0.5, y + 0.5, str(b) if rid is None else f"{b}\n{what}", ha="center",
                    va="center", fontsize=(7 if ncols <= 16 else 5) - (rid is not None), color=text_color,
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


STEP_FONT = 10.5     # the step picture's text, in points: readable at JupyterLab's notebook width
# (a frame is ~12 in wide at EXPLORER_DPI = 80, about the width of JupyterLab's notebook column,
# so a point is about a pixel: 7-8 pt text was ~6 px on screen)


def _rgb_table():
    """The palette as an array: row k is request_color(k) for k < NUM_COLORS, then FREE, IDLE,
    SHARED, MISSING at -1, -2, -3, -4 (numpy indexing from the end)."""
    import matplotlib.colors as mc
    import numpy as np
    return np.array([mc.to_rgb(c) for c in PALETTE] + [mc.to_rgb(c) for c in (MISSING, SHARED, IDLE, FREE)])


def why_waiting(trace, i) -> str:
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


class StepPainter:
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
            self.slot_num[y].set_color(ink(color))
            label = "free" if rid is None else f"{req_name(rid)}: {ph}"
            cached = s.cached_tokens[y] if y < len(s.cached_tokens) else 0
            if rid is not None and cached:
                label += f", {cached} cached"
            if rid in s.emitted:
                label += f" -> {s.emitted[rid]}"
            if rid in getattr(s, "spec", {}):             # speculative decoding: this step's guesses
                guesses, kept = s.spec[rid]
                label += f" (+{kept} of {len(guesses)} guessed)"
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
                self.q_num[x].set_color(ink(request_color(rid)))
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
                        t.set_color("black" if b in s.block_refs else ink(request_color(rid)))
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
                    t.set_color("black" if b in s.block_refs else ink(request_color(rid)))
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
        self.why.set_text(textwrap.fill(why_waiting(trace, i), 120))
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
    return StepPainter(trace, fig, show_time).paint(i)

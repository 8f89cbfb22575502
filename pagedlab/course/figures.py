"""Regenerate every course figure in figures/: `python -m pagedlab.course.figures [--out DIR]`.

The figures are drawn by pagedlab.course.viz from engine traces of the tiny random Llama running a fixed
toy workload (ignore_eos, chosen lengths), so the schedule -- and hence every picture -- is the
same on any machine, CPU or GPU, in about ten seconds. (figures/kernels_*.png and engine_*.png are
made by the benchmarks, not here.)
"""
from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from ..kv_cache import blocks_needed  # noqa: E402
from . import toy_workload, viz  # noqa: E402
from .style import ink  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def run_trace(slots: int, policy: str = "continuous", num_blocks: int | None = None, n: int = 10,
              seed: int = 1, block_size: int = 16, **workload):
    from ..llm import LLM
    llm = LLM("random:tiny", device="cpu", max_num_seqs=slots, policy=policy, num_blocks=num_blocks,
              block_size=block_size, trace=True, show_progress=False, attention_backend="torch")
    prompts, params = toy_workload(n, seed=seed, **workload)
    outs = llm.generate(prompts, params)
    return llm.trace, outs, prompts, params


def run_shared_prefix_trace(slots: int = 4, n: int = 8, seed: int = 2, block_size: int = 8):
    """Prefix caching on: n requests that start with the same 'system prompt' (3 blocks)."""
    from ..llm import LLM
    llm = LLM("random:tiny", device="cpu", max_num_seqs=slots, num_blocks=64, block_size=block_size,
              prefix_caching=True, trace=True, show_progress=False, attention_backend="torch")
    prompts, params = toy_workload(n + 1, seed=seed, prompt_len=(6, 14), new_tokens=(6, 12))
    system = (prompts[0] * 4)[:3 * block_size]
    llm.generate([system + p for p in prompts[1:]], params[1:])
    return llm.trace


def fragmentation_numbers(prompts, params, max_model_len: int, block_size: int):
    """Token slots reserved by contiguous per-request allocation (max_model_len each) and by
    paging (whole blocks), against the tokens actually stored, for a set of finished requests."""
    lens = [len(p) + sp.max_new_tokens for p, sp in zip(prompts, params)]
    used = sum(lens)
    return {"contiguous (max length each)": used, f"paged (blocks of {block_size})": used}, {
        "contiguous (max length each)": max_model_len * len(lens),
        f"paged (blocks of {block_size})": sum(blocks_needed(n, block_size) * block_size for n in lens)}


# ----------------------------------------------------------------------------- concept diagrams
# Small pictures of one idea each, drawn by code (boxes, arrows, text), no engine run needed.
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402


def _canvas(w, h, figsize):
    fig, ax = plt.subplots(figsize=figsize)
    ax.set_xlim(0, w)
    ax.set_ylim(0, h)
    ax.set_aspect("equal")
    ax.axis("off")
    return fig, ax


def _box(ax, x, y, w, h, text="", color="#ffffff", edge="#555555", fontsize=9, round_=True, **kw):
    shape = FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.12" if round_ else "square,pad=0",
                           facecolor=color, edgecolor=edge, linewidth=1, **kw)
    ax.add_patch(shape)
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize,
                color=ink(color) if color not in ("#ffffff", "white") else "black")
    return shape


def _arrow(ax, p, q, text="", color="#333333", rad=0.0, fontsize=8, offset=(0, 0.12), lw=1.2):
    ax.add_patch(FancyArrowPatch(p, q, arrowstyle="-|>", mutation_scale=11, color=color, lw=lw,
                                 connectionstyle=f"arc3,rad={rad}", shrinkA=2, shrinkB=2))
    if text:
        ax.text((p[0] + q[0]) / 2 + offset[0], (p[1] + q[1]) / 2 + offset[1], text, ha="center",
                va="bottom", fontsize=fontsize, color=color)


def draw_paging_concept():
    """Two requests' logical blocks (left) point into one shared pool of physical blocks (right):
    consecutive tokens, scattered blocks, and the block table is the list of arrows."""
    fig, ax = _canvas(13, 5.2, (10, 4))
    pool = {0: 5, 1: 2, 2: 9}, {0: 0, 1: 7}          # req -> {logical: physical}
    names = ("req 0", "req 1")
    for r, (table, name) in enumerate(zip(pool, names)):
        y = 3.4 - 2.2 * r
        ax.text(0, y + 0.95, f"{name}: logical blocks (tokens 0-15, 16-31, ...)", fontsize=9)
        for lb in range(3):
            held = lb in table
            _box(ax, 0.2 + 1.15 * lb, y, 1, 0.7, f"{lb}" if held else "", viz.request_color(r) if held else "#ffffff",
                 edge="#555555" if held else "#cccccc", round_=False)
        ax.text(0.2, y - 0.35, "block table row: " + str([table[k] for k in sorted(table)]), fontsize=8,
                family="monospace", color="#444444")
    ax.text(7.3, 4.9, "the KV pool: physical blocks, any free one will do", fontsize=9)
    where = {}
    for b in range(12):
        x, y = 7.3 + 1.15 * (b % 4), 3.6 - 1.2 * (b // 4)
        owner = next((r for r, t in enumerate(pool) if b in t.values()), None)
        _box(ax, x, y, 1, 0.8, str(b), viz.request_color(owner) if owner is not None else "#ffffff",
             edge="#555555" if owner is not None else "#bbbbbb", round_=False)
        where[b] = (x, y + 0.4)
    for r, table in enumerate(pool):
        y = 3.4 - 2.2 * r
        for lb, b in table.items():
            _arrow(ax, (0.2 + 1.15 * lb + 1, y + 0.35), where[b], color=viz.request_color(r),
                   rad=-0.15 if r == 0 else 0.15, lw=1)
    ax.text(7.3, 0.0, "white = free; a request grows one block at a time, wherever one is free", fontsize=8,
            color="#555555")
    ax.set_title("paged KV cache: logical blocks -> physical blocks", fontsize=11, loc="left")
    return fig


def draw_slot_states():
    """The life of a request: waiting -> running (prefill, then decode) -> finished; preempted when
    the pool runs dry: blocks freed, back to the front of the queue."""
    fig, ax = _canvas(12, 4.6, (9.5, 3.7))
    _box(ax, 0.3, 1.8, 2.4, 1.1, "WAITING\n(in the queue)", "#d0d8e8")
    _box(ax, 4.4, 1.8, 3.2, 1.1, "RUNNING in a slot\nprefill -> decode ...", "#4c72b0")
    _box(ax, 9.3, 1.8, 2.4, 1.1, "FINISHED\n(slot + blocks freed)", "#55a868")
    _arrow(ax, (2.7, 2.55), (4.4, 2.55), "admitted:\na slot and blocks free", offset=(0, 0.3))
    _arrow(ax, (7.6, 2.55), (9.3, 2.55), "EOS / max_tokens /\nstop string", offset=(0, 0.3))
    _arrow(ax, (6.0, 1.8), (1.5, 1.8), "PREEMPTED: pool out of blocks -> blocks freed,\n"
           "back to the FRONT of the queue (tokens kept, recomputed later)", color=viz.PREEMPT,
           rad=-0.45, offset=(0, -1.75))
    ax.add_patch(FancyArrowPatch((5.2, 2.9), (6.8, 2.9), arrowstyle="-|>", mutation_scale=10,
                                 connectionstyle="arc3,rad=-1.1", color="#333333"))
    ax.text(6.0, 4.0, "one token per step", ha="center", fontsize=8)
    ax.set_title("a request's states (request.py: RequestStatus)", fontsize=11, loc="left")
    return fig


def draw_preemption_cycle():
    """Four frames of a 8-block pool: full; the newest request is preempted and its blocks freed;
    the others grow into them and finish; the preempted one is prefilled again."""
    fig, axes = plt.subplots(1, 4, figsize=(12, 2.6))
    frames = [
        ("1. pool full: req 2 needs a block", [0, 0, 1, 1, 1, 2, 2, 0], {}),
        ("2. preempt the newest (req 2):\nits blocks are freed", [0, 0, 1, 1, 1, None, None, 0], {2}),
        ("3. the others grow into them;\nreq 2 waits at the front", [0, 0, 1, 1, 1, 1, 0, 0], {2}),
        ("4. req 0 finishes; req 2 is\nadmitted and prefilled again", [2, 2, 1, 1, 1, 1, 2, None], set()),
    ]
    for ax, (title, owners, queued) in zip(axes, frames):
        ax.set_xlim(0, 4.2)
        ax.set_ylim(0, 3.6)
        ax.set_aspect("equal")
        ax.axis("off")
        for b, o in enumerate(owners):
            x, y = 0.1 + 1.0 * (b % 4), 1.9 - 1.0 * (b // 4)
            _box(ax, x, y, 0.9, 0.9, str(b) if o is None else f"{b}\nreq {o}",
                 "#ffffff" if o is None else viz.request_color(o), fontsize=7, round_=False)
        ax.text(0.1, 0.35, "queue: " + (", ".join(f"req {r}" for r in sorted(queued)) or "empty"),
                fontsize=8, color=viz.PREEMPT if queued else "#555555")
        ax.set_title(title, fontsize=9, loc="left")
    fig.suptitle("preemption: free the newest request's blocks, recompute it later", fontsize=11, x=0.01,
                 ha="left")
    fig.tight_layout()
    return fig


def draw_gqa(num_heads: int = 8, num_kv_heads: int = 2):
    """Grouped-query attention: query head h reads KV head h // (num_heads // num_kv_heads)."""
    g = num_heads // num_kv_heads
    fig, ax = _canvas(num_heads * 1.2 + 0.4, 4.2, (9, 3.4))
    kv_x = {}
    for k in range(num_kv_heads):
        x = 0.2 + (k * g + (g - 1) / 2) * 1.2
        _box(ax, x, 0.4, 1.0, 1.0, f"K,V\nhead {k}", viz.request_color(k))
        kv_x[k] = x + 0.5
    for h in range(num_heads):
        x = 0.2 + 1.2 * h
        _box(ax, x, 2.7, 1.0, 0.9, f"Q {h}", viz.request_color(h // g))
        _arrow(ax, (x + 0.5, 2.7), (kv_x[h // g], 1.4), color=viz.request_color(h // g), lw=1)
    ax.text(0.2, 3.9, f"{num_heads} query heads share {num_kv_heads} KV heads: groups of {g}  "
            f"(KV head = h // {g}); the cache stores {num_kv_heads}, not {num_heads}, heads per token -> "
            f"{g}x less memory", fontsize=8.5)
    ax.set_title("grouped-query attention (GQA)", fontsize=11, loc="left", pad=14)
    return fig


def draw_online_softmax(tiles: int = 3):
    """Flash/paged attention reads K and V a tile at a time and keeps three running numbers per
    query row: the max m, the sum l and the output acc, rescaled whenever m grows."""
    fig, ax = _canvas(12.4, 5.2, (10, 4.2))
    ax.text(0.2, 4.8, "one query row q; the keys arrive in tiles (e.g. one KV block each)", fontsize=9)
    for t in range(tiles):
        x = 0.3 + 4.2 * t
        _box(ax, x + 0.5, 3.4, 2.4, 0.8, f"tile {t}: K_{t}, V_{t}", viz.request_color(t))
        _box(ax, x, 1.45, 3.4, 1.5, f"s = q K_{t} / sqrt(d)\nm' = max(m, max s)\n"
             f"l = l e^(m-m') + sum e^(s-m')\nacc = acc e^(m-m') + e^(s-m') V_{t}\nm = m'",
             "#ffffff", fontsize=7.5)
        _arrow(ax, (x + 1.7, 3.4), (x + 1.7, 2.95))
        if t:
            _arrow(ax, (x - 0.8, 2.2), (x, 2.2))
            ax.text(x - 0.4, 2.35, "m, l,\nacc", ha="center", va="bottom", fontsize=7)
    _box(ax, 8.5, 0.1, 3.2, 0.8, "out = acc / l", "#55a868")
    _arrow(ax, (0.3 + 4.2 * (tiles - 1) + 1.7, 1.45), (10.1, 0.9))
    ax.text(0.2, 0.35, "start: m = -inf, l = 0, acc = 0\nno [T x T] score matrix is ever stored", fontsize=8,
            color="#555555")
    ax.set_title("online softmax: attention one tile at a time", fontsize=11, loc="left")
    return fig


def draw_llama_layer():
    """One decoder layer: two residual branches (attention, then the SwiGLU MLP), each added back."""
    fig, ax = _canvas(10, 11, (5.6, 6.2))
    x0, w = 2.2, 4.6
    steps = [("h (residual stream)", "#e8e8e8"), ("RMSNorm", "#ccb974"), ("Q, K, V projections", "#4c72b0"),
             ("RoPE on Q, K", "#8172b2"), ("attention (GQA, causal;\nK, V written to the paged cache)", "#4c72b0"),
             ("O projection", "#4c72b0"), ("+", None), ("RMSNorm", "#ccb974"),
             ("SwiGLU MLP:\ndown(silu(gate x) * up x)", "#dd8452"), ("+", None)]
    ys = [10.0 - 1.0 * i for i in range(len(steps))]
    cx = x0 + w / 2
    for (text, c), y in zip(steps, ys):
        if c is None:
            ax.add_patch(plt.Circle((cx, y + 0.35), 0.3, facecolor="white", edgecolor="#c44e52", lw=1.4))
            ax.text(cx, y + 0.35, "+", ha="center", va="center", fontsize=12, color="#c44e52")
        else:
            _box(ax, x0, y, w, 0.7, text, c, fontsize=8)
    for (t0, c0), (t1, c1), y0, y1 in zip(steps, steps[1:], ys, ys[1:]):
        _arrow(ax, (cx, y0 + (0.05 if c0 is None else 0)), (cx, y1 + (0.65 if c1 is None else 0.7)))
    _arrow(ax, (cx, ys[-1] + 0.05), (cx, ys[-1] - 0.45))
    ax.text(cx, ys[-1] - 0.75, "h for the next layer", ha="center", fontsize=8.5)
    xr = x0 + w + 0.8
    for (a, b), label in (((0, 6), "h + attention(...)"), ((6, 9), "h + MLP(...)")):
        ya = ys[a] + 0.35
        yb = ys[b] + 0.35
        start = x0 + w if steps[a][1] is not None else cx + 0.3
        ax.plot([start, xr, xr], [ya, ya, yb], color="#c44e52", lw=1.3)
        _arrow(ax, (xr, yb), (cx + 0.3, yb), color="#c44e52")
        ax.text(xr + 0.15, (ya + yb) / 2, label, rotation=90, va="center", fontsize=8, color="#c44e52")
    ax.set_title("a Llama decoder layer (x num_layers),\nthen a final RMSNorm and the LM head", fontsize=10,
                 loc="left")
    return fig


CONCEPTS = {"paging_concept.png": draw_paging_concept, "slot_states.png": draw_slot_states,
            "preemption_cycle.png": draw_preemption_cycle, "gqa_heads.png": draw_gqa,
            "online_softmax.png": draw_online_softmax, "llama_layer.png": draw_llama_layer}


def make_all(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []

    def save(fig, name):
        path = out / name
        fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})
        plt.close(fig)
        written.append(path)

    # 00 / 08: the slot timeline of continuous batching
    cont, _, prompts, params = run_trace(slots=4, n=12)
    save(viz.draw_timeline(cont, title="continuous batching: 4 slots, 12 requests "
                                       "(a letter per request, hatched = prefill)"), "slot_timeline.png")
    # 05 / 08: static vs continuous on the same workload
    static, *_ = run_trace(slots=4, n=12, policy="static")
    save(viz.draw_timelines({"static batching": static, "continuous batching": cont}),
         "static_vs_continuous.png")
    save(viz.draw_utilization({"static": static, "continuous": cont}), "utilization.png")
    # 07: the block table and the pool at one step
    mid = len(cont) // 2
    s = cont.steps[mid]
    save(viz.draw_block_table(s.block_table, s.slot_request,
                              title=f"block table at step {mid}: slot x logical block -> physical block"),
         "block_table.png")
    # 08: one frame of the trace explorer
    save(viz.draw_step(cont, mid, show_time=False), "trace_step.png")     # no wall clock: reproducible
    # 07: fragmentation, contiguous vs paged
    used, reserved = fragmentation_numbers(prompts, params, max_model_len=256, block_size=16)
    save(viz.draw_fragmentation(used, reserved, title="KV memory for 12 requests (max length 256)"),
         "fragmentation.png")
    # 10: preemption when the pool runs out
    tight, outs, *_ = run_trace(slots=4, n=8, num_blocks=9, seed=3, prompt_len=(10, 30),
                                new_tokens=(20, 40))
    npre = sum(o.num_preemptions for o in outs)
    save(viz.draw_pool_usage(tight, title=f"a 9-block pool, 4 slots: {npre} preemptions"),
         "preemption_pool.png")
    save(viz.draw_timeline(tight, title="the same run: preempted requests go back to the queue "
                                        "and are prefilled again"), "preemption_timeline.png")
    # prefix caching: requests that share a system prompt share its blocks (gold, holder count)
    shared = run_shared_prefix_trace()
    best = max(range(len(shared)), key=lambda i: sum(shared[i].block_refs.values()))
    save(viz.draw_step(shared, best, show_time=False), "prefix_cache_step.png")
    # concept diagrams (07 paging, 08 states, 10 preemption, 06 GQA and online softmax, 03 the layer)
    for name, draw in CONCEPTS.items():
        save(draw(), name)
    return written


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m pagedlab.course.figures", description=__doc__)
    p.add_argument("--out", default=str(ROOT / "figures"), help="output folder (default: figures/)")
    args = p.parse_args(argv)
    for path in make_all(Path(args.out)):
        print(path)


if __name__ == "__main__":
    main()

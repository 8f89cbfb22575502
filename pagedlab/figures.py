"""Regenerate every course figure in figures/: `python -m pagedlab.figures [--out DIR]`.

The figures are drawn by pagedlab.viz from engine traces of the tiny random Llama running a fixed
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

from . import course, viz  # noqa: E402
from .kv_cache import blocks_needed  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def run_trace(slots: int, policy: str = "continuous", num_blocks: int | None = None, n: int = 10,
              seed: int = 1, block_size: int = 16, **workload):
    from .llm import LLM
    llm = LLM("random:tiny", device="cpu", max_num_seqs=slots, policy=policy, num_blocks=num_blocks,
              block_size=block_size, trace=True, show_progress=False, attention_backend="torch")
    prompts, params = course.toy_workload(n, seed=seed, **workload)
    outs = llm.generate(prompts, params)
    return llm.trace, outs, prompts, params


def run_shared_prefix_trace(slots: int = 4, n: int = 8, seed: int = 2, block_size: int = 8):
    """Prefix caching on: n requests that start with the same 'system prompt' (3 blocks)."""
    from .llm import LLM
    llm = LLM("random:tiny", device="cpu", max_num_seqs=slots, num_blocks=64, block_size=block_size,
              prefix_caching=True, trace=True, show_progress=False, attention_backend="torch")
    prompts, params = course.toy_workload(n + 1, seed=seed, prompt_len=(6, 14), new_tokens=(6, 12))
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
    return written


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m pagedlab.figures", description=__doc__)
    p.add_argument("--out", default=str(ROOT / "figures"), help="output folder (default: figures/)")
    args = p.parse_args(argv)
    for path in make_all(Path(args.out)):
        print(path)


if __name__ == "__main__":
    main()

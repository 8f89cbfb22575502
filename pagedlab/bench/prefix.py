"""`python -m pagedlab bench prefix`: prefix caching off and on, same engine, same process.

  shared prompt : 256 requests, one 1,024-token system prompt + a 32-256-token question each,
                  32-256 new tokens (EOS ignored), all queued at once
  multi-turn    : 64 chats x 4 turns; each turn resends the whole conversation (previous prompt +
                  previous answer + a new 32-128-token question; the first prompt 128-512 tokens),
                  answers 64-128 tokens; a turn's requests are queued together once the previous
                  turn is done
  offline       : bench engine's offline workload (256 requests, prompt and output lengths
                  uniform in [100, 1024]): nothing to share -- what caching costs when it cannot help
  unique        : 256 requests of 1,088 unique random tokens, 64 new tokens each: nothing to
                  share and every prompt 68 full blocks -- the most hashing and registering per
                  output token (the miss cost's worst case among these)

Each workload runs with prefix caching off and on, on one engine (the cache emptied before each
run), --rounds times alternating (the median run of each is reported), after a warm-up pass of each (Triton compiles kernel variants on first sight). Reported:
output tokens/s (wall time, prefill included), TTFT p50/p90/p99 (from queueing), the prompt
tokens computed and the hit rate (prompt tokens found cached / prompt tokens), and whether the
greedy tokens of the two runs agree. JSON + a markdown table + a plot in --out.

Default: the Llama-3.2-1B config with random bf16 weights on CUDA. --small: the tiny random model
and small workloads of the same shapes (runs on CPU in seconds: what the tests use).
"""
from __future__ import annotations

import argparse
import time

import torch

from pagedlab.bench.common import RANDOM_TOKEN_LIMIT, out_dir, write_json
from pagedlab.sampling import SamplingParams

WORKLOADS = ("shared_prompt", "multi_turn", "offline", "unique")
FULL = dict(requests=256, system=1024, question=(32, 256), answer=(32, 256),
            chats=64, turns=4, first=(128, 512), turn_question=(32, 128), turn_answer=(64, 128),
            offline=(100, 1024), unique=(256, 1088, 64))
SMALL = dict(requests=16, system=48, question=(4, 16), answer=(2, 8),
             chats=4, turns=3, first=(8, 32), turn_question=(4, 8), turn_answer=(2, 8),
             offline=(8, 32), unique=(32, 200, 4))


def _uniform(g, lo_hi, n=1):
    lo, hi = lo_hi
    return torch.randint(lo, hi + 1, (n,), generator=g).tolist()


def _tokens(g, n, vocab):
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def shared_prompt_workload(s, vocab, seed=0):
    """One system prompt, then a different question per request: (prompts, new tokens)."""
    g = torch.Generator().manual_seed(seed)
    system = _tokens(g, s["system"], vocab)
    prompts = [system + _tokens(g, q, vocab) for q in _uniform(g, s["question"], s["requests"])]
    return prompts, _uniform(g, s["answer"], s["requests"])


def offline_workload(s, vocab, seed=0):
    """bench engine's offline workload (same prompts at the full size)."""
    from pagedlab.bench.engine import offline_workload as engine_offline
    return engine_offline(s["requests"], *s["offline"], vocab=vocab, seed=seed)


def set_prefix_caching(llm, on: bool) -> None:
    """Switch prefix caching on an idle engine and empty the cache (a run starts cold)."""
    s = llm.engine.scheduler
    assert not s.has_work(), "switch prefix caching only on an idle engine"
    s.prefix_caching = on
    s.allocator.reset_prefix_cache()


def _sync(llm):
    if llm.engine.device.type == "cuda":
        torch.cuda.synchronize()


def percentiles_ms(xs, ps=(50, 90, 99)):
    if not xs:
        return {p: float("nan") for p in ps}
    t = torch.tensor(xs, dtype=torch.float64)
    return {p: float(t.quantile(p / 100)) * 1e3 for p in ps}


def generate(llm, prompts, out_lens):
    return llm.generate(prompts, [SamplingParams(max_new_tokens=o, ignore_eos=True) for o in out_lens])


def run_workload(llm, name, s, vocab, seed=0):
    """One pass of a workload: every output, the wall time (multi-turn: the sum of its turns)."""
    if name == "multi_turn":
        g = torch.Generator().manual_seed(seed)
        prompts = [_tokens(g, n, vocab) for n in _uniform(g, s["first"], s["chats"])]
        outs, wall = [], 0.0
        for turn in range(s["turns"]):
            answers = _uniform(g, s["turn_answer"], s["chats"])
            _sync(llm)
            t0 = time.perf_counter()
            got = generate(llm, prompts, answers)
            _sync(llm)
            wall += time.perf_counter() - t0
            outs += got
            prompts = [p + o.token_ids + _tokens(g, q, vocab)
                       for p, o, q in zip(prompts, got, _uniform(g, s["turn_question"], s["chats"]))]
        return outs, wall
    if name == "unique":
        g = torch.Generator().manual_seed(seed)
        n, p, o = s["unique"]
        prompts, out_lens = [_tokens(g, p, vocab) for _ in range(n)], [o] * n
    else:
        prompts, out_lens = (shared_prompt_workload if name == "shared_prompt" else offline_workload)(s, vocab, seed)
    _sync(llm)
    t0 = time.perf_counter()
    outs = generate(llm, prompts, out_lens)
    _sync(llm)
    return outs, time.perf_counter() - t0


def measure(llm, name, s, vocab, caching: bool) -> dict:
    set_prefix_caching(llm, caching)
    eng = llm.engine
    eng.reset_timing()
    alloc = eng.scheduler.allocator
    q0, h0 = alloc.prefix_queries, alloc.prefix_hits
    outs, wall = run_workload(llm, name, s, vocab)
    n_out = sum(len(o.token_ids) for o in outs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    cached = sum(o.num_cached_tokens for o in outs)
    queries = alloc.prefix_queries - q0
    return dict(requests=len(outs), tokens=n_out, wall_s=wall, tokens_per_s=n_out / wall,
                ttft_ms=percentiles_ms([o.ttft_s for o in outs]),
                itl_ms=percentiles_ms([x for o in outs for x in o.itl_s]),
                prompt_tokens=prompt_tokens, cached_prompt_tokens=cached,
                computed_prompt_tokens=prompt_tokens - cached,
                hit_rate=cached / prompt_tokens if prompt_tokens else 0.0,
                lookup_hit_rate=(alloc.prefix_hits - h0) / queries if queries else 0.0,
                preemptions=sum(o.num_preemptions for o in outs),
                host_timing={k: (v if k == "steps" else round(v, 4)) for k, v in eng.timing.items()},
                token_ids=[o.token_ids for o in outs])


def median_run(runs: list[dict]) -> dict:
    """The run of median tokens/s, with every run's tokens/s beside it."""
    ordered = sorted(runs, key=lambda r: r["tokens_per_s"])
    return dict(ordered[(len(ordered) - 1) // 2], runs_tokens_per_s=[round(r["tokens_per_s"], 1) for r in runs])


def compare(results: dict) -> None:
    """Speed-ups and token agreement between the off and on runs of each workload (in place)."""
    for name, r in results["workloads"].items():
        off, on = r["off"], r["on"]
        a, b = off.pop("token_ids"), on.pop("token_ids")
        r["same_tokens"] = sum(x == y for x, y in zip(a, b)) / max(1, len(a))
        r["speedup_tokens_per_s"] = on["tokens_per_s"] / off["tokens_per_s"]
        r["miss_cost"] = 1 - r["speedup_tokens_per_s"] if on["hit_rate"] == 0 else None
        r["ttft_p50_ratio"] = on["ttft_ms"][50] / off["ttft_ms"][50]


def table(results: dict) -> list[str]:
    lines = ["| workload | caching | tokens/s | TTFT p50 / p90 / p99 ms | prompt tokens computed | hit rate "
             "| same tokens | wall |", "|---|---|---|---|---|---|---|---|"]
    for name, r in results["workloads"].items():
        for mode in ("off", "on"):
            m = r[mode]
            t = m["ttft_ms"]
            lines.append(f"| {name} | {mode} | {m['tokens_per_s']:,.0f} | {t[50]:.1f} / {t[90]:.1f} / "
                         f"{t[99]:.1f} | {m['computed_prompt_tokens']:,} of {m['prompt_tokens']:,} | "
                         f"{m['hit_rate']:.1%} | {r['same_tokens']:.0%} | {m['wall_s']:.2f} s |")
    return lines


def plot(results: dict, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(results["workloads"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    w = 0.38
    for ax, key, label in ((axes[0], "tokens_per_s", "output tokens / s"),
                           (axes[1], "ttft_p50", "TTFT p50 (ms)")):
        for j, (mode, color) in enumerate((("off", "tab:gray"), ("on", "tab:blue"))):
            vals = [results["workloads"][n][mode]["ttft_ms"][50] if key == "ttft_p50"
                    else results["workloads"][n][mode][key] for n in names]
            xs = [i + (j - 0.5) * w for i in range(len(names))]
            ax.bar(xs, vals, w, color=color, label=f"prefix caching {mode}")
            for x, v, n in zip(xs, vals, names):
                hr = results["workloads"][n][mode]["hit_rate"]
                ax.text(x, v, f"{v:,.0f}" + (f"\nhit {hr:.0%}" if mode == "on" else ""), ha="center",
                        va="bottom", fontsize=8)
        ax.set_xticks(range(len(names)), [n.replace("_", " ") for n in names])
        ax.set_ylabel(label)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.2)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    axes[0].legend(fontsize=8, loc="upper right")
    fig.suptitle(f"prefix caching off / on -- {results['model']} on {results['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    run(argv)


def run(argv=None) -> dict:
    """main(), returning the results."""
    p = argparse.ArgumentParser(prog="python -m pagedlab bench prefix", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default random:llama-3.2-1b (--small: random:tiny)")
    p.add_argument("--small", action="store_true", help="tiny model, small workloads (CPU is fine)")
    p.add_argument("--slots", type=int, default=None, help="max_num_seqs (default 256; --small 8)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of " + ", ".join(WORKLOADS))
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up passes")
    p.add_argument("--rounds", type=int, default=1, help="runs of each mode, alternating; the median is kept")
    p.add_argument("--out", default="figures", help="where prefix_bench.json/.md/.png go")
    args = p.parse_args(argv)
    names = [w for w in args.workloads.split(",") if w]
    bad = [w for w in names if w not in WORKLOADS]
    if bad:
        p.error(f"unknown workload(s) {bad}: choose from {', '.join(WORKLOADS)}")
    cuda = torch.cuda.is_available()
    if not args.small and not cuda:
        raise SystemExit("bench prefix needs a CUDA GPU (or --small, which runs on CPU)")
    from pagedlab.llm import LLM
    from pagedlab.weights import load_checkpoint

    s = SMALL if args.small else FULL
    model = args.model or ("random:tiny" if args.small else "random:llama-3.2-1b")
    device = "cuda" if cuda else "cpu"
    dtype = "bfloat16" if cuda and not args.small else "float32"
    ckpt = load_checkpoint(model, show_progress=False)
    vocab = min(ckpt.config.vocab_size, RANDOM_TOKEN_LIMIT)
    longest = max(s["system"] + s["question"][1] + s["answer"][1], 2 * s["offline"][1], sum(s["unique"][1:]),
                  s["first"][1] + s["turns"] * (s["turn_answer"][1] + s["turn_question"][1]))
    llm = LLM(checkpoint=ckpt, device=device, dtype=dtype, max_num_seqs=args.slots or (8 if args.small else 256),
              max_model_len=longest + 16, prefix_caching=True, show_progress=False,
              **(dict(block_size=8, num_blocks=1024) if args.small else {}))
    results = dict(command="python -m pagedlab bench prefix " + " ".join(argv or []), model=ckpt.source,
                   device=torch.cuda.get_device_name() if cuda else "CPU", dtype=dtype,
                   block_size=llm.engine.config.block_size, num_blocks=llm.engine.kv_cache.num_blocks,
                   workload_sizes=s, workloads={})
    try:
        from pagedlab.bench.common import metadata
        results["metadata"] = metadata("python -m pagedlab bench prefix", argv)
    except Exception as e:          # (no triton on this machine): the run is still worth keeping
        results["metadata"] = {"error": f"{type(e).__name__}: {e}"}
    for name in names:
        if not args.no_warmup:
            for caching in (False, True):
                set_prefix_caching(llm, caching)
                run_workload(llm, name, s, vocab, seed=1)
        runs = {"off": [], "on": []}
        for _ in range(max(1, args.rounds)):
            for mode in ("off", "on"):
                runs[mode].append(measure(llm, name, s, vocab, mode == "on"))
        results["workloads"][name] = {mode: median_run(rs) for mode, rs in runs.items()}
        print(f"{name}: off {results['workloads'][name]['off']['tokens_per_s']:,.0f} tokens/s, "
              f"on {results['workloads'][name]['on']['tokens_per_s']:,.0f} tokens/s "
              f"(hit rate {results['workloads'][name]['on']['hit_rate']:.1%}; runs off "
              f"{results['workloads'][name]['off']['runs_tokens_per_s']}, on "
              f"{results['workloads'][name]['on']['runs_tokens_per_s']})", flush=True)
    compare(results)
    out = out_dir(args.out)
    write_json(out / "prefix_bench.json", results)
    plot(results, out / "prefix_bench.png")
    lines = [f"model: {results['model']} ({dtype}) on {results['device']}; block size "
             f"{results['block_size']}, {results['num_blocks']} blocks", ""] + table(results)
    (out / "prefix_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return results


if __name__ == "__main__":
    main()

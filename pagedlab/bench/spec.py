"""`python -m pagedlab bench spec`: speculative decoding (n-gram prompt lookup) off and on, one engine.

  copy : copy-heavy -- the model is asked to quote or lightly edit a given text (real weights: a
         chat prompt with one of PASSAGES; random weights: the passage's token ids followed by its
         first half, so a copy is what the proposer guesses)
  free : free-running -- short stories on a topic (random weights: random prompts); little to copy

Each workload runs as one stream (each prompt alone, one after the other) and batched (all
prompts at once), with speculation off and on (greedy, at most --max-tokens new tokens, EOS ends a
request as usual), after a warm-up pass of each. Reported per run: output tokens / wall time,
engine steps, tokens per step, guesses proposed / kept, and whether the tokens equal the
non-speculative run's. JSON + a markdown table in --out.

--small: the tiny random model on CPU with few tokens (what the tests run).
"""
from __future__ import annotations

import argparse
import time

import torch

from pagedlab.bench.common import RANDOM_TOKEN_LIMIT, out_dir, write_json
from pagedlab.sampling import SamplingParams

PASSAGES = [
    "A paged KV cache stores the keys and values of every sequence in fixed-size blocks. A block "
    "table maps each sequence's logical blocks to physical ones, so sequences grow one block at a "
    "time and memory is never reserved for tokens that may never come. When a request finishes, "
    "its blocks go back to the pool and the next request can use them at once.",
    "def moving_average(values, window):\n    total = 0.0\n    out = []\n    for i, v in "
    "enumerate(values):\n        total += v\n        if i >= window:\n            total -= "
    "values[i - window]\n        out.append(total / min(i + 1, window))\n    return out\n",
    "The meeting is moved from Tuesday to Thursday at ten o'clock. Please bring the quarterly "
    "report, the list of open questions from the last review, and the draft of the budget for "
    "next year. Lunch will be served after the meeting in the small conference room.",
    "Continuous batching refills a slot as soon as its request ends, instead of waiting for the "
    "whole batch to finish. The scheduler admits new requests while blocks and token budget last, "
    "and preempts the newest request when the pool runs out, so that older requests can finish.",
]
COPY_ASKS = ["Repeat the following text exactly, word for word:\n\n{}",
             "Rewrite the following code with the variable `total` renamed to `running_sum`; change "
             "nothing else:\n\n{}",
             "Copy this message exactly as it is:\n\n{}",
             "Quote the following paragraph exactly:\n\n{}"]
TOPICS = ["a lighthouse keeper who finds a message in a bottle", "a robot learning to bake bread",
          "a city where it never stops raining", "two friends lost on a mountain trail"]
WORKLOADS = ("copy", "free")


def prompts_for(name: str, tokenizer, real: bool, vocab: int, seed: int = 0):
    """The workload's prompts: chat strings (real weights) or token ids (random weights)."""
    if real:
        if name == "copy":
            return [COPY_ASKS[i].format(p) for i, p in enumerate(PASSAGES)]
        return [f"Write a short story about {t}." for t in TOPICS]
    g = torch.Generator().manual_seed(seed)
    if name == "copy":
        out = []
        for p in PASSAGES:
            ids = tokenizer.encode(p) if tokenizer is not None else \
                torch.randint(3, vocab, (96,), generator=g).tolist()
            out.append(ids + ids[:len(ids) // 2])
        return out
    return [torch.randint(3, vocab, (64,), generator=g).tolist() for _ in TOPICS]


def set_speculation(llm, speculator) -> None:
    """Speculation on (a Speculator) or off (None) on an idle engine (spec/speculator.py use)."""
    from pagedlab.spec.speculator import use
    use(llm.engine, speculator)


def _sync(llm):
    if llm.engine.device.type == "cuda":
        torch.cuda.synchronize()


def run_once(llm, prompts, params, real: bool, batched: bool):
    """Outputs and wall seconds: all prompts at once, or one after the other."""
    _sync(llm)
    t0 = time.perf_counter()
    if batched:
        outs = llm.generate(prompts, params, chat=real)
    else:
        outs = [llm.generate([p], params, chat=real)[0] for p in prompts]
    _sync(llm)
    return outs, time.perf_counter() - t0


def measure(llm, speculator, prompts, params, real, batched) -> dict:
    set_speculation(llm, speculator)
    eng = llm.engine
    eng.reset_timing()
    overlapped0 = eng.num_overlapped
    outs, wall = run_once(llm, prompts, params, real, batched)
    n = sum(len(o.token_ids) for o in outs)
    proposed = sum(o.num_spec_proposed for o in outs)
    accepted = sum(o.num_spec_accepted for o in outs)
    steps = eng.timing["steps"]
    return dict(tokens=n, wall_s=wall, tokens_per_s=n / wall, steps=steps,
                # each step a request runs emits 1 + the guesses it keeps
                tokens_per_request_step=n / max(1, n - accepted),
                proposed=proposed, accepted=accepted, acceptance=accepted / proposed if proposed else 0.0,
                step_ms=None if speculator is None else {("verify" if k else "plain"): v and v * 1e3
                                                         for k, v in speculator.step_s.items()},
                host_timing={k: (v if k == "steps" else round(v, 4)) for k, v in eng.timing.items()},
                overlapped_steps=eng.num_overlapped - overlapped0,
                token_ids=[o.token_ids for o in outs])


# (hidden, intermediate, Hq, Hkv, D, vocab) of the two models bench spec runs
KERNEL_SHAPES = {"smollm2": (576, 1536, 9, 3, 64, 49152), "llama-3.2-1b": (2048, 8192, 32, 8, 64, 128256)}


def kernel_times(rows=(1, 8, 16), reps: int = 20) -> dict:
    """One layer's linear work (norm+QKV+RoPE+store, O + residual, norm+SwiGLU, down + residual) and
    the LM head at each row count, in microseconds, bf16 random weights of both models' shapes:
    "cublas" (the composed path: cuBLAS + the small Triton kernels, what a verify step runs) and
    "fused" (kernels/gemv.py: one row, or inside fused_rows() rows padded to 16 on tensor cores).
    Each timed as a CUDA graph of `reps` launches (no launch overhead), median of do_bench."""
    from triton.testing import do_bench

    from pagedlab.kernels import gemv
    from pagedlab.kernels.rope import rope_cos_sin

    def timed(fn):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        return round(do_bench(graph.replay, warmup=20, rep=100) / reps * 1e3, 2)

    dev, dt, out = "cuda", torch.bfloat16, {}
    for name, (h, inter, hq, hkv, d, vocab) in KERNEL_SHAPES.items():
        rnd = lambda *shape, scale=1.0: torch.randn(*shape, device=dev, dtype=dt) * scale   # noqa: E731
        g = rnd(h)
        wqkv, wo = rnd((hq + 2 * hkv) * d, h, scale=h ** -0.5), rnd(h, hq * d, scale=h ** -0.5)
        wgu, wd, wl = rnd(2 * inter, h, scale=h ** -0.5), rnd(h, inter, scale=inter ** -0.5), rnd(vocab, h, scale=0.05)
        cs = rope_cos_sin(d, 10000.0, 4096, None, device=dev)
        kc, vc = rnd(64, 16, hkv, d), rnd(64, 16, hkv, d)
        for t in rows:
            x, a, m = rnd(t, h), rnd(t, hq * d), rnd(t, inter)
            pos = slots = torch.arange(t, device=dev)
            for path, fused in (("cublas", False), ("fused", None)):
                fns = {"qkv": lambda: gemv.norm_qkv_rope_store_triton(x, g, 1e-5, wqkv, pos, cs, kc, vc, slots, hq,
                                                                      fused=fused),
                       "o": lambda: gemv.linear_residual_triton(a, wo, x, fused=fused),
                       "swiglu": lambda: gemv.norm_swiglu_triton(x, g, 1e-5, wgu, fused=fused),
                       "down": lambda: gemv.linear_residual_triton(m, wd, x, fused=fused),
                       "lm_head": lambda: gemv.norm_lm_head_triton(x, g, 1e-5, wl, fused=fused, greedy=True)}
                with gemv.fused_rows(fused is None):
                    r = {k: timed(f) for k, f in fns.items()}
                r["layer"] = round(r["qkv"] + r["o"] + r["swiglu"] + r["down"], 2)
                out[f"{name}/{t} rows/{path}"] = r
                print(f"{name} {t} rows {path}: {r}", flush=True)
    return out


def table(results: dict) -> list[str]:
    lines = ["| workload | mode | spec | tokens/s | speed-up | steps | tokens/step/request | kept / proposed "
             "| same tokens |", "|---|---|---|---|---|---|---|---|---|"]
    for key, r in results["runs"].items():
        for m in ("off", "on"):
            x = r[m]
            lines.append(f"| {r['workload']} | {r['mode']} | {m} | {x['tokens_per_s']:,.0f} | "
                         f"{(x['tokens_per_s'] / r['off']['tokens_per_s']):.2f}x | {x['steps']} | "
                         f"{x['tokens_per_request_step']:.2f} | {x['accepted']} / {x['proposed']} | "
                         f"{r['same_tokens']:.0%} |")
    return lines


def main(argv=None) -> None:
    run(argv)


def run(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m pagedlab bench spec", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="smollm2 (default on CUDA), random:llama-3.2-1b, ... "
                                                 "(--small: random:tiny)")
    p.add_argument("--small", action="store_true", help="tiny random model, few tokens (CPU is fine)")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens (default 4)")
    p.add_argument("--ngram", type=int, default=4, help="prompt_lookup_max (default 4)")
    p.add_argument("--max-tokens", type=int, default=None, help="new tokens per request (default 256; --small 24)")
    p.add_argument("--copies", type=int, default=4, help="batched: each prompt this many times (default 4)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of copy, free")
    p.add_argument("--no-adaptive", action="store_true", help="fixed k (no back-off)")
    p.add_argument("--fuse-up-to", type=int, default=None, metavar="N",
                   help="use the fused GEMV kernels for steps of up to N rows (kernels/gemv.py FUSE_UP_TO, "
                        "at most 16): verify steps of one stream have k + 1 rows")
    p.add_argument("--fused-rows", action="store_true",
                   help="capture the speculative engine's graphs of 2-16 rows with the fused decode kernels on "
                        "tensor cores (kernels/gemv.py fused_rows) instead of cuBLAS + separate small kernels "
                        "(ModelRunner.SPEC_FUSED_ROWS; measured slower, off by default)")
    p.add_argument("--replay", action="store_true",
                   help="also time a graph replay per captured size up to 16 rows (padding rows: the "
                        "linear layers' cost of a verify step of that many rows)")
    p.add_argument("--kernels", action="store_true",
                   help="also time one layer's linear work and the LM head at 1, 8, 16 rows, cuBLAS vs fused "
                        "(both models' shapes, random bf16 weights)")
    p.add_argument("--out", default="figures", help="where spec_bench.json/.md go")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not args.small and not cuda:
        raise SystemExit("bench spec needs a CUDA GPU (or --small, which runs on CPU)")
    from pagedlab.llm import LLM
    if args.fuse_up_to is not None:
        from pagedlab.kernels import gemv
        gemv.FUSE_UP_TO = max(1, min(args.fuse_up_to, gemv.MAX_ROWS))
    if args.fused_rows:
        from pagedlab.runner import ModelRunner
        ModelRunner.SPEC_FUSED_ROWS = True
    from pagedlab.spec.config import SpeculativeConfig
    from pagedlab.spec.speculator import Speculator

    model = args.model or ("random:tiny" if args.small else "smollm2")
    real = not model.startswith("random:")
    dtype = "bfloat16" if cuda and not args.small else "float32"
    max_tokens = args.max_tokens or (24 if args.small else 256)
    slots = len(PASSAGES) * args.copies
    sc = SpeculativeConfig(method="ngram", num_speculative_tokens=args.k, prompt_lookup_max=args.ngram,
                           adaptive=not args.no_adaptive)
    llm = LLM(model, device="cuda" if cuda else "cpu", dtype=dtype, max_num_seqs=slots, show_progress=False,
              speculative_config=sc)
    spec = llm.engine.speculator
    tok = llm.get_tokenizer() if real or model == "random:llama-3.2-1b" else None
    vocab = min(llm.engine.model.config.vocab_size, RANDOM_TOKEN_LIMIT)
    results = dict(command="python -m pagedlab bench spec " + " ".join(argv or []), model=model, dtype=dtype,
                   device=torch.cuda.get_device_name() if cuda else "CPU", speculative_config=sc.to_dict(),
                   max_tokens=max_tokens, cuda_graphs=llm.engine.runner.graphs is not None,
                   fuse_up_to=__import__("pagedlab.kernels.gemv", fromlist=["x"]).FUSE_UP_TO,
                   fused_rows=args.fused_rows, overlap=llm.engine.overlap, runs={})
    try:
        from pagedlab.bench.common import metadata
        results["metadata"] = metadata("python -m pagedlab bench spec", argv)
    except Exception as e:          # (no triton on this machine): the run is still worth keeping
        results["metadata"] = {"error": f"{type(e).__name__}: {e}"}
    params = SamplingParams(max_tokens=max_tokens)
    for name in [w for w in args.workloads.split(",") if w]:
        prompts = prompts_for(name, tok, real, vocab)
        for mode in ("one_stream", "batched"):
            batched = mode == "batched"
            ps = prompts * args.copies if batched else prompts
            for s in (None, spec):                       # warm-up: compile, capture, fill caches
                set_speculation(llm, s)
                run_once(llm, ps[:len(prompts)], SamplingParams(max_tokens=min(16, max_tokens)), real, batched)
            r = dict(workload=name, mode=mode, requests=len(ps))
            for m, s in (("off", None), ("on", spec)):
                r[m] = measure(llm, s, ps, params, real, batched)
            a, b = r["off"].pop("token_ids"), r["on"].pop("token_ids")
            r["same_tokens"] = sum(x == y for x, y in zip(a, b)) / len(a)
            r["first_difference"] = [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
                                     for x, y in zip(a, b) if x != y]
            r["speedup"] = r["on"]["tokens_per_s"] / r["off"]["tokens_per_s"]
            results["runs"][f"{name}/{mode}"] = r
            print(f"{name} {mode}: off {r['off']['tokens_per_s']:,.0f} tok/s, on {r['on']['tokens_per_s']:,.0f} "
                  f"tok/s ({r['speedup']:.2f}x), kept {r['on']['accepted']}/{r['on']['proposed']}, "
                  f"same tokens {r['same_tokens']:.0%}", flush=True)
    set_speculation(llm, spec)
    graphs = llm.engine.runner.graphs
    if args.replay and graphs is not None and graphs.capture:
        from triton.testing import do_bench
        graphs.fill_padding()
        results["replay_ms"] = {b: do_bench(lambda b=b: graphs.replay(b), warmup=50, rep=200)
                                for b in graphs.sizes if b <= 16}
        print("graph replay ms by rows:", {b: round(v, 4) for b, v in results["replay_ms"].items()}, flush=True)
    if args.kernels and cuda:
        results["kernels_us"] = kernel_times()
    out = out_dir(args.out)
    stem = "spec_bench" + ("" if real or args.small else "_random")
    write_json(out / f"{stem}.json", results)
    lines = [f"model: {model} ({dtype}) on {results['device']}; k={args.k}, prompt_lookup_max={args.ngram}, "
             f"max_tokens={max_tokens}", ""] + table(results)
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return results


if __name__ == "__main__":
    main()

"""`python -m pagedlab bench engine`: pagedlab against transformers on two workloads, same process.

  one stream : 1 request, 128-token prompt, 256 new tokens (EOS ignored); median of 5 runs
  offline    : 256 requests, prompt and output lengths uniform in [100, 1024] (seed 0, EOS ignored);
               output tokens / wall time, prefill included; the second of two passes (the first
               compiles Triton kernel variants)

--cold: the cold start, each case in a fresh process (python -m pagedlab bench engine --cold):
  no warm-up, empty Triton cache | warm-up at load, empty Triton cache | warm-up at load, the cache
  the previous process left on disk. Each process reports LLM() load seconds (the warm-up's part
  of it), the TTFT of its first request (128-token prompt, sent right after load), then two
  offline passes (same lengths, other tokens: nothing for the prefix cache to find): the first
  one's tokens/s against the second's (the target: >= 0.9).

Prints one table (tokens/s, ratio to transformers, TTFT and inter-token latency percentiles,
fraction of the weight-bandwidth floor) and writes JSON + a plot. Default model: the
Llama-3.2-1B config with random bf16 weights (no hub needed).
"""
from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from pagedlab.bench.common import (RANDOM_TOKEN_LIMIT, STREAM_NEW_TOKENS, STREAM_RUNS,
                                   WARMUP_NEW_TOKENS, copy_bandwidth_tbs, device_line,
                                   kernel_times_us, median, metadata, out_dir, random_prompt,
                                   require_cuda, write_json)
from pagedlab.sampling import SamplingParams


def percentiles(xs, ps=(50, 90, 99)):
    if not xs:
        return {p: float("nan") for p in ps}
    t = torch.tensor(xs, dtype=torch.float64)
    return {p: float(t.quantile(p / 100)) for p in ps}


def offline_workload(n=256, lo=100, hi=1024, vocab=RANDOM_TOKEN_LIMIT, seed=0):
    g = torch.Generator().manual_seed(seed)
    p_lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    o_lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    prompts = [torch.randint(0, vocab, (p,), generator=g).tolist() for p in p_lens]
    return prompts, o_lens


def run_pagedlab(llm, prompts, out_lens, keep_tokens=False):
    """Generate `out_lens[i]` tokens (EOS ignored) for each prompt: tokens/s, TTFT and ITL
    percentiles, the engine's host time per phase (and, keep_tokens, every request's tokens)."""
    eng = llm.engine
    eng.reset_timing()
    # every pass starts with an empty prefix cache: benches run the same prompts more than once
    # (a warm-up pass, then the measured one), and the second would find them all cached
    reset = getattr(eng.scheduler.allocator, "reset_prefix_cache", None)
    if reset is not None:
        reset()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, [SamplingParams(max_new_tokens=o, ignore_eos=True) for o in out_lens])
    wall = time.perf_counter() - t0
    n_out = sum(len(o.token_ids) for o in outs)
    assert n_out == sum(out_lens)
    itl = [x for o in outs for x in o.itl_s]
    res = dict(tokens=n_out, wall_s=wall, tokens_per_s=n_out / wall,
               ttft_ms={k: v * 1e3 for k, v in percentiles([o.ttft_s for o in outs]).items()},
               itl_ms={k: v * 1e3 for k, v in percentiles(itl).items()},
               host_timing={k: (v if k == "steps" else round(v, 4)) for k, v in eng.timing.items()})
    if keep_tokens:
        res["token_ids"] = [o.token_ids for o in outs]
    return res


def one_stream(llm, prompt, new_tokens=STREAM_NEW_TOKENS, runs=STREAM_RUNS, keep_tokens=False):
    """One request at a time, after a warm-up: the run of median tokens/s, with every run's
    tokens/s in `runs_tokens_per_s`."""
    run_pagedlab(llm, [prompt], [WARMUP_NEW_TOKENS])
    results = [run_pagedlab(llm, [prompt], [new_tokens], keep_tokens) for _ in range(runs)]
    return dict(median(results, key=lambda r: r["tokens_per_s"]),
                runs_tokens_per_s=sorted(round(r["tokens_per_s"], 1) for r in results))


def run_hf_generate(model, prompt, new_tokens):
    ids = torch.tensor([prompt], device="cuda")
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    # Warm up with the very run that is timed: SDPA's cuDNN backend builds a plan per KV length
    # on first sight, and a cold run measured 16 tokens/s against 66 warm (H200, 2026-11-29).
    model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    n = out.shape[1] - len(prompt)
    return dict(tokens=n, wall_s=wall, tokens_per_s=n / wall)


def run_hf_generate_batch(model, prompts, new_tokens):
    from transformers import GenerationConfig
    cfg = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    warm = GenerationConfig(max_new_tokens=32, min_new_tokens=32, do_sample=False, eos_token_id=None,
                            pad_token_id=0)
    model.generate_batch(inputs=prompts[:8], generation_config=warm, progress_bar=False)   # warm up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    res = model.generate_batch(inputs=prompts, generation_config=cfg, progress_bar=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    n = sum(len(r.generated_tokens) for r in res.values())
    return dict(tokens=n, wall_s=wall, tokens_per_s=n / wall,
                note=f"{len(prompts)} requests x {new_tokens} new tokens, after an 8 x 32 warm-up")


def finish(engine):
    """Run the engine until every request is done."""
    while engine.has_work():
        engine.step()


def step_until_decoding(engine):
    """Step the engine until no request waits and every admitted one is past its prefill."""
    s = engine.scheduler
    while s.waiting or any(r.num_tokens - r.num_computed > 1 for r in s.admitted):
        engine.step()


def profile_decode(llm, batch: int, context: int, steps: int = 5) -> dict:
    """Kernel-time breakdown of decode steps at `batch` sequences of ~`context` tokens (torch
    profiler over graph replays). Returns {kernel name: us per step} and the wall time per step.
    With programmatic dependent launch on (kernels/pdl.py) a kernel's time includes its wait for
    the previous one, so the kernel times add up to more than the step: see `bench step`."""
    from pagedlab.kernels import pdl
    eng = llm.engine
    for i in range(batch):
        eng.add_request(random_prompt(context, seed=batch * 1000 + i),
                        SamplingParams(max_new_tokens=steps * 3 + 8, ignore_eos=True))
    step_until_decoding(eng)
    for _ in range(3):
        eng.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()              # with overlap a call returns before its own step is done...
    torch.cuda.synchronize()    # ...so the wall time waits for the last one
    wall = (time.perf_counter() - t0) / steps
    per = kernel_times_us(eng.step, steps)
    finish(eng)
    return dict(batch=batch, context=context, pdl=pdl.effective_mode(torch.device("cuda")),
                wall_ms=wall * 1e3, kernel_us=per, kernel_total_us=sum(per.values()))


def fmt_row(name, r, ref=None, floor_tps=None):
    if r is None or "error" in r:
        return f"| {name} | {'failed: ' + r['error'] if r else 'not run'} | | | | |"
    ratio = f"{r['tokens_per_s'] / ref['tokens_per_s']:.1f}x" if ref and "tokens_per_s" in ref else ""
    lat = ""
    if "ttft_ms" in r:
        t, i = r["ttft_ms"], r["itl_ms"]
        lat = (f"TTFT {t[50]:.1f} / {t[90]:.1f} / {t[99]:.1f} ms; "
               f"ITL {i[50]:.2f} / {i[90]:.2f} / {i[99]:.2f} ms")
    floor = f"{r['tokens_per_s'] / floor_tps:.2f}" if floor_tps else ""
    return f"| {name} | {r['tokens_per_s']:,.0f} | {ratio} | {lat} | {floor} | {r['wall_s']:.2f} s |"


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, wl in zip(axes, ("one_stream", "offline")):
        names, vals, colors = [], [], []
        for key, label, color in (("pagedlab", "pagedlab", "tab:blue"), ("hf_generate", "transformers\ngenerate", "tab:gray"),
                                  ("hf_generate_batch", "transformers\ngenerate_batch", "tab:olive")):
            r = results[wl].get(key)
            if r and "tokens_per_s" in r:
                names.append(label)
                vals.append(r["tokens_per_s"])
                colors.append(color)
        ax.bar(names, vals, color=colors)
        for x, v in enumerate(vals):
            ax.text(x, v, f"{v:,.0f}", ha="center", va="bottom")
        if wl == "one_stream" and results.get("floor_tokens_per_s"):
            ax.axhline(results["floor_tokens_per_s"], ls="--", color="k", lw=1)
            ax.text(len(vals) - 0.5, results["floor_tokens_per_s"], " weight-bandwidth limit", va="bottom", ha="right")
        ax.set_title({"one_stream": "one stream (128-token prompt, 256 new)",
                      "offline": "offline: 256 requests, lengths U[100, 1024]"}[wl])
        ax.set_ylabel("output tokens / s")
    fig.suptitle(results["device_line"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


COLD_CASES = (("no warm-up, empty Triton cache", False, "a"), ("warm-up at load, empty Triton cache", True, "b"),
              ("warm-up at load, Triton cache on disk", True, "b"))


def cold_child(args) -> dict:
    """One fresh process: load (with or without the warm-up), first request's TTFT, two passes."""
    from pagedlab.llm import LLM
    prompts, out_lens = offline_workload(args.requests)
    need = max(len(a) + b for a, b in zip(prompts, out_lens))
    t0 = time.perf_counter()
    llm = LLM(args.model, device="cuda", dtype="bfloat16", max_num_seqs=args.slots,
              max_model_len=max(need + 16, 2048), show_progress=False, warmup=args.child_warmup == "on")
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    first = run_pagedlab(llm, [random_prompt()], [1])
    # two passes over the same lengths with different tokens: prefix caching (on by default)
    # finds nothing of the first pass in the second
    passes = [run_pagedlab(llm, prompts, out_lens),
              run_pagedlab(llm, *offline_workload(args.requests, seed=1))]
    return dict(load_s=load_s, warmup=llm.warmup_info, first_ttft_ms=first["ttft_ms"][50],
                first_pass_tokens_per_s=passes[0]["tokens_per_s"],
                second_pass_tokens_per_s=passes[1]["tokens_per_s"],
                first_over_second=passes[0]["tokens_per_s"] / passes[1]["tokens_per_s"],
                first_pass_ttft_ms=passes[0]["ttft_ms"], second_pass_ttft_ms=passes[1]["ttft_ms"])


def cold_start(args, argv) -> dict:
    """The COLD_CASES, each in a process of its own; Triton caches in fresh folders."""
    import os
    import subprocess
    import sys
    import tempfile
    caches = {k: tempfile.mkdtemp(prefix=f"pagedlab-triton-{k}-") for k in "ab"}
    rows = []
    for i, (name, warm, cache) in enumerate(COLD_CASES):
        if str(i) not in args.cold_cases.split(","):
            continue
        env = dict(os.environ, TRITON_CACHE_DIR=caches[cache], PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "pagedlab.bench.engine", "--cold-child", "on" if warm else "off",
               "--model", args.model, "--requests", str(args.requests), "--slots", str(args.slots)]
        t0 = time.perf_counter()
        res = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = next((ln for ln in res.stdout.splitlines()[::-1] if ln.startswith("{")), None)
        row = json.loads(line) if res.returncode == 0 and line else {"error": res.stderr[-2000:]}
        row.update(case=name, process_s=time.perf_counter() - t0)
        rows.append(row)
        print(json.dumps(row), flush=True)
    results = dict(metadata("python -m pagedlab.bench.engine", argv), cases=rows)
    lines = ["| fresh process | LLM() load s (warm-up s) | first request TTFT ms | 1st pass tok/s | 2nd pass tok/s "
             "| 1st / 2nd |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | failed: {r['error'][-200:]} | | | | |")
            continue
        w = r["warmup"].get("seconds")
        lines.append(f"| {r['case']} | {r['load_s']:.1f} ({'-' if w is None else f'{w:.1f}'}) | "
                     f"{r['first_ttft_ms']:.1f} | {r['first_pass_tokens_per_s']:,.0f} | "
                     f"{r['second_pass_tokens_per_s']:,.0f} | {r['first_over_second']:.3f} |")
    results["table"] = lines
    out = out_dir(args.out)
    write_json(out / "engine_cold_start.json", results)
    print("\n".join(lines), flush=True)
    return results


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m pagedlab bench engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:llama-3.2-1b")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--hf-batch-requests", type=int, default=256,
                   help="requests given to transformers' generate_batch (fewer saves time)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument("--out", default="figures", help="where engine_bench.json/.png go")
    p.add_argument("--profile", action="store_true", help="only a kernel breakdown of decode steps")
    p.add_argument("--quantization", default=None, choices=["fp8"], help="FP8 weights (default: bf16)")
    p.add_argument("--cold", action="store_true", help="only the cold start: fresh processes (see above)")
    p.add_argument("--cold-cases", default="0,1,2", help="with --cold: which cases (0, 1, 2 as listed above)")
    p.add_argument("--cold-child", dest="child_warmup", choices=["on", "off"], default=None,
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    require_cuda("bench engine")
    if args.child_warmup is not None:
        print(json.dumps(cold_child(args)), flush=True)
        return
    if args.cold:
        cold_start(args, argv)
        return

    from pagedlab.llm import LLM
    from pagedlab.reference import hf_model
    from pagedlab.weights import load_checkpoint

    dev = torch.device("cuda")
    ckpt = load_checkpoint(args.model, show_progress=False)
    bw = copy_bandwidth_tbs(dev) * 1e12                              # bytes/s
    prompts, out_lens = offline_workload(args.requests)
    need = max(len(a) + b for a, b in zip(prompts, out_lens))
    t0 = time.perf_counter()
    llm = LLM(checkpoint=ckpt, device="cuda", dtype="bfloat16", max_num_seqs=args.slots,
              max_model_len=max(need + 16, 2048), show_progress=False, quantization=args.quantization)
    setup_s = time.perf_counter() - t0
    weight_bytes = llm.model.num_bytes()
    floor_tps = bw / weight_bytes
    results = dict(
        metadata("python -m pagedlab.bench.engine", argv),
        model=ckpt.source, copy_bandwidth_TBps=bw / 1e12, weight_GB=weight_bytes / 1e9,
        floor_tokens_per_s=floor_tps, engine_setup_s=setup_s, one_stream={}, offline={})
    results["device_line"] = device_line(results)
    out = out_dir(args.out)

    if args.profile:
        prof = [profile_decode(llm, b, c) for b, c in ((1, 256), (64, 1024), (256, 1024))]
        write_json(out / "engine_profile.json", prof)
        for r in prof:
            print(f"\nbatch {r['batch']} context {r['context']}: {r['wall_ms']:.3f} ms/step wall, "
                  f"{r['kernel_total_us']:.0f} us/step of kernels")
            for k, v in list(r["kernel_us"].items())[:14]:
                print(f"  {v:8.1f} us  {k}")
        return
    stream_prompt = random_prompt()
    results["one_stream"]["pagedlab"] = one_stream(llm, stream_prompt)       # the median of 5 runs
    # LLM() compiled the kernels at load (warmup.py): the first pass runs as fast as the second
    # (bench engine --cold measures that in fresh processes). Both are kept; the second is reported.
    results["warmup_at_load"] = llm.warmup_info
    # (the warm-up pass has other tokens: with prefix caching on, the same prompts would be hits)
    results["offline"]["warmup_pass"] = run_pagedlab(llm, *offline_workload(args.requests, seed=1))
    results["offline"]["pagedlab"] = run_pagedlab(llm, prompts, out_lens)
    print(json.dumps({k: results[k] for k in ("one_stream", "offline")}, indent=1), flush=True)
    del llm
    gc.collect()                       # the engine's graphs and pool, before transformers runs
    torch.cuda.empty_cache()

    if not args.no_hf:
        hf = hf_model(ckpt, torch.bfloat16, "cuda")
        try:
            results["one_stream"]["hf_generate"] = run_hf_generate(hf, stream_prompt, STREAM_NEW_TOKENS)
        except Exception as e:                                    # report, don't hide
            results["one_stream"]["hf_generate"] = {"error": f"{type(e).__name__}: {e}"[:200]}
        mean_out = round(sum(out_lens) / len(out_lens))
        k = args.hf_batch_requests
        try:
            hf.set_attn_implementation("sdpa_paged") if hasattr(hf, "set_attn_implementation") else None
        except Exception:
            pass
        try:
            results["offline"]["hf_generate_batch"] = run_hf_generate_batch(hf, prompts[:k], mean_out)
        except Exception as e:
            results["offline"]["hf_generate_batch"] = {"error": f"{type(e).__name__}: {e}"[:200]}

    write_json(out / "engine_bench.json", results)
    plot(results, out / "engine_bench.png")
    os_, off = results["one_stream"], results["offline"]
    lines = [
        f"device: {results['device_line']}; model: {results['model']}",
        f"copy bandwidth {bw / 1e12:.2f} TB/s (read + write); weights {weight_bytes / 1e9:.3f} GB -> "
        f"one decode step >= {weight_bytes / bw * 1e3:.3f} ms, one stream <= {floor_tps:,.0f} tokens/s",
        "",
        "| workload / engine | tokens/s | vs transformers | latency p50 / p90 / p99 | of floor | wall |",
        "|---|---|---|---|---|---|",
        fmt_row("one stream: pagedlab", os_["pagedlab"], os_.get("hf_generate"), floor_tps),
        fmt_row("one stream: transformers generate", os_.get("hf_generate")),
        fmt_row("offline: pagedlab", off["pagedlab"], off.get("hf_generate_batch")),
        fmt_row("offline: transformers generate_batch", off.get("hf_generate_batch")),
        "",
        f"host time per step (s, summed): one stream {os_['pagedlab']['host_timing']}, "
        f"offline {off['pagedlab']['host_timing']}",
    ]
    (out / "engine_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""`python -m pagedlab bench parallel`: one GPU against two, split (tensor parallel) or copied (data
parallel), on the workloads of `bench engine`, all in one process run.

  one stream : 1 request, 128-token prompt, 256 new tokens (EOS ignored); median of 5 runs
  offline    : 256 requests, prompt and output lengths uniform in [100, 1024] (seed 0, EOS ignored);
               output tokens / wall time; the second of two passes
  profile    : decode steps at batch 1 (context 256) and batch 64 (context 1024) under the torch
               profiler on rank 0: GPU time per step in NCCL kernels (the all-reduces and the
               logits all-gather) next to the step's wall time

Configurations: TP=1 (one GPU), TP=2, DP=2 (default; --configs tp1,tp2,dp2,...). Needs as many
GPUs as the largest configuration. Writes JSON + a plot + a markdown table.
"""
from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from pagedlab.bench.common import device_line, metadata, out_dir, random_prompt, require_cuda, write_json
from pagedlab.bench.engine import offline_workload, one_stream, profile_decode, run_pagedlab

CONFIGS = {"tp1": (1, 1), "tp2": (2, 1), "dp2": (1, 2), "tp4": (4, 1), "dp4": (1, 4), "tp2dp2": (2, 2)}


def label(tp: int, dp: int) -> str:
    return "TP=1" if tp == dp == 1 else " x ".join(x for x in (f"TP={tp}" * (tp > 1), f"DP={dp}" * (dp > 1)) if x)


def nccl_us(kernel_us: dict) -> float:
    """GPU microseconds per step in NCCL's kernels (all-reduce, all-gather)."""
    return sum(v for k, v in kernel_us.items() if "nccl" in k.lower())


def verdict(rows: list[dict]) -> str:
    """What the rows say, in words, every number read from them: each configuration against one GPU
    (offline and one-stream throughput) and, for tensor parallelism, where its batch-1 step went --
    the kernels other than NCCL's (what halving the weights saved), the NCCL kernels, and the rest
    of the step (launches and ranks waiting for each other)."""
    by = {r["config"]: r for r in rows}
    one = by.get("TP=1")
    if one is None:
        return "no TP=1 row: nothing to compare against"
    parts = []
    for r in rows:
        if r is one:
            continue
        off, stream = r["offline_tok_s"] / one["offline_tok_s"], r["one_stream_tok_s"] / one["one_stream_tok_s"]
        text = f"{r['config']} gives {off:.2f}x the offline tokens/s of one GPU and {stream:.2f}x its one-stream speed"
        if r.get("tp", 1) > 1:
            a, b = one["profile"]["batch1"], r["profile"]["batch1"]
            saved = a["kernel_total_us"] - (b["kernel_total_us"] - b["nccl_us"])
            grew = b["step_us"] - a["step_us"]
            text += (f": per batch-1 step its kernels other than NCCL's took {b['kernel_total_us'] - b['nccl_us']:,.0f} us "
                     f"against one GPU's {a['kernel_total_us']:,.0f} (halving the weights saved {saved:,.0f} us) and "
                     f"its collectives {b['nccl_us']:,.0f} us of NCCL kernels "
                     + ("(more than that saving)" if b["nccl_us"] > saved else "(less than that saving)")
                     + f", so its kernels took {b['kernel_total_us']:,.0f} us in all against {a['kernel_total_us']:,.0f}; "
                     f"yet the profiled step {'grew' if grew > 0 else 'shrank'} from {a['step_us']:,.0f} to "
                     f"{b['step_us']:,.0f} us: " + ("the difference is not kernel time but the gaps between kernels "
                                                      "(launches, the ranks waiting for each other in every collective)"
                                                      if grew > 0 and b["kernel_total_us"] <= a["kernel_total_us"] + grew / 2
                                                      else "kernel time and the gaps between kernels together"))
        parts.append(text)
    best = max(rows, key=lambda r: (r["offline_tok_s"], r["one_stream_tok_s"]))
    fastest = max(rows, key=lambda r: r["one_stream_tok_s"])
    head = (f"{best['config']} has the most offline throughput, {fastest['config']} the fastest single stream. "
            if best is not fastest else f"{best['config']} wins on both offline throughput and a single stream. ")
    return head + "; ".join(parts) + "."


def measure(ckpt, tp: int, dp: int, prompts, out_lens, slots: int, max_len: int) -> dict:
    from pagedlab.llm import LLM
    t0 = time.perf_counter()
    with LLM(checkpoint=ckpt, device="cuda", dtype="bfloat16", max_num_seqs=slots, max_model_len=max_len,
             show_progress=False, tensor_parallel_size=tp, data_parallel_size=dp) as llm:
        setup = time.perf_counter() - t0
        row = dict(config=label(tp, dp), tp=tp, dp=dp, setup_s=setup,
                   weight_GB_per_gpu=llm.model.num_bytes() / 1e9,
                   kv_blocks_per_replica=llm.engine.kv_cache.num_blocks)
        s = one_stream(llm, random_prompt())
        row.update(one_stream_tok_s=s["tokens_per_s"], ttft_ms=s["ttft_ms"][50], itl_p50_ms=s["itl_ms"][50],
                   itl_p99_ms=s["itl_ms"][99], one_stream_runs=s["runs_tokens_per_s"])
        run_pagedlab(llm, prompts, out_lens)                     # compiles the Triton variants
        off = run_pagedlab(llm, prompts, out_lens)
        row.update(offline_tok_s=off["tokens_per_s"], offline_wall_s=off["wall_s"],
                   offline_ttft_p50_ms=off["ttft_ms"][50], offline_itl_p50_ms=off["itl_ms"][50])
        prof = {}
        for batch, context in ((1, 256), (64, 1024)):
            p = profile_decode(llm, batch, context)
            prof[f"batch{batch}"] = dict(step_us=p["wall_ms"] * 1e3, nccl_us=nccl_us(p["kernel_us"]),
                                         kernel_total_us=p["kernel_total_us"],
                                         top=dict(list(p["kernel_us"].items())[:8]))
        row["profile"] = prof
        row["step_us"] = prof["batch1"]["step_us"]
        row["allreduce_us_per_step"] = prof["batch1"]["nccl_us"] if tp > 1 else None
    gc.collect()
    torch.cuda.empty_cache()
    return row


def run_child(config: str, args) -> dict:
    import subprocess
    import sys
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as tmp:
        row_path = Path(tmp) / "row.json"
        cmd = [sys.executable, "-m", "pagedlab.bench.parallel", "--one", config, "--row-json", str(row_path),
               "--model", args.model, "--requests", str(args.requests), "--slots", str(args.slots)]
        try:
            proc = subprocess.run(cmd, timeout=args.timeout, capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            return dict(config=config, error=f"timed out after {args.timeout:.0f} s")
        if proc.returncode or not row_path.exists():
            return dict(config=config, error=(proc.stderr or proc.stdout)[-2000:])
        return json.loads(row_path.read_text())


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    names = [r["config"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, key, title in ((axes[0], "one_stream_tok_s", "one stream (tokens/s)"),
                           (axes[1], "offline_tok_s", "offline, 256 requests (tokens/s)")):
        vals = [r[key] for r in rows]
        bars = ax.bar(names, vals, color=["#4c72b0", "#dd8452", "#55a868", "#c44e52"][:len(rows)])
        ax.bar_label(bars, labels=[f"{v:,.0f}" for v in vals], fontsize=8)
        ax.set_title(title, fontsize=10)
    ax = axes[2]
    for i, r in enumerate(rows):
        step = r["itl_p50_ms"] * 1e3                         # one stream: a decode step, steady state
        comm = r["profile"]["batch1"]["nccl_us"]
        ax.bar(i, step, color="#bbbbbb", label="inter-token latency p50" if i == 0 else None)
        ax.bar(i, comm, color="#c44e52", label="GPU time in NCCL kernels" if i == 0 else None)
    ax.set_xticks(range(len(rows)), names)
    ax.set_title("one stream: a decode step (us)", fontsize=10)
    ax.legend(fontsize=8)
    fig.suptitle(f"{result['model']}: {result['device_line']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m pagedlab bench parallel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:llama-3.2-1b")
    p.add_argument("--configs", default="tp1,tp2,dp2", help=f"comma-separated, from {sorted(CONFIGS)}")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--out", default="docs", help="where parallel_bench.json/.md/.png go")
    p.add_argument("--timeout", type=float, default=900, help="seconds per configuration")
    p.add_argument("--one", help=argparse.SUPPRESS)            # internal: measure one config ...
    p.add_argument("--row-json", help=argparse.SUPPRESS)       # ... and write its row here
    args = p.parse_args(argv)
    require_cuda("bench parallel")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        p.error(f"--configs: unknown {bad}; choose from {sorted(CONFIGS)}")
    need = max(CONFIGS[c][0] * CONFIGS[c][1] for c in configs)
    if torch.cuda.device_count() < need:
        p.error(f"--configs {args.configs} needs {need} GPUs; torch sees {torch.cuda.device_count()}")

    from pagedlab.weights import load_checkpoint
    ckpt = load_checkpoint(args.model, show_progress=False)
    prompts, out_lens = offline_workload(args.requests)
    max_len = max(max(len(a) + b for a, b in zip(prompts, out_lens)) + 16, 2048)
    result = dict(metadata("python -m pagedlab bench parallel", argv), model=ckpt.source,
                  gpus=torch.cuda.device_count(), rows=[])
    result["device_line"] = device_line(result)
    out = out_dir(args.out)
    if args.one:                     # a child process: one configuration, one row
        tp, dp = CONFIGS[args.one]
        write_json(args.row_json, measure(ckpt, tp, dp, prompts, out_lens, args.slots, max_len))
        return
    for c in configs:                # each configuration in a fresh process: its own CUDA context
        row = run_child(c, args)     # and torch.distributed world; a crash or hang costs one row
        result["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
        write_json(out / "parallel_bench.json", result)         # partial results survive a crash
    result["failed"] = [r for r in result["rows"] if "error" in r]
    result["rows"] = [r for r in result["rows"] if "error" not in r]
    for r in result["failed"]:
        print(f"{r['config']} failed:\n{r['error']}")
    if not result["rows"]:
        write_json(out / "parallel_bench.json", result)
        return
    result["verdict"] = verdict(result["rows"])
    base = result["rows"][0]
    lines = [f"device: {result['device_line']}; model: {result['model']}", "",
             "| config | one stream tok/s | TTFT ms | ITL p50 ms | offline tok/s | vs first | "
             "batch-1 step us (NCCL us) | batch-64 step us (NCCL us) | weights GB/GPU |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        b1, b64 = r["profile"]["batch1"], r["profile"]["batch64"]
        lines.append(f"| {r['config']} | {r['one_stream_tok_s']:,.0f} | {r['ttft_ms']:.1f} | {r['itl_p50_ms']:.2f} | "
                     f"{r['offline_tok_s']:,.0f} | {r['offline_tok_s'] / base['offline_tok_s']:.2f}x | "
                     f"{b1['step_us']:.0f} ({b1['nccl_us']:.0f}) | {b64['step_us']:.0f} ({b64['nccl_us']:.0f}) | "
                     f"{r['weight_GB_per_gpu']:.2f} |")
    write_json(out / "parallel_bench.json", result)
    plot(result, out / "parallel_bench.png")
    (out / "parallel_bench.md").write_text("\n".join(lines + ["", result["verdict"]]) + "\n")
    print("\n".join(lines + ["", result["verdict"]]))


if __name__ == "__main__":
    main()

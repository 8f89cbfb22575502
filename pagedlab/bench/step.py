"""`python -m pagedlab bench step`: one decode step at batch 1, variant by variant.

At batch 1 a decode step is ~100 short kernels replayed from a CUDA graph, and what is left
between the weight-bandwidth floor and the measured step is launch boundaries and host time.
This command measures, for each programmatic-dependent-launch mode (kernels/pdl.py: off, late):

  graph_us     one replay of the step's graph, GPU only (CUDA events around back-to-back replays)
  kernels_us   the sum of the kernels' own times in one replay (torch profiler): graph_us minus
               this is the time between kernels
  one stream   tokens/s of one request (128-token prompt, 256 new tokens, median of 5 runs), with
               the engine's step overlap on and off (engine.py: launch step n+1 before reading n)

and checks that every variant generates exactly the same tokens (PDL and overlap change when
things run, never what they compute). Default model: the Llama-3.2-1B config, random bf16 weights.
Writes step_bench.json (and prints a table). The PDL mode reaches the kernels through
LLM(kernel_options={"pdl": mode}) (select_kernels binds it); overlap through LLM(overlap=...).

--timeline: where one stream's wall time goes OUTSIDE the decode graph (bench/timeline.py: one
profiled generate cut into the prompt step, the replays, the gaps between them and the tail), bf16
and FP8 weights, session 14's engine (TIMELINE_ROWS: eager 128-token prompt, inputs as torch ops,
the old FP8 gate/up tile) against the defaults since session 15, each twice, one process, a fresh
engine per row: load time, one stream, batch-1 graph replay, timeline (step_timeline.json).
"""
from __future__ import annotations

import argparse
import gc
import json

import torch

from pagedlab.bench.common import (device_line, event_time_us, kernel_times_us, metadata, out_dir,
                                   random_prompt, require_cuda, write_json)
from pagedlab.bench.engine import finish, one_stream, step_until_decoding
from pagedlab.sampling import SamplingParams

MAX_MODEL_LEN = 4096
REPLAYS_PER_ROUND = 200
WARMUP_REPLAYS = 20
PROFILED_REPLAYS = 20


def graph_step_us(llm, context: int) -> tuple[float, float]:
    """(GPU time of one batch-1 graph replay at `context` tokens, kernel time inside it) in us.
    The engine runs a request until it decodes; then its batch-1 graph is replayed with the inputs
    the last launch left in place (the same step again and again)."""
    eng = llm.engine
    graphs = eng.runner.graphs
    if graphs is None or 1 not in graphs.sizes:
        raise SystemExit("bench step needs the engine's CUDA graph of batch size 1")
    eng.add_request(random_prompt(context, seed=context),
                    SamplingParams(max_new_tokens=8, ignore_eos=True))
    step_until_decoding(eng)
    eng.step()                                     # a decode step: its graph's inputs are in place
    torch.cuda.synchronize()

    def replay():
        graphs.replay(1)
    for _ in range(WARMUP_REPLAYS):
        replay()
    graph_us = event_time_us(replay, calls_per_round=REPLAYS_PER_ROUND, rounds=5)
    kernels_us = sum(kernel_times_us(replay, PROFILED_REPLAYS).values())
    finish(eng)                                    # the request's tokens are garbage now
    return graph_us, kernels_us


# (weights, engine): "s14" = session 14's engine (graphs up to max_num_seqs, prompt steps of at
# most 80 rows replayed, inputs as torch ops, FP8 gate/up in 32 x 1024 tiles of 8 warps), "s15" =
# the defaults since session 15 (prompt graphs up to 128 rows, FUSED_INPUTS, 16 x 512 x 4 warps)
TIMELINE_ROWS = (("bf16", "s14"), ("bf16", "s15"), ("fp8", "s14"), ("fp8", "s15"), ("bf16", "s14"),
                 ("bf16", "s15"))
S14_FP8_GATE_UP = {"swiglu_fp8": dict(BLOCK_R=32, K_SPLIT=2048, BLOCK_K=1024, num_warps=8, num_stages=1)}
TIMELINE_PREFILL_ROWS = 128        # the one-stream prompt: replayed whole when the sizes reach it


def timeline_row(ckpt, weights: str, prefill_graphs: bool, context: int, fused_inputs: bool = False,
                 gemv_config=None) -> dict:
    """One engine (max_num_seqs 8, max_model_len 2048: bench gemv's one stream): its load time,
    one stream (median of 5), the batch-1 graph replay at `context`, and the timeline."""
    import time
    from pagedlab.bench.timeline import one_stream_timeline
    from pagedlab.llm import LLM
    from pagedlab.cuda_graph import DecodeGraphs
    from pagedlab.runner import ModelRunner
    saved = ModelRunner.GRAPH_PREFILL_SIZES, ModelRunner.GRAPH_PREFILL_AUTO, DecodeGraphs.FUSED_INPUTS
    DecodeGraphs.FUSED_INPUTS = fused_inputs
    if prefill_graphs:
        ModelRunner.GRAPH_PREFILL_SIZES, ModelRunner.GRAPH_PREFILL_AUTO = True, TIMELINE_PREFILL_ROWS
    else:                          # session 14's engine: graphs up to max_num_seqs, prompt rows <= 80
        ModelRunner.GRAPH_PREFILL_SIZES, ModelRunner.GRAPH_PREFILL_AUTO = False, 80
    try:
        t0 = time.perf_counter()
        llm = LLM(checkpoint=ckpt, device="cuda", dtype="bfloat16", max_num_seqs=8, max_model_len=2048,
                  show_progress=False, quantization=None if weights == "bf16" else weights,
                  kernel_options=None if gemv_config is None else {"gemv_config": gemv_config})
        torch.cuda.synchronize()
        row = dict(weights=weights, prefill_graphs=prefill_graphs, fused_inputs=fused_inputs,
                   load_s=round(time.perf_counter() - t0, 2),
                   graph_sizes=list(llm.engine.runner.graphs.sizes))
        run = one_stream(llm, random_prompt(), keep_tokens=True)
        row["tokens"] = run.pop("token_ids")[0]
        row["one_stream"] = run
        row["graph_us"], row["kernels_us"] = graph_step_us(llm, context)
        try:
            row["timeline"] = one_stream_timeline(llm, random_prompt(), run["tokens"])
        except Exception as e:                  # keep the row's other numbers
            row["timeline"] = dict(error=f"{type(e).__name__}: {e}")
    finally:
        ModelRunner.GRAPH_PREFILL_SIZES, ModelRunner.GRAPH_PREFILL_AUTO, DecodeGraphs.FUSED_INPUTS = saved
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return row


def timeline_main(args, argv) -> None:
    from pagedlab.weights import load_checkpoint
    ckpt = load_checkpoint(args.model, show_progress=False)
    path = out_dir(args.out) / "step_timeline.json"
    res = dict(metadata("python -m pagedlab bench step --timeline", argv), model=ckpt.source,
               context=args.context, rows=[])
    first = {}
    for weights, engine in TIMELINE_ROWS:
        pg = fused = engine == "s15"
        try:
            row = timeline_row(ckpt, weights, pg, args.context, fused,
                               None if engine == "s15" else S14_FP8_GATE_UP)
            row["engine"] = engine
        except Exception as e:                  # keep the other rows
            print(f"{weights} prefill graphs {pg} fused inputs {fused}: {type(e).__name__}: {e}", flush=True)
            res["rows"].append(dict(weights=weights, prefill_graphs=pg, fused_inputs=fused,
                                    error=f"{type(e).__name__}: {e}"))
            continue
        first.setdefault(weights, row["tokens"])
        a, b = first[weights], row["tokens"]
        row["same_tokens_as_first"] = sum(x == y for x, y in zip(a, b)) / max(1, len(a))
        row["tokens"] = row["tokens"][:16]
        res["rows"].append(row)
        write_json(path, res)
        o, t = row["one_stream"], row["timeline"]
        print(f"{weights} prefill graphs {pg} fused inputs {fused}: load {row['load_s']} s, one stream {o['tokens_per_s']:.1f} tok/s "
              f"{o['runs_tokens_per_s']}, TTFT {o['ttft_ms']}, ITL {o['itl_ms']}, graph {row['graph_us']:.1f} us, "
              f"same tokens {row['same_tokens_as_first']:.3f}", flush=True)
        print("  timeline:", json.dumps(t), flush=True)
    print(device_line(res))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m pagedlab bench step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:llama-3.2-1b")
    p.add_argument("--modes", default="off,late", help="PDL modes (kernels/pdl.py): off, late")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--out", default="figures")
    p.add_argument("--timeline", action="store_true",
                   help="where one stream's time goes outside the decode graph, prompt step eager and "
                        "replayed, bf16 and FP8 (step_timeline.json)")
    args = p.parse_args(argv)
    require_cuda("bench step")
    if args.timeline:
        return timeline_main(args, argv)

    from pagedlab.kernels import pdl
    from pagedlab.llm import LLM
    from pagedlab.weights import load_checkpoint
    modes = [pdl.check_mode(m, "--modes") for m in args.modes.split(",")]
    dev = torch.device("cuda")
    ckpt = load_checkpoint(args.model, show_progress=False)
    prompt = random_prompt()
    rows, tokens = [], {}
    for mode in modes:
        row = dict(pdl=mode, effective_pdl=pdl.effective_mode(dev, mode))
        for overlap in (True, False):
            llm = LLM(checkpoint=ckpt, device="cuda", dtype="bfloat16", max_num_seqs=1,
                      max_model_len=MAX_MODEL_LEN, show_progress=False, overlap=overlap,
                      kernel_options={"pdl": mode})
            if overlap:                            # the graph is the same with and without
                row["graph_us"], row["kernels_us"] = graph_step_us(llm, args.context)
                row["between_kernels_us"] = row["graph_us"] - row["kernels_us"]
            run = one_stream(llm, prompt, keep_tokens=True)
            key = "overlap" if overlap else "no_overlap"
            row[f"one_stream_{key}"] = run["tokens_per_s"]
            row[f"runs_{key}"] = run["runs_tokens_per_s"]
            tokens[(mode, key)] = run["token_ids"][0]
            del llm
            gc.collect()
            torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
    first = next(iter(tokens.values()))
    same = {f"{m}/{k}": v == first for (m, k), v in tokens.items()}
    res = dict(metadata("python -m pagedlab.bench.step", argv), model=ckpt.source,
               context=args.context, rows=rows, same_tokens_as_first=same)
    write_json(out_dir(args.out) / "step_bench.json", res)
    print(f"\n{device_line(res)}; batch 1, context {args.context}")
    print("| PDL | graph replay us | kernels us | between us | one stream, overlap | no overlap |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['pdl']} | {r['graph_us']:.1f} | {r['kernels_us']:.1f} | {r['between_kernels_us']:.1f} | "
              f"{r['one_stream_overlap']:.0f} | {r['one_stream_no_overlap']:.0f} |")
    print("identical tokens across variants:", all(same.values()), same)


if __name__ == "__main__":
    main()

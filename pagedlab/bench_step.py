"""`python -m pagedlab bench step`: one decode step at batch 1, variant by variant.

At batch 1 a decode step is ~100 short kernels replayed from a CUDA graph, and what is left
between the weight-bandwidth floor and the measured step is launch boundaries and host time.
This command measures, for each programmatic-dependent-launch mode (kernels/pdl.py):

  graph_us     one replay of the step's graph, GPU only (CUDA events around back-to-back replays)
  kernels_us   the sum of the kernels' own times in one replay (torch profiler): graph_us minus
               this is the time between kernels
  one stream   tokens/s of one request (128-token prompt, 256 new tokens, median of 5 runs), with
               the engine's step overlap on and off (engine.py: launch step n+1 before reading n)

and checks that every variant generates exactly the same tokens (PDL and overlap change when
things run, never what they compute). Default model: the Llama-3.2-1B config, random bf16 weights.
Writes step_bench.json (and prints a table).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def graph_step_us(eng, context: int, replays: int = 200) -> tuple[float, float]:
    """(GPU time of one batch-1 graph replay at `context` tokens, kernel time inside it) in us."""
    from torch.profiler import ProfilerActivity, profile

    from .sampling import SamplingParams
    g = torch.Generator().manual_seed(context)
    rid = eng.add_request(torch.randint(0, 128000, (context,), generator=g).tolist(),
                          SamplingParams(max_new_tokens=8, ignore_eos=True))
    eng.step()                                     # prefill
    req = eng.requests[rid]
    eng.scheduler._grow(req, req.num_tokens)       # a block for the next token, as schedule() would
    replay = eng.graphs.launch(eng._graph_rows([req]))   # inputs in place: the next decode step
    replay.read_tokens()
    graph = eng.graphs.graphs[1]
    for _ in range(20):
        graph.replay()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / replays)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
    kernels = sum(getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
                  for e in prof.key_averages()) / 20
    eng.run()                                      # finish the request (its tokens are garbage)
    return sorted(times)[len(times) // 2], kernels


def one_stream(llm, prompt, new_tokens=256, runs=5):
    from .sampling import SamplingParams
    sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    llm.generate([prompt], SamplingParams(max_new_tokens=16, ignore_eos=True))
    res = []
    for _ in range(runs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = llm.generate([prompt], sp)[0]
        res.append((new_tokens / (time.perf_counter() - t0), out.token_ids))
    res.sort(key=lambda r: r[0])
    return res[len(res) // 2][0], [round(r[0], 1) for r in res], res[0][1]


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m pagedlab bench step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:llama-3.2-1b")
    p.add_argument("--modes", default="off,wait,late", help="PDL modes (kernels/pdl.py): off, wait, early, prefetch, late")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--out", default="figures")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench step needs a CUDA GPU")
    import triton

    from .kernels import pdl
    from .llm import LLM
    from .weights import load_checkpoint
    ckpt = load_checkpoint(args.model, show_progress=False)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 128000, (128,), generator=g).tolist()
    rows, tokens = [], {}
    for mode in args.modes.split(","):
        pdl.PDL = mode                              # read at each launch: recapture below
        llm = LLM(checkpoint=ckpt, device="cuda", dtype="bfloat16", max_num_seqs=1,
                  max_model_len=4096, show_progress=False)
        eng = llm.engine
        graph_us, kernels_us = graph_step_us(eng, args.context)
        row = dict(pdl=mode, graph_us=graph_us, kernels_us=kernels_us, between_kernels_us=graph_us - kernels_us)
        for overlap in (True, False):
            eng.overlap = overlap
            tps, runs, toks = one_stream(llm, prompt)
            key = "overlap" if overlap else "no_overlap"
            row[f"one_stream_{key}"] = tps
            row[f"runs_{key}"] = runs
            tokens[(mode, key)] = toks
        rows.append(row)
        print(json.dumps(row), flush=True)
        del llm, eng
        torch.cuda.empty_cache()
    first = next(iter(tokens.values()))
    same = {f"{m}/{k}": v == first for (m, k), v in tokens.items()}
    res = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, model=ckpt.source, context=args.context, rows=rows,
               same_tokens_as_first=same)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_bench.json").write_text(json.dumps(res, indent=1))
    print(f"\n{res['device']}, torch {res['torch']}, triton {res['triton']}, {res['date']}; "
          f"batch 1, context {args.context}")
    print("| PDL | graph replay us | kernels us | between us | one stream, overlap | no overlap |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['pdl']} | {r['graph_us']:.1f} | {r['kernels_us']:.1f} | {r['between_kernels_us']:.1f} | "
              f"{r['one_stream_overlap']:.0f} | {r['one_stream_no_overlap']:.0f} |")
    print("identical tokens across variants:", all(same.values()), same)


if __name__ == "__main__":
    main()

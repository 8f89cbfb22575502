"""Where one stream's wall time goes: a torch-profiler trace of one `llm.generate`, cut into phases.

    res = one_stream_timeline(llm, prompt, new_tokens)    # GPU only
    res = phases(trace_events, "one_stream_generate")     # the analysis alone (any machine)

The run's GPU work is split by what launched it: kernels and copies launched by a
`cudaGraphLaunch` are one graph replay each (a decode step -- or a prompt step replayed as decode
rows); everything the GPU does before the first replay is the prompt step (eager, or a replay
itself when it is one). Between two consecutive replays the GPU either runs something else (the
step's copies of inputs and tokens, a block-table write) or nothing: `gaps_us` is the time from
one replay's last kernel end to the next replay's first start, `idle_us` the part of it in which no
GPU work ran at all. `ahead_us` is how long before a replay started on the GPU the host had issued
it (small: the GPU waited for the host). `host_sync` sums the host's waits on the device by call.
"""
from __future__ import annotations

import json
import os
import tempfile
from statistics import median

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cuda_runtime", "cuda_driver")
SYNC_CALLS = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize",
              "cudaMemcpy", "cudaMemcpyAsync", "cudaStreamWaitEvent")


def _busy(intervals) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def _stats(xs) -> dict:
    xs = list(xs)
    if not xs:
        return dict(n=0)
    return dict(n=len(xs), sum=round(sum(xs), 1), median=round(median(xs), 2), max=round(max(xs), 1),
                min=round(min(xs), 2))


def phases(events: list, window: str) -> dict:
    """events: a chrome trace's traceEvents (times in us); window: the name of the annotation that
    spans the run (record_function). Returns the run cut into prompt step, replays, gaps and tail."""
    win = next(e for e in events if e.get("name") == window and e.get("ph") == "X"
               and e.get("cat") in ("user_annotation", "cpu_op"))
    t0, t1 = win["ts"], win["ts"] + win["dur"]
    host = {}
    for e in events:
        if e.get("cat") in HOST_CATS and "correlation" in e.get("args", {}):
            host[e["args"]["correlation"]] = e
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS and t0 <= e["ts"] <= t1),
                 key=lambda e: e["ts"])
    replays: dict = {}                          # correlation of the cudaGraphLaunch -> its GPU events
    for e in gpu:
        call = host.get(e.get("args", {}).get("correlation"))
        if call is not None and call["name"] == "cudaGraphLaunch":
            replays.setdefault(e["args"]["correlation"], []).append(e)
    spans = sorted((min(x["ts"] for x in es), max(x["ts"] + x["dur"] for x in es), c)
                   for c, es in replays.items())
    out = dict(wall_us=round(t1 - t0, 1), replays=len(spans))
    first = spans[0][0] if spans else t1
    pre = [e for e in gpu if e["ts"] < first]
    out["before_first_replay"] = dict(
        host_us=round(first - t0, 1), gpu_busy_us=round(_busy((e["ts"], e["ts"] + e["dur"]) for e in pre), 1),
        gpu_ops=len(pre), kernels=sum(e["cat"] == "kernel" for e in pre))
    out["first_replay_us"] = round(spans[0][1] - spans[0][0], 1) if spans else None
    out["replay_us"] = _stats(b - a for a, b, _ in spans[1:])
    gaps, idle, between, ahead = [], [], {}, []
    for (a0, a1, _), (b0, _, c) in zip(spans, spans[1:]):
        gaps.append(b0 - a1)
        inside = [e for e in gpu if a1 <= e["ts"] < b0]
        idle.append((b0 - a1) - _busy((e["ts"], min(e["ts"] + e["dur"], b0)) for e in inside))
        for e in inside:
            key = f"{e['cat']}: {e['name'][:50]}"
            between[key] = between.get(key, 0.0) + e["dur"]
        call = host.get(c)
        if call is not None:
            ahead.append(b0 - call["ts"])
    out["gaps_us"] = _stats(gaps)
    out["idle_us"] = _stats(idle)
    out["between_replays_gpu_us"] = {k: round(v, 1) for k, v in sorted(between.items(), key=lambda kv: -kv[1])}
    out["ahead_us"] = _stats(ahead)
    last_end = max((e["ts"] + e["dur"] for e in gpu), default=t0)
    out["after_last_gpu_us"] = round(t1 - last_end, 1)
    sync: dict = {}
    for e in events:
        if e.get("cat") in HOST_CATS and t0 <= e["ts"] <= t1 and e["name"] in SYNC_CALLS:
            phase = "prompt" if e["ts"] < first else "decode"
            key = f"{phase}: {e['name']}"
            n, us = sync.get(key, (0, 0.0))
            sync[key] = (n + 1, us + e["dur"])
    out["host_sync"] = {k: dict(calls=n, us=round(us, 1)) for k, (n, us) in sorted(sync.items())}
    return out


def one_stream_timeline(llm, prompt, new_tokens: int) -> dict:
    """One `llm.generate` (greedy, EOS ignored) under the torch profiler (CPU + CUDA), cut into
    phases (see the module docstring). Profiling slows the host: the phases' shares are the
    point, the un-profiled runs' tokens/s the number."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function
    from pagedlab.sampling import SamplingParams
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    llm.generate([prompt], params)                      # warm: the same run once
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("one_stream_generate"):
            out = llm.generate([prompt], params)
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    res = phases(events, "one_stream_generate")
    res["ttft_ms"] = round(out[0].ttft_s * 1e3, 3)
    res["tokens"] = len(out[0].token_ids)
    return res

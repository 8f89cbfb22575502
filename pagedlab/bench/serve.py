"""bench serve: an OpenAI-compatible server under load, the way its users see it.

    python -m pagedlab bench serve --url http://127.0.0.1:8000 --rate 1,4,16,inf --num-prompts 200

Offline throughput (bench engine) says how fast the engine empties a queue it was given all at once.
A server's users arrive one by one, at random: this benchmark sends requests as a Poisson process
(gaps drawn from an exponential distribution, seeded, so every run sends the same workload at the
same moments) at each request rate, streams every answer, and measures per request

    TTFT  time to first token: the request's send -> its first streamed text
    TPOT  time per output token after the first: (latency - TTFT) / (output tokens - 1)
    ITL   inter-token latency: the gaps between streamed chunks

and per rate: requests/s and output tokens/s achieved, p50/p90/p99 of each latency, and goodput --
requests/s that met the service-level objective (TTFT and TPOT under --slo-ttft-ms / --slo-tpot-ms).
As the rate grows the server saturates: throughput flattens while the queue, and TTFT with it, grows.
The last default rate, inf, sends everything at once, so saturation is always in the picture.

Only OpenAI's HTTP API is used (streaming /v1/completions), so the same command measures pagedlab,
vLLM, or `transformers serve`. pagedlab-only fields are never sent unless asked: --ignore-eos sends
`ignore_eos: true` (vLLM and pagedlab honour it: every request generates exactly its output length)
and gives prompts as random token ids; without it, prompts are random words and answers may stop early.
Results: <out>/serve_bench.json (with the command, versions, date) and <out>/serve_bench.png.

Served against offline, in one command: --serve "ARGS" starts `python -m pagedlab serve ARGS` itself
(and stops it at the end); --offline then runs the very same requests through LLM.generate (built from
the same ARGS, in a fresh process once the server is gone) and prints served / offline tokens/s,
against the median of that process's passes after the first (--offline-passes N; several rates
such as `--rate inf,inf,inf` send several bursts to the one server).
--no-stream asks for whole answers instead of server-sent events. --client-procs N sends each burst
from N client processes (one Python process opening hundreds of connections is itself part of a
burst's "way in"; a real burst comes from many clients). --client raw sends each request in ONE write
through the benchmark's own HTTP/1.1 client (bench/raw_http.py: aiohttp and httpx run every request's
first steps before any of them connects or writes, so a burst's first request leaves late), and
--preconnect opens each client's connections before the clock (an application's pool, a gateway).
Each rate's line splits the engine's time
(core idle, inbox, hand-out, the front end's output work) and, per step, the host's phases:
schedule, launch, read (waiting for the GPU), accept -- the offline pass's too.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pagedlab.bench.common import git_commit, out_dir, write_json
from pagedlab.loop_watch import LoopWatch

DEFAULT_RATES = "1,2,4,8,16,inf"
WORDS = ("time year people way day man thing woman life child world school state family student "
         "group country problem hand part place case week company system program question work "
         "government number night point home water room mother area money story fact month lot "
         "right study book eye job word business issue side kind head house service friend father "
         "power hour game line end member law car city community name president team minute idea "
         "kid body information back parent face others level office door health person art war "
         "history party result change morning reason research girl guy moment air teacher force "
         "education river mountain garden window bridge engine paper light music").split()
TOKEN_ID_RANGE = (100, 500)     # random prompt ids: past the low special tokens, inside any vocabulary
PHASES = ("schedule", "launch", "read", "accept")
HOST_PHASES = tuple(f"engine_host_{k}_seconds" for k in PHASES)
HOST_DECODE_PHASES = tuple(f"engine_host_decode_{k}_seconds" for k in PHASES)


def bad(message: str):
    """One line on stderr, exit status 2 (as the rest of the command line)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


# -- the workload --------------------------------------------------------------------------------

@dataclass
class Job:
    prompt: object          # a string of words, or a list of token ids (--ignore-eos)
    input_len: int          # as asked (words or tokens); the server's usage gives the real count
    output_len: int         # max_tokens
    temperature: float = 0.0  # 0: greedy (the default); > 0: sampled (the server draws a seed)


def lengths(rng, mean: int, ratio: float, n: int) -> list[int]:
    """n lengths, uniform in [mean * (1 - ratio), mean * (1 + ratio)], at least 1."""
    lo, hi = max(1, round(mean * (1 - ratio))), max(1, round(mean * (1 + ratio)))
    return [int(x) for x in rng.integers(lo, hi + 1, size=n)]


def read_trace(path: str, n: int) -> list[tuple[int, int]]:
    """(input_len, output_len) per line of a JSON-lines file: {"input_len": 100, "output_len": 50}
    (also "prompt_len"/"prompt_tokens" and "output_tokens"); its first n lines, cycled if fewer."""
    pairs = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            a = next(row[k] for k in ("input_len", "prompt_len", "prompt_tokens") if k in row)
            b = next(row[k] for k in ("output_len", "output_tokens") if k in row)
        except (json.JSONDecodeError, StopIteration, TypeError) as e:
            bad(f"--trace {path}: line {i} is not {{\"input_len\": int, \"output_len\": int}} ({e or 'missing key'})")
        if not (isinstance(a, int) and isinstance(b, int) and a >= 1 and b >= 1):
            bad(f"--trace {path}: line {i}: lengths must be integers >= 1, got {a!r}, {b!r}")
        pairs.append((a, b))
    if not pairs:
        bad(f"--trace {path}: no lines")
    return [pairs[i % len(pairs)] for i in range(n)]


def make_workload(args) -> list[Job]:
    rng = np.random.default_rng(args.seed)
    n = args.num_prompts
    if args.trace:
        pairs = read_trace(args.trace, n)
    else:
        pairs = list(zip(lengths(rng, args.input_len, args.range_ratio, n),
                         lengths(rng, args.output_len, args.range_ratio, n)))
    jobs = []
    for a, b in pairs:
        if args.ignore_eos:
            prompt = [int(t) for t in rng.integers(*TOKEN_ID_RANGE, size=a)]
        else:
            prompt = " ".join(WORDS[int(i)] for i in rng.integers(0, len(WORDS), size=a))
        jobs.append(Job(prompt, a, b, getattr(args, "temperature", 0.0)))
    return jobs


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each request is sent: a Poisson process of `rate` requests/s
    (exponential gaps; the same seed gives the same gaps, scaled by 1/rate), or all at 0 for inf."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0, size=n) / rate
    return list(np.cumsum(gaps) - gaps[0])


# -- one request ---------------------------------------------------------------------------------

@dataclass
class Result:
    ok: bool = False
    error: str | None = None
    ttft_s: float = float("nan")
    latency_s: float = float("nan")
    output_tokens: int = 0
    prompt_tokens: int | None = None
    itl_s: list = field(default_factory=list)
    # moments (time.perf_counter: CLOCK_MONOTONIC on Linux, one clock for the machine's processes):
    # sent, the first text read, and -- from a pagedlab server asked for them (--server-timing) --
    # when the request reached its front end and when its first token came back from the engine
    sent_t: float = float("nan")
    first_read_t: float = float("nan")
    server_arrival_t: float = float("nan")
    server_first_token_t: float = float("nan")

    @property
    def tpot_s(self) -> float:
        if self.output_tokens < 2:
            return float("nan")
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def request_body(model: str, job: Job, ignore_eos: bool, stream: bool | str) -> dict:
    """stream: True, False, or "timing" (streamed, and a pagedlab server is asked for its moments:
    stream_options.pagedlab_timing)."""
    body = {"model": model, "prompt": job.prompt, "max_tokens": job.output_len, "temperature": job.temperature}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        if stream == "timing":
            body["stream_options"]["pagedlab_timing"] = True
    if ignore_eos:
        body["ignore_eos"] = True
    return body


async def read_stream(lines, r: Result, t0: float) -> None:
    """Fill `r` from the lines (str) of a server-sent event stream, timing each token's chunk."""
    chunks, finished, last = 0, False, t0
    r.sent_t = t0
    async for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            r.ok = r.error is None and chunks > 0
            break
        obj = json.loads(data)
        if "error" in obj:
            r.error = str(obj["error"].get("message", obj["error"]))
            continue
        if obj.get("pagedlab_timing"):
            moments = obj["pagedlab_timing"][0]
            r.server_arrival_t = moments.get("arrival") or float("nan")
            r.server_first_token_t = moments.get("first_token") or float("nan")
        if obj.get("usage"):
            r.prompt_tokens = obj["usage"].get("prompt_tokens")
            r.output_tokens = obj["usage"].get("completion_tokens", r.output_tokens)
        for choice in obj.get("choices") or []:
            if choice.get("finish_reason"):
                finished = True
            text = choice.get("text")
            # a token's chunk: text, or text "" that is not the finish (a token whose text is held
            # back -- half a character, a possible stop string: pagedlab and vLLM send it so)
            if text or (text == "" and not choice.get("finish_reason")):
                now = time.perf_counter()
                if chunks == 0:
                    r.ttft_s, r.first_read_t = now - t0, now
                else:
                    r.itl_s.append(now - last)
                last, chunks = now, chunks + 1
    r.latency_s = last - t0
    if not r.ok and finished and r.error is None and chunks > 0:
        r.ok = True        # a finish_reason, then the stream closed: some servers (transformers) send no [DONE]
    if r.output_tokens == 0:          # a server without usage in streams: one token per chunk
        r.output_tokens = chunks
    if not r.ok and r.error is None:
        r.error = "the stream ended without [DONE]" if chunks else "no text was streamed"


def read_whole(answer: dict, r: Result, t0: float) -> None:
    """Fill `r` from a whole (not streamed) answer: its TTFT is its latency, as a client sees it."""
    usage = answer.get("usage") or {}
    r.latency_s = r.ttft_s = time.perf_counter() - t0
    r.output_tokens, r.prompt_tokens = usage.get("completion_tokens", 0), usage.get("prompt_tokens")
    r.ok = r.output_tokens > 0


async def send(client, url: str, model: str, job: Job, ignore_eos: bool, stream: bool = True) -> Result:
    """One /v1/completions request through httpx, streamed and timed chunk by chunk (stream=False:
    one whole answer)."""
    r, body = Result(), request_body(model, job, ignore_eos, stream)
    t0 = time.perf_counter()
    try:
        if not stream:
            resp = await client.post(f"{url}/v1/completions", json=body)
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                return r
            read_whole(resp.json(), r, t0)
            return r
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                r.error = f"HTTP {resp.status_code}: {text[:200]}"
                return r
            await read_stream(resp.aiter_lines(), r, t0)
    except Exception as e:          # noqa: BLE001 -- a failed request is a result, not a crash
        r.error = f"{type(e).__name__}: {e}"
    return r


async def send_aiohttp(session, url: str, model: str, job: Job, ignore_eos: bool, stream: bool = True) -> Result:
    """As send(), through aiohttp: several times less client CPU per request than httpx, so that at
    hundreds of concurrent streams the client measures the server, not itself."""
    r, body = Result(), request_body(model, job, ignore_eos, stream)
    t0 = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return r
            if not stream:
                read_whole(await resp.json(), r, t0)
                return r
            await read_stream((raw.decode("utf-8", "replace") async for raw in resp.content), r, t0)
    except Exception as e:          # noqa: BLE001 -- a failed request is a result, not a crash
        r.error = f"{type(e).__name__}: {e}"
    return r


async def send_raw(client, url: str, model: str, job: Job, ignore_eos: bool, stream: bool = True) -> Result:
    """As send(), through the benchmark's own client (raw_http.py: one write per request)."""
    r, data = Result(), json.dumps(request_body(model, job, ignore_eos, stream)).encode()
    t0 = time.perf_counter()

    async def one():
        async with client.request("POST", "/v1/completions", data) as resp:
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.read()).decode('utf-8', 'replace')[:200]}"
            elif not stream:
                read_whole(json.loads(await resp.read()), r, t0)
            else:
                lines = resp.lines()
                try:
                    await read_stream(lines, r, t0)
                finally:                # left at [DONE]: closed here, not by the loop's shutdown
                    await lines.aclose()
    try:
        await asyncio.wait_for(one(), client.timeout_s)
    except Exception as e:          # noqa: BLE001 -- a failed request is a result, not a crash
        r.error = f"{type(e).__name__}: {e}"
    return r


CLIENTS = ("auto", "raw", "aiohttp", "httpx")


def client_library(choice: str = "auto") -> str:
    """--client: raw (raw_http.py), aiohttp, httpx; auto: aiohttp when it is installed (the
    lighter of the two libraries), else httpx."""
    if choice != "auto":
        return choice
    try:
        import aiohttp  # noqa: F401
        return "aiohttp"
    except ImportError:
        return "httpx"


# -- one rate ------------------------------------------------------------------------------------

def pcts(xs, scale: float = 1e3) -> dict:
    """min, mean, p50, p90, p99 (in ms by default) of the finite values of xs."""
    xs = np.asarray([x for x in xs if math.isfinite(x)], dtype=np.float64) * scale
    if not len(xs):
        return {"min": None, "mean": None, "p50": None, "p90": None, "p99": None}
    q = np.percentile(xs, [50, 90, 99])
    return {"min": float(xs.min()), "mean": float(xs.mean()), "p50": float(q[0]), "p90": float(q[1]),
            "p99": float(q[2])}


def summarize(rate: float, results: list[Result], duration_s: float, args) -> dict:
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    good = [r for r in done if r.ttft_s * 1e3 <= args.slo_ttft_ms
            and (not math.isfinite(r.tpot_s) or r.tpot_s * 1e3 <= args.slo_tpot_ms)]
    errors = sorted({r.error for r in results if r.error})
    return {
        "rate": "inf" if math.isinf(rate) else rate, "requested": len(results), "completed": len(done),
        "failed": len(results) - len(done), "errors": errors[:5], "duration_s": duration_s,
        "request_throughput": len(done) / duration_s, "output_throughput": out_tokens / duration_s,
        "total_output_tokens": out_tokens,
        "total_prompt_tokens": sum(r.prompt_tokens or 0 for r in done),
        "ttft_ms": pcts(r.ttft_s for r in done), "tpot_ms": pcts(r.tpot_s for r in done),
        "itl_ms": pcts(x for r in done for x in r.itl_s), "e2e_latency_ms": pcts(r.latency_s for r in done),
        "goodput": len(good) / duration_s, "goodput_fraction": len(good) / len(results) if results else None,
        # each request's TTFT in the jobs' order (None: failed), for ttft_by_wave
        "ttft_ms_each": [round(r.ttft_s * 1e3, 3) if r.ok else None for r in results],
    } | ttft_split(results)


def ttft_split(results: list[Result]) -> dict:
    """A client's TTFT in three parts, request by request, where the server said its moments
    (--server-timing): the way in (sent -> the request reached the front end: the client's write,
    the network, HTTP parsing), the engine (-> its first token came back to the front end: the
    queue, the prefill, the core's hand-out) and the way out (-> the client read it: the front
    end's event, the socket, the client's read). Percentiles of each, and each part's mean over the
    slowest 1 % of TTFTs (where a burst's p99 sits)."""
    timed = [r.ok and math.isfinite(r.server_first_token_t) for r in results]
    rows = [(r.ttft_s, r.server_arrival_t - r.sent_t, r.server_first_token_t - r.server_arrival_t,
             r.first_read_t - r.server_first_token_t) for r, ok in zip(results, timed) if ok]
    if not rows:
        return {}
    t0 = min(r.sent_t for r, ok in zip(results, timed) if ok)
    # per request, in the jobs' order: [way in, engine, way out, when the front end had its first
    # token (from the first request sent)] in ms, None where the server said nothing: whether the
    # slow ways out come together (one stall of the front end) or spread (a per-stream delay)
    each = [[round(1e3 * x, 3) for x in (r.server_arrival_t - r.sent_t, r.server_first_token_t - r.server_arrival_t,
                                        r.first_read_t - r.server_first_token_t, r.server_first_token_t - t0)]
            if ok else None for r, ok in zip(results, timed)]
    rows.sort()
    tail = rows[-max(1, len(rows) // 100):]
    parts = ("way_in", "engine", "way_out")
    return {"ttft_split_ms": {p: pcts(row[k + 1] for row in rows) for k, p in enumerate(parts)},
            "ttft_split_slowest_ms": {p: 1e3 * statistics.fmean(row[k + 1] for row in tail)
                                      for k, p in enumerate(parts)},
            "ttft_split_each_ms": each}


BUSY = ("core_busy_periods", "core_busy_start_time", "core_busy_end_time")
# the front end's own stalls (pagedlab/loop_watch.py), counters read before and after a run
FRONTEND_STALLS = ("frontend_stall_seconds", "frontend_long_stalls", "frontend_long_stall_seconds",
                   "frontend_gc_seconds", "frontend_gcs", "frontend_long_gcs", "frontend_long_gc_seconds")


def engine_counters(url: str) -> dict | None:
    """pagedlab's engine step counters from /metrics (None from another server)."""
    import httpx
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    vals = {}
    names = ("engine_steps", "engine_step_seconds", "engine_step_sequences", "engine_prompt_steps",
             "engine_prompt_step_seconds", *HOST_PHASES, *HOST_DECODE_PHASES, "core_idle_seconds",
             "core_inbox_seconds", "core_handout_seconds", "frontend_output_seconds", "frontend_cpu_seconds",
             *FRONTEND_STALLS, *BUSY)
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("pagedlab_") and name[9:] in names:
            vals[name[9:]] = float(value)
    return vals if "engine_steps" in vals else None


def engine_step(before: dict | None, after: dict | None) -> dict:
    """The engine's mean step time and batch over a run, from its counters (pagedlab only), and
    the steps with prompt tokens in them (eager) apart from the decode-only ones (CUDA graphs)."""
    if not before or not after or after["engine_steps"] <= before["engine_steps"]:
        return {"engine_step_ms": None, "engine_batch": None}
    d = {k: after[k] - before.get(k, 0.0) for k in after if k not in BUSY[1:]}
    n = d.pop("engine_steps")
    out = {"engine_step_ms": 1e3 * d["engine_step_seconds"] / n,
           "engine_batch": d["engine_step_sequences"] / n,
           "seconds": {k: v for k, v in d.items() if k.endswith("seconds")
                       and k not in HOST_PHASES + HOST_DECODE_PHASES + FRONTEND_STALLS}}
    if "frontend_stall_seconds" in d:
        out["frontend_stalls"] = {k: d[k] for k in FRONTEND_STALLS if k in d}
    kinds = step_kinds(n, d["engine_step_seconds"], d.get("engine_prompt_steps"), d.get("engine_prompt_step_seconds"))
    host = host_per_step(n, {k: d[f"engine_host_{k}_seconds"] for k in PHASES if f"engine_host_{k}_seconds" in d},
                         kinds.get("decode_steps"),
                         {k: d[f"engine_host_decode_{k}_seconds"] for k in PHASES if f"engine_host_decode_{k}_seconds" in d})
    return out | kinds | host


def frontend_cpu_text(r: dict) -> str:
    """The front-end process's CPU over the run, per request (pagedlab: /metrics'
    pagedlab_frontend_cpu_seconds, of the front end that answered the scrape -- with several
    front ends, one of them)."""
    cpu = (r.get("seconds") or {}).get("frontend_cpu_seconds")
    if cpu is None or not r.get("completed"):
        return ""
    text = f"; the front end's CPU {cpu:.2f} s, {1e3 * cpu / r['completed']:.2f} ms per request"
    st = r.get("frontend_stalls")
    if st:        # (pagedlab/loop_watch.py: how long its loop stood still, and its collector)
        text += (f", its loop stood still {1e3 * st['frontend_stall_seconds']:.0f} ms in all, "
                 f"{st['frontend_long_stalls']:.0f} stalls >= 50 ms ({1e3 * st['frontend_long_stall_seconds']:.0f} ms), "
                 f"its collector {1e3 * st['frontend_gc_seconds']:.0f} ms in {st['frontend_gcs']:.0f} collections "
                 f"({st['frontend_long_gcs']:.0f} >= 50 ms)")
    return text


def kinds_text(r: dict) -> str:
    if r.get("prompt_steps") is None:
        return ""
    f = lambda x: "-" if x is None else f"{x:.1f}"                     # noqa: E731
    text = (f"; {r['prompt_steps']} steps with prompt tokens at {f(r['prompt_step_ms'])} ms, "
            f"{r['decode_steps']} decode-only at {f(r['decode_step_ms'])} ms")
    host = r.get("host_ms_per_step")
    if host:
        text += "; the host per step (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in host.items())
    host = r.get("host_ms_per_decode_step")
    if host:
        text += "; per decode-only step: " + ", ".join(f"{k} {v:.2f}" for k, v in host.items())
    return text


def host_per_step(steps, seconds: dict, decode_steps=None, decode_seconds: dict | None = None) -> dict:
    """The engine's host phases (engine.PhaseTimer: schedule, launch, read = waiting for the GPU,
    accept) in ms per step: where a step's time went, served and offline alike; the same over the
    decode-only steps (a prompt step's launch is an eager forward: it swamps the mean)."""
    out = {"host_ms_per_step": {k: 1e3 * v / steps for k, v in seconds.items()}} if steps and seconds else {}
    if decode_steps and decode_seconds:
        out["host_ms_per_decode_step"] = {k: 1e3 * v / decode_steps for k, v in decode_seconds.items()}
    return out


def step_kinds(steps, seconds, prompt_steps, prompt_seconds) -> dict:
    """Steps with prompt tokens (eager) and decode-only steps: how many, mean ms of each."""
    if prompt_steps is None:
        return {}
    decode = steps - prompt_steps
    return {"prompt_steps": int(prompt_steps),
            "prompt_step_ms": 1e3 * prompt_seconds / prompt_steps if prompt_steps else None,
            "decode_steps": int(decode),
            "decode_step_ms": 1e3 * (seconds - prompt_seconds) / decode if decode else None}


async def run_rate(url: str, model: str, jobs: list[Job], rate: float, args, procs: int = 1) -> dict:
    """Send every job at its Poisson arrival time, all streams concurrently; wait for all.
    procs > 1: the jobs are dealt round-robin to that many client processes, each with its own
    event loop and connections, started together (see send_from_processes)."""
    from tqdm.auto import tqdm
    times = arrival_times(len(jobs), rate, args.seed)
    stream = (not args.no_stream) and ("timing" if args.server_timing or args.serve else True)
    how = dict(timeout_s=args.timeout_s, ignore_eos=args.ignore_eos, stream=stream,
               preconnect=args.preconnect, client=args.client, cpus=getattr(args, "client_cpu_list", None))
    if procs > 1:       # the engine's counters: read once the clients are up, just before they go,
        results, duration, counters, after, start, cpus, stalls = await asyncio.to_thread(  # and once the last answer is in
            send_from_processes, url, model, jobs, times, how, procs, lambda: engine_counters(url))
    else:
        counters = engine_counters(url)
        bar = tqdm(total=len(jobs), desc=f"rate {rate:g} req/s", unit="req", disable=args.no_progress)
        client = await make_client(how, url, len(jobs))
        t0, start, cpu = time.perf_counter(), time.monotonic(), time.process_time()
        stalls = [{}]
        results = await send_all(url, model, jobs, times, how, t0, lambda: bar.update(1), client, stalls[0])
        duration, cpus = time.perf_counter() - t0, [time.process_time() - cpu]
        bar.close()
        after = engine_counters(url)
    return (summarize(rate, results, duration, args) | {"client_procs": procs, "client_cpu_s": cpus,
                                                         "client_stalls": stalls}
            | engine_step(counters, after) | busy_window(counters, after, start, duration))


def busy_window(before: dict | None, after: dict | None, start: float, duration: float) -> dict:
    """Where a run's wall time went around the engine core (pagedlab only; time.monotonic, one
    clock for the machine): from the first request sent to the core starting work (start_s), the
    core's busy span and the steps in it, and from the core running out of work to the last answer
    read (end_s). busy_periods > 1: the core ran out of work mid-run (the span is then the last
    period's)."""
    if not before or not after or "core_busy_periods" not in after:
        return {}
    periods = after["core_busy_periods"] - before.get("core_busy_periods", 0)
    if periods < 1:
        return {}
    t0, t1 = after["core_busy_start_time"], after["core_busy_end_time"]
    return {"busy": {"periods": int(periods), "start_s": t0 - start, "span_s": t1 - t0,
                     "end_s": start + duration - t1}}


def client_cpu_text(r: dict) -> str:
    """The client processes' own CPU over the run: a client near its wall time is itself a bound;
    and their own stalls (loop_watch.LoopWatch): the longest loop lag, the collector's pauses."""
    cpus = r.get("client_cpu_s")
    if not cpus:
        return ""
    stalls = [x for x in r.get("client_stalls") or [] if x]
    if stalls:
        more = ("; the clients' longest loop lag " + ", ".join(f"{1e3 * x['longest_stall_s']:.0f}" for x in stalls)
                + " ms, their collector " + ", ".join(f"{1e3 * x['gc_s']:.0f} ({x['gcs']}, longest "
                                                      f"{1e3 * x['longest_gc_s']:.0f})" for x in stalls) + " ms")
    else:
        more = ""
    return (f"; the {'clients' + chr(39) if len(cpus) > 1 else 'client' + chr(39) + 's'} CPU "
            f"{', '.join(f'{c:.2f}' for c in cpus)} s "
            f"(of {r['duration_s']:.2f} s)" + more)


def busy_text(r: dict) -> str:
    b = r.get("busy")
    if not b:
        return ""
    more = f" ({b['periods']} busy periods: it ran out of work mid-run)" if b["periods"] > 1 else ""
    return (f"; the core started {1e3 * b['start_s']:.0f} ms after the first request, was busy "
            f"{b['span_s']:.2f} s and done {1e3 * b['end_s']:.0f} ms before the last answer{more}")


async def make_client(how: dict, url: str | None = None, connections: int = 0):
    """The HTTP client of one client process or loop, and its send function: built BEFORE a run's
    clock starts (importing httpx and building its client take tens of ms, ~80 ms on a 2-core CPU:
    client work, not the server's, and until session 20 they were counted in a burst's duration).
    how["preconnect"] (--preconnect): also open `connections` connections to `url` now, kept alive
    for the run (GET /health on each), as an application's connection pool or a gateway holds them."""
    library = client_library(how.get("client", "auto"))
    if library == "raw":
        from .raw_http import RawHTTP
        client = RawHTTP(url, how["timeout_s"])
        if how.get("preconnect") and connections:
            await client.preconnect(connections)
        return client, send_raw
    import httpx
    if library == "aiohttp":
        import aiohttp
        client, one = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=how["timeout_s"]),
                                            connector=aiohttp.TCPConnector(limit=0)), send_aiohttp

        async def touch():
            async with client.get(f"{url}/health") as r:
                await r.read()
    else:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        client, one = httpx.AsyncClient(timeout=httpx.Timeout(how["timeout_s"]), limits=limits), send

        async def touch():
            await client.get(f"{url}/health")
    if how.get("preconnect") and url and connections:
        await asyncio.gather(*(touch() for _ in range(connections)))
    return client, one


async def send_all(url: str, model: str, jobs: list[Job], times, how: dict, start: float,
                   done=None, client=None, stalls: dict | None = None) -> list[Result]:
    """One client (one event loop, its own connections): each job sent at start + its arrival time
    (perf_counter clock), every stream read concurrently. client: make_client's (client, send),
    built before `start`; default: built here. stalls: a dict that gets this client's own stalls
    over the run (loop_watch.LoopWatch's totals: a client that stands still reads late)."""
    client, one = client or await make_client(how, url)
    if stalls is not None:
        if os.environ.get("PAGEDLAB_BENCH_CLIENT_GC") == "freeze":   # (an experiment: docs/serving.md, session 25)
            gc.collect()
            gc.freeze()
        watch = LoopWatch(every_s=0.002).start()
    try:
        tasks = []
        for job, at in zip(jobs, times):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(one(client, url, model, job, how["ignore_eos"], how["stream"]))
            if done is not None:
                task.add_done_callback(lambda _t: done())
            tasks.append(task)
        return list(await asyncio.gather(*tasks))
    finally:                  # (httpx's client, once used -- --preconnect --, cannot be entered again)
        if stalls is not None:
            stalls.update(watch.stop())
        await (getattr(client, "aclose", None) or client.close)()


def send_from_processes(url: str, model: str, jobs: list[Job], times, how: dict, procs: int,
                        counters=lambda: None):
    """--client-procs N: one Python client process is itself a bottleneck for a burst (its one loop
    opens every connection, writes every request and reads every stream in turn), while a real
    burst comes from many clients. N spawned processes take every N-th job, wait at a common
    start (time.monotonic: one clock for every process of the machine) and send theirs; the
    results come back in the jobs' order, the duration is the common start -> the last answer.
    Returns (results, duration_s, counters() just before the start, counters() once the last
    answer is in -- before the clients exit, the common start, each client's CPU seconds)."""
    import multiprocessing
    ctx = multiprocessing.get_context("spawn")
    ready, results = ctx.Queue(), ctx.Queue()
    go = ctx.Event()
    share = [range(i, len(jobs), procs) for i in range(procs)]
    start_at = ctx.Value("d", 0.0)
    workers = [ctx.Process(target=_client_process, daemon=True,
                           args=(i, url, model, [jobs[j] for j in idx], [times[j] for j in idx], how,
                                 ready, go, start_at, results)) for i, idx in enumerate(share)]
    for w in workers:
        w.start()
    try:
        for _ in workers:
            _from_clients(ready, workers)   # every client imported and waiting
        before = counters()
        start_at.value = time.monotonic() + 0.05
        go.set()
        got = {}
        for _ in workers:
            i, res, end, cpu, stall = _from_clients(results, workers)
            got[i] = (res, end, cpu, stall)
        after = counters()
    finally:
        for w in workers:
            w.join(5)
            if w.is_alive():
                w.kill()
    out: list = [None] * len(jobs)
    for i, idx in enumerate(share):
        for j, r in zip(idx, got[i][0]):
            out[j] = r
    return (out, max(g[1] for g in got.values()) - start_at.value, before, after, start_at.value,
            [got[i][2] for i in range(procs)], [got[i][3] for i in range(procs)])


def _from_clients(q, workers):
    """The next message of the client processes; a client that died without one is an error
    (not a wait as long as the requests' timeout)."""
    import queue
    while True:
        try:
            return q.get(timeout=1.0)
        except queue.Empty:
            dead = [w.exitcode for w in workers if w.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"a client process died (exit code {dead[0]})") from None


def _client_process(i, url, model, jobs, times, how, ready, go, start_at, results) -> None:
    if how.get("cpus"):
        os.sched_setaffinity(0, how["cpus"])
    loop = asyncio.new_event_loop()              # the loop and the HTTP client are ready before
    client = loop.run_until_complete(make_client(how, url, len(jobs)))   # the common start: it times the server
    ready.put(i)
    go.wait()
    delay = start_at.value - time.monotonic()
    if delay > 0:
        time.sleep(delay)
    start, cpu = time.perf_counter(), time.process_time()
    stalls = {}
    try:
        res = loop.run_until_complete(send_all(url, model, jobs, times, how, start, client=client, stalls=stalls))
    finally:
        loop.close()
    results.put((i, res, time.monotonic(), time.process_time() - cpu, stalls))


# -- results -------------------------------------------------------------------------------------

def plot(results: list[dict], path: Path, title: str) -> Path:
    """Latency (TTFT, TPOT: p50 and p99) and throughput against the offered request rate."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [str(r["rate"]) for r in results]
    x = np.arange(len(results))

    def series(key, stat):
        return [np.nan if r[key][stat] is None else r[key][stat] for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, name in ((axes[0], "ttft_ms", "time to first token (ms)"),
                          (axes[1], "tpot_ms", "time per output token (ms)")):
        for stat, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
            ax.plot(x, series(key, stat), style, label=stat)
        ax.set_ylabel(name)
        ax.legend()
    axes[2].plot(x, [r["output_throughput"] for r in results], "o-", label="output tokens/s")
    axes[2].set_ylabel("output tokens/s")
    axes[2].legend(loc="lower right")
    ax2 = axes[2].twinx()
    ax2.plot(x, [r["request_throughput"] for r in results], "s--", color="C1", label="requests/s")
    ax2.plot(x, [r["goodput"] for r in results], "^:", color="C2", label="goodput (req/s in SLO)")
    ax2.set_ylabel("requests/s")
    ax2.legend(loc="upper left")
    for ax in axes:
        ax.set_xticks(x, labels)
        ax.set_xlabel("offered request rate (req/s)")
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def metadata(argv, url: str, server_models, client: str = "auto") -> dict:
    import httpx
    return {"date": datetime.date.today().isoformat(),
            "time": datetime.datetime.now().isoformat(timespec="seconds"),
            "python": platform.python_version(), "httpx": httpx.__version__, "numpy": np.__version__,
            "client_commit": git_commit(), "client": client_library(client),
            "command": " ".join(["python -m pagedlab bench serve"] + list(argv)),
            "url": url, "server_models": server_models}


def parse_rates(text: str) -> list[float]:
    rates = []
    for part in text.split(","):
        try:
            r = float(part)
        except ValueError:
            bad(f"--rate must be a comma-separated list of numbers > 0 or inf, got {part!r} in {text!r}")
        if not r > 0:                           # also nan
            bad(f"--rate must be > 0 (or inf), got {part!r}")
        rates.append(r)
    return rates


def parse_procs(text: str) -> list[int]:
    try:
        procs = [int(x) for x in str(text).split(",")]
    except ValueError:
        bad(f"--client-procs must be a comma-separated list of whole numbers, got {text!r}")
    if not procs or min(procs) < 1 or max(procs) > 64:
        bad(f"--client-procs must be between 1 and 64, got {text!r}")
    return procs


def parse_cpus(text: str | None) -> set[int] | None:
    """--client-cpus "12-15" or "0,2,4-6": the CPUs the client processes run on; the rest of the
    machine is left to the server, its engine core and the offline pass."""
    if not text:
        return None
    if not hasattr(os, "sched_setaffinity"):
        bad("--client-cpus needs os.sched_setaffinity (Linux)")
    cpus = set()
    try:
        for part in str(text).split(","):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        bad(f"--client-cpus must look like 12-15 or 0,2,4-6, got {text!r}")
    mine = os.sched_getaffinity(0)
    if not cpus or not cpus < mine:
        bad(f"--client-cpus {text!r} must be some, not all, of this process's CPUs {sorted(mine)}")
    return cpus


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pagedlab bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (without /v1)")
    p.add_argument("--model", default=None, help="the model name to send (default: the first of /v1/models)")
    p.add_argument("--rate", default=DEFAULT_RATES, help="request rates (req/s), comma-separated; inf = all at once")
    p.add_argument("--num-prompts", type=int, default=200, help="requests per rate")
    p.add_argument("--seed", type=int, default=0, help="the prompts, lengths and arrival times")
    p.add_argument("--input-len", type=int, default=128, help="prompt length (tokens, or words without --ignore-eos)")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in len*(1-r) .. len*(1+r), r in [0, 1)")
    p.add_argument("--trace", default=None, help="JSON lines {\"input_len\": .., \"output_len\": ..} (instead of the lengths above)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos: true and token-id prompts (vLLM and pagedlab take them)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="every request's temperature (default 0: greedy; > 0: sampled, offline too)")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="goodput: TTFT at most this")
    p.add_argument("--slo-tpot-ms", type=float, default=100.0, help="goodput: TPOT at most this")
    p.add_argument("--warmup", type=int, default=1, help="requests sent first, not measured")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per request")
    p.add_argument("--out", default="out", help="where serve_bench.json / .png go (default: ./out; "
                                               "the README's figures come from --out figures)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-stream", action="store_true", help="whole answers (stream: false) instead of SSE")
    p.add_argument("--server-timing", action="store_true",
                   help="ask a pagedlab server at --url for each request's moments (stream_options."
                        "pagedlab_timing) and split the TTFT into the way in, the engine and the way out "
                        "(on with --serve; the server must run on this machine: one clock)")
    p.add_argument("--client-procs", default="1", metavar="N[,N..]",
                   help="client processes sending each rate's requests (default 1); a list is taken in "
                        "turn across the rates: `--rate inf,inf --client-procs 1,4` sends the first burst "
                        "from one process and the second from four")
    p.add_argument("--client", choices=CLIENTS, default="auto",
                   help="the HTTP client: raw (the benchmark's own: one write per request, so that a "
                        "burst leaves as a burst), aiohttp, httpx (default auto: aiohttp if installed, else httpx)")
    p.add_argument("--client-cpus", default=None, metavar="CPUS",
                   help="run the client processes on these CPUs (e.g. 12-15) and the server, its engine "
                        "core and the offline pass on the others: the clients then do not share the "
                        "engine's host CPUs (Linux)")
    p.add_argument("--preconnect", action="store_true",
                   help="each client opens its connections before the clock starts (kept alive, as an "
                        "application's connection pool or a gateway holds them): a burst then times its "
                        "requests, not hundreds of TCP connections opened at once by a few Python processes")
    p.add_argument("--serve", default=None, metavar="ARGS",
                   help="start `python -m pagedlab serve ARGS` here first (on a free port; --url is "
                        "then ignored) and stop it at the end, e.g. \"--model random:llama-3.2-1b --slots 256\"")
    p.add_argument("--offline", action="store_true",
                   help="with --serve: then run the same requests through LLM.generate (same ARGS) "
                        "and print served / offline tokens/s")
    p.add_argument("--offline-passes", type=int, default=2, metavar="N",
                   help="with --offline: passes of the same requests in the offline process (>= 2); the "
                        "first compiles and is reported apart, served/offline uses the median of the "
                        "others (one process's passes vary: docs/serving.md, session 10)")
    return p


def check(args) -> list[float]:
    rates = parse_rates(args.rate)
    for flag, v in (("--num-prompts", args.num_prompts), ("--input-len", args.input_len),
                    ("--output-len", args.output_len)):
        if v < 1:
            bad(f"{flag} must be >= 1, got {v}")
    if not 0 <= args.range_ratio < 1:
        bad(f"--range-ratio must be in [0, 1), got {args.range_ratio}")
    for flag, v in (("--slo-ttft-ms", args.slo_ttft_ms), ("--slo-tpot-ms", args.slo_tpot_ms),
                    ("--timeout-s", args.timeout_s)):
        if not v > 0:
            bad(f"{flag} must be > 0, got {v}")
    if args.warmup < 0:
        bad(f"--warmup must be >= 0, got {args.warmup}")
    if not 0 <= args.temperature <= 2:
        bad(f"--temperature must be in [0, 2] (the OpenAI API's range), got {args.temperature}")
    if not args.url.startswith(("http://", "https://")):
        bad(f"--url must start with http:// or https://, got {args.url!r}")
    if args.trace and not Path(args.trace).is_file():
        bad(f"--trace {args.trace}: no such file")
    return rates


def server_model(url: str, model: str | None):
    """The server's /v1/models (and the model to ask for): also checks the server answers."""
    import httpx
    try:
        r = httpx.get(f"{url}/v1/models", timeout=30)
        r.raise_for_status()
        models = r.json()
    except (httpx.HTTPError, ValueError) as e:
        bad(f"--url {url}: GET /v1/models failed ({type(e).__name__}: {e})")
    ids = [m.get("id") for m in models.get("data", [])]
    if model is None:
        if not ids:
            bad(f"--url {url}: /v1/models lists no model; give --model")
        model = ids[0]
    return model, models


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    rates = check(args)
    procs = parse_procs(args.client_procs)
    client_cpus = parse_cpus(args.client_cpus)
    if args.offline and not args.serve:
        bad("--offline needs --serve ARGS (the engine to run the same requests through)")
    if args.offline_passes < 2:
        bad(f"--offline-passes must be >= 2 (the first pass compiles), got {args.offline_passes}")
    if client_cpus:                    # the server (started now), its core and the offline pass: the rest
        os.sched_setaffinity(0, os.sched_getaffinity(0) - client_cpus)
        args.client_cpu_list = sorted(client_cpus)  # for the client processes (run_rate)
    server = start_server(args.serve) if args.serve else None
    try:
        url = server.url if server else args.url.rstrip("/")
        model, models = server_model(url, args.model)
        jobs = make_workload(args)
        meta = metadata(argv, url, models, args.client)

        async def everything():
            if args.warmup:
                await asyncio.gather(*(send_one(url, model, j, args) for j in jobs[:args.warmup]))
            return [await run_rate(url, model, jobs, r, args, procs[i % len(procs)])
                    for i, r in enumerate(rates)]
        results = asyncio.run(everything())
    finally:
        if server:
            server.stop()
    offline = None
    if args.offline:
        offline = run_offline(args.serve, jobs, args)
        for r in results:
            r["served_over_offline"] = r["output_throughput"] / offline["output_throughput"]
        offline["bursts"] = burst_comparison(results, offline)
        for r in results:
            r["ttft_by_wave"] = ttft_by_wave(r["ttft_ms_each"], offline.get("ttft_ms_each") or [])
    out = out_dir(args.out)
    config = {k: v for k, v in vars(args).items()} | {"model": model, "rates": [str(r) for r in rates]}
    path = write_json(out / "serve_bench.json", {"metadata": meta, "config": config, "results": results,
                                                 "offline": offline})
    title = f"{model} at {url} -- {meta['date']}, {args.num_prompts} requests per rate, " \
            f"SLO TTFT <= {args.slo_ttft_ms:g} ms, TPOT <= {args.slo_tpot_ms:g} ms"
    plot(results, out / "serve_bench.png", title)
    print(table(results))
    for r in results:
        if r.get("seconds"):
            print(f"rate {r['rate']}: {r['duration_s']:.2f} s, of which "
                  + ", ".join(f"{k.replace('_seconds', '')} {v:.2f} s" for k, v in r["seconds"].items()
                              if k not in ("engine_prompt_step_seconds", "frontend_cpu_seconds"))
                  + kinds_text(r) + frontend_cpu_text(r) + busy_text(r) + client_cpu_text(r))
    if offline:
        print("offline median pass:" + kinds_text(offline))
        # the first token of a burst: offline the queue holds every request at once; served, the
        # first one has crossed the client's connections and the HTTP layer first (the way in)
        print("TTFT min (the first answer of a burst): offline {:.1f} ms; served ".format(offline["ttft_ms"]["min"])
              + ", ".join(f"rate {r['rate']}: {r['ttft_ms']['min']:.1f} ms" for r in results
                          if r["ttft_ms"].get("min") is not None))
    for r in results:
        if r.get("ttft_split_ms"):
            sp, slow = r["ttft_split_ms"], r["ttft_split_slowest_ms"]
            print(f"rate {r['rate']}: TTFT split (ms, p50 / p99 / mean of the slowest 1 %): " + ", ".join(
                f"{name} {sp[k]['p50']:.1f} / {sp[k]['p99']:.1f} / {slow[k]:.1f}" for k, name in
                (("way_in", "way in (sent -> front end)"), ("engine", "engine (-> first token back)"),
                 ("way_out", "way out (-> client read)"))))
        if r.get("ttft_by_wave"):
            print(f"rate {r['rate']}: TTFT served - offline, request by request, in eighths by offline TTFT "
                  "(median ms: offline -> served, +diff): " + ", ".join(
                      f"{w['offline_ms']:.0f}->{w['served_ms']:.0f} ({w['served_minus_offline_ms']:+.0f})"
                      for w in r["ttft_by_wave"]))
    if offline:
        later = ", ".join(f"{x:.0f}" for x in offline["pass_throughputs"][1:])
        print(f"offline (LLM.generate, the same {len(jobs)} requests at once, the median of passes 2.."
              f"{len(offline['pass_throughputs'])} [{later}] tok/s): "
              f"{offline['output_throughput']:.1f} tok/s, TTFT p99 {offline['ttft_ms']['p99']:.1f} ms "
              f"(first pass {offline['first_pass']['output_throughput']:.1f} tok/s); "
              + ", ".join(f"rate {r['rate']}: served/offline {r['served_over_offline']:.2f}" for r in results))
        if offline["bursts"]:
            b = offline["bursts"]
            print(f"bursts (rate inf) against offline passes 2..{len(offline['pass_throughputs'])}, medians: "
                  f"tokens/s {b['served_tok_s']:.0f} vs {b['offline_tok_s']:.0f} = {b['tok_s_ratio']:.2f}; "
                  f"TTFT p99 {b['served_ttft_p99_ms']:.0f} vs {b['offline_ttft_p99_ms']:.0f} ms = "
                  f"{b['ttft_p99_ratio']:.2f} (offline passes' TTFT p99: "
                  + ", ".join(f"{x:.0f}" for x in offline["pass_ttft_p99_ms"][1:]) + " ms)")
    print(f"wrote {path} and {out / 'serve_bench.png'}")
    return 0


async def send_one(url, model, job, args) -> Result:
    import httpx
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout_s)) as client:
        return await send(client, url, model, job, args.ignore_eos, not args.no_stream)


def table(results: list[dict]) -> str:
    def f(x):
        return "-" if x is None else f"{x:.1f}"
    rows = [f"{'rate':>6} {'done':>6} {'req/s':>7} {'tok/s':>8} {'TTFT p50':>9} {'p99':>8} "
            f"{'TPOT p50':>9} {'p99':>8} {'ITL p50':>8} {'goodput':>8} {'step ms':>8} {'batch':>6} {'clients':>7}"]
    for r in results:
        rows.append(f"{r['rate']!s:>6} {r['completed']:>3}/{r['requested']:<2} {r['request_throughput']:7.2f} "
                    f"{r['output_throughput']:8.1f} {f(r['ttft_ms']['p50']):>9} {f(r['ttft_ms']['p99']):>8} "
                    f"{f(r['tpot_ms']['p50']):>9} {f(r['tpot_ms']['p99']):>8} {f(r['itl_ms']['p50']):>8} "
                    f"{r['goodput']:8.2f} {f(r.get('engine_step_ms')):>8} {f(r.get('engine_batch')):>6} "
                    f"{r.get('client_procs', 1):>7}")
    failed = [f"rate {r['rate']}: {r['failed']} of {r['requested']} requests failed: " + "; ".join(r["errors"])
              for r in results if r["failed"]]
    return "\n".join(rows + failed) + ("\n(latencies in ms; goodput: requests/s within the SLO; step ms / batch: the "
                                       "engine's mean step and decode batch during the run, from /metrics; clients: "
                                       "client processes)")


# -- the server and the offline run, in this command ----------------------------------------------

class StartedServer:
    """`python -m pagedlab serve ARGS` as a child process, on a free port."""

    def __init__(self, serve_args: str):
        import shlex
        serve_args = without_prefix_reuse(serve_args)
        import socket
        import subprocess
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "pagedlab", "serve", *shlex.split(serve_args), "--port", str(port),
               "--log-level", "warning"]
        print("+", " ".join(cmd), file=sys.stderr, flush=True)
        self.proc = subprocess.Popen(cmd)

    def wait(self, timeout_s: float = 1800.0) -> "StartedServer":
        import httpx
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                bad(f"the server exited with status {self.proc.returncode} before it answered")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        bad(f"the server did not answer /health within {timeout_s:.0f} s")

    def stop(self) -> None:
        import signal
        import subprocess
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_server(serve_args: str) -> StartedServer:
    return StartedServer(serve_args).wait()


def without_prefix_reuse(serve_args: str) -> str:
    """The same requests go out at every rate (and the offline run's two passes repeat them): with
    prefix caching (on by default) each run would find the previous one's prompts cached. Unless
    ARGS says otherwise, the server and the offline run get --no-prefix-caching."""
    if "prefix-caching" in serve_args:
        return serve_args
    return serve_args + " --no-prefix-caching"


def ttft_by_wave(served: list, offline: list, groups: int = 8) -> list[dict]:
    """Request by request, the same job served and offline: the jobs in the order of their offline
    TTFT, cut into `groups` equal groups (the first: the requests the engine answers first; the
    last: those that waited for a slot -- where a burst's TTFT p99 sits), and per group the median
    offline TTFT, served TTFT and served minus offline (ms). Where the served TTFT is lost: at the
    front (the way in), evenly (the way out), or at the tail (the engine's own timeline)."""
    pairs = sorted((o, s) for o, s in zip(offline, served) if o is not None and s is not None)
    groups = min(groups, len(pairs))                  # (fewer requests than groups: one each)
    out = []
    for g in range(groups):
        part = pairs[g * len(pairs) // groups:(g + 1) * len(pairs) // groups]
        out.append({"offline_ms": statistics.median(o for o, _ in part),
                    "served_ms": statistics.median(s for _, s in part),
                    "served_minus_offline_ms": statistics.median(s - o for o, s in part)})
    return out


def burst_comparison(results: list[dict], offline: dict) -> dict | None:
    """The bursts (rate inf) against the offline passes after the first, both as medians: one burst
    and one pass each vary by ~10 % (tokens/s and TTFT p99 alike), so a single pair says little."""
    bursts = [r for r in results if math.isinf(float(r["rate"]))]
    if not bursts:
        return None
    tok = statistics.median(r["output_throughput"] for r in bursts)
    ttft = statistics.median(r["ttft_ms"]["p99"] for r in bursts)
    return {"bursts": len(bursts), "served_tok_s": tok, "offline_tok_s": offline["output_throughput"],
            "tok_s_ratio": tok / offline["output_throughput"], "served_ttft_p99_ms": ttft,
            "offline_ttft_p99_ms": offline["ttft_p99_ms_median"],
            "ttft_p99_ratio": ttft / offline["ttft_p99_ms_median"]}


def run_offline(serve_args: str, jobs: list[Job], args) -> dict:
    """The same requests through LLM.generate, all at once, in a fresh process built from the
    serve ARGS, args.offline_passes times: the median output tokens/s of the second and later passes
    (of two: their mean), TTFT percentiles (each request's) of the middle one (the first pass, which
    compiles kernels, is kept as first_pass; every pass's tokens/s in pass_throughputs)."""
    serve_args = without_prefix_reuse(serve_args)
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "jobs.json"
        spec.write_text(json.dumps({"serve_args": serve_args, "ignore_eos": args.ignore_eos,
                                    "warmup": args.warmup, "passes": args.offline_passes,
                                    "jobs": [[j.prompt, j.output_len, j.temperature] for j in jobs]}))
        subprocess.run([sys.executable, "-m", "pagedlab.bench.serve", "--offline-worker", str(spec)], check=True)
        return json.loads((Path(tmp) / "offline.json").read_text())


def offline_worker(spec_path: str) -> int:
    import shlex
    from pagedlab.__main__ import build_objects
    from pagedlab.__main__ import build_parser as cli_parser
    from pagedlab.llm import LLM
    from pagedlab.sampling import SamplingParams
    spec = json.loads(Path(spec_path).read_text())
    a = cli_parser().parse_args(["serve", *shlex.split(spec["serve_args"])])
    build_objects(a, sampling=False)                 # the server's own engine arguments, as it builds them
    llm = LLM(a.model, tensor_parallel_size=a.tensor_parallel_size, data_parallel_size=a.data_parallel_size,
              **a.engine_kwargs)
    prompts = [p for p, *_ in spec["jobs"]]
    params = [SamplingParams(max_tokens=n, temperature=t, ignore_eos=spec["ignore_eos"]) for _, n, t in spec["jobs"]]
    if spec["warmup"]:
        llm.generate(prompts[:spec["warmup"]], params[:spec["warmup"]])
    passes = []
    core = getattr(llm, "core", None)           # (none with data_parallel_size > 1: replicas)
    counters = (lambda: (core.num_steps, core.step_seconds, core.prompt_steps, core.prompt_step_seconds,
                         dict(core.engine.timing))) if core is not None else (lambda: None)
    for _ in range(spec.get("passes", 2)):    # the first pass of a process compiles kernels: the
        before = counters()                   # median of the others is compared with serving
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        dt = time.perf_counter() - t0
        kinds = {}
        if core is not None:
            after = counters()
            kinds = step_kinds(*(a - b for a, b in zip(after[:4], before[:4])))
            spent = {k: v - before[4][k] for k, v in after[4].items() if k != "steps"}
            kinds |= host_per_step(after[0] - before[0], {k: spent[k] for k in PHASES}, kinds.get("decode_steps"),
                                   {k: spent[f"decode_{k}"] for k in PHASES})
        tokens = sum(len(o.token_ids) for o in outs)
        passes.append({"output_throughput": tokens / dt, "duration_s": dt, "total_output_tokens": tokens,
                       "ttft_ms": pcts(o.ttft_s for o in outs),
                       "ttft_ms_each": [round(o.ttft_s * 1e3, 3) for o in outs]} | kinds)
    later = sorted(passes[1:], key=lambda x: x["output_throughput"])
    # tokens/s: the median of the later passes (of two, their mean); TTFT and steps: the middle pass
    median = statistics.median(x["output_throughput"] for x in later)
    # TTFT p99 moves by ~10 % from pass to pass (docs/serving.md, session 15): every pass's is kept
    # and the served bursts are compared with the median of the later passes'
    result = later[(len(later) - 1) // 2] | {"output_throughput": median, "first_pass": passes[0],
                                             "pass_throughputs": [x["output_throughput"] for x in passes],
                                             "pass_ttft_p99_ms": [x["ttft_ms"]["p99"] for x in passes],
                                             "ttft_p99_ms_median": statistics.median(
                                                 x["ttft_ms"]["p99"] for x in passes[1:])}
    (Path(spec_path).parent / "offline.json").write_text(json.dumps(result))
    llm.close()
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--offline-worker"]:
        sys.exit(offline_worker(sys.argv[2]))
    sys.exit(main())

# Solutions to notebook 11. Run from the notebook (uses SMALL, URL, NAME, SLOTS, CAPACITY, LOAD_REQUESTS, jobs,
# fire, sse_events, split_step, read_metrics, CHAT_TOKENS, LLM, serve, httpx, asyncio, time).
import random
import threading

import numpy as np

from pagedlab.bench.serve import pcts


def run_async(coro):
    """Run a coroutine to its end from plain code. (In a notebook cell you would just `await` it;
    this file is run with exec, where `await` is not allowed, and Jupyter's loop is already
    running, so asyncio.run needs a thread of its own.)"""
    box = {}

    def target():
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as e:          # noqa: BLE001 -- raised again below, in the caller
            box["error"] = e
    t = threading.Thread(target=target)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


# 1. Bursty or regular: the same jobs at the same average rate. Poisson arrivals come in clumps:
#    a clump finds the slots full and waits, while an even schedule hands each request a slot that
#    the one before it has just freed. Same mean load, longer tail.
#    (All LOAD_REQUESTS jobs with the tiny model; 4 with a real model on a CPU, to keep it short.
#    With so few requests the percentiles are noisy: run it a few times, or with more jobs.)
rate, few = 0.8 * CAPACITY, jobs if SMALL else jobs[:4]
for how, times in (("Poisson", None), ("regular", [i / rate for i in range(len(few))])):
    got = run_async(fire(few, rate, time.perf_counter(), seed=1, times=times))
    ttft = pcts(r.ttft_s for _, r in got if r.ok)
    print(f"{how:8s} at {rate:.1f} req/s: TTFT p50 {ttft['p50']:7.1f} ms, p99 {ttft['p99']:7.1f} ms")


# 2. Poisson arrivals of your own: exponential gaps, checked by their statistics.
def my_arrivals(n, rate, seed=0):
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


rate, n = 5.0, 20000
at = my_arrivals(n, rate)
gaps = np.diff(at)
per_second = np.bincount(np.floor(at).astype(int))[:-1]      # arrivals in each whole second
print(f"mean gap {gaps.mean():.4f} s (1/rate = {1 / rate:.4f}); std {gaps.std():.4f} (exponential: = mean)")
print(f"arrivals per second: mean {per_second.mean():.2f}, variance {per_second.var():.2f} (Poisson: equal)")
assert abs(gaps.mean() * rate - 1) < 0.03 and abs(gaps.std() / gaps.mean() - 1) < 0.05
assert abs(per_second.var() / per_second.mean() - 1) < 0.15
ref = np.diff(arrival_times(n, rate, seed=0))                # bench serve's: the same distribution
assert abs(ref.mean() * rate - 1) < 0.03 and abs(ref.std() / ref.mean() - 1) < 0.05


# 3. Admission control: 2 slots + 1 waiting = 3 streams at a time; the others are refused at once
#    with 503 and Retry-After, before anything reaches the engine.
async def admission_demo():
    small = LLM("random:tiny", max_num_seqs=2, show_progress=False)
    with serve(small, model_name="tiny", port=0, max_waiting=1) as s:
        req = {"model": "tiny", "prompt": list(range(100, 120)), "max_tokens": 64, "ignore_eos": True,
               "stream": True}
        async with httpx.AsyncClient(timeout=60) as client:
            async def one():
                async with client.stream("POST", s.url + "/v1/completions", json=req) as r:
                    await r.aread()
                    return r.status_code, r.headers.get("retry-after")
            answers = await asyncio.gather(*(one() for _ in range(8)))
        m = read_metrics(httpx.get(s.url + "/metrics").text)
    return answers, m


answers, m = run_async(admission_demo())
codes = [c for c, _ in answers]
print("status codes:", codes, "| Retry-After:", sorted({ra for c, ra in answers if c == 503}))
print("pagedlab_requests_rejected_total:", m["pagedlab_requests_rejected_total"])
assert codes.count(200) == 3 and codes.count(503) == 5 and m["pagedlab_requests_rejected_total"] == 5


# 4. n=2: the chunks of both choices come interleaved in one stream; "index" says whose they are.
texts = {}
req = {"model": NAME, "messages": [{"role": "user", "content": "Say something about cats."}],
       "max_tokens": CHAT_TOKENS // 2, "temperature": 0.8, "seed": 1, "n": 2, "stream": True}
with httpx.stream("POST", URL + "/v1/chat/completions", json=req, timeout=120) as r:
    for event in sse_events(r.iter_bytes()):
        for c in event["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "")
for i, text in sorted(texts.items()):
    print(f"choice {i}: {text!r}")
assert sorted(texts) == [0, 1]


# 5. How many front ends? Measure on the GPU host itself, the whole server against the same requests
#    offline, in one run (so both see the same machine): bench serve --offline does both. For N = 1, 2,
#    4 (docs/serving.md, session 16: scripts/serve_bench_h200.sh api1 api4 ...), several bursts each
#    (one burst moves by ~10 %: compare medians), read per N:
#      - the first answer of a burst (TTFT min) against offline's: what the lockstep costs;
#      - TTFT p99 and tokens/s against offline's: the whole burst, not just its head;
#      - the core's idle seconds per burst and its decode-only step time: more front ends take more
#        of the host's CPUs, and the core's host loop slows when the host is busy (session 15).
#    Stop at the N after which the first answer no longer comes closer to offline's, or the core's
#    steps (tokens/s) start to lose: the front ends then cost the core more than they save the burst.
#    Then a Poisson load near capacity too: a burst is the front end's worst case, not the usual one.
print("exercise 5: measure N = 1, 2, 4 with bench serve --offline (see the comments in this cell)")


# 6. What the core writes per step: one message per front end with requests in the step. The bytes
#    are about the same in all (the same columns, cut up), the count of messages -- each a pickle and
#    a pipe write on the core's side -- grows with N while requests are spread over the front ends.
import pickle

step_ids = list(range(256))
step_toks = [[7] for _ in step_ids]
for n in (1, 2, 4, 8):
    for how, ids in (("spread evenly", step_ids), ("all of front end 0", [i * n for i in step_ids])):
        parts = split_step(ids, step_toks, n)
        size = sum(len(pickle.dumps(p)) for p in parts.values())
        print(f"N = {n}, {how:18s}: {len(parts)} message(s), {size:,} bytes pickled")
    assert len(split_step(step_ids, step_toks, n)) == n and len(split_step([i * n for i in step_ids], step_toks, n)) == 1

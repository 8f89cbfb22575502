"""Run ahead past requests that end by length, on and off (Scheduler.RUN_AHEAD_PAST_ENDS), in ONE
process, passes alternating: the serving burst of docs/serving.md (random Llama-3.2-1B, 256 slots,
512 requests, prompts 63-512 tokens, 32-256 new tokens, greedy, EOS ignored) through LLM.generate.

    python scripts/run_ahead_ab.py [passes per arm, default 5]     # results: $OUT/run_ahead.json
    KNOB=sampled python scripts/run_ahead_ab.py 5    # ModelRunner.RUN_AHEAD_SAMPLED on/off instead,
                                                     # every request sampled (TEMP, default 1.0)

Per pass: tokens/s, TTFT p50 / p99, steps and steps launched before the previous one was read
(Engine.num_overlapped); medians per arm at the end. MODEL / NP (env) shrink it for a CPU check
(MODEL=random:tiny NP=40: the graph path run eagerly). Session 19 on the H200: docs/serving.md.
For the served side: PAGEDLAB_RUN_AHEAD_PAST_ENDS=0 in the server's environment turns it off."""
import json, os, random, statistics, sys, time
from pathlib import Path

from pagedlab import LLM, SamplingParams
from pagedlab.runner import ModelRunner
from pagedlab.scheduler import Scheduler

knob = os.environ.get("KNOB", "past_ends")
if knob not in ("past_ends", "sampled"):
    raise SystemExit(f"KNOB is past_ends or sampled, not {knob!r}")
owner, attr = (Scheduler, "RUN_AHEAD_PAST_ENDS") if knob == "past_ends" else (ModelRunner, "RUN_AHEAD_SAMPLED")
temperature = float(os.environ.get("TEMP", "1.0" if knob == "sampled" else "0.0"))

passes = int(sys.argv[1]) if len(sys.argv) > 1 else 5
model, n = os.environ.get("MODEL", "random:llama-3.2-1b"), int(os.environ.get("NP", "512"))
tiny = model == "random:tiny"
llm = LLM(model, max_num_seqs=32 if tiny else 256, max_model_len=2048, prefix_caching=False,
          show_progress=False, **({"device": "cpu", "cuda_graphs": "eager"} if tiny else {}))
eng, rng = llm.engine, random.Random(0)
vocab = min(llm.config.vocab_size, 100_000)
scale = 0.08 if tiny else 1.0
prompts = [[rng.randrange(10, vocab) for _ in range(int(rng.randint(63, 512) * scale))] for _ in range(n)]
params = [SamplingParams(max_tokens=max(1, int(rng.randint(32, 256) * scale)), temperature=temperature,
                         ignore_eos=True, seed=i) for i in range(len(prompts))]
llm.generate(prompts[:16], params[:16])
llm.generate(prompts, params)                       # the first pass of a process compiles kernels
res, ids = {"on": [], "off": []}, {}
for i in range(2 * passes):                         # on, off, off, on, on, off, ...
    arm = ("on", "off")[(i + 1) // 2 % 2]
    setattr(owner, attr, arm == "on")
    o0, s0 = eng.num_overlapped, llm.core.num_steps
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t
    ttft = sorted(o.ttft_s for o in outs)
    r = dict(tokens_per_s=sum(len(o.token_ids) for o in outs) / dt, ttft_p50_ms=ttft[len(ttft) // 2] * 1e3,
             ttft_p99_ms=ttft[int(0.99 * len(ttft))] * 1e3, steps=llm.core.num_steps - s0,
             overlapped=eng.num_overlapped - o0)
    res[arm].append(r)
    ids.setdefault(arm, [o.token_ids for o in outs])
    print(f"{arm}: {r['tokens_per_s']:,.0f} tok/s, TTFT p50 {r['ttft_p50_ms']:.0f} p99 {r['ttft_p99_ms']:.0f} ms, "
          f"steps {r['steps']}, overlapped {r['overlapped']}", flush=True)
summary = {arm: {k: statistics.median(x[k] for x in xs) for k in xs[0]} for arm, xs in res.items()}
for arm, m in summary.items():
    print(f"{arm}: median {m['tokens_per_s']:,.0f} tok/s, TTFT p99 {m['ttft_p99_ms']:.0f} ms, "
          f"p50 {m['ttft_p50_ms']:.0f} ms, overlapped {m['overlapped']:.0f} of {m['steps']:.0f} steps")
same = sum(a == b for a, b in zip(ids["on"], ids["off"])) / len(ids["on"])
print(f"{owner.__name__}.{attr}, temperature {temperature}: requests with the same tokens on and off: {same:.0%} "
      "(bf16: batch mates differ in time, near-ties flip)")
out = Path(os.environ.get("OUT", "out"))
out.mkdir(parents=True, exist_ok=True)
(out / "run_ahead.json").write_text(json.dumps(dict(model=model, requests=n, knob=f"{owner.__name__}.{attr}",
                                                    temperature=temperature, passes=res, medians=summary,
                                                    same_tokens=same), indent=1))

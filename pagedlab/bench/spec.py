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

--repeats N: each run N times, off and on alternating (one-stream ratios are noisy: a run is a
few hundred tokens), medians reported. --fused-rows MODES: the speculative runs once per mode of
the few-row decode graphs (kernels/gemv.py fused_rows; each mode's graphs captured in the same
engine, swapped between runs). --breakdown: one more instrumented run of each one-stream case,
its steps split into prefill (eager; prefill_graph: replayed, --graph-prefill) / plain decode / verify:
host time of each phase (schedule with the proposer inside, launch, read, accept), GPU time (CUDA
events around the launch) and the GPU's idle gap before each step.

--small: the tiny random model on CPU with few tokens (what the tests run).
"""
from __future__ import annotations

import argparse
import statistics
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


def measure(llm, speculator, prompts, params, real, batched, graphs=None) -> dict:
    """One run; graphs: the decode graphs to replay (a fused_rows mode's, see variant_graphs)."""
    set_speculation(llm, speculator)
    eng = llm.engine
    if graphs is not None:
        eng.runner.graphs = graphs
    eng.reset_timing()
    overlapped0 = eng.num_overlapped
    gate = speculator.gate if speculator is not None else None
    gate0 = {k: getattr(gate, k) for k in ("num_closes", "num_probes", "num_plain_steps")} if gate else {}
    kinds0 = dict(speculator.num_steps) if speculator is not None else {}
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
                # the batch's gate: closes, probes and plain steps it made this run (None: gate off)
                gate=None if speculator is None or speculator.gate is None else
                {k: getattr(speculator.gate, k) - gate0[k] for k in gate0},
                # decode steps by kind: verify (someone guessed), ahead (planned while the previous
                # one ran: the overlap loop's pace), sync (plain, the previous step read first)
                step_kinds=None if speculator is None else
                {k: v - kinds0[k] for k, v in speculator.num_steps.items()},
                # the lookups' replay decided who guesses at batches up to this size (spec/shadow.py;
                # None: off)
                shadow=None if speculator is None or speculator.shadow is None else speculator.shadow_max_batch,
                # what the gate weighed at the run's batch size at its end: a verify step / a plain one
                batch_cost=None if speculator is None else speculator.batch_cost(len(prompts) if batched else 1),
                host_timing={k: (v if k == "steps" else round(v, 4)) for k, v in eng.timing.items()},
                overlapped_steps=eng.num_overlapped - overlapped0,
                token_ids=[o.token_ids for o in outs])


def adaptive_options(spec, item: str) -> dict:
    """--fused-rows item "mode@name=value+name=value": AdaptiveK settings for that variant's runs
    (e.g. fma@max_miss_pause=4+pause=32), checked against the speculator's AdaptiveK; "gate=off"
    (or on): the batch's gate (spec/gate.py BatchGate) off for those runs; "gate_NAME=value": a
    BatchGate setting (gate_min_steps=5); "shadow=on" (or off): the lookups' replay deciding who
    guesses and when at every batch size (spec/shadow.py; off: nowhere); "shadow_max_batch=N": at
    batches of up to N decoding sequences (the default's own: Speculator.SHADOW_MAX_BATCH);
    "row_gain=x": its per-request bar."""
    opts = {}
    for part in [p for p in item.partition("@")[2].split("+") if p]:
        name, _, value = part.partition("=")
        if name == "gate" and spec is not None and spec.gate is not None:
            if value not in ("on", "off"):
                raise SystemExit(f"--fused-rows {item!r}: gate is on or off, not {value!r}")
            opts["gate"] = value
            continue
        if name in ("shadow", "row_gain", "shadow_max_batch") and spec is not None:
            if name == "shadow":
                if value not in ("on", "off"):
                    raise SystemExit(f"--fused-rows {item!r}: shadow is on or off, not {value!r}")
                opts["spec_shadow"] = value == "on"
                if value == "on":
                    opts["spec_shadow_max_batch"] = 1 << 30
            else:
                opts["spec_" + name] = float(value) if name == "row_gain" else int(value)
            continue
        if name.startswith("gate_") and spec is not None and spec.gate is not None:
            attr = name[5:]
            if attr.startswith("_") or attr.startswith("num_") or not isinstance(getattr(spec.gate, attr, None), (int, float)):
                raise SystemExit(f"--fused-rows {item!r}: {attr!r} is no BatchGate setting")
            opts[name] = type(getattr(spec.gate, attr))(value)
            continue
        if spec is None or spec.adaptive is None or not hasattr(spec.adaptive, name) or name.startswith("_"):
            raise SystemExit(f"--fused-rows {item!r}: {name!r} is no AdaptiveK setting")
        opts[name] = type(getattr(spec.adaptive, name))(value)
    return opts


class adaptive_set:
    """`with adaptive_set(speculator, opts):` those AdaptiveK settings (and the gate off for
    "gate": "off"), the old ones back after."""

    def __init__(self, spec, opts: dict):
        self.spec = spec
        self.target = spec.adaptive if spec is not None else None
        self.opts = opts if self.target is not None else {}

    def __enter__(self):
        opts = dict(self.opts)
        self.gate = self.spec.gate if self.spec is not None else None
        self.old_gate = {k[5:]: getattr(self.gate, k[5:]) for k in opts if k.startswith("gate_")}
        for k in list(opts):
            if k.startswith("gate_"):
                setattr(self.gate, k[5:], opts.pop(k))
        if opts.pop("gate", "on") == "off":
            self.spec.gate = None
        own = {"spec_shadow": "shadow_on", "spec_row_gain": "row_gain", "spec_shadow_max_batch": "shadow_max_batch"}
        self.old_spec = {}
        for k in [k for k in opts if k in own]:
            self.old_spec[own[k]] = getattr(self.spec, own[k])
            setattr(self.spec, own[k], opts.pop(k))
        self.old = {k: getattr(self.target, k) for k in opts}
        for k, v in opts.items():
            setattr(self.target, k, v)

    def __exit__(self, *exc):
        for k, v in self.old.items():
            setattr(self.target, k, v)
        if self.spec is not None:
            for k, v in self.old_spec.items():
                setattr(self.spec, k, v)
            self.spec.gate = self.gate
            for k, v in self.old_gate.items():
                setattr(self.gate, k, v)


def variant_graphs(llm, modes) -> dict:
    """mode -> decode graphs of the engine's sizes captured in that kernels/gemv.py fused_rows mode
    ("off": the composed cuBLAS path), the engine's own graphs for its own mode. Captured on the
    idle engine; a run swaps them in (runner.graphs) -- every set shares the engine's KV cache and
    block table, only one replays at a time."""
    from pagedlab.cuda_graph import DecodeGraphs
    from pagedlab.kernels.gemv import fused_rows
    runner = llm.engine.runner
    own = runner.graphs
    out = {}
    from pagedlab.kernels import gemv
    for mode in modes:
        if own is None or not own.capture or mode == (runner.spec_fused_rows or "off"):
            out[mode] = own
            continue
        name, _, rows = mode.partition(":")        # "fma_layers:4": the fused kernels up to 4 rows
        was = gemv.FMA_ROWS
        try:
            gemv.FMA_ROWS = int(rows) if rows else was
            with fused_rows(None if name == "off" else name):
                out[mode] = DecodeGraphs(runner.model, runner.kv_cache, runner.block_table.table, own.max_seq_len,
                                         own.sizes[-1], sizes=own.sizes, capture=True)
        finally:
            gemv.FMA_ROWS = was
    return out


class StepProbe:
    """--breakdown: wraps one engine's scheduler / runner / proposer methods (instance attributes,
    removed by close()) and records per launched step: its kind (prefill, plain decode, verify),
    rows, the host seconds of schedule (the proposer inside it), propose, launch, read and accept,
    and CUDA events around the launch (GPU time of the step; with the previous step's end event,
    how long the GPU sat idle before it)."""

    def __init__(self, engine):
        self.engine, self.steps, self.patched = engine, [], []
        self.by_batch, self.by_launch = {}, {}
        self.cuda = engine.device.type == "cuda"
        self.schedule_now_s = self.propose_now_s = 0.0
        sched, runner = engine.scheduler, engine.runner
        self.wrap(sched, "schedule", self.on_schedule)
        self.wrap(runner, "launch", self.on_launch)
        self.wrap(runner, "read", self.on_read)
        self.wrap(sched, "accept", self.on_accept)
        if engine.speculator is not None:
            self.wrap(engine.speculator.proposer, "propose", self.on_propose)

    def wrap(self, obj, name, fn):
        orig = getattr(obj, name)
        self.patched.append((obj, name))
        setattr(obj, name, lambda *a, **kw: fn(orig, *a, **kw))

    def close(self) -> None:
        for obj, name in self.patched:
            delattr(obj, name)          # the class's method again
        self.patched = []

    def on_schedule(self, orig, *a, **kw):
        self.propose_now_s = 0.0
        t = time.perf_counter()
        out = orig(*a, **kw)
        self.schedule_now_s = time.perf_counter() - t
        return out

    def on_propose(self, orig, *a, **kw):
        t = time.perf_counter()
        out = orig(*a, **kw)
        self.propose_now_s += time.perf_counter() - t
        return out

    def on_launch(self, orig, batch, *a, **kw):
        graph_prefill = bool(batch.prefill) and self.engine.runner.replays(batch)
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if self.cuda else None
        if ev:
            ev[0].record()
        rows = sum(r.num_scheduled for r in batch.prefill) + sum(1 + len(r.spec_token_ids) for r in batch.decode)
        t = time.perf_counter()
        launch = orig(batch, *a, **kw)
        dt = time.perf_counter() - t
        if ev:
            ev[1].record()
        kind = ("prefill_graph" if graph_prefill else "prefill") if batch.prefill else \
            ("verify" if batch.guessed else "plain")
        rec = dict(kind=kind, rows=rows, t=t, schedule_s=self.schedule_now_s, propose_s=self.propose_now_s,
                   launch_s=dt, read_s=0.0, accept_s=0.0, events=ev)
        self.steps.append(rec)
        self.by_batch[id(batch)], self.by_launch[id(launch)] = rec, rec
        return launch

    def on_read(self, orig, launch):
        t = time.perf_counter()
        out = orig(launch)
        rec = self.by_launch.get(id(launch))
        if rec is not None:
            rec["read_s"] += time.perf_counter() - t
        return out

    def on_accept(self, orig, batch, *a, **kw):
        t = time.perf_counter()
        out = orig(batch, *a, **kw)
        rec = self.by_batch.get(id(batch))
        if rec is not None:
            rec["accept_s"] += time.perf_counter() - t
        return out

    def summary(self) -> dict:
        """Per kind: steps, rows, and per phase the median and the total in ms (GPU: the step's
        time on the device; gap: the GPU idle before it, waiting for the host)."""
        if self.cuda:
            torch.cuda.synchronize()
        prev = None
        for rec in self.steps:
            ev = rec.pop("events")
            if ev:
                rec["gpu_s"] = ev[0].elapsed_time(ev[1]) / 1e3
                rec["gap_s"] = prev[1].elapsed_time(ev[0]) / 1e3 if prev else 0.0
                prev = ev
        out = {}
        phases = ("schedule_s", "propose_s", "launch_s", "read_s", "accept_s", "gpu_s", "gap_s")
        for kind in ("prefill", "prefill_graph", "plain", "verify"):
            recs = [r for r in self.steps if r["kind"] == kind]
            if not recs:
                continue
            k = dict(steps=len(recs), rows=round(statistics.mean(r["rows"] for r in recs), 2))
            for ph in phases:
                vals = [r[ph] for r in recs if ph in r]
                if vals:
                    k[ph[:-2] + "_ms"] = dict(median=round(statistics.median(vals) * 1e3, 4),
                                              total=round(sum(vals) * 1e3, 3))
            out[kind] = k
        return out


def breakdown(llm, speculator, prompts, params, real, graphs=None) -> dict:
    """One instrumented one-stream run (StepProbe): per step kind, where the time goes."""
    set_speculation(llm, speculator)
    if graphs is not None:
        llm.engine.runner.graphs = graphs
    probe = StepProbe(llm.engine)
    try:
        outs, wall = run_once(llm, prompts, params, real, batched=False)
    finally:
        probe.close()
    s = probe.summary()
    in_steps = sum(v.get("gpu_ms", {}).get("total", 0) + v.get("gap_ms", {}).get("total", 0) for v in s.values())
    return dict(wall_ms=round(wall * 1e3, 3), tokens=sum(len(o.token_ids) for o in outs),
                accepted=sum(o.num_spec_accepted for o in outs),
                outside_steps_ms=round(wall * 1e3 - in_steps, 3) if probe.cuda else None, kinds=s)


# (hidden, intermediate, Hq, Hkv, D, vocab) of the two models bench spec runs
KERNEL_SHAPES = {"smollm2": (576, 1536, 9, 3, 64, 49152), "llama-3.2-1b": (2048, 8192, 32, 8, 64, 128256)}


def kernel_times(rows=(1, 5, 8), modes=("fma",), reps: int = 20, models=None) -> dict:
    """One layer's linear work (norm+QKV+RoPE+store, O + residual, norm+SwiGLU, down + residual) and
    the LM head at each row count, in microseconds, bf16 random weights of both models' shapes:
    "cublas" (the composed path: cuBLAS + the small Triton kernels), "fused" at one row, and at
    more rows each kernels/gemv.py fused_rows mode in `modes` ("fma": each row against the weight
    tile; "dot": rows padded to 16 on tensor cores). Each timed as a CUDA graph of `reps` launches
    (no launch overhead), median of do_bench."""
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
        if models is not None and name not in models:
            continue
        rnd = lambda *shape, scale=1.0: torch.randn(*shape, device=dev, dtype=dt) * scale   # noqa: E731
        g = rnd(h)
        wqkv, wo = rnd((hq + 2 * hkv) * d, h, scale=h ** -0.5), rnd(h, hq * d, scale=h ** -0.5)
        wgu, wd, wl = rnd(2 * inter, h, scale=h ** -0.5), rnd(h, inter, scale=inter ** -0.5), rnd(vocab, h, scale=0.05)
        cs = rope_cos_sin(d, 10000.0, 4096, None, device=dev)
        kc, vc = rnd(64, 16, hkv, d), rnd(64, 16, hkv, d)
        for t in rows:
            x, a, m = rnd(t, h), rnd(t, hq * d), rnd(t, inter)
            pos = slots = torch.arange(t, device=dev)
            paths = [("cublas", False, None)] + ([("fused", None, None)] if t == 1 else
                                                 [(mode, None, mode) for mode in modes])
            for path, fused, mode in paths:
                fns = {"qkv": lambda: gemv.norm_qkv_rope_store_triton(x, g, 1e-5, wqkv, pos, cs, kc, vc, slots, hq,
                                                                      fused=fused),
                       "o": lambda: gemv.linear_residual_triton(a, wo, x, fused=fused),
                       "swiglu": lambda: gemv.norm_swiglu_triton(x, g, 1e-5, wgu, fused=fused),
                       "down": lambda: gemv.linear_residual_triton(m, wd, x, fused=fused),
                       "lm_head": lambda: gemv.norm_lm_head_triton(x, g, 1e-5, wl, fused=fused, greedy=True)}
                with gemv.fused_rows(mode):
                    r = {k: timed(f) for k, f in fns.items()}
                r["layer"] = round(r["qkv"] + r["o"] + r["swiglu"] + r["down"], 2)
                out[f"{name}/{t} rows/{path}"] = r
                print(f"{name} {t} rows {path}: {r}", flush=True)
    return out


def table(results: dict) -> list[str]:
    lines = ["| workload | mode | variant | tokens/s (median) | speed-up (vs its off) | vs the first off | runs (tok/s) "
             "| steps | tokens/step/request | kept / proposed | same tokens |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, r in results["runs"].items():
        for v, x in r["variants"].items():
            m = x["median_run"]
            lines.append(f"| {r['workload']} | {r['mode']} | {v} | {x['median']:,.0f} | {x['speedup']:.2f}x | "
                         f"{x['speedup_vs_first_off']:.2f}x | {', '.join(f'{t:,.0f}' for t in x['tokens_per_s'])} | {m['steps']} | "
                         f"{m['tokens_per_request_step']:.2f} | {m['accepted']} / {m['proposed']} | "
                         f"{x['same_tokens']:.0%} |")
    return lines


def median_run(runs: list[dict]) -> dict:
    """The run with the median tokens/s (the lower middle of an even count)."""
    ranked = sorted(runs, key=lambda x: x["tokens_per_s"])
    return ranked[(len(ranked) - 1) // 2]


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
    p.add_argument("--modes", default="one_stream,batched", help="comma-separated subset of one_stream, batched")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each case, off and on alternating (medians reported; default 1)")
    p.add_argument("--no-adaptive", action="store_true", help="fixed k (no back-off)")
    p.add_argument("--fuse-up-to", type=int, default=None, metavar="N",
                   help="use the fused GEMV kernels for steps of up to N rows (kernels/gemv.py FUSE_UP_TO, "
                        "at most 16): verify steps of one stream have k + 1 rows")
    p.add_argument("--fused-rows", default=None, metavar="MODES",
                   help="comma-separated kernels/gemv.py fused_rows modes of the few-row decode graphs the "
                        "speculative runs replay, each a run of its own: off (cuBLAS + separate small "
                        "kernels), fma, fma_layers, dot (default: the engine's, ModelRunner.SPEC_FUSED_ROWS); "
                        "fma:N / fma_layers:N: the fused kernels up to N rows (kernels/gemv.py FMA_ROWS)")
    p.add_argument("--batch-gate", default=None, metavar="on|off|off,on",
                   help="the batch's gate (spec/gate.py: speculation off for the whole batch where it "
                        "does not pay): several values, each speculative variant once per value "
                        "(default: on, the engine's own)")
    p.add_argument("--graph-prefill", default=None, metavar="N[,M...]",
                   help="steps with at most N prompt + decode rows replay the decode graphs "
                        "(runner.ModelRunner.GRAPH_PREFILL_ROWS; every run, plain and speculative). "
                        "Several values: every variant (off and on) once per value, in the same engine, "
                        "each on-variant's speed-up against the off-run of its own value")
    p.add_argument("--breakdown", action="store_true",
                   help="one more instrumented one-stream run per case: host / GPU / idle time per step kind")
    p.add_argument("--replay", action="store_true",
                   help="also time a graph replay per captured size up to 16 rows (padding rows: the "
                        "linear layers' cost of a verify step of that many rows), for each --fused-rows mode")
    p.add_argument("--kernels", action="store_true",
                   help="also time one layer's linear work and the LM head at 1, 5, 8 rows, cuBLAS vs fused "
                        "(both models' shapes, random bf16 weights)")
    p.add_argument("--out", default="figures", help="where spec_bench.json/.md go")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not args.small and not cuda:
        raise SystemExit("bench spec needs a CUDA GPU (or --small, which runs on CPU)")
    from pagedlab.kernels import gemv
    from pagedlab.llm import LLM
    if args.fuse_up_to is not None:
        gemv.FUSE_UP_TO = max(1, min(args.fuse_up_to, gemv.MAX_ROWS))
    items = [m for m in (args.fused_rows or "").split(",") if m]
    for m in items:
        name, _, rows = m.partition("@")[0].partition(":")
        if name != "off" and name not in gemv.FUSED_ROWS_MODES:
            raise SystemExit(f"--fused-rows: {m!r} is none of off, {', '.join(gemv.FUSED_ROWS_MODES)}")
        if rows and not (rows.isdigit() and int(rows) >= 1 and name in ("fma", "fma_layers")):
            raise SystemExit(f"--fused-rows: {m!r}: MODE:N (N >= 1 rows) is for fma and fma_layers")
    gates = [g for g in (args.batch_gate or "").split(",") if g]
    if any(g not in ("on", "off") for g in gates):
        raise SystemExit(f"--batch-gate: {args.batch_gate!r}: on, off or both")
    modes = [m.partition("@")[0] for m in items]
    from pagedlab.spec.config import SpeculativeConfig
    from pagedlab.spec.speculator import Speculator  # noqa: F401  (the engine builds it)

    model = args.model or ("random:tiny" if args.small else "smollm2")
    real = not model.startswith("random:")
    dtype = "bfloat16" if cuda and not args.small else "float32"
    max_tokens = args.max_tokens or (24 if args.small else 256)
    slots = len(PASSAGES) * args.copies
    sc = SpeculativeConfig(method="ngram", num_speculative_tokens=args.k, prompt_lookup_max=args.ngram,
                           adaptive=not args.no_adaptive)
    llm = LLM(model, device="cuda" if cuda else "cpu", dtype=dtype, max_num_seqs=slots, show_progress=False,
              speculative_config=sc)
    runner = llm.engine.runner
    own_gp = runner.GRAPH_PREFILL_ROWS
    gps = [int(x) for x in args.graph_prefill.split(",") if x] if args.graph_prefill else []
    if any(g < 0 for g in gps):
        raise SystemExit(f"--graph-prefill: {args.graph_prefill!r}: row counts are >= 0")
    if len(gps) == 1:
        runner.GRAPH_PREFILL_ROWS = gps[0]
    default_gp = runner.GRAPH_PREFILL_ROWS
    if default_gp is None:         # the runner's auto setting, as it resolves on this engine
        default_gp = runner.GRAPH_PREFILL_AUTO if runner.graphs is not None and runner.graphs.capture else 0
    spec = llm.engine.speculator
    own_mode = getattr(llm.engine.runner, "spec_fused_rows", None) or "off"    # (no graphs on a CPU)
    if not items:
        items = modes = [own_mode]
    if gates:                                            # each variant once per gate setting
        items = [m + ("+" if "@" in m else "@") + f"gate={g}" for m in items for g in gates]
        modes = [m.partition("@")[0] for m in items]
    graphs = variant_graphs(llm, set(modes) | {own_mode})
    base = graphs[own_mode]                              # what the runs without speculation replay
    # name -> (speculator, graphs, AdaptiveK settings, GRAPH_PREFILL_ROWS, the off-variant it is against)
    variants = {}
    for gp in gps if len(gps) > 1 else [default_gp]:
        tag = f" (graph prefill {gp})" if len(gps) > 1 else ""
        variants["off" + tag] = (None, base, {}, gp, "off" + tag)
        for m in items:
            name = (f"on ({m})" if len(items) > 1 else "on") + tag
            variants[name] = (spec, graphs[m.partition("@")[0]], adaptive_options(spec, m), gp, "off" + tag)
    first_off = next(iter(variants))
    tok = llm.get_tokenizer() if real or model == "random:llama-3.2-1b" else None
    vocab = min(llm.engine.model.config.vocab_size, RANDOM_TOKEN_LIMIT)
    results = dict(command="python -m pagedlab bench spec " + " ".join(argv or []), model=model, dtype=dtype,
                   device=torch.cuda.get_device_name() if cuda else "CPU", speculative_config=sc.to_dict(),
                   max_tokens=max_tokens, cuda_graphs=llm.engine.runner.graphs is not None,
                   fuse_up_to=gemv.FUSE_UP_TO, fused_rows=items, fma_min_programs=gemv.FMA_MIN_PROGRAMS,
                   graph_prefill_rows=gps if len(gps) > 1 else default_gp, repeats=args.repeats,
                   overlap=llm.engine.overlap, runs={})
    try:
        from pagedlab.bench.common import metadata
        results["metadata"] = metadata("python -m pagedlab bench spec", argv)
    except Exception as e:          # (no triton on this machine): the run is still worth keeping
        results["metadata"] = {"error": f"{type(e).__name__}: {e}"}
    out = out_dir(args.out)
    stem = "spec_bench" + ("" if real or args.small else "_random")
    params = SamplingParams(max_tokens=max_tokens)
    # one stream first (the cases the #25 targets name), then batched; a run cut short keeps what it has
    cases = [(w, m) for m in [m for m in args.modes.split(",") if m] for w in [w for w in args.workloads.split(",") if w]]
    for name, mode in cases:
        prompts = prompts_for(name, tok, real, vocab)
        batched = mode == "batched"
        ps = prompts * args.copies if batched else prompts
        for s, g, _, gp, _ in variants.values():      # warm-up: compile, capture, fill caches
            set_speculation(llm, s)
            runner.graphs, runner.GRAPH_PREFILL_ROWS = g, gp
            run_once(llm, ps[:len(prompts)], SamplingParams(max_tokens=min(16, max_tokens)), real, batched)
        runs = {v: [] for v in variants}
        order = list(variants)
        for i in range(max(1, args.repeats)):        # alternating: off, on..., then on..., off
            for v in (order if i % 2 == 0 else order[::-1]):
                s, g, opts, gp, _ = variants[v]
                runner.GRAPH_PREFILL_ROWS = gp
                with adaptive_set(s, opts):
                    runs[v].append(measure(llm, s, ps, params, real, batched, graphs=g))
        r = dict(workload=name, mode=mode, requests=len(ps), variants={})
        medians = {v: statistics.median(x["tokens_per_s"] for x in xs) for v, xs in runs.items()}
        ref_ids = {v: runs[v][0]["token_ids"] for v in runs}
        for v, xs in runs.items():
            against = variants[v][4]
            ref = ref_ids[against]
            same = [sum(a == b for a, b in zip(ref, x["token_ids"])) / len(ref) for x in xs]
            firsts = sorted({next((i for i, (u, w) in enumerate(zip(a, b)) if u != w), min(len(a), len(b)))
                             for x in xs for a, b in zip(ref, x["token_ids"]) if a != b})
            same_first = min(sum(a == b for a, b in zip(ref_ids[first_off], x["token_ids"])) / len(ref) for x in xs)
            med = medians[v]
            ratios = [x["tokens_per_s"] / o["tokens_per_s"] for x, o in zip(xs, runs[against])]
            r["variants"][v] = dict(tokens_per_s=[round(x["tokens_per_s"], 1) for x in xs], median=med,
                                    speedup=med / medians[against], against=against,
                                    speedup_vs_first_off=med / medians[first_off],
                                    speedup_per_repeat=[round(q, 3) for q in ratios],
                                    same_tokens=min(same), same_tokens_as_first_off=same_first,
                                    first_difference=firsts, median_run=median_run(xs), runs=xs)
            print(f"{name} {mode} {v}: median {med:,.0f} tok/s ({med / medians[against]:.2f}x vs {against}; "
                  f"{med / medians[first_off]:.2f}x vs {first_off}; runs "
                  f"{', '.join(f'{x:,.0f}' for x in r['variants'][v]['tokens_per_s'])}), kept "
                  f"{r['variants'][v]['median_run']['accepted']}/{r['variants'][v]['median_run']['proposed']}, "
                  f"same tokens {min(same):.0%}", flush=True)
        for xs in runs.values():
            for x in xs:
                x.pop("token_ids")
        first_on = next(v for v in variants if variants[v][0] is not None)
        r["off"], r["on"] = r["variants"][first_off]["median_run"], r["variants"][first_on]["median_run"]
        r["speedup"] = r["variants"][first_on]["speedup"]
        r["same_tokens"] = r["variants"][first_on]["same_tokens"]
        results["runs"][f"{name}/{mode}"] = r
        if args.breakdown and not batched:
            for v, (s, g, opts, gp, _) in variants.items():
                runner.GRAPH_PREFILL_ROWS = gp
                with adaptive_set(s, opts):
                    b = breakdown(llm, s, ps, params, real, graphs=g)
                results.setdefault("breakdown", {})[f"{name}/{v}"] = b
                print(f"breakdown {name} {v}: {b}", flush=True)
        write_json(out / f"{stem}.json", results)      # (a run cut short keeps what it has)
    runner.GRAPH_PREFILL_ROWS = own_gp
    set_speculation(llm, spec)
    llm.engine.runner.graphs = base
    if args.replay and cuda:
        from triton.testing import do_bench
        results["replay_ms"] = {}
        for m in dict.fromkeys(modes):
            g = graphs[m]
            if g is None or not g.capture:
                continue
            g.fill_padding()
            results["replay_ms"][m] = {b: do_bench(lambda b=b: g.replay(b), warmup=25, rep=100)
                                       for b in g.sizes if b <= 16}
            print(f"graph replay ms by rows ({m}):", {b: round(v, 4) for b, v in results["replay_ms"][m].items()},
                  flush=True)
    if args.kernels and cuda:
        results["kernels_us"] = kernel_times(modes=[m for m in dict.fromkeys(modes) if m != "off"] or ("fma",))
    write_json(out / f"{stem}.json", results)
    lines = [f"model: {model} ({dtype}) on {results['device']}; k={args.k}, prompt_lookup_max={args.ngram}, "
             f"max_tokens={max_tokens}, repeats={args.repeats}", ""] + table(results)
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return results


if __name__ == "__main__":
    main()

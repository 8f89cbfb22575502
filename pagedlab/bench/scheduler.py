"""`python -m pagedlab.bench.scheduler`: what prefix caching costs the scheduler when nothing is
shared (the miss cost), on the CPU, with no model.

The scheduler alone (schedule() + accept() with dummy tokens, pagedlab.checks' harness) runs the
prefix benchmark's no-sharing workload shape: N requests of P unique random tokens (default 256 x
1,088, as `bench prefix`'s "offline" case), M new tokens each, S slots -- once with prefix
caching off and once on, alternating, R rounds; the median host CPU seconds (time.process_time)
per step of each. With
caching on and nothing to find, every prompt's full blocks are hashed once (BLAKE2b, 16 tokens a
block) and looked up, every finished block is registered, and freed blocks pass through the LRU.

Reported: the extra host time per step, per request and per prompt token on the step's critical
path (schedule() + accept(): what the device waits for), and apart from it the hashing that
Scheduler.hash_ahead does where the runner calls it, after a step's device work is queued and
before it is read back (on a GPU that time overlaps the step; on the CPU it adds to it).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time


def run_scheduler(prompts, new_tokens: int, slots: int, caching: bool, block_size: int = 16) -> dict:
    """Host seconds of schedule() + accept() over the whole workload; steps; cached tokens."""
    from pagedlab.request import Request
    from pagedlab.sampling import SamplingParams
    from pagedlab.scheduler import Scheduler
    longest = max(len(p) for p in prompts) + new_tokens
    blocks = slots * (longest // block_size + 2)
    sched = Scheduler(num_blocks=blocks, block_size=block_size, max_num_seqs=slots,
                      max_model_len=longest + 1, max_num_batched_tokens=8192, prefix_caching=caching)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        sched.add(Request(request_id=i, prompt_token_ids=list(p), params=params, seed=0))
    rng = random.Random(0)
    steps, window = 0, 0.0
    clock = time.process_time       # this process's CPU time: on a shared machine the wall clock
                                    # also counts the time other jobs hold the core
    t0 = clock()
    while sched.has_work():
        batch = sched.schedule()
        t1 = clock()
        sched.hash_ahead(batch)             # where the runner calls it: while the device runs the step
        window += clock() - t1
        sched.accept(batch, [rng.randrange(3, 128000) for _ in batch.sampled])
        sched.take_finished()
        steps += 1
    total = clock() - t0
    return dict(seconds=total - window, window_seconds=window, steps=steps,
                hits=getattr(sched.allocator, "prefix_hits", 0))


def burst(seed: int, requests: int = 512, vocab: int = 500):
    """The lab's burst: prompts of 63-512 random token ids (< vocab), 31-256 new tokens, ignore_eos."""
    from pagedlab.sampling import SamplingParams
    rng = random.Random(seed)

    def length(mean):
        return rng.randint(max(1, int(mean * 0.22)), int(mean * 1.78))
    jobs = [([rng.randrange(3, vocab) for _ in range(length(288))], length(144)) for _ in range(requests)]
    return [p for p, _ in jobs], [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in jobs]


def run_overlap_loop(seed: int = 0, requests: int = 512, slots: int = 256, caching: bool = True) -> dict:
    """The engine's overlap loop with no model (`--overlap-loop`): the lab's burst (prompts 63-512
    tokens, 31-256 new, ignore_eos) through schedule / advance / hash_ahead / settle / can_run_ahead
    in the order engine._step_overlap calls them, one step in flight, dummy tokens. Host CPU
    seconds per decode-only step: what the scheduler's bookkeeping adds to every step's host time
    (on the GPU the runner's launch comes on top)."""
    from pagedlab.request import Request
    from pagedlab.scheduler import Scheduler
    prompts, params = burst(seed, requests, vocab=128000)
    sched = Scheduler(num_blocks=slots * 40, block_size=16, max_num_seqs=slots, max_model_len=2048,
                      max_num_batched_tokens=8192, prefix_caching=caching)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        sched.add(Request(request_id=i, prompt_token_ids=prompt, params=p, seed=0))
    clock, unread = time.process_time, None
    decode_s, decode_steps, steps, done = 0.0, 0, 0, 0
    while sched.has_work():
        t = clock()
        if unread is not None and not sched.can_run_ahead(slots):
            sched.settle(*unread)
            unread = None
        batch = sched.schedule()
        if not batch.empty:
            sched.advance(batch)
            sched.hash_ahead(batch)
        if unread is not None:
            sched.settle(*unread)
        unread = None if batch.empty else (batch, [7] * len(batch.sampled))
        done += len(sched.take_finished())
        if not batch.empty:
            steps += 1
            if not batch.prefill:
                decode_s += clock() - t
                decode_steps += 1
    if unread is not None:
        sched.settle(*unread)
    done += len(sched.take_finished())
    assert done == requests and sched.allocator.num_used == 0     # every request out, every block back
    return dict(decode_us_per_step=decode_s / decode_steps * 1e6, decode_steps=decode_steps, steps=steps)


def tiny_checkpoint(positions: int):
    """random:tiny's weights with room for `positions` (the lab's burst runs past its own 256, and
    max_model_len may not pass a model's limit)."""
    from pagedlab.config import tiny_config
    from pagedlab.weights import load_checkpoint
    return load_checkpoint(tiny_config(max_position_embeddings=positions), show_progress=False)


def run_engine_host(passes: int = 3) -> dict:
    """`--engine-host`: the whole engine's host path with no model -- LLM.generate of the burst on a
    tiny random Llama whose forward returns constant logits at once (the CUDA-graph code path run
    eagerly, as on a CPU): scheduler, runner inputs, overlap loop, hand-out, output processor.
    This process's CPU seconds per pass and the decode-only steps' phases."""
    import torch
    from pagedlab import LLM
    llm = LLM(checkpoint=tiny_checkpoint(1024), max_num_seqs=256, max_model_len=1024, num_blocks=256 * 40,
              show_progress=False,
              cuda_graphs="eager")
    engine = llm.core.engine
    vocab = engine.runner.model.config.vocab_size

    def no_model(input_ids, positions, kv_cache, meta, logits_indices=None, greedy=False, embedded=None,
                 tokens_out=None):
        n = len(logits_indices) if logits_indices is not None else input_ids.shape[0]
        logits = torch.zeros(n, vocab)
        logits[:, 7] = 1.0
        if not greedy:
            return logits
        tokens = torch.full((n,), 7, dtype=torch.int64)
        if tokens_out is not None:
            tokens = tokens_out.copy_(tokens)
        return logits, tokens
    engine.runner.model.forward = no_model
    prompts, params = burst(0)
    llm.generate(prompts[:16], params[:16])
    runs = []
    for k in range(passes):
        prompts, params = burst(k + 1)
        before, steps = dict(engine.timing), engine.timer.totals["steps"]
        t = time.process_time()
        outs = llm.generate(prompts, params)
        cpu = time.process_time() - t
        spent = {key: v - before.get(key, 0.0) for key, v in engine.timing.items()}
        runs.append(dict(cpu_s=cpu, steps=engine.timer.totals["steps"] - steps,
                         tokens=sum(len(o.token_ids) for o in outs),
                         decode_phases_s={key[7:]: spent[key] for key in spent if key.startswith("decode_")}))
    llm.close()
    return dict(passes=runs, cpu_s_median=statistics.median(r["cpu_s"] for r in runs))


def host_profile(model: str = "random:llama-3.2-1b", top: int = 45, requests: int = 512) -> str:
    """`--profile MODEL`: where the host's time goes in a burst through LLM.generate on a real
    engine (a GPU: the model on the device; a CPU: its forward too) -- a warm pass, then one pass
    under cProfile, each pass a burst of its own (no prefix-cache hits between passes). Returns the
    profile's top functions by own and by cumulative time."""
    import cProfile
    import io
    import pstats

    from pagedlab import LLM
    kw = dict(checkpoint=tiny_checkpoint(2048)) if model == "random:tiny" else dict(model=model)
    llm = LLM(max_num_seqs=256, max_model_len=2048, show_progress=False, **kw)
    vocab = min(32000, llm.core.engine.runner.model.config.vocab_size)
    llm.generate(*burst(0, requests, vocab))
    prompts, params = burst(1, requests, vocab)
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    outs = llm.generate(prompts, params)
    prof.disable()
    wall = time.perf_counter() - t
    llm.close()
    text = io.StringIO()
    text.write(f"{model}: the profiled pass {sum(len(o.token_ids) for o in outs) / wall:.0f} tokens/s "
               f"(cProfile slows the host)\n")
    for key in ("tottime", "cumtime"):
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(top)
    return text.getvalue()


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m pagedlab.bench.scheduler", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=1088, help="prompt tokens per request (all unique)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    ap.add_argument("--overlap-loop", action="store_true",
                    help="instead: the host bookkeeping per decode-only step of the overlap loop on the lab's "
                         "512-request burst (256 slots, prefix caching on), median of --rounds runs")
    ap.add_argument("--engine-host", action="store_true",
                    help="instead: the whole engine's host CPU per pass of the burst through LLM.generate with "
                         "the model stubbed out (constant logits), --rounds passes")
    ap.add_argument("--profile", metavar="MODEL", default=None,
                    help="instead: cProfile of one burst through LLM.generate with this model (on the GPU: "
                         "random:llama-3.2-1b), after a warm pass -- where the host's time goes")
    args = ap.parse_args(argv)
    if args.profile:
        print(host_profile(args.profile))
        return None
    if args.engine_host:
        out = run_engine_host(args.rounds)
        for r in out["passes"]:
            ph = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in r["decode_phases_s"].items())
            print(f"engine host, no model: {r['steps']} steps, {r['tokens']} tokens, {r['cpu_s']:.3f} s CPU; "
                  f"decode-only steps' phases: {ph}")
        print(f"median {out['cpu_s_median']:.3f} s CPU per pass")
        return out
    if args.overlap_loop:
        runs = [run_overlap_loop(seed=k) for k in range(args.rounds)]
        out = dict(decode_us_per_step=statistics.median(r["decode_us_per_step"] for r in runs),
                   runs_us=[round(r["decode_us_per_step"], 1) for r in runs],
                   decode_steps=runs[0]["decode_steps"], steps=runs[0]["steps"])
        print(f"overlap loop, 512 requests, 256 slots: scheduler host time per decode-only step "
              f"{out['decode_us_per_step']:.1f} us (median of {args.rounds}: {out['runs_us']}); "
              f"{out['decode_steps']} decode-only steps of {out['steps']}")
        return out
    g = random.Random(1)
    prompts = [[g.randrange(3, 128000) for _ in range(args.prompt)] for _ in range(args.requests)]
    res = {False: [], True: []}
    for _ in range(args.rounds):
        for caching in (False, True):
            res[caching].append(run_scheduler(prompts, args.new_tokens, args.slots, caching))
    off = statistics.median(r["seconds"] for r in res[False])
    on = statistics.median(r["seconds"] for r in res[True])
    window = statistics.median(r["window_seconds"] for r in res[True])
    steps = res[True][0]["steps"]
    assert steps == res[False][0]["steps"] and all(r["hits"] == 0 for r in res[True])
    out = dict(requests=args.requests, prompt=args.prompt, new_tokens=args.new_tokens, slots=args.slots,
               rounds=args.rounds, steps=steps, host_s_off=off, host_s_on=on,
               host_us_per_step_off=off / steps * 1e6, host_us_per_step_on=on / steps * 1e6,
               extra_us_per_step=(on - off) / steps * 1e6, extra_us_per_request=(on - off) / args.requests * 1e6,
               extra_us_per_prompt_token=(on - off) / (args.requests * args.prompt) * 1e6,
               window_us_per_step=window / steps * 1e6,
               window_us_per_prompt_token=window / (args.requests * args.prompt) * 1e6)
    from pagedlab.bench.common import metadata
    out.update(metadata("python -m pagedlab.bench.scheduler", argv))
    print(f"{args.requests} requests x {args.prompt} unique prompt tokens, {args.new_tokens} new, "
          f"{args.slots} slots: {steps} steps")
    print(f"scheduler host time per step: caching off {out['host_us_per_step_off']:.1f} us, on "
          f"{out['host_us_per_step_on']:.1f} us (+{out['extra_us_per_step']:.1f} us)")
    print(f"= +{out['extra_us_per_request']:.0f} us per request, +{out['extra_us_per_prompt_token']:.2f} us "
          f"per prompt token on the step's critical path")
    print(f"hashing while the device runs the step (hash_ahead): {out['window_us_per_step']:.1f} us per step, "
          f"{out['window_us_per_prompt_token']:.2f} us per prompt token")
    if args.out:
        from pagedlab.bench.common import write_json
        write_json(args.out, out)
    return out


if __name__ == "__main__":
    main()

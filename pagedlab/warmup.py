"""Compile at load: run the engine's step shapes once, so that no request waits for a compiler.

Triton compiles a kernel the first time it sees a new combination of its compile-time parameters
(tile sizes, a prefill tier, an integer argument that is 1 or a multiple of 16, ...). Without a
warm-up those compiles land in the first requests a process serves: measured on an H200 the
first offline pass of a fresh process ran at 33,868 tokens/s against 41,608 warm.
CUDA graphs already compile the decode-only steps at load (cuda_graph.py); what is left is every
step with prompt tokens in it. `warm_up(engine)` runs a few tiny requests through the engine
itself -- the very code path that serves -- in waves that produce each kind of step:

  * prefill-only steps of a short and a long prompt, with an odd token count and a multiple of
    16 (Triton specializes integer arguments on divisibility by 16);
  * mixed steps, a prompt arriving while another request decodes (prefill + decode in one pass);
  * a prompt whose first blocks are cached (prefix caching: queries after cached context);
  * the decode steps in between (CUDA-graph replays, already captured);
  * and, called directly, split_kv decode attention at every split count auto can choose (powers
    of two, decode_attention.choose_num_splits): the decode part of a mixed step is eager, and
    its split count follows the batch size and the context, so the waves cannot meet them all;
  * and, called directly, prefill attention at one length in each of its launch tiers
    (prefill_attention.PREFILL_CONFIG: a tier per range of prompt lengths, each its own kernel).

Triton keeps what it compiled on disk (TRITON_CACHE_DIR, default ~/.triton/cache): a second
process finds the kernels there and its warm-up only loads them. The engine is left as it was:
request numbering, the seed stream, the prefix cache and its counters, the step timings.
Only on CUDA (on the CPU nothing is compiled: the torch path runs, or the interpreter).
"""
from __future__ import annotations

import time

import torch

from .sampling import SamplingParams


def warmup_waves(max_model_len: int, max_num_seqs: int, budget: int, vocab: int) -> list[list[tuple]]:
    """Waves of (prompt length, new tokens): each wave's requests are added one step apart, so
    the later ones prefill while the earlier ones decode (mixed steps)."""
    room = max_model_len - 4                               # prompt + a few new tokens must fit
    long = min(room, budget, 1500)
    waves = [[(17, 3)], [(32, 3)], [(long, 2)],            # short / long tier, odd / multiple of 16
             [(20, 8), (31, 4), (100, 3)],                 # prompts arriving while others decode
             [(24, 6), (long, 2)]]                         # a long prompt beside a decode
    out = []
    for wave in waves:
        wave = [(max(1, min(p, room)), n) for p, n in wave][:max(1, max_num_seqs)]
        if wave not in out:
            out.append(wave)
    return out


def warm_up(engine, show_progress: bool = True, force: bool = False) -> dict:
    """Run the warm-up waves through `engine` (see the module docstring). Returns what it did:
    {"seconds", "steps", "requests"}; {} where there is nothing to compile (not CUDA, or a trace
    is being recorded: its steps are the user's to see). force: run it anyway (the CPU tests)."""
    if engine.trace is not None or (engine.device.type != "cuda" and not force):
        return {}
    t0 = time.perf_counter()
    sched = engine.scheduler
    alloc = sched.allocator
    saved = (engine._next_id, getattr(alloc, "prefix_queries", None), getattr(alloc, "prefix_hits", None))
    vocab = engine.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    waves = warmup_waves(engine.max_model_len, engine.config.max_num_seqs,
                         engine.config.max_num_batched_tokens, vocab)
    shared = None                                          # one prompt sent twice: a prefix-cache hit
    bar = _progress(len(waves) + 2, show_progress)
    splits, tiers = [], []
    steps, ids = 0, []
    try:
        for wave in waves + [[(0, 2)]]:
            for i, (p_len, new) in enumerate(wave):
                if p_len == 0:                              # the last wave: the first wave's prompt again
                    prompt = shared
                else:
                    prompt = torch.randint(3, vocab, (p_len,), generator=g).tolist()
                    shared = shared or prompt
                params = SamplingParams(max_new_tokens=new, ignore_eos=True, seed=0)
                ids.append(engine.add_checked(prompt, None, params))
                if i < len(wave) - 1:
                    engine.step(into=[])                   # the next one arrives while this one runs
                    steps += 1
            while engine.has_work():
                engine.step(into=[])
                steps += 1
            bar.update(1)
        splits = compile_decode_splits(engine)
        tiers = compile_prefill_tiers(engine)
        bar.update(1)
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
    finally:
        bar.close()
        for rid in ids:                                    # (an interrupted warm-up leaves nothing)
            engine.abort(rid)
        while engine.has_work():
            engine.step(into=[])
        engine._next_id = saved[0]
        if hasattr(alloc, "reset_prefix_cache"):
            alloc.reset_prefix_cache()
        if saved[1] is not None:
            alloc.prefix_queries, alloc.prefix_hits = saved[1], saved[2]
        engine.reset_timing()
    return dict(seconds=time.perf_counter() - t0, steps=steps, requests=len(ids), decode_splits=splits,
                prefill_tiers=tiers)


def _one_token(engine):
    """A compile probe's inputs: one query token over layer 0's pages, whose table row points at
    the null block (q, k_cache, v_cache, block_table, seq_lens)."""
    kv, model = engine.kv_cache, engine.model
    k, v = kv.k[0], kv.v[0]
    hq = getattr(model, "num_heads", model.config.num_heads)
    q = torch.randn(1, hq, k.shape[3], dtype=k.dtype, device=k.device)
    table = torch.full((1, 4), kv.null_block, dtype=torch.int32, device=k.device)
    return q, k, v, table, torch.ones(1, dtype=torch.int32, device=k.device)


def compile_decode_splits(engine) -> list[int]:
    """One tiny split_kv decode launch per split count auto can choose, through the model's own
    decode kernel (its variant, launch config and PDL mode): each compiles its kernel variant.
    Returns the split counts launched ([] when the model's decode attention is not Triton's auto
    or split_kv, or is a learner's kernel plugged in with LLM(decode_kernel=))."""
    from .kernels.decode_attention import MAX_SPLITS, MIN_SPLIT_LEN
    model = engine.model
    kernels = model.kernels
    if getattr(kernels, "backend", None) != "triton" or getattr(kernels, "decode_plugged", False) or \
            kernels.options.get("decode_variant") not in ("auto", "split_kv"):
        return []
    q, k, v, table, seq_lens = _one_token(engine)
    d = k.shape[3]
    done, n = [], 2
    while n <= MAX_SPLITS:
        kernels.decode_attention(q, k, v, table, seq_lens, d ** -0.5, n * MIN_SPLIT_LEN, num_splits=n)
        done.append(n)
        n *= 2
    return done


def compile_prefill_tiers(engine) -> list[int]:
    """One tiny prefill attention launch per launch tier of the model's prefill kernel (its launch
    config; prefill_attention.prefill_tier_lengths): the waves' prompts meet only the tiers of
    their own lengths. The launch holds one query token; the longest-query-run hint picks the
    tier (programs past the token exit at once). Returns the lengths launched ([] unless the
    model's attention is Triton's)."""
    from .kernels.prefill_attention import prefill_tier_lengths
    model = engine.model
    kernels = model.kernels
    if getattr(kernels, "backend", None) != "triton":
        return []
    q, k, v, table, seq_lens = _one_token(engine)
    d = k.shape[3]
    cu = torch.tensor([0, 1], dtype=torch.int32, device=k.device)
    lengths = prefill_tier_lengths(kernels.options["prefill_config"])
    for n in lengths:
        kernels.prefill_attention(q, k, v, table, cu, seq_lens, d ** -0.5, n)
    return lengths


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


def _progress(total: int, show: bool):
    if not show:
        return _NoBar()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc="compiling kernels (cached on disk for the next process)",
                unit="wave", leave=False)

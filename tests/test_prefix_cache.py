"""Prefix caching (prefix_cache.py, the ref-counted allocator, admission and registration in the
scheduler), on the tiny random model in fp32 on CPU:

* greedy outputs identical with caching on and off, under randomized request streams whose
  prompts share random prefixes (lengths one short of, at, and one past block boundaries, whole
  prompts repeated, second turns that resend prompt + answer), with chunked prefill, preemption,
  both policies, and the overlap loop (graph path run eagerly);
* after EVERY step: each block's reference count is the number of running requests holding it, no
  block is both free and held, a shared block lies wholly inside every holder's computed part (so
  nobody writes it), and every key in the map names a block whose K/V were written -- by the
  runner, at those very positions -- from exactly that key's prefix (checked against a record of
  every write the runner made, and against the hash chain recomputed from the tokens);
* hits really happen (and never with caching off); abort and interrupts anywhere leak no block;
* unit tests of the hash chain and of the allocator's LRU order; the trace and the drawings.
"""
import os
import random
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from helpers import interrupts_in_finalizers_dropped, tiny_llm  # noqa: E402
from pagedlab import SamplingParams, viz  # noqa: E402
from pagedlab.config import ConfigError, EngineConfig  # noqa: E402
from pagedlab.kv_cache import BlockAllocator, OutOfBlocks  # noqa: E402
from pagedlab.prefix_cache import block_key, hash_chain  # noqa: E402
from pagedlab.request import RequestStatus  # noqa: E402

PAGEDLAB = os.path.dirname(__import__("pagedlab").__file__)
VOCAB = 512


# ----------------------------------------------------------------------------- units
def test_hash_chain():
    rnd = random.Random(0)
    for bs in (1, 3, 16):
        a = [rnd.randrange(VOCAB) for _ in range(rnd.randint(4 * bs, 9 * bs))]
        keys = hash_chain(a, bs)
        assert len(keys) == len(a) // bs and len(set(keys)) == len(keys)
        assert hash_chain(a[:len(a) - bs - 1], bs) == keys[:(len(a) - bs - 1) // bs]   # prefixes agree
        j = rnd.randrange(len(keys))                        # change one token of block j
        b = list(a)
        pos = j * bs + rnd.randrange(bs)
        b[pos] = (b[pos] + 1) % VOCAB
        kb = hash_chain(b, bs)
        assert kb[:j] == keys[:j]
        assert all(x != y for x, y in zip(kb[j:], keys[j:])), "a changed token must change every later key"
        # the same block content after a different parent gets another key
        assert block_key(keys[0], a[:bs]) != block_key(None, a[:bs]) == keys[0]
        for i in range(1, len(keys)):
            assert keys[i] == block_key(keys[i - 1], a[i * bs:(i + 1) * bs])


def test_hash_is_stable_across_processes():
    """Python's hash() is salted per process; the keys must not be."""
    tokens = [random.Random(1).randrange(VOCAB) for _ in range(40)]
    code = ("import importlib.util, sys; s = importlib.util.spec_from_file_location('pc', sys.argv[1]); "
            "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); "
            f"print([k.hex() for k in m.hash_chain({tokens}, 8)])")
    outs = {subprocess.run([sys.executable, "-c", code, os.path.join(PAGEDLAB, "prefix_cache.py")],
                           env=dict(os.environ, PYTHONHASHSEED=seed), capture_output=True, text=True,
                           check=True).stdout for seed in ("1", "2")}
    assert outs == {str([k.hex() for k in hash_chain(tokens, 8)]) + "\n"}


def test_lru_eviction_order_small():
    alloc = BlockAllocator(4)
    blocks = alloc.allocate("a", 4)
    for b in blocks[:3]:
        assert alloc.prefix_cache.register(b, bytes([b]) * 16)
    alloc.free([blocks[2], blocks[0], blocks[1], blocks[3]])
    assert list(alloc.free_blocks) == [blocks[3]] and list(alloc.cached) == [blocks[2], blocks[0], blocks[1]]
    assert alloc.num_free == 4 and alloc.num_used == 0 and alloc.num_cached == 3
    # truly free blocks first, then the least recently used cached one, whose key is dropped
    assert alloc.allocate("b", 2) == [blocks[3], blocks[2]]
    assert blocks[2] not in alloc.prefix_cache.key_of and bytes([blocks[2]]) * 16 not in alloc.prefix_cache.block_of
    # a hit takes a cached block out of the LRU; released again, it is the most recently used
    assert alloc.allocate("c", 0, shared=[blocks[0]]) == [blocks[0]]
    assert list(alloc.cached) == [blocks[1]]
    alloc.free([blocks[0]])
    assert list(alloc.cached) == [blocks[1], blocks[0]]
    assert alloc.allocate("d", 1) == [blocks[1]]
    with pytest.raises(OutOfBlocks):
        alloc.allocate("e", 1, shared=[blocks[0]])       # the hit itself takes the last cached block
    assert alloc.ref_count == {blocks[3]: 1, blocks[2]: 1, blocks[1]: 1}, "a refused allocate changes nothing"


def test_allocator_against_a_model():
    """Random allocate / share / register / free against a list-based model of the allocator."""
    rnd = random.Random(3)
    n = 23
    alloc = BlockAllocator(n)
    free, lru, refs, names = list(range(n)), [], {}, {}      # the model
    held = []                                                # lists of blocks, one per holder
    for step in range(3000):
        op = rnd.random()
        if op < 0.35:
            k = rnd.randint(0, 4)
            named = sorted(names)                  # (a named block is held or cached)
            shared = rnd.sample(named, min(rnd.randint(0, 2), len(named)))
            revived = sum(b in lru for b in shared)
            if k + revived > len(free) + len(lru):
                with pytest.raises(OutOfBlocks):
                    alloc.allocate(step, k, shared=shared)
                continue
            got = alloc.allocate(step, k, shared=shared)
            want = list(shared)
            for b in shared:
                if b in lru:
                    lru.remove(b)
                refs[b] = refs.get(b, 0) + 1
            for _ in range(k):
                b = free.pop(0) if free else lru.pop(0)
                names.pop(b, None)
                refs[b] = 1
                want.append(b)
            assert got == want
            held.append(got)
        elif op < 0.5 and refs:
            b = rnd.choice(sorted(refs))
            key = rnd.randbytes(16)
            if b not in names:
                assert alloc.prefix_cache.register(b, key)
                names[b] = key
            else:
                assert not alloc.prefix_cache.register(b, key)
        elif held:
            blocks = held.pop(rnd.randrange(len(held)))
            alloc.free(blocks)
            for b in blocks:
                refs[b] -= 1
                if not refs[b]:
                    del refs[b]
                    (lru if b in names else free).append(b)
        assert list(alloc.free_blocks) == free and list(alloc.cached) == lru and alloc.ref_count == refs
        assert alloc.prefix_cache.key_of == names
        assert {b: k for k, b in alloc.prefix_cache.block_of.items()} == names
    with pytest.raises(RuntimeError):
        alloc.free([alloc.free_blocks[0] if alloc.free_blocks else next(iter(alloc.cached))])


def test_on_by_default_at_every_door_and_off_on_request():
    """LLM / EngineConfig: on unless turned off; a plugged allocator (no sharing API wrapped in
    PluggedAllocator) turns it off unless asked for; vLLM's name does the same."""
    from pagedlab.plugged_allocator import PluggedAllocator
    assert tiny_llm().engine.scheduler.prefix_caching is True
    assert tiny_llm(prefix_caching=False).engine.scheduler.prefix_caching is False
    assert tiny_llm(enable_prefix_caching=False).engine.scheduler.prefix_caching is False
    plugged = tiny_llm(allocator=BlockAllocator)
    assert plugged.engine.scheduler.prefix_caching is False
    assert isinstance(plugged.engine.scheduler.allocator, PluggedAllocator)
    asked = tiny_llm(allocator=BlockAllocator, prefix_caching=True).engine.scheduler
    assert asked.prefix_caching is True and isinstance(asked.allocator, BlockAllocator)
    # with nothing shared, caching on and off give the same tokens and every block back
    prompts = [[random.Random(i).randrange(3, VOCAB) for _ in range(9 + 5 * i)] for i in range(4)]
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
    on, off = tiny_llm(block_size=4), tiny_llm(block_size=4, prefix_caching=False)
    a, b = on.generate(prompts, sp), off.generate(prompts, sp)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(o.num_cached_tokens == 0 for o in a)
    assert len(on.engine.scheduler.allocator.prefix_cache) > 0             # named, for later requests
    assert on.engine.scheduler.allocator.num_free == on.engine.scheduler.allocator.num_blocks


def test_config_validates_prefix_caching():
    assert EngineConfig().prefix_caching is True                 # on by default, as in vLLM
    assert EngineConfig(prefix_caching=False).prefix_caching is False
    for bad in ("yes", 1, None):
        with pytest.raises(ConfigError, match="prefix_caching"):
            EngineConfig(prefix_caching=bad)


# ----------------------------------------------------------------------------- what the runner wrote
class WriteLog:
    """Every K/V write the runner makes: physical block -> offset -> (request, position). Recorded
    after each launch returns (on CPU the forward has then run), before the batch advances."""

    def __init__(self, engine):
        self.bs = engine.scheduler.block_size
        self.at: dict[int, dict[int, tuple]] = {}
        runner, launch = engine.runner, engine.runner.launch

        def logged(batch, *a, **kw):
            out = launch(batch, *a, **kw)
            for r in batch.prefill:
                self._wrote(r, range(r.num_computed, r.num_computed + r.num_scheduled))
            for r in batch.decode:
                self._wrote(r, [r.num_tokens - 1])
            return out

        runner.launch = logged

    def _wrote(self, r, positions):
        for p in positions:
            self.at.setdefault(r.blocks[p // self.bs], {})[p % self.bs] = (r, p)

    def tokens(self, block):
        """(position, token) at each offset of the block, token None where unknown."""
        out = []
        for o in range(self.bs):
            r, p = self.at.get(block, {}).get(o, (None, None))
            ids = r.all_token_ids if r is not None else []
            tok = ids[p] if p is not None and p < len(ids) else None
            out.append((p, tok))
        return out


def check_prefix_invariants(engine, log: WriteLog | None, everyone):
    s = engine.scheduler
    alloc, cache, bs = s.allocator, s.allocator.prefix_cache, s.block_size
    holders = {}
    for r in s.admitted:
        assert len(set(r.blocks)) == len(r.blocks), "a request holds a block twice"
        for j, b in enumerate(r.blocks):
            holders.setdefault(b, []).append((r, j))
    assert alloc.ref_count == {b: len(h) for b, h in holders.items()}, "ref count != holders"
    assert set(alloc.owner) == set(alloc.ref_count)
    free, cached = list(alloc.free_blocks), list(alloc.cached)
    assert len(set(free)) == len(free)
    assert not (set(free) & set(cached)) and not (set(free) | set(cached)) & set(holders), "free and held"
    assert len(free) + len(cached) + len(holders) == alloc.num_blocks, "a block leaked"
    assert set(cached) <= set(cache.key_of), "a cached block without a key"
    assert not set(free) & set(cache.key_of), "a free block still named"
    assert {b: k for k, b in cache.block_of.items()} == cache.key_of
    # the device block table (plus edits not yet written, after an interrupted step)
    table = engine.runner.block_table.table.tolist()
    for slot, i, b in s.table_edits:
        table[slot][i] = b
    for r in s.admitted:
        assert s.slots[r.slot] is r and table[r.slot][:len(r.blocks)] == r.blocks
    # nobody writes a shared block or a named one: it lies inside each holder's computed tokens
    for b, hs in holders.items():
        if len(hs) > 1 or b in cache.key_of:
            for r, j in hs:
                assert (j + 1) * bs <= r.num_computed, f"block {b} shared/named but not computed by {r.request_id}"
        if b in cache.key_of:
            for r, j in hs:
                assert len(r.block_keys) > j and r.block_keys[j] == cache.key_of[b], "a held block named wrongly"
    # every key names a block written from exactly that prefix, at those positions
    prefix_of = {}
    for r in everyone:
        ids = r.all_token_ids
        for j, k in enumerate(r.block_keys):
            assert len(ids) >= (j + 1) * bs and min(ids[:(j + 1) * bs]) >= 0
            p = ids[:(j + 1) * bs]
            assert prefix_of.setdefault(k, p) == p, "one key, two prefixes"
    for k, b in cache.block_of.items():
        p = prefix_of[k]
        assert hash_chain(p, bs)[-1] == k, "the key is not the chain of its prefix"
        if log is not None:
            start = len(p) - bs
            assert log.tokens(b) == [(start + o, p[start + o]) for o in range(bs)], \
                f"block {b} does not hold what its key says"


def shared_prefix_prompts(rnd, n, bs):
    """Prompts that share prefixes of random lengths, many of them at block boundaries -1, 0, +1,
    some repeated whole, some a prefix of another."""
    roots = [[rnd.randrange(3, VOCAB) for _ in range(rnd.randint(bs + 2, 5 * bs + 3))] for _ in range(3)]
    prompts = []
    for _ in range(n):
        if prompts and rnd.random() < 0.15:
            prompts.append(list(rnd.choice(prompts)))           # the same prompt again (full hit)
            continue
        root = rnd.choice(roots)
        k = rnd.randint(1, len(root) // bs)
        cut = max(1, min(len(root), rnd.choice([k * bs - 1, k * bs, k * bs + 1, rnd.randint(1, len(root))])))
        tail = [] if rnd.random() < 0.3 else [rnd.randrange(3, VOCAB) for _ in range(rnd.randint(1, 2 * bs))]
        prompts.append(root[:cut] + tail)
    return prompts


def drive(llm, prompts, params, arrival, log=None, abort_at=None, step=None, check=True, everyone=None):
    """Feed prompts at their arrival steps, check the invariants after every step; abort_at:
    prompt index -> step at which it is aborted. Returns prompt index -> finished Request."""
    eng, step = llm.engine, step or llm.engine.step
    order = sorted(range(len(prompts)), key=lambda i: arrival[i])
    ids, done, n, k = {}, {}, 0, 0
    everyone = [] if everyone is None else everyone         # every request added (for the key check)
    abort_at = dict(abort_at or {})
    while k < len(order) or eng.has_work():
        while k < len(order) and arrival[order[k]] <= n:
            rid = eng.add_request(prompts[order[k]], params[order[k]])
            ids[rid] = order[k]
            everyone.append(eng.scheduler.requests[rid])
            k += 1
        for rid, i in list(ids.items()):
            if abort_at.get(i) == n and eng.abort(rid):
                del abort_at[i]
        for r in step():
            assert r.request_id not in done, "a request handed out twice"
            done[r.request_id] = r
        if check:
            check_prefix_invariants(eng, log, everyone)
        n += 1
    s = eng.scheduler
    assert len(done) == len(prompts) and s.allocator.num_used == 0 and not s.requests, "a leak"
    assert s.allocator.num_free == s.allocator.num_blocks
    for r in done.values():
        assert r.status is RequestStatus.FINISHED and min(r.output_token_ids, default=0) >= 0
    return {ids[rid]: r for rid, r in done.items()}


def llm_for(caching, overlap=False, **kw):
    kw = dict(max_num_seqs=4, block_size=4, num_blocks=96, dtype="float32") | kw
    if overlap:
        kw["cuda_graphs"] = "eager"
    llm = tiny_llm(prefix_caching=caching, **kw)
    assert llm.engine.overlap == overlap
    return llm


CASES = {      # name: engine settings
    "roomy": dict(),
    "chunked+preempt": dict(num_blocks=22, max_num_batched_tokens=9, max_num_seqs=5),
    "static": dict(policy="static", block_size=8, num_blocks=48, max_num_batched_tokens=20),
    "overlap": dict(overlap=True, num_blocks=40),
    "overlap+preempt": dict(overlap=True, num_blocks=16, max_num_seqs=5),
    "bs1": dict(block_size=1, num_blocks=300, max_num_batched_tokens=7),
    "bs7": dict(block_size=7, num_blocks=30, max_num_seqs=3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_same_outputs_with_and_without_caching(case):
    settings = CASES[case]
    seed = list(CASES).index(case)
    rnd = random.Random(seed)
    bs = settings.get("block_size", 4)
    prompts = shared_prefix_prompts(rnd, 16, bs)
    params = [SamplingParams(max_new_tokens=rnd.randint(1, 3 * bs + 2), ignore_eos=rnd.random() < 0.7)
              for _ in prompts]
    arrival = [rnd.randint(0, 25) for _ in prompts]
    results = {}
    for caching in (False, True):
        llm = llm_for(caching, **settings)
        log, everyone = (WriteLog(llm.engine) if caching else None), []
        first = drive(llm, prompts, params, arrival, log, everyone=everyone)
        # a second turn: the prompt + the answer of the first (as the caching-off run gave it) +
        # a new question, on the same engine (its cache still warm)
        if caching is False:
            turn2 = [list(prompts[i]) + first[i].output_token_ids
                     + [rnd.randrange(3, VOCAB) for _ in range(rnd.randint(1, bs + 1))] for i in range(6)]
            turn2 = [p[:llm.engine.max_model_len - 2] for p in turn2]
        second = drive(llm, turn2, params[:6], [0, 0, 1, 2, 2, 5], log, everyone=everyone)
        results[caching] = (first, second, llm.engine.scheduler.allocator)
        if caching:
            assert llm.engine.num_overlapped > 0 if settings.get("overlap") else True
            if "preempt" in case:
                assert any(r.num_preemptions for r in first.values()), "no preemption: the case checks less"
    for a, b in zip(results[False][:2], results[True][:2]):
        assert {i: r.output_token_ids for i, r in a.items()} == {i: r.output_token_ids for i, r in b.items()}
        assert [r.finish_reason for r in a.values()] == [r.finish_reason for r in b.values()]
    off, on = results[False][2], results[True][2]
    assert off.prefix_queries == off.prefix_hits == 0 and off.num_cached == 0
    assert all(r.num_cached_tokens == 0 for part in results[False][:2] for r in part.values())
    cached = [r.num_cached_tokens for part in results[True][:2] for r in part.values()]
    assert sum(cached) > 0 and on.prefix_hits > 0 and 0 < on.hit_rate < 1
    assert all(c % bs == 0 and c < len(r.prompt_token_ids) + 1
               for part in results[True][:2] for r, c in ((r, r.num_cached_tokens) for r in part.values()))
    if case == "roomy":      # nothing evicted: a repeated prompt and every second turn hit
        first, second = results[True][:2]
        for i, r in second.items():
            assert r.num_cached_tokens >= (len(prompts[i]) // bs - 1) * bs
        seen = set()
        for i in sorted(first, key=lambda i: arrival[i]):
            if tuple(prompts[i]) in seen and len(prompts[i]) > bs:
                assert first[i].num_cached_tokens > 0
            seen.add(tuple(prompts[i]))


def test_full_hit_recomputes_the_last_block():
    """A prompt that ends at a block boundary and is cached whole: its last block is computed
    again into a fresh block (the shared one is never written), and the output is unchanged."""
    bs = 4
    prompt = [random.Random(5).randrange(3, VOCAB) for _ in range(3 * bs)]
    sp = SamplingParams(max_new_tokens=5, ignore_eos=True)
    want = llm_for(False).generate([prompt], sp)[0].token_ids
    llm = llm_for(True)
    eng = llm.engine
    a = eng.add_request(prompt, SamplingParams(max_new_tokens=30, ignore_eos=True))
    for _ in range(3):
        eng.step()                          # a is decoding, its 3 prompt blocks are registered
    b = eng.add_request(prompt, sp)
    eng.step()
    s = eng.scheduler
    ra, rb = s.requests[a], s.requests[b]
    assert rb.num_cached_tokens == 2 * bs
    assert rb.blocks[:2] == ra.blocks[:2] and rb.blocks[2] != ra.blocks[2]
    assert s.allocator.ref_count[ra.blocks[0]] == 2 and s.allocator.ref_count[ra.blocks[2]] == 1
    done = {r.request_id: r for r in eng.run()}
    assert done[b].output_token_ids == want


def test_preempted_blocks_stay_cached_and_are_found_again():
    bs = 4
    rnd = random.Random(8)
    prompts = [[rnd.randrange(3, VOCAB) for _ in range(6 * bs + 1)] for _ in range(3)]
    sp = SamplingParams(max_new_tokens=3 * bs, ignore_eos=True)
    want = [o.token_ids for o in llm_for(False, num_blocks=64).generate(prompts, sp)]
    llm = llm_for(True, num_blocks=24, max_num_seqs=3)
    got = drive(llm, prompts, [sp] * 3, [0, 0, 0], WriteLog(llm.engine))
    assert [got[i].output_token_ids for i in range(3)] == want
    back = [r for r in got.values() if r.num_preemptions]
    assert back, "no request was preempted"
    alloc = llm.engine.scheduler.allocator
    assert alloc.prefix_hits > sum(r.num_cached_tokens for r in got.values()), \
        "a preempted request should find its own blocks again when it returns"


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_shared_requests(overlap):
    rnd = random.Random(11 + overlap)
    bs = 4
    prompts = shared_prefix_prompts(rnd, 14, bs)
    params = [SamplingParams(max_new_tokens=rnd.randint(2, 12), ignore_eos=True) for _ in prompts]
    arrival = [rnd.randint(0, 8) for _ in prompts]
    want = drive(llm_for(False, overlap, num_blocks=30), prompts, params, arrival, check=False)
    victims = rnd.sample(range(len(prompts)), 6)
    abort_at = {v: arrival[v] + rnd.randint(0, 6) for v in victims}
    llm = llm_for(True, overlap, num_blocks=30)
    got = drive(llm, prompts, params, arrival, WriteLog(llm.engine), abort_at=abort_at)
    aborted = [i for i, r in got.items() if r.finish_reason == "abort"]
    assert aborted and set(aborted) <= set(victims)
    for i, r in got.items():
        if i not in aborted:
            assert r.output_token_ids == want[i].output_token_ids
    assert llm.engine.scheduler.allocator.prefix_hits > 0


# ----------------------------------------------------------------------------- interrupts
ENGINE_FILES = {os.path.join(PAGEDLAB, f) for f in (
    "engine.py", "scheduler.py", "runner.py", "kv_cache.py", "prefix_cache.py", "cuda_graph.py",
    "request.py", "model.py", "sampling.py", "llm.py")}


class Interrupter:
    """As tests/test_robustness.py: a KeyboardInterrupt at the `at`-th call of an engine function
    (prefix_cache.py included)."""

    def __init__(self):
        self.calls, self.at, self.names = 0, None, set()

    def __call__(self, frame, event, arg):
        if event == "call" and frame.f_code.co_filename in ENGINE_FILES:
            self.calls += 1
            if self.calls == self.at:
                self.at = None
                self.names.add(frame.f_code.co_name)
                raise KeyboardInterrupt(frame.f_code.co_name)
        return None


@pytest.mark.parametrize("overlap,mode,seed", [(False, "every", 0), (True, "every", 1),
                                               (False, "random", 2), (True, "random", 3)])
def test_interrupts_leak_nothing(overlap, mode, seed):
    rnd = random.Random(seed)
    bs = 4
    n = 7 if mode == "every" else 12
    prompts = shared_prefix_prompts(rnd, n, bs)
    params = [SamplingParams(max_new_tokens=rnd.randint(1, 9), ignore_eos=True) for _ in prompts]
    arrival = [rnd.randint(0, 6) for _ in prompts]
    kw = dict(num_blocks=26, max_num_seqs=3, max_num_batched_tokens=12)
    want = drive(llm_for(True, overlap, **kw), prompts, params, arrival, check=False)
    llm = llm_for(True, overlap, **kw)
    eng, hook = llm.engine, Interrupter()
    log, everyone = WriteLog(eng), []
    count = [0]

    def step_with_interrupts():
        at = 1
        while True:
            hook.calls, hook.at = 0, (at if mode == "every" else rnd.randint(1, 60) if at < 4 else None)
            sys.settrace(hook)
            try:
                return eng.step()
            except KeyboardInterrupt:
                count[0] += 1
                check_prefix_invariants(eng, log, everyone)
                at += 1
            finally:
                sys.settrace(None)

    with interrupts_in_finalizers_dropped():
        got = drive(llm, prompts, params, arrival, log, step=step_with_interrupts, everyone=everyone)
    assert {i: r.output_token_ids for i, r in got.items()} == {i: r.output_token_ids for i, r in want.items()}
    assert count[0] > 30
    assert eng.scheduler.allocator.prefix_hits > 0
    if mode == "every":
        for name in ("_match_prefix", "match", "_register_full_blocks", "extend_keys", "allocate"):
            assert name in hook.names, f"no interrupt landed in {name}"


# ----------------------------------------------------------------------------- trace and drawings
@pytest.fixture(scope="module")
def shared_trace():
    rnd = random.Random(21)
    prompts = shared_prefix_prompts(rnd, 10, 4)
    llm = llm_for(True, max_num_seqs=4, num_blocks=60, trace=True)
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(p, SamplingParams(max_new_tokens=10, ignore_eos=True))
        eng.step()
    eng.run()
    return llm.trace


def test_trace_records_shared_blocks_and_hits(shared_trace):
    shared_steps = 0
    for s in shared_trace.steps:
        count = {}
        for row in s.block_table:
            for b in row:
                count[b] = count.get(b, 0) + 1
        assert s.block_refs == {b: c for b, c in count.items() if c > 1}
        assert len(count) == s.pool_used and s.pool_used + s.pool_cached <= s.pool_total
        assert all(c == 0 for c, rid in zip(s.cached_tokens, s.slot_request) if rid is None)
        shared_steps += bool(s.block_refs)
    assert shared_steps > 0
    last = shared_trace.steps[-1]
    assert last.prefix_hits > 0 and 0 < last.hit_rate < 1
    hits = [s.prefix_hits for s in shared_trace.steps]
    assert hits == sorted(hits)


def test_drawing_shows_shared_blocks(shared_trace):
    i = max(range(len(shared_trace)), key=lambda i: sum(shared_trace[i].block_refs.values()))
    s = shared_trace[i]
    fig = viz.draw_block_table(s.block_table, s.slot_request, block_refs=s.block_refs)
    ax = fig.axes[0]
    shared_cells = [p for p in ax.patches if p.get_facecolor()[:3] == matplotlib.colors.to_rgb(viz.SHARED)]
    assert len(shared_cells) == sum(s.block_refs.values())
    texts = [t.get_text() for t in ax.texts]
    for b, n in s.block_refs.items():
        assert texts.count(f"{b}\n×{n}") == n
    plt.close(fig)
    fig = viz.draw_step(shared_trace, i)
    titles = " ".join(a.get_title(loc="left") for a in fig.axes)
    assert f"{s.hit_rate:.0%}" in titles and "shared" in titles
    assert len(viz.fig_to_png(fig)) > 1000
    plt.close(fig)


# ----------------------------------------------------------------------------- the benchmark
def test_bench_prefix_small_runs_on_cpu(tmp_path):
    from pagedlab.bench import BENCHMARKS, prefix
    assert "prefix" in BENCHMARKS
    res = prefix.run(["--small", "--no-warmup", "--out", str(tmp_path)])
    w = res["workloads"]
    assert set(w) == set(prefix.WORKLOADS)
    for name, r in w.items():
        assert r["off"]["hit_rate"] == 0 and r["off"]["cached_prompt_tokens"] == 0
        assert r["same_tokens"] == 1.0, f"{name}: greedy tokens differ with caching on (fp32, CPU)"
        assert r["off"]["tokens"] == r["on"]["tokens"] > 0
        assert r["on"]["computed_prompt_tokens"] + r["on"]["cached_prompt_tokens"] == r["on"]["prompt_tokens"]
    assert w["shared_prompt"]["on"]["hit_rate"] > 0.3 and w["multi_turn"]["on"]["hit_rate"] > 0.2
    assert w["offline"]["on"]["hit_rate"] == 0           # random prompts share no full block
    for f in ("prefix_bench.json", "prefix_bench.md", "prefix_bench.png"):
        assert (tmp_path / f).stat().st_size > 200

"""Notebook 12's hands-on pieces and their checks: prefix caching.

    block_keys = prefix_course.check_block_keys(block_keys)
    PrefixAllocator = prefix_course.check_prefix_allocator(PrefixAllocator)

`check_block_keys` compares the learner's hash chain, `block_keys(token_ids, block_size)`, with
pagedlab's (`prefix_cache.hash_chain`) on random and edge cases: equal prefixes, one changed token,
a repeated block (a hash of the block alone would give it the key of the first), a partial last
block (no key), fewer tokens than a block.

`check_prefix_allocator` runs random admissions and releases of requests that share prefixes on
the learner's `PrefixAllocator` and on pagedlab's `BlockAllocator` (with its `PrefixCache`) side by
side, and after every operation compares the free list, the LRU of cached blocks, the reference
counts and the key -> block map; asking for more blocks than can be had, and freeing a block
nobody holds, must raise and change nothing. A mistake raises `CheckFailed` (pagedlab.checks)
with the operations so far, what was expected and what was found, and a hint.

The solutions live with the notebooks, in notebooks/solutions/pieces_prefix.py; with
PAGEDLAB_SOLUTIONS=1 the checks run them instead of the learner's code.
"""
from __future__ import annotations

import random

from ..kv_cache import BlockAllocator, blocks_needed
from ..prefix_cache import hash_chain
from .chapter import Chapter, CheckFailed

# the solutions: notebooks/solutions/pieces_prefix.py ("block_keys", "PrefixAllocator")
chapter = Chapter("pieces_prefix.py", module="prefix_course")
solution, show_solution = chapter.solution, chapter.show_solution


def _short(x, n=160) -> str:
    s = repr(x)
    return s if len(s) <= n else s[:n] + f"... ({len(x)} items)"


# -- piece 1: the hash chain -------------------------------------------------------------------------

def _key_cases(rng):
    """(what, tokens, block_size): edge cases first, then random ones."""
    cases = [("no tokens", [], 4), ("fewer tokens than a block", [5, 6, 7], 4),
             ("exactly one block", [5, 6, 7, 8], 4), ("one block and a partial one", [5, 6, 7, 8, 9], 4),
             ("the same block twice in a row", [9, 9, 9, 9] * 2, 4),
             ("block_size 1", [3, 1, 4, 1, 5], 1), ("large token ids", [128_000, 128_255, 2**40, 7], 2)]
    for _ in range(30):
        bs = rng.choice([2, 4, 16])
        cases.append(("random", [rng.randrange(3, 130_000) for _ in range(rng.randint(0, 5 * bs + 3))], bs))
    return cases


def _key_hint(tokens, bs, got, want) -> str:
    full = len(tokens) // bs
    if len(got) != len(want):
        return (f"{len(tokens)} tokens in blocks of {bs} make {full} FULL blocks: one key each "
                f"({len(tokens) % bs} tokens left over in a partial block get no key).")
    j = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    if j == 0:
        return ("block 0's parent is ROOT (b'pagedlab-prefix-v1'): hashlib.blake2b(ROOT, digest_size=16), "
                "then .update(array('q', block_tokens).tobytes()) -- 8-byte integers -- then .digest().")
    return (f"keys 0..{j - 1} agree, key {j} does not: block j's parent is key j-1 (not ROOT): "
            "hashlib.blake2b(keys[j - 1], digest_size=16), then the block's tokens.")


def check_block_keys(fn, seed: int = 0):
    """fn(token_ids, block_size) -> the keys (bytes) of the full blocks, as pagedlab's hash_chain.
    Returns the function that passed."""
    name = "block_keys"
    fn = chapter.pick(fn, name)
    rng = random.Random(seed)
    n = 0
    for what, tokens, bs in _key_cases(rng):
        want = hash_chain(list(tokens), bs)
        got = chapter.call(fn, name, list(tokens), bs)
        got = list(got) if got is not None else None
        if got is None or not all(isinstance(k, bytes) for k in got):
            raise CheckFailed(f"{name}({_short(tokens)}, {bs}) returned {_short(got)}: expected a list of "
                              "bytes, one 16-byte key per full block (hashlib's .digest(), not .hexdigest()).")
        if got != want:
            raise CheckFailed(f"{name}({_short(tokens)}, {bs})   # {what}\n"
                              f"  expected {len(want)} keys: {[k.hex()[:8] for k in want]}\n"
                              f"  got      {len(got)} keys: {[k.hex()[:8] for k in got]}\n"
                              f"Hint: {_key_hint(tokens, bs, got, want)}")
        n += 1
    print(f"\u2713 {name}: {n} cases equal pagedlab's hash_chain (edge cases: empty, partial block, "
          "a block repeated, block_size 1); equal prefixes give equal keys, one changed token changes "
          "its block's key and every later one")
    return fn


# -- piece 2: the ref-counted allocator with an LRU of cached blocks ----------------------------------

def _state(a):
    """(free list, cached LRU, ref counts, key -> block) of the learner's allocator."""
    return (list(a.free_blocks), list(a.cached), dict(a.ref_count), dict(a.block_of))


def _ref_state(ref: BlockAllocator):
    return (list(ref.free_blocks), list(ref.cached), dict(ref.ref_count), dict(ref.prefix_cache.block_of))


def _story(log, last=14):
    shown = log if len(log) <= last else [log[0], "..."] + log[-last:]
    return "after\n    " + "\n    ".join(shown) + "\n"


_PARTS = [  # (attribute, what it is, hint), compared in this order: the most telling difference first
    ("ref_count", "reference counts",
     "allocate: +1 for each shared block, 1 for each fresh one; free: -1, and a block whose count "
     "reaches 0 leaves ref_count (del)."),
    ("cached", "cached blocks, least recently used first",
     "free: a block whose count reaches 0 and that has a key goes to the END of `cached` (most "
     "recently used), not to the free list; allocate: a shared hit on a cached block takes it OUT "
     "of `cached`; a fresh block comes from free_blocks first, and only when that is empty from the "
     "FRONT of `cached` (the least recently used: popitem(last=False))."),
    ("block_of", "key -> block map",
     "evicting a cached block (allocate, free list empty) must drop its key from block_of (and "
     "key_of) before the block is handed out: its K/V are about to be overwritten."),
    ("free_blocks", "free list",
     "allocate takes from the FRONT of free_blocks first; free puts a block nobody holds and "
     "nobody named at the BACK."),
]


def _compare(ours, ref, log):
    got = dict(zip(("free_blocks", "cached", "ref_count", "block_of"), _state(ours)))
    want = dict(zip(("free_blocks", "cached", "ref_count", "block_of"), _ref_state(ref)))
    for attr, what, hint in _PARTS:          # the most telling difference first
        g, w = got[attr], want[attr]
        if g != w:
            show = (lambda d: {b: k.hex()[:8] for k, b in d.items()}) if attr == "block_of" else (lambda x: x)
            raise CheckFailed(_story(log) + f"{what} ({attr}): {show(g)}\n  expected: {show(w)}\nHint: {hint}")


def _expect_raise(ours, op, log, why, name):
    before = _state(ours)
    try:
        op()
    except NotImplementedError as e:
        raise CheckFailed(chapter.not_written(name, e)) from None
    except Exception:
        if _state(ours) != before:
            raise CheckFailed(_story(log) + "it raised, but changed the allocator first.\n"
                              "Hint: check that everything is possible before you change anything.") from None
        return
    raise CheckFailed(_story(log) + f"no error was raised: {why}.")


def check_prefix_allocator(cls, trials: int = 40, seed: int = 0, block_size: int = 4):
    """cls(num_blocks) with free_blocks (deque), cached (OrderedDict, LRU first), ref_count, block_of,
    key_of, lookup(keys), allocate(n, shared=()), free(blocks), register(block, key), against
    pagedlab's BlockAllocator and PrefixCache. Returns the class that passed."""
    name = "PrefixAllocator"
    cls = chapter.pick(cls, name)
    rng = random.Random(seed)
    bs = block_size
    for trial in range(trials):
        num_blocks = rng.choice([3, 4, 6, 10])
        ours, ref = chapter.call(cls, name, num_blocks), BlockAllocator(num_blocks)
        log = [f"PrefixAllocator({num_blocks})   # blocks of {bs} tokens"]
        # a few shared prefixes; each request = a prefix + its own tokens
        prefixes = [[rng.randrange(3, 50) for _ in range(rng.choice([bs, 2 * bs, 2 * bs + 1]))] for _ in range(2)]
        running: dict[str, list[int]] = {}
        for op in range(rng.randint(4, 30)):
            r = rng.random()
            if running and r < 0.4:                                       # a request finishes
                rid = rng.choice(sorted(running))
                blocks = running.pop(rid)
                if rng.random() < 0.7:            # last block first, like the scheduler (its LRU then
                    blocks = blocks[::-1]         # evicts a chain from its end); any order must work
                log.append(f"free({blocks})   # {rid} finished")
                ref.free(blocks)
                chapter.call(ours.free, f"{name}.free", blocks)
            elif r < 0.47:                                                # a block nobody holds
                bad = rng.choice([b for b in range(num_blocks) if b not in ref.ref_count] or [num_blocks + 2])
                log.append(f"free([{bad}])   # nobody holds it: must raise")
                _expect_raise(ours, lambda: ours.free([bad]), log,
                              "freeing a block nobody holds must raise (it would be counted below 0, "
                              "or handed out twice)", name)
            else:                                                         # a request arrives
                rid = f"r{op}"
                tokens = rng.choice(prefixes) + [rng.randrange(3, 50) for _ in range(rng.randint(0, 2 * bs))]
                if not tokens:
                    continue
                keys = hash_chain(tokens, bs)
                usable = (len(tokens) - 1) // bs                          # the full-hit rule
                want_hits = ref.prefix_cache.match(list(keys), tokens, bs, usable)
                log.append(f"lookup(keys[:{usable}])   # {rid}: {len(tokens)} tokens, "
                           f"{len(keys)} full blocks")
                got_hits = chapter.call(ours.lookup, f"{name}.lookup", keys[:usable])
                if list(got_hits or []) != want_hits:
                    raise CheckFailed(_story(log) + f"lookup returned {got_hits}, expected {want_hits}.\n"
                                      "Hint: walk the keys in order and stop at the first key that is not in "
                                      "block_of: a block after a miss belongs to a different prefix.")
                fresh = blocks_needed(len(tokens), bs) - len(want_hits)
                can = fresh + ref.num_cached_in(want_hits) <= ref.num_free
                log.append(f"allocate({fresh}, shared={want_hits})"
                           + ("" if can else "   # not enough blocks: must raise"))
                if not can:
                    _expect_raise(ours, lambda: ours.allocate(fresh, shared=want_hits), log,
                                  f"{fresh} fresh blocks (+{ref.num_cached_in(want_hits)} cached hits revived) "
                                  f"but only {ref.num_free} free or cached: allocate must raise and take none", name)
                    _compare(ours, ref, log)
                    continue
                want = ref.allocate(rid, fresh, shared=want_hits)
                got = chapter.call(ours.allocate, f"{name}.allocate", fresh, shared=want_hits)
                if list(got or []) != want:
                    raise CheckFailed(_story(log) + f"allocate returned {got}, expected {want}.\n"
                                      "Hint: return the shared blocks first, then the fresh ones in the order "
                                      "taken: from the front of the free list while it has blocks, then by evicting the least "
                                      "recently used cached block (the FRONT of `cached`: popitem(last=False)).")
                running[rid] = want
                _compare(ours, ref, log)
                if rng.random() < 0.85 and len(keys) > len(want_hits):    # computed: name the full blocks
                    full = len(keys)
                    log.append(f"register blocks {len(want_hits)}..{full - 1} of {rid}")
                    for j in range(len(want_hits), full):
                        ref.prefix_cache.register(want[j], keys[j])
                        chapter.call(ours.register, f"{name}.register", want[j], keys[j])
            _compare(ours, ref, log)
    print(f"\u2713 {name}: {trials} random runs of requests sharing prefixes match pagedlab's BlockAllocator "
          "(hits, blocks handed out, free list, LRU of cached blocks, reference counts, keys, errors)")
    return cls

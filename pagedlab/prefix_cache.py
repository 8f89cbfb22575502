"""Prefix caching: full KV blocks named by their content, so requests that share a prefix share blocks.

Two requests that start with the same tokens (a system prompt, the earlier turns of a chat) compute
the same K and V for those tokens: attention is causal, so a token's K/V depend only on the tokens
before it. A full block can therefore be named by *everything up to its end*, and a request whose
prompt starts the same way can take that block instead of computing it again.

The name (key) of a full block is a hash chain:

    key(block 0) = H(ROOT,            tokens 0 .. bs-1)
    key(block j) = H(key(block j-1),  tokens j*bs .. (j+1)*bs-1)

so a key stands for the whole prefix up to the end of its block: equal keys mean equal prefixes
(up to a 128-bit hash collision), and one changed token changes the key of its block and of every
block after it. H is BLAKE2b over the token ids as 8-byte integers -- stable across processes and
runs, unlike Python's hash(), which is salted per process. Only full blocks have keys: a partly
filled block is still being written.

PrefixCache is the map key -> physical block (and, kept on the block, block -> key). The allocator
(kv_cache.py) decides when a block leaves the map: a block nobody holds any more stays cached,
with its key, until the pool needs it; then it is evicted, least recently used first, and its key
is dropped before the block is written again. So every key in the map names a block whose K/V are
exactly that prefix's.

Who does what:
  * the scheduler looks up a new request's full blocks (`match`) at admission and takes the hits;
  * the scheduler registers a request's blocks (`register`) once they are full, computed, and
    their tokens known (a token still in flight in the overlap loop is not known yet);
  * the allocator keeps a reference count per block and the LRU order of cached blocks.
"""
from __future__ import annotations

import hashlib
from array import array

ROOT = b"pagedlab-prefix-v1"      # the parent of a sequence's first block
KEY_BYTES = 16                    # 128-bit keys


def block_key(parent: bytes | None, tokens) -> bytes:
    """The key of a full block: a hash of its parent's key and its token ids (8-byte integers)."""
    h = hashlib.blake2b(ROOT if parent is None else parent, digest_size=KEY_BYTES)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def extend_keys(keys: list[bytes], tokens: list[int], block_size: int, num_blocks: int,
                start: int = 0) -> list[bytes]:
    """Grow `keys` (the chain of a sequence's first len(keys) full blocks) to `num_blocks` keys,
    hashing each new block once. `tokens` holds the sequence's tokens from position `start` (at
    most len(keys) * block_size) to at least num_blocks * block_size. Returns `keys` (extended in
    place: a request keeps its chain and only hashes its new blocks).

    The same keys as block_key, block after block, computed faster (this runs for every full block
    of every request, so it is what prefix caching costs when nothing is shared): the new blocks'
    tokens become bytes in one call, and each key is ONE BLAKE2b call over parent + the block's
    bytes (hashing a concatenation = updating with its parts), 1.6x faster than block_key."""
    j0 = len(keys)
    if num_blocks <= j0:
        return keys
    bs, nbytes = block_size, 8 * block_size
    data = array("q", tokens[j0 * bs - start:num_blocks * bs - start]).tobytes()
    blake2b, parent = hashlib.blake2b, keys[-1] if j0 else ROOT
    for i in range(0, (num_blocks - j0) * nbytes, nbytes):
        parent = blake2b(parent + data[i:i + nbytes], digest_size=KEY_BYTES).digest()
        keys.append(parent)       # one key at a time: an interrupt leaves a valid (shorter) chain
    return keys


def hash_chain(tokens: list[int], block_size: int) -> list[bytes]:
    """The keys of every full block of `tokens`."""
    return extend_keys([], tokens, block_size, len(tokens) // block_size)


class PrefixCache:
    """key -> physical block for full, computed blocks; `key_of` keeps each block's own key.

    Plain dicts, changed only by `register` and by the allocator's eviction (kv_cache.py), which
    drops a block's key inline, with no call in between, so an interrupt cannot separate them."""

    def __init__(self):
        self.block_of: dict[bytes, int] = {}     # key -> the physical block holding that prefix's end
        self.key_of: dict[int, bytes] = {}       # physical block -> its key (only blocks in the map)
        self.evictions = 0      # times keys were dropped (evicted, cleared): a match found before is
                                # still valid, block for block, while this has not changed

    def __len__(self) -> int:
        return len(self.block_of)

    def match(self, keys: list[bytes], tokens: list[int], block_size: int, max_blocks: int,
              hits: list[int] | None = None) -> list[int]:
        """The physical blocks holding the longest cached prefix of `tokens`, at most `max_blocks`
        of them: block j is a hit if key j is in the map, and the first miss ends the match (a
        block's K/V are only valid after the very same prefix). `keys` (the sequence's chain so
        far) is extended as far as needed. `hits`: a match of the same sequence made while
        `evictions` had its present value (still valid): the lookup goes on after it, so a request
        that waits at the head of the queue is not matched from its first block at every step."""
        hits = [] if hits is None else hits[:max_blocks]
        block_of = self.block_of
        for j in range(len(hits), max_blocks):
            if j == len(keys):
                extend_keys(keys, tokens, block_size, j + 1)
            b = block_of.get(keys[j])
            if b is None:
                break
            hits.append(b)
        return hits

    def register(self, block: int, key: bytes) -> bool:
        """Name a full, computed block by its key. False (nothing changes) if the block is named
        already, or if another block holds the same prefix (this one then stays private and goes
        back to the free list when released)."""
        if key in self.block_of or block in self.key_of:
            return False
        self.block_of[key] = block
        self.key_of[block] = key
        return True

    def clear(self) -> None:
        self.evictions += 1
        self.block_of.clear()
        self.key_of.clear()

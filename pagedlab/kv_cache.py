"""The paged KV cache: a pool of fixed-size blocks, who owns which block, and the block table.

  KVCache         per-layer K and V tensors [num_blocks, block_size, kv_heads, head_dim]. One
                  block id names the same place in every layer (one table for all layers, as in
                  vLLM).
  BlockAllocator  plain Python: a reference count per held block (a block shared by requests with
                  the same prefix is held several times), a free list, and the cached blocks
                  (nobody holds them, their prefix is still known: prefix_cache.py), LRU first.
  BlockTable      slot x logical block -> physical block, kept on the device for the kernels
                  (by the runner) and updated a few entries at a time, never copied whole.
"""
from __future__ import annotations

from collections import OrderedDict, deque

import torch

from .interrupts import atomic
from .prefix_cache import PrefixCache


class OutOfBlocks(RuntimeError):
    """The pool has no free block left (the scheduler preempts instead of letting this escape)."""


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockAllocator:
    """Which physical blocks are held, by how many requests, and which are free.

    Every block is in exactly one of three states:
      held    ref_count[b] >= 1: in the block list of that many running requests. A block held by
              several requests is shared (prefix caching); nobody ever writes a shared block.
      cached  ref_count 0 but still named in the prefix cache (its K/V are a known prefix): kept
              in `cached`, least recently used first, until the pool needs it.
      free    never filled, or filled with nothing worth keeping: in `free_blocks`.

    allocate() takes truly free blocks first, then evicts the least recently used cached block
    (dropping its key from the map before anyone writes it). Both cached and free blocks count
    as `num_free`: a cached block is one allocate() away from being free. Without prefix caching
    nothing is ever named, so `cached` stays empty and this is a free list with reference counts.

    `prefix_queries` / `prefix_hits` (tokens): how many tokens admitted sequences asked the prefix
    cache for, and how many of them it had (`hit_rate`), counted by the scheduler at admission.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free_blocks = deque(range(num_blocks))
        self.cached: OrderedDict[int, None] = OrderedDict()   # ref-0 named blocks, LRU first
        self.ref_count: dict[int, int] = {}         # held block -> how many requests hold it
        self.owner: dict[int, object] = {}          # held block -> the request that took it first
        self.prefix_cache = PrefixCache()
        self.prefix_queries = 0                     # tokens looked up at admission
        self.prefix_hits = 0                        # of those, tokens found cached (not computed)

    @property
    def num_free(self) -> int:
        """Blocks allocate() can give: free ones and cached ones (evicted on demand)."""
        return len(self.free_blocks) + len(self.cached)

    @property
    def num_used(self) -> int:
        """Blocks held by at least one request (a shared block counts once)."""
        return len(self.ref_count)

    @property
    def num_cached(self) -> int:
        """Blocks nobody holds that still hold a named prefix."""
        return len(self.cached)

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def num_cached_in(self, blocks) -> int:
        """How many of `blocks` are cached (ref 0): taking them as hits removes them from num_free."""
        cached = self.cached
        return sum(b in cached for b in blocks)

    @atomic
    def allocate(self, owner, n: int = 1, shared=()) -> list[int]:
        """Take the `shared` blocks (prefix-cache hits: one more holder each) and `n` fresh ones;
        returns shared + fresh, in that order. All or nothing: it checks first, then changes
        state in one deferred section (interrupts.atomic: a Ctrl-C waits for its end)."""
        cached, refs = self.cached, self.ref_count
        revived = sum(b in cached for b in shared)
        if n + revived > len(self.free_blocks) + len(cached):
            raise OutOfBlocks(f"asked for {n} blocks (+{revived} cached hits), "
                              f"{self.num_free} free of {self.num_blocks}")
        taken = list(shared)
        for b in shared:
            if b in cached:                  # a hit on a block nobody held: out of the LRU
                del cached[b]
                self.owner[b] = owner
            refs[b] = refs.get(b, 0) + 1
        for _ in range(n):
            if self.free_blocks:
                b = self.free_blocks.popleft()
            else:                            # evict the least recently used cached block
                b, _ = cached.popitem(last=False)
                del self.prefix_cache.block_of[self.prefix_cache.key_of.pop(b)]
                self.prefix_cache.evictions += 1
            refs[b] = 1
            self.owner[b] = owner
            taken.append(b)
        return taken

    @atomic
    def free(self, blocks) -> None:
        """One holder fewer for each block. A block nobody holds any more stays cached (most
        recently used) if the prefix cache names it, else it goes back to the free list. One
        deferred section: a Ctrl-C half-way would leave some blocks freed and others not."""
        refs, named = self.ref_count, self.prefix_cache.key_of
        for b in blocks:
            count = refs.get(b, 0)
            if count == 0:
                raise RuntimeError(f"block {b} freed twice (or never allocated)")
            if count > 1:
                refs[b] = count - 1
                continue
            del refs[b]
            del self.owner[b]
            if b in named:
                self.cached[b] = None
            else:
                self.free_blocks.append(b)

    @atomic
    def reset_prefix_cache(self) -> None:
        """Forget every named prefix: cached blocks become free (held blocks stay held, unnamed)."""
        self.free_blocks.extend(self.cached)
        self.cached.clear()
        self.prefix_cache.clear()


class BlockTable:
    """Device tensor [max_num_seqs + 1, max_blocks_per_seq] int32, one row per slot. The extra last
    row is the "null row" (padding rows of a CUDA-graph batch read it).

    The scheduler changes it a few entries at a time (a slot filled, a sequence crossing a block
    boundary); each step's changes reach the device together, in one small copy (`write`), never
    as a copy of the whole table. Entries past a sequence's length are never read, so freeing a
    slot writes nothing: its stale entries are simply overwritten by the next owner."""

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, device, null_block: int = 0):
        self.table = torch.full((max_num_seqs + 1, max_blocks_per_seq), null_block, dtype=torch.int32,
                                device=device)

    def write(self, edits: list[tuple[int, int, int]]) -> None:
        """(slot, logical index, physical block) entries -> the device: one copy, one indexed store."""
        if edits:
            latest = {(slot, i): b for slot, i, b in edits}     # a later write wins
            upd = torch.tensor([(s, i, b) for (s, i), b in latest.items()], dtype=torch.int64)
            upd = upd.to(self.table.device, non_blocking=True)
            self.table[upd[:, 0], upd[:, 1]] = upd[:, 2].to(torch.int32)


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype=torch.float32, device="cpu"):
        self.num_blocks, self.block_size = num_blocks, block_size
        # One extra "null" block past the pool that no request ever owns: padded rows of a
        # CUDA-graph batch write and read there.
        self.null_block = num_blocks
        self.data = torch.zeros(num_layers, 2, num_blocks + 1, block_size, num_kv_heads, head_dim,
                                dtype=dtype, device=device)
        self.k = [self.data[i, 0] for i in range(num_layers)]
        self.v = [self.data[i, 1] for i in range(num_layers)]

    @staticmethod
    def bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

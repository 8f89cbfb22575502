"""A learner's block allocator in pagedlab's scheduler (LLM(..., allocator=...), notebook 07).

The scheduler reaches it through PluggedAllocator, which checks every answer (n distinct blocks, in
range, not in use; only blocks in use freed): a wrong allocator is a clear error, not a corrupt
cache. prefix_caching=True needs the whole prefix-cache API of kv_cache.BlockAllocator, and then the
allocator is used as it is. (plugins.py gathers every plug-in; this file needs nothing above the
allocator, so the scheduler can import it.)
"""
from __future__ import annotations

# what the scheduler uses of a BlockAllocator with prefix_caching=True
PREFIX_API = ("prefix_cache", "num_cached_in", "cached", "ref_count", "num_cached", "num_used",
              "num_free", "prefix_queries", "prefix_hits")


def plug_allocator(factory, num_blocks: int, prefix_caching: bool = False):
    """The allocator `factory(num_blocks)`, as the scheduler uses it."""
    alloc = factory(num_blocks)
    if prefix_caching:
        missing = [a for a in PREFIX_API if not hasattr(alloc, a)]
        if missing:
            raise ValueError(f"prefix_caching=True needs an allocator with kv_cache.BlockAllocator's "
                             f"prefix-cache API; {type(alloc).__name__} has no {', '.join(missing)}. "
                             f"Use prefix_caching=False with this allocator.")
        return alloc                     # trusted as is: it shares blocks, PluggedAllocator would refuse
    return PluggedAllocator(alloc, num_blocks)


class PluggedAllocator:
    """A learner's allocator behind the attributes the scheduler reads (num_free, num_used,
    ref_count, ...), every answer checked."""

    def __init__(self, inner, num_blocks: int):
        if not (hasattr(inner, "num_free") or hasattr(inner, "free_list")):
            raise ValueError(f"a plugged allocator needs num_free or free_list: {type(inner).__name__} has neither")
        for a in ("allocate", "free"):
            if not callable(getattr(inner, a, None)):
                raise ValueError(f"a plugged allocator needs a method {a}: {type(inner).__name__} has none")
        self.inner, self.num_blocks = inner, num_blocks
        self.held: set[int] = set()
        self.prefix_queries = self.prefix_hits = 0
        self.num_cached, self.hit_rate = 0, 0.0

    @property
    def num_free(self) -> int:
        inner = self.inner
        return int(inner.num_free) if hasattr(inner, "num_free") else len(inner.free_list)

    @property
    def num_used(self) -> int:
        return len(self.held)

    @property
    def ref_count(self) -> dict[int, int]:
        return dict.fromkeys(self.held, 1)

    def num_cached_in(self, blocks) -> int:
        return 0

    def allocate(self, owner, n: int = 1, shared=()) -> list[int]:
        if shared:
            raise ValueError("a plugged allocator cannot share blocks (prefix caching)")
        if n == 0:
            return []
        got = list(self.inner.allocate(owner, n))
        name = type(self.inner).__name__
        if len(got) != n:
            raise RuntimeError(f"plugged allocator {name}.allocate({owner!r}, {n}) returned {len(got)} blocks: {got}")
        for b in got:
            if not (isinstance(b, int) and 0 <= b < self.num_blocks):
                raise RuntimeError(f"plugged allocator {name} handed out {b!r}: not a block of 0..{self.num_blocks - 1}")
        if len(set(got)) != n or self.held & set(got):
            twice = sorted({b for b in got if got.count(b) > 1} | (self.held & set(got)))
            raise RuntimeError(f"plugged allocator {name} handed out block(s) {twice} that are already in "
                               f"use: two sequences would write the same K/V")
        self.held.update(got)
        return got

    def free(self, blocks) -> None:
        blocks = list(blocks)
        if not set(blocks) <= self.held:
            raise RuntimeError(f"the scheduler freed blocks {blocks} that the allocator never handed out")
        self.inner.free(blocks)
        self.held.difference_update(blocks)

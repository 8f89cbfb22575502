"""The paged KV cache: a pool of fixed-size blocks, who owns which block, and the block table.

  KVCache         per-layer K and V tensors [num_blocks, block_size, kv_heads, head_dim]. One
                  block id names the same place in every layer (one shared table, as in vLLM; the
                  original engine kept a separate table per layer).
  BlockAllocator  plain Python: a free list and an owner for every used block.
  BlockTable      slot x logical block -> physical block, kept on the device for the kernels
                  (by the runner) and updated a few entries at a time, never copied whole.
"""
from __future__ import annotations

from collections import deque

import torch


class OutOfBlocks(RuntimeError):
    """The pool has no free block left (the scheduler preempts instead of letting this escape)."""


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockAllocator:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free_blocks = deque(range(num_blocks))
        self.owner: dict[int, object] = {}          # physical block -> request id

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def allocate(self, owner, n: int = 1) -> list[int]:
        if n > len(self.free_blocks):
            raise OutOfBlocks(f"asked for {n} blocks, {len(self.free_blocks)} free of {self.num_blocks}")
        taken = [self.free_blocks.popleft() for _ in range(n)]
        for b in taken:
            self.owner[b] = owner
        return taken

    def free(self, blocks) -> None:
        for b in blocks:
            if b not in self.owner:
                raise RuntimeError(f"block {b} freed twice (or never allocated)")
            del self.owner[b]
            self.free_blocks.append(b)


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
        self.null_row = max_num_seqs

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

    @property
    def num_bytes(self) -> int:  # the whole allocation, null block included
        return self.data.numel() * self.data.element_size()

"""The paged KV cache: a pool of fixed-size blocks, who owns which block, and the block table.

  KVCache         per-layer K and V tensors [num_blocks, block_size, kv_heads, head_dim]. One
                  block id names the same place in every layer (one shared table, as in vLLM; the
                  original engine kept a separate table per layer).
  BlockAllocator  plain Python: a free list and an owner for every used block.
  BlockTable      slot x logical block -> physical block, kept on the device for the kernels and
                  updated one entry (or one row) at a time, never copied whole.
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
    """Device tensor [max_num_seqs, max_blocks_per_seq] int32, one row per slot (-1 = no block)."""

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, device):
        self.table = torch.full((max_num_seqs, max_blocks_per_seq), -1, dtype=torch.int32, device=device)

    def set_row(self, slot: int, blocks: list[int]) -> None:
        """A slot was (re)filled: write its row (one small host->device copy)."""
        n = len(blocks)
        if n:
            self.table[slot, :n] = torch.tensor(blocks, dtype=torch.int32).to(self.table.device, non_blocking=True)

    def append(self, slot: int, index: int, block: int) -> None:
        """A sequence crossed a block boundary: write one entry."""
        self.table[slot, index] = block

    def clear_row(self, slot: int, n: int) -> None:
        if n:
            self.table[slot, :n] = -1


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

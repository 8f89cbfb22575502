"""Shared helper of the torch references: read a sequence's pages back into contiguous K/V."""
from __future__ import annotations

import torch


def gather_pages(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """cache [N, bs, Hkv, D], block_table [B, M] -> [B, M * bs, Hkv, D] (entries past a sequence's
    length are whatever the pages hold; callers mask them). Negative table entries read block 0."""
    b, m = block_table.shape
    _, bs, hkv, d = cache.shape
    pages = cache[block_table.clamp(min=0).long()]          # [B, M, bs, Hkv, D]
    return pages.reshape(b, m * bs, hkv, d)

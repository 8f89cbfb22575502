"""KV-store: write one step's new K/V rows (all sequences at once) into the paged cache."""
from __future__ import annotations

import torch


def kv_store_torch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D]; slot_mapping: [T] physical slot of each token (block * block_size + offset)."""
    num_blocks, block_size, hkv, d = k_cache.shape
    k_cache.view(num_blocks * block_size, hkv, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(num_blocks * block_size, hkv, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))

"""Paged decode attention: one new query token per sequence attends to its whole paged context."""
from __future__ import annotations

import torch

from .paged import gather_pages


def decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           max_seq_len: int | None = None) -> torch.Tensor:
    """q [B, Hq, D] -> out [B, Hq, D]. Sequence b attends to its first seq_lens[b] cached tokens.
    Computed in fp32 by gathering the pages (no loop over sequences). max_seq_len (an upper
    bound on seq_lens) is accepted for the same signature as the Triton launcher; unused here."""
    b, hq, d = q.shape
    hkv = k_cache.shape[2]
    k = gather_pages(k_cache, block_table).float()          # [B, L, Hkv, D]
    v = gather_pages(v_cache, block_table).float()
    qg = q.float().view(b, hkv, hq // hkv, d)               # query heads grouped by their KV head
    scores = torch.einsum("bhgd,blhd->bhgl", qg, k) * scale
    valid = torch.arange(k.shape[1], device=q.device)[None, :] < seq_lens[:, None]   # [B, L]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)        # a sequence of length 0 gives zeros
    out = torch.einsum("bhgl,blhd->bhgd", p, v)
    return out.reshape(b, hq, d).to(q.dtype)

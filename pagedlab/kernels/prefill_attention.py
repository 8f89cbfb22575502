"""Prefill attention: causal attention for packed variable-length queries over paged K/V."""
from __future__ import annotations

import torch

from .paged import gather_pages


def prefill_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float,
                            max_q_len: int | None = None) -> torch.Tensor:
    """q [T, Hq, D] packed: sequence b owns rows cu_seqlens_q[b]:cu_seqlens_q[b+1].
    seq_lens[b] counts all of b's tokens in the cache, the new ones included (their K/V are already
    stored); max_q_len, when the caller knows it, saves a device->host read., so query i of b sits at position seq_lens[b] - q_len[b] + i and sees keys 0..that.
    Computed in fp32: queries are padded per sequence, scores masked (no loop over sequences)."""
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    b = seq_lens.shape[0]
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    seq_of_token = torch.repeat_interleave(torch.arange(b, device=q.device), q_lens, output_size=t)
    idx_in_seq = torch.arange(t, device=q.device) - cu_seqlens_q[:-1].long()[seq_of_token]
    max_q = max_q_len if max_q_len is not None else (int(q_lens.max()) if b else 0)

    qp = q.new_zeros(b, max_q, hq, d, dtype=torch.float32)
    qp[seq_of_token, idx_in_seq] = q.float()
    k = gather_pages(k_cache, block_table).float()           # [B, L, Hkv, D]
    v = gather_pages(v_cache, block_table).float()
    qg = qp.view(b, max_q, hkv, hq // hkv, d)
    scores = torch.einsum("bqhgd,blhd->bhgql", qg, k) * scale
    q_pos = (seq_lens - q_lens)[:, None] + torch.arange(max_q, device=q.device)[None, :]   # [B, Q]
    k_pos = torch.arange(k.shape[1], device=q.device)
    allowed = k_pos[None, None, :] <= q_pos[:, :, None]                                    # [B, Q, L]
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = torch.einsum("bhgql,blhd->bqhgd", p, v).reshape(b, max_q, hq, d)
    return out[seq_of_token, idx_in_seq].to(q.dtype)

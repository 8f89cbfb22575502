"""The one attention interface: paged K/V + block table + sequence lengths.

A step's batch is packed: first the tokens of the sequences being prefilled (several new tokens
each), then one token per decoding sequence. `AttentionMetadata` describes both parts. The step's new K/V
are already in the pages (the QKV projection stores them, see kernels/gemv.py); `attend` runs
prefill attention on the first part and decode attention on the second, with whichever kernels
(torch or Triton) the model was given.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor          # [T] where each new token's K/V goes (block * bs + offset)
    num_prefill_tokens: int             # tokens [0, num_prefill_tokens) belong to prefills
    # prefill part (Bp sequences)
    prefill_block_table: torch.Tensor   # [Bp, M]
    cu_seqlens_q: torch.Tensor          # [Bp + 1] offsets of each prefill's new tokens
    prefill_seq_lens: torch.Tensor      # [Bp] cached context incl. the new tokens
    max_q_len: int
    # decode part (Bd sequences, one token each)
    decode_block_table: torch.Tensor    # [Bd, M]
    decode_seq_lens: torch.Tensor       # [Bd]
    max_seq_len: int

    @property
    def num_decode_tokens(self) -> int:
        return self.decode_seq_lens.shape[0]


def attend(kernels, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, Hq, D] for this step's tokens (their K/V already stored) -> attention output [T, Hq, D].
    Rows past the prefill and decode tokens (the runner's padding up to a bucketed row count)
    attend to nothing: their output is zeros."""
    n, d = meta.num_prefill_tokens, meta.num_decode_tokens
    padded = n + d < q.shape[0]
    if d == 0 and not padded:
        return kernels.prefill_attention(q, k_cache, v_cache, meta.prefill_block_table,
                                         meta.cu_seqlens_q, meta.prefill_seq_lens, scale, meta.max_q_len)
    if n == 0 and not padded:
        return kernels.decode_attention(q, k_cache, v_cache, meta.decode_block_table,
                                        meta.decode_seq_lens, scale, meta.max_seq_len)
    out = torch.zeros_like(q) if padded else torch.empty_like(q)
    if n:
        out[:n] = kernels.prefill_attention(q[:n], k_cache, v_cache, meta.prefill_block_table,
                                            meta.cu_seqlens_q, meta.prefill_seq_lens, scale, meta.max_q_len)
    if d:
        out[n:n + d] = kernels.decode_attention(q[n:n + d], k_cache, v_cache, meta.decode_block_table,
                                                meta.decode_seq_lens, scale, meta.max_seq_len)
    return out

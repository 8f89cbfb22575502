"""Decode attention inside the O projection's launch, for one stream (issue #27; off in the engine
unless select_kernels(attend_o=N) / PAGEDLAB_ATTEND_O asks for it, and not measured yet:
`python -m pagedlab bench gemv --attend-o`).

At one decode token the attention half of a layer is three launches -- QKV (+RoPE, KV store),
attention, O (+ residual) -- and the two after QKV are mostly latency: attention reads ~0.5 MB of
K/V with a chain of dependent loads (block table, K, V, softmax), O streams 8.4 MB (from L2 when
QKV prefetched it). Session 13 put the attention in QKV's tail and lost: one program per KV head
ran it after the GEMV, serially, while the GPU idled. Here it goes the other way round -- the O
projection split along K by KV head:

  grid (row blocks of O, KV heads). Program (r, h) loads its [BLOCK_R, G * D] slice of W_o -- the
  columns that multiply KV head h's G query heads -- FIRST, so the weight stream is in flight
  while it computes head group h's attention itself (decode_attention.group_attention: the gqa
  kernel's loop over the whole paged context, every program of the group redoing it from L2),
  then its partial W_o slice . attn_h, and the split-K reduction of gemv (_gather_splits: the
  program that arrives last for its row block adds the Hkv partials in head order, so the result
  does not depend on arrival order) + the residual.

Every program does the group's attention again (N / BLOCK_R times per group): cheap only while
the context is short (L2 reads of K/V grow with it); the launcher refuses more than one row (the
one stream) and the bench measures where it stops paying.

attend_o_residual_torch is the reference (attention, then O + residual: the two launches' math);
attend_o_residual_triton the launcher (same arguments, plus launch options).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quantization import FP8Weight
from . import scratch
from .decode_attention import decode_attention_torch, group_attention
from .gemv import _gather_splits, linear_residual_torch
from .launch import INT32_LIMIT
from .online_softmax import LOG2E


def attend_o_residual_torch(q, k_cache, v_cache, block_table, seq_lens, scale, w, residual):
    """q [B, Hq, D] (this step's queries), the paged caches [blocks, block_size, Hkv, D], w the O
    projection [H, Hq * D] (or an FP8Weight), residual [B, H] -> residual + attention(q) @ w^T."""
    attn = decode_attention_torch(q, k_cache, v_cache, block_table, seq_lens, scale)
    return linear_residual_torch(attn.reshape(q.shape[0], -1), w, residual)


@triton.jit
def _attend_o_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, sl_ptr, w_ptr, s_ptr, r_ptr, out_ptr, ws_ptr, cnt_ptr,
                     sm_scale, N, K, max_blocks,
                     HKV: tl.constexpr, G: tl.constexpr, GW: tl.constexpr, GP: tl.constexpr,
                     BS: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                     HAS_SCALE: tl.constexpr, IEEE: tl.constexpr, IDX64: tl.constexpr):
    kvh = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < N
    offs_w = tl.arange(0, GW)                       # the group's query heads (GW: G to a power of 2)
    offs_d = tl.arange(0, D)
    # W_o[rows, (kvh * G + g) * D + d] as [BLOCK_R, GW, D]: in flight before the attention's loads
    cols = (kvh * G + offs_w)[None, :, None] * D + offs_d[None, None, :]
    w_rows = rows.to(tl.int64) if IDX64 else rows
    wmask = rmask[:, None, None] & (offs_w < G)[None, :, None]
    w = tl.load(w_ptr + w_rows[:, None, None] * K + cols, mask=wmask, other=0.0)
    attn, _, _ = group_attention(q_ptr, k_ptr, v_ptr, bt_ptr, sl_ptr, sm_scale, tl.program_id(2), kvh, HKV, G,
                                 GP, BS, D, BLOCK_N, max_blocks, IEEE, IDX64)     # [GP, D]: GP >= 16 (tl.dot)
    offs_p = tl.arange(0, GP)
    attn = tl.sum(tl.where(offs_p[:, None, None] == offs_w[None, :, None], attn[:, None, :], 0.0), axis=0)
    part = tl.sum(tl.sum(w.to(tl.float32) * attn[None, :, :], axis=2), axis=1)   # [BLOCK_R]
    last, acc, _, _ = _gather_splits(part[None, :], part[None, :], tl.zeros([1], dtype=tl.float32),
                                     ws_ptr, cnt_ptr, False, HKV, 1, BLOCK_R)
    if last:       # (a new name: Triton 3.6 refuses a variable whose shape changes inside an `if`)
        y = tl.sum(acc, axis=0)
        if HAS_SCALE:
            y = y * tl.load(s_ptr + rows, mask=rmask, other=0.0)
        y += tl.load(r_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=rmask)


# BLOCK_R rows of O per program (BLOCK_R x G x D weight products in registers: 8,192 at 32 x 4 x 64,
# as gemv's MAX_PRODUCT_VALUES), BLOCK_N keys per step of the attention loop. Not tuned yet.
ATTEND_O_CONFIG = {"BLOCK_R": 32, "BLOCK_N": 128, "num_warps": 4, "num_stages": 1}


def attend_o_residual_triton(q, k_cache, v_cache, block_table, seq_lens, scale, w, residual,
                             config=None):
    """Same contract as attend_o_residual_torch, one sequence (B = 1) only; config: launch
    parameters (ATTEND_O_CONFIG unless given)."""
    cfg = dict(ATTEND_O_CONFIG, **(config or {}))
    b, hq, d = q.shape
    hkv, bs = k_cache.shape[2], k_cache.shape[1]
    if b != 1:
        raise ValueError(f"attend_o_residual_triton runs one sequence (the one stream), got a batch of {b}")
    if d < 16 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {d}")
    codes, scales = (w.q, w.scale) if isinstance(w, FP8Weight) else (w, None)
    n, k = codes.shape
    if k != hq * d or residual.shape != (1, n):
        raise ValueError(f"O projection {tuple(codes.shape)} and residual {tuple(residual.shape)} do not fit "
                         f"q {tuple(q.shape)}")
    block_r = cfg["BLOCK_R"]
    row_blocks = triton.cdiv(n, block_r)
    ws, cnt = scratch.get(("attend_o", q.device, block_r, row_blocks, hkv), q.device, lambda: (
        torch.empty(row_blocks * hkv * (2 * block_r + 1), dtype=torch.float32, device=q.device),
        torch.zeros(row_blocks, dtype=torch.int32, device=q.device)))
    out = torch.empty_like(residual)
    g = hq // hkv
    _attend_o_kernel[(row_blocks, hkv, 1)](     # (axis 2: the sequence, one)
        q.contiguous(), k_cache, v_cache, block_table, seq_lens, codes, scales if scales is not None else codes,
        residual, out, ws, cnt, scale * LOG2E, n, k, block_table.shape[1],     # (the softmax runs in base 2)
        HKV=hkv, G=g, GW=triton.next_power_of_2(g), GP=max(16, triton.next_power_of_2(g)), BS=bs, D=d,
        BLOCK_N=cfg["BLOCK_N"], BLOCK_R=block_r, HAS_SCALE=scales is not None, IEEE=q.dtype == torch.float32,
        IDX64=max(k_cache.numel(), codes.numel()) >= INT32_LIMIT,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out

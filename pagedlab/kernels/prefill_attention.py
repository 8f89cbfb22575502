"""Prefill attention: causal attention for packed variable-length queries over paged K/V.

The prompts of one step are packed back to back into q [T, Hq, D]; cu_seqlens_q marks where each
sequence starts. Sequence b's new tokens may come after context already in the cache (a previous
chunk of a chunked prefill, or a cached prefix), so query i of b sits at position
seq_lens[b] - q_len[b] + i and sees every key up to that position -- keys that are read through
the block table from the paged pool, never from a contiguous copy.

The Triton kernel is FlashAttention-2 style: one program per (tile of BLOCK_M queries, sequence,
query head). It walks the keys in tiles of BLOCK_N, each tile gathered from the pages (key n lives
at block_table[b, n // block_size], offset n % block_size), computes S = Q K^T with tl.dot, and
keeps a running (max m, sum l, output acc) -- the online softmax -- so the [q_len, seq_len] score
matrix never exists in memory. Work is in the base-2 domain (exp2, scale folded with log2 e).
The key loop has two phases: keys every query of the tile sees (no mask at all, the bulk of the
work), then the tiles that cross the causal diagonal (masked). The running max starts at a large
FINITE negative number, so a row that sees no key at all gives exp2(-inf - finite) = 0 and an
output of 0, never NaN. Programs with the most work (the last query tiles) are launched first.

GQA: query head h reads KV head h // (Hq // Hkv); the other query heads of the group re-read the
same K/V tiles, which mostly hit in L2 (prefill is compute bound, so that is fine).

prefill_attention_torch is the reference; prefill_attention_triton has the same signature, plus
its launch parameters as an explicit keyword argument `config` (PREFILL_CONFIG unless given).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import INT32_LIMIT, freeze, num_stages
from .online_softmax import LOG2E, online_softmax_update
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


# Tile sizes and launch parameters (tuned on the H200 for head_dim 64; see docs/kernels.md).
# Read-only: pass another config (launch.merge_config(PREFILL_CONFIG, {...})) to change them.
PREFILL_CONFIG = freeze({"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3})
# Under the interpreter (CPU) every padded row and column is computed in numpy, one program after
# another: tiles no larger than the queries need (and at least MIN_BLOCK, tl.dot's minimum), and
# key tiles of at most CPU_BLOCK_N.
MIN_BLOCK = 16
CPU_BLOCK_N = 32


@triton.jit
def _prefill_tile(acc, m_i, l_i, q, k_ptr, v_ptr, bt_row_ptr, kvh, start, offs_n, offs_d, q_pos,
                  seq_len, sm_scale, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                  stride_vh, D: tl.constexpr, BS: tl.constexpr, MASKED: tl.constexpr,
                  IEEE: tl.constexpr, EVEN_D: tl.constexpr, IDX64: tl.constexpr):
    k_pos = start + offs_n
    if MASKED:
        kmask = k_pos < seq_len
        blk = tl.load(bt_row_ptr + k_pos // BS, mask=kmask, other=0)
    else:
        blk = tl.load(bt_row_ptr + k_pos // BS)
    if IDX64:                                  # int32 address math unless the pool is huge
        blk = blk.to(tl.int64)
    tok = k_pos % BS
    k_ptrs = k_ptr + (blk * stride_kb + tok * stride_kt + kvh * stride_kh)[:, None] + offs_d[None, :]
    v_ptrs = v_ptr + (blk * stride_vb + tok * stride_vt + kvh * stride_vh)[:, None] + offs_d[None, :]
    if MASKED:
        ld_mask = kmask[:, None] & (offs_d[None, :] < D)
        k = tl.load(k_ptrs, mask=ld_mask, other=0.0)
        v = tl.load(v_ptrs, mask=ld_mask, other=0.0)
    elif EVEN_D:                               # the bulk of the work: no predicate at all
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    else:
        k = tl.load(k_ptrs, mask=offs_d[None, :] < D, other=0.0)
        v = tl.load(v_ptrs, mask=offs_d[None, :] < D, other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * sm_scale
    if MASKED:
        allowed = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < seq_len)
        s = tl.where(allowed, s, float("-inf"))
    return online_softmax_update(acc, m_i, l_i, s, v, IEEE)


@triton.jit
def _prefill_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, cu_ptr, sl_ptr, sm_scale,
                              stride_qt, stride_qh, stride_ot, stride_oh,
                              stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                              stride_bt, num_m_tiles,
                              G: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                              BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              IEEE: tl.constexpr, EVEN_D: tl.constexpr, IDX64: tl.constexpr):
    pid_m = num_m_tiles - 1 - tl.program_id(0)          # heaviest (last) query tiles first
    b = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // G
    q_start = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_start
    seq_len = tl.load(sl_ptr + b)
    ctx = seq_len - q_len                                 # tokens already in the cache before q
    m_start = pid_m * BLOCK_M

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < q_len
    dmask = offs_d < D
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & dmask[None, :], other=0.0)
    q_pos = ctx + offs_m
    bt_row_ptr = bt_ptr + b.to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: empty rows give 0, not NaN
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    tile_live = m_start < q_len
    # phase 1: keys [0, full_end) are visible to every query of the tile -> no mask
    full_end = tl.where(tile_live, ((ctx + m_start) // BLOCK_N) * BLOCK_N, 0)
    for start in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _prefill_tile(acc, m_i, l_i, q, k_ptr, v_ptr, bt_row_ptr, kvh, start,
                                      offs_n, offs_d, q_pos, seq_len, sm_scale, stride_kb,
                                      stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                                      D, BS, False, IEEE, EVEN_D, IDX64)
    # phase 2: the tiles that cross the causal diagonal (and the end of the sequence) -> masked
    diag_end = tl.where(tile_live, tl.minimum(ctx + m_start + BLOCK_M, seq_len), 0)
    for start in range(full_end, diag_end, BLOCK_N):
        acc, m_i, l_i = _prefill_tile(acc, m_i, l_i, q, k_ptr, v_ptr, bt_row_ptr, kvh, start,
                                      offs_n, offs_d, q_pos, seq_len, sm_scale, stride_kb,
                                      stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                                      D, BS, True, IEEE, EVEN_D, IDX64)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(o_ptr + q_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & dmask[None, :])


def prefill_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
                             seq_lens: torch.Tensor, scale: float,
                             max_q_len: int | None = None, *, config=PREFILL_CONFIG) -> torch.Tensor:
    """Same contract as prefill_attention_torch; `config` holds the launch parameters (the keys
    of PREFILL_CONFIG). No device->host sync: without max_q_len the grid is bounded by
    min(T, block_table.shape[1] * block_size) (extra programs exit at once)."""
    t, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    b = seq_lens.shape[0]
    if q.stride(-1) != 1:
        q = q.contiguous()
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if max_q_len is None:
        max_q_len = min(t, block_table.shape[1] * bs)
    if t == 0 or b == 0 or max_q_len == 0:
        return out
    block_m = config["BLOCK_M"]
    block_n = config["BLOCK_N"]
    if q.device.type == "cpu":                       # interpreter: small tiles, less padding
        block_m = min(block_m, max(MIN_BLOCK, triton.next_power_of_2(max_q_len)))
        block_n = min(block_n, CPU_BLOCK_N)
    num_m_tiles = triton.cdiv(max_q_len, block_m)
    block_d = max(MIN_BLOCK, triton.next_power_of_2(d))
    ieee = q.dtype == torch.float32
    _prefill_attention_kernel[(num_m_tiles, b, hq)](
        q, k_cache, v_cache, out, block_table, cu_seqlens_q, seq_lens, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0), num_m_tiles,
        G=hq // hkv, BS=bs, D=d, BLOCK_D=block_d,
        BLOCK_M=block_m, BLOCK_N=block_n, IEEE=ieee, EVEN_D=d == block_d,
        IDX64=max(k_cache.numel(), v_cache.numel()) >= INT32_LIMIT,
        num_warps=config["num_warps"], num_stages=num_stages(config["num_stages"], q.device))
    return out

"""Decode-time linear layers: matrix-vector products with their neighbours fused in.

When only a few tokens are in a step (decode at small batch: M <= MAX_ROWS rows), every matmul of
a Llama layer is a matrix-vector product. It reads the whole weight matrix to do 2*M*N*K flops, so
it is bound by memory bandwidth; and the small ops around it (RMSNorm before, RoPE, K/V store,
SwiGLU, the residual add after) cost mostly launch latency. So each kernel below streams one weight
matrix ONCE and does its neighbours in the same launch; a whole layer is five launches:

    norm_qkv_rope_store  q = rope(n Wq^T) -> out;  rope(n Wk^T), n Wv^T -> paged K/V cache
    (attention)
    linear_residual      h + o Wo^T
    norm_swiglu          silu(n Wg^T) * (n Wu^T)
    linear_residual      h + a Wd^T
                         (n = rmsnorm(h))       and at the end: norm_lm_head  rmsnorm(h) W^T in fp32

Two tricks make the fusion free:
  * the norm: rmsnorm(x) W^T = rsqrt(mean(x^2) + eps) * ((x * g) W^T). Every program streams all of
    x for its dot products anyway, so it sums x^2 in the same loop and scales its outputs at the end.
  * RoPE and SwiGLU both combine output row r with output row r + offset (RoPE: the two halves of a
    head, offset D/2; SwiGLU: gate row r and up row r, offset I). A program computes PAIRS of rows
    (two accumulators over the same x tile) and combines them before storing.

Each program owns BLOCK_R output rows (or row pairs) for all M tokens and loops over K in BLOCK_K
tiles: acc[M, R] += x[M, K_tile] . W[R, K_tile]^T, a tl.dot with M padded to 16 (tensor cores; the
padding rows are masked loads, they cost no memory traffic).

Every function has a `*_torch` version (the plain composition of the reference kernels: the CPU
path and the test oracle) and a `*_triton` launcher that runs the fused kernel for up to MAX_ROWS
tokens and, above that (prefill, large decode batches, where cuBLAS matmuls are compute-efficient),
the composition of the unfused Triton kernels with cuBLAS.
"""
from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .activation import silu_and_mul_torch, silu_and_mul_triton
from .kv_store import kv_store_torch, kv_store_triton
from .rmsnorm import rms_norm_torch, rms_norm_triton
from .rope import rope_torch, rope_triton

MAX_ROWS = 16          # the fused kernels take up to this many tokens (one tl.dot tile of rows)

# Launch parameters per kernel: BLOCK_R output rows (row pairs for qkv/swiglu) per program, BLOCK_K
# columns per loop step, warps, software-pipeline stages.
# `python -m pagedlab.bench_gemv --tune` sweeps them and writes the best as JSON; a file named by
# the environment variable PAGEDLAB_GEMV_CONFIG overrides these at import.
GEMV_CONFIG = {
    "qkv": dict(BLOCK_R=16, BLOCK_K=256, num_warps=4, num_stages=4),
    "swiglu": dict(BLOCK_R=16, BLOCK_K=256, num_warps=4, num_stages=4),
    "residual": dict(BLOCK_R=16, BLOCK_K=256, num_warps=4, num_stages=4),
    "lm_head": dict(BLOCK_R=64, BLOCK_K=128, num_warps=4, num_stages=4),
}
if os.environ.get("PAGEDLAB_GEMV_CONFIG"):
    with open(os.environ["PAGEDLAB_GEMV_CONFIG"]) as f:
        GEMV_CONFIG.update(json.load(f))


# --------------------------------------------------------------------------------------------
# references: the unfused composition (CPU path, large batches, test oracle)
# --------------------------------------------------------------------------------------------
def _qkv_composed(norm, rope, kv_store, x, norm_w, eps, w, positions, cos_sin, k_cache, v_cache,
                  slot_mapping, num_heads):
    t = x.shape[0]
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    q, k, v = F.linear(norm(x, norm_w, eps), w).split([num_heads * d, hkv * d, hkv * d], dim=-1)
    q, k = rope(q.reshape(t, num_heads, d), k.reshape(t, hkv, d), positions, cos_sin)
    kv_store(k, v.reshape(t, hkv, d), k_cache, v_cache, slot_mapping)
    return q


def norm_qkv_rope_store_torch(x, norm_w, eps, w, positions, cos_sin, k_cache, v_cache,
                              slot_mapping, num_heads):
    """x [T, H] (the residual stream) -> q [T, Hq, D]. Also writes each token's rotated K and its V
    into the paged caches [num_blocks, block_size, Hkv, D] at slot_mapping [T]."""
    return _qkv_composed(rms_norm_torch, rope_torch, kv_store_torch, x, norm_w, eps, w, positions,
                         cos_sin, k_cache, v_cache, slot_mapping, num_heads)


def linear_residual_torch(x, w, residual):
    """residual + x @ w^T (one matmul with the add in its epilogue)."""
    return torch.addmm(residual, x, w.t())


def norm_swiglu_torch(x, norm_w, eps, w_gate_up):
    """silu(n Wg^T) * (n Wu^T) with n = rmsnorm(x); w_gate_up = [Wg; Wu] stacked [2I, H]."""
    return silu_and_mul_torch(F.linear(rms_norm_torch(x, norm_w, eps), w_gate_up))


def norm_lm_head_torch(x, norm_w, eps, w, greedy=False):
    """The final norm and the LM head: fp32 logits [T, vocab] (and, greedy=True, their argmax)."""
    logits = F.linear(rms_norm_torch(x, norm_w, eps), w).float()
    return (logits, logits.argmax(dim=-1)) if greedy else logits


# --------------------------------------------------------------------------------------------
# the shared loop: acc[M, R] (+ a second accumulator for paired rows) and sum(x^2) per row
# --------------------------------------------------------------------------------------------
@triton.jit
def _mma(x, w, acc, IEEE: tl.constexpr):
    if IEEE:
        return acc + tl.dot(x, tl.trans(w), input_precision="ieee")
    else:
        return acc + tl.dot(x, tl.trans(w))


@triton.jit
def _stream_rows(x_ptr, stride_x, g_ptr, w_ptr, rows_a, rows_b, rmask, M, K,
                 HAS_NORM: tl.constexpr, PAIRED: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 IEEE: tl.constexpr):
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mmask = offs_m < M
    acc_a = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    wa_ptrs = w_ptr + rows_a[:, None] * K + offs_k[None, :]
    wb_ptrs = w_ptr + rows_b[:, None] * K + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_x + offs_k[None, :]
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            kmask = offs_k < BLOCK_K
        else:
            kmask = k0 + offs_k < K
        x = tl.load(x_ptrs + k0, mask=mmask[:, None] & kmask[None, :], other=0.0)
        if HAS_NORM:
            xf = x.to(tl.float32)
            sum_sq += tl.sum(xf * xf, axis=1)
            g = tl.load(g_ptr + k0 + offs_k, mask=kmask, other=0.0).to(tl.float32)
            x = (xf * g[None, :]).to(w_ptr.dtype.element_ty)
        wmask = rmask[:, None] & kmask[None, :]
        acc_a = _mma(x, tl.load(wa_ptrs + k0, mask=wmask, other=0.0), acc_a, IEEE)
        if PAIRED:
            acc_b = _mma(x, tl.load(wb_ptrs + k0, mask=wmask, other=0.0), acc_b, IEEE)
    return acc_a, acc_b, sum_sq


@triton.jit
def _linear_kernel(x_ptr, g_ptr, w_ptr, r_ptr, out_ptr, best_ptr, M, N, K, eps, stride_x, stride_r,
                   stride_o, HAS_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ARGMAX: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   EVEN_K: tl.constexpr, IEEE: tl.constexpr, IDX64: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < N
    w_rows = rows.to(tl.int64) if IDX64 else rows
    acc, _, sum_sq = _stream_rows(x_ptr, stride_x, g_ptr, w_ptr, w_rows, w_rows, rmask, M, K,
                                  HAS_NORM, False, BLOCK_M, BLOCK_R, BLOCK_K, EVEN_K, IEEE)
    if HAS_NORM:
        acc = acc * (1.0 / tl.sqrt(sum_sq / K + eps))[:, None]
    offs_m = tl.arange(0, BLOCK_M)
    omask = (offs_m < M)[:, None] & rmask[None, :]
    if HAS_RESIDUAL:
        acc += tl.load(r_ptr + offs_m[:, None] * stride_r + rows[None, :], mask=omask,
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_m[:, None] * stride_o + rows[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=omask)
    if ARGMAX:
        # greedy decoding: this program's best row per token, as (value, index) partials
        # best [2, M, programs] fp32; _argmax_merge_kernel picks the winner
        vals = tl.where(rmask[None, :], acc, float("-inf"))
        best = tl.max(vals, axis=1)
        idx = tl.argmax(vals, axis=1) + tl.program_id(0) * BLOCK_R
        slot = offs_m * tl.num_programs(0) + tl.program_id(0)
        tl.store(best_ptr + slot, best, mask=offs_m < M)
        tl.store(best_ptr + M * tl.num_programs(0) + slot, idx.to(tl.float32), mask=offs_m < M)


@triton.jit
def _argmax_merge_kernel(best_ptr, tok_ptr, M, P, BLOCK_P: tl.constexpr):
    m = tl.program_id(0)
    offs = tl.arange(0, BLOCK_P)
    vals = tl.load(best_ptr + m * P + offs, mask=offs < P, other=float("-inf"))
    win = tl.argmax(vals, axis=0)        # ties: the first program, whose index is the smaller
    idx = tl.load(best_ptr + M * P + m * P + win)
    tl.store(tok_ptr + m, idx.to(tl.int64))


@triton.jit
def _swiglu_kernel(x_ptr, g_ptr, w_ptr, out_ptr, M, INTER, K, eps, stride_x, stride_o,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   EVEN_K: tl.constexpr, IEEE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)       # gate rows; up = rows + INTER
    rmask = rows < INTER
    gate, up, sum_sq = _stream_rows(x_ptr, stride_x, g_ptr, w_ptr, rows, rows + INTER, rmask, M, K,
                                    True, True, BLOCK_M, BLOCK_R, BLOCK_K, EVEN_K, IEEE)
    inv_rms = (1.0 / tl.sqrt(sum_sq / K + eps))[:, None]
    gate = gate * inv_rms
    out = gate / (1.0 + tl.exp(-gate)) * (up * inv_rms)
    offs_m = tl.arange(0, BLOCK_M)
    tl.store(out_ptr + offs_m[:, None] * stride_o + rows[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(offs_m < M)[:, None] & rmask[None, :])


@triton.jit
def _qkv_rope_store_kernel(x_ptr, g_ptr, w_ptr, q_ptr, kc_ptr, vc_ptr, pos_ptr, cs_ptr, slot_ptr,
                           M, K, eps, stride_x,
                           HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                           EVEN_K: tl.constexpr, IEEE: tl.constexpr):
    # Output heads are stacked q (HQ), k (HKV), v (HKV). Each program takes BLOCK_R pairs
    # (i, i + D/2) of one head -- exactly the pairs RoPE rotates together.
    HALF: tl.constexpr = D // 2
    PER_HEAD: tl.constexpr = (HALF + BLOCK_R - 1) // BLOCK_R
    head = tl.program_id(0) // PER_HEAD
    i = (tl.program_id(0) % PER_HEAD) * BLOCK_R + tl.arange(0, BLOCK_R)
    imask = i < HALF
    rows = head * D + i
    a, b, sum_sq = _stream_rows(x_ptr, stride_x, g_ptr, w_ptr, rows, rows + HALF, imask, M, K,
                                True, True, BLOCK_M, BLOCK_R, BLOCK_K, EVEN_K, IEEE)
    inv_rms = (1.0 / tl.sqrt(sum_sq / K + eps))[:, None]
    a = a * inv_rms
    b = b * inv_rms
    offs_m = tl.arange(0, BLOCK_M)
    mmask = offs_m < M
    omask = mmask[:, None] & imask[None, :]
    if head < HQ + HKV:                                     # q and k heads: rotate the pairs
        pos = tl.load(pos_ptr + offs_m, mask=mmask, other=0)
        cs = cs_ptr + pos[:, None] * D + i[None, :]          # cos_sin [max_pos, D] = cos | sin
        cos = tl.load(cs, mask=omask, other=0.0)
        sin = tl.load(cs + HALF, mask=omask, other=0.0)
        a, b = a * cos - b * sin, b * cos + a * sin
    if head < HQ:
        dst = q_ptr + offs_m[:, None] * (HQ * D) + rows[None, :]
        tl.store(dst, a.to(q_ptr.dtype.element_ty), mask=omask)
        tl.store(dst + HALF, b.to(q_ptr.dtype.element_ty), mask=omask)
    else:
        slot = tl.load(slot_ptr + offs_m, mask=mmask, other=-1).to(tl.int64)
        smask = omask & (slot >= 0)[:, None]                 # a negative slot stores nothing
        if head < HQ + HKV:
            dst = kc_ptr + (slot * HKV + (head - HQ))[:, None] * D + i[None, :]
            tl.store(dst, a.to(kc_ptr.dtype.element_ty), mask=smask)
            tl.store(dst + HALF, b.to(kc_ptr.dtype.element_ty), mask=smask)
        else:
            dst = vc_ptr + (slot * HKV + (head - HQ - HKV))[:, None] * D + i[None, :]
            tl.store(dst, a.to(vc_ptr.dtype.element_ty), mask=smask)
            tl.store(dst + HALF, b.to(vc_ptr.dtype.element_ty), mask=smask)


# --------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------
def _rows2d(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def _common(x, k, cfg):
    return dict(BLOCK_M=16, BLOCK_R=cfg["BLOCK_R"], BLOCK_K=cfg["BLOCK_K"],
                EVEN_K=k % cfg["BLOCK_K"] == 0, IEEE=x.dtype == torch.float32,
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def _use_fused(x, fused) -> bool:
    """fused=None: the fused kernel for 1..MAX_ROWS tokens; True/False forces a path."""
    if fused is None:
        return 0 < x.shape[0] <= MAX_ROWS
    if fused and x.shape[0] > MAX_ROWS:
        raise ValueError(f"the fused kernels take at most {MAX_ROWS} rows, got {x.shape[0]}")
    return fused and x.shape[0] > 0


def norm_qkv_rope_store_triton(x, norm_w, eps, w, positions, cos_sin, k_cache, v_cache,
                               slot_mapping, num_heads, config=None, fused=None):
    """Same contract as norm_qkv_rope_store_torch: one launch for up to MAX_ROWS tokens."""
    if not _use_fused(x, fused):
        return _qkv_composed(rms_norm_triton, rope_triton, kv_store_triton, x, norm_w, eps, w,
                             positions, cos_sin, k_cache, v_cache, slot_mapping, num_heads)
    t, k = x.shape
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and w.is_contiguous()
    assert cos_sin.is_contiguous() and cos_sin.shape[1] == d
    cfg = config or GEMV_CONFIG["qkv"]
    x = _rows2d(x)
    q = torch.empty((t, num_heads, d), dtype=x.dtype, device=x.device)
    per_head = triton.cdiv(d // 2, cfg["BLOCK_R"])
    _qkv_rope_store_kernel[((num_heads + 2 * hkv) * per_head,)](
        x, norm_w, w, q, k_cache, v_cache, positions, cos_sin, slot_mapping, t, k, eps, x.stride(0),
        HQ=num_heads, HKV=hkv, D=d, **_common(x, k, cfg))
    return q


def linear_residual_triton(x, w, residual, config=None, fused=None):
    """Same contract as linear_residual_torch."""
    if not _use_fused(x, fused):
        return torch.addmm(residual, x, w.t())
    return _linear(x, None, 0.0, w, residual, residual.dtype, config or GEMV_CONFIG["residual"])


def norm_lm_head_triton(x, norm_w, eps, w, config=None, fused=None, greedy=False):
    """Same contract as norm_lm_head_torch. greedy=True also returns each row's argmax (int64),
    taken inside the fused kernel (per-program partials + one tiny merge launch)."""
    if not _use_fused(x, fused):
        logits = F.linear(rms_norm_triton(x, norm_w, eps), w).float()
        return (logits, logits.argmax(dim=-1)) if greedy else logits
    return _linear(x, norm_w, eps, w, None, torch.float32, config or GEMV_CONFIG["lm_head"], greedy)


def _linear(x, norm_w, eps, w, residual, out_dtype, cfg, greedy=False):
    t, k = x.shape
    n = w.shape[0]
    assert w.is_contiguous()
    assert not greedy or n < 2 ** 24           # indices travel as fp32 partials: exact below 2^24
    x = _rows2d(x)
    out = torch.empty((t, n), dtype=out_dtype, device=x.device)
    r = _rows2d(residual) if residual is not None else out
    programs = triton.cdiv(n, cfg["BLOCK_R"])
    best = torch.empty((2, t, programs), dtype=torch.float32, device=x.device) if greedy else out
    _linear_kernel[(programs,)](
        x, norm_w if norm_w is not None else w, w, r, out, best, t, n, k, eps, x.stride(0),
        r.stride(0), out.stride(0), HAS_NORM=norm_w is not None, HAS_RESIDUAL=residual is not None,
        ARGMAX=greedy, IDX64=w.numel() >= 2 ** 31, **_common(x, k, cfg))
    if not greedy:
        return out
    tokens = torch.empty(t, dtype=torch.int64, device=x.device)
    _argmax_merge_kernel[(t,)](best, tokens, t, programs, BLOCK_P=triton.next_power_of_2(programs),
                               num_warps=4)
    return out, tokens


def norm_swiglu_triton(x, norm_w, eps, w_gate_up, config=None, fused=None):
    """Same contract as norm_swiglu_torch."""
    if not _use_fused(x, fused):
        return silu_and_mul_triton(F.linear(rms_norm_triton(x, norm_w, eps), w_gate_up))
    t, k = x.shape
    inter = w_gate_up.shape[0] // 2
    assert w_gate_up.is_contiguous()
    cfg = config or GEMV_CONFIG["swiglu"]
    x = _rows2d(x)
    out = torch.empty((t, inter), dtype=x.dtype, device=x.device)
    _swiglu_kernel[(triton.cdiv(inter, cfg["BLOCK_R"]),)](
        x, norm_w, w_gate_up, out, t, inter, k, eps, x.stride(0), out.stride(0), **_common(x, k, cfg))
    return out

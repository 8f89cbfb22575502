"""Decode-time linear layers: matrix-vector products with their neighbours fused in.

When only a few tokens are in a step (decode at small batch), every matmul of
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

At one decode token the attention can also run inside the first launch (the config's ATTN,
norm_qkv_rope_store_attend): the program that finishes the last row block of a KV head's group
(its query heads, K and V) attends for that group -- four launches a layer.

Two tricks make the fusion free:
  * the norm: rmsnorm(x) W^T = rsqrt(mean(x^2) + eps) * ((x * g) W^T). Every program streams all of
    x for its dot products anyway, so it sums x^2 in the same loop and scales its outputs at the end.
  * RoPE and SwiGLU both combine output row r with output row r + offset (RoPE: the two halves of a
    head, offset D/2; SwiGLU: gate row r and up row r, offset I). A program computes PAIRS of rows
    (two accumulators over the same x tile) and combines them before storing.

Each program owns BLOCK_R output rows (or row pairs) and a K_SPLIT-wide slice of K: it multiplies
its weight tile by x and sums (plain fp32 FMAs: at one token there is nothing for tensor cores to
do). Splitting K gives enough programs to keep every SM's memory pipe busy even for the small
matrices (QKV, O); the programs of a row block add their partial sums up inside the same launch
(the last one to finish does it, in a fixed order, see _gather_splits).

Every function has a `*_torch` version (the plain composition of the reference kernels: the CPU
path and the test oracle) and a `*_triton` launcher that runs the fused kernel for up to FUSE_UP_TO
tokens and, above that (prefill, decode batches, where cuBLAS's tensor-core matmuls win), the
composition of the unfused Triton kernels with cuBLAS. The launchers take their launch parameters
(`config`, one entry of GEMV_CONFIG unless given) and the PDL mode (`pdl`, see pdl.py) as explicit
keyword arguments; select_kernels binds them.
"""
from __future__ import annotations

import json
import os

import torch
import triton
import triton.language as tl

from ..quantization import FP8Weight, linear
from .activation import silu_and_mul_torch, silu_and_mul_triton
from .decode_attention import attend_group, decode_attention_torch
from . import scratch
from .kv_store import kv_store_torch, kv_store_triton
from .launch import INT32_LIMIT, freeze, merge_config, num_stages
from .pdl import launch_options, main_loop_done, pdl_flag, start as pdl_start
from .rmsnorm import rms_norm_torch, rms_norm_triton
from .rope import rope_torch, rope_triton

MAX_ROWS = 16          # the fused kernels handle up to this many tokens...
FUSE_UP_TO = 1         # ...and are used (fused=None) up to this many: measured by bench_gemv,
                       # with more tokens cuBLAS's tensor-core matmuls win
DOT_ROWS: tl.constexpr = tl.constexpr(16)   # from this many (padded) tokens the kernels use tensor cores
# fused_rows(mode): inside it, steps of a few tokens use the fused kernels too -- what a speculative
# engine captures its small decode graphs with (runner.py), where a verify step's k + 1 rows would
# otherwise leave the fused kernels for cuBLAS and twice the launches. Modes:
#   "fma"        2..FMA_ROWS tokens, any dtype: each token against the weight tile as loaded
#                (_stream_each_row: the one-token kernels' fp32 FMAs, the weights read once)
#   "fma_layers" the same for the layers, the LM head stays cuBLAS (its rows x vocab of FMAs)
#   "dot"        2..MAX_ROWS tokens of a 16-bit model, rows padded to DOT_ROWS (tensor cores)
FMA_ROWS = 5          # H200, SmolLM2 graph replay: fma_layers faster at 2..5 rows, slower at 8
# 2..FMA_ROWS tokens do up to that many times the one-token kernels' FMAs with the same launch
# parameters; K is split further (halving K_SPLIT, not below BLOCK_K) until a launch has at least
# this many programs (0: the one-token split). H200, SmolLM2 shapes, 5 rows, 30 layers + LM head:
# 1,067 us at 0, 851 at 264 (two per SM), 851 at 528. PAGEDLAB_FMA_MIN_PROGRAMS sets it at import.
FMA_MIN_PROGRAMS = int(os.environ.get("PAGEDLAB_FMA_MIN_PROGRAMS", "264"))
FUSED_ROWS_MODES = ("fma", "fma_layers", "dot")
_FUSED_ROWS = [False]

# Launch parameters per kernel: BLOCK_R output rows (row pairs for qkv/swiglu) per program,
# K_SPLIT columns of K per program (split-K: K / K_SPLIT programs share a row block), BLOCK_K
# columns per loop step, warps, software-pipeline stages. At one token only: ACC2D (sum over K
# once per program), PREFETCH (about this many extra programs read the NEXT kernel's matrix
# into L2 -- the one the model passes as `prefetch=` -- at most PREFETCH_MB of it, 0 = all;
# see _prefetch_l2). qkv only, one decode token: ATTN (the decode attention runs in the QKV
# launch's tail -- norm_qkv_rope_store_attend_triton -- when the step's context bound is at most
# ATTN tokens; 0 = off, two launches) and ATTN_BLOCK_N (keys per step of that attention; a power
# of two >= 16, attn_block_n).
# ATTN is off: measured exact but SLOWER on the H200 (2026-12-02, docs/kernels.md "One stream,
# session 13": bf16 graph 983.0 us against 890.0, FP8 688.6 against 680.0 -- the tail runs one
# program per KV head after the GEMV has drained).
# `python -m pagedlab bench gemv --tune` sweeps them and writes the best as JSON; a file named by
# the environment variable PAGEDLAB_GEMV_CONFIG replaces entries of these defaults at import.
# Read-only afterwards: pass another config (the launchers' `config=`) instead of changing it.
H200_GEMV_CONFIG = freeze({       # tuned on the H200 at one token
    # bf16: tuned 2026-11-29 (docs/engine.md). The one-token sweep of 2026-12-02 (bench gemv
    # --one-stream, docs/one_stream_probe.json) found faster tiles for each matrix ALONE, but in
    # the engine's graph they made the step slower (921.2 us against 896.7, same run,
    # docs/one_stream_confirm.json), so bf16 keeps these. QKV's launch prefetches the O
    # projection into L2 (PREFETCH): graph replay 891.8 us against 901.5 / 900.5 without, same
    # run, same tokens (2026-12-02, docs/one_stream_variants.json). Prefetching in the other
    # launches too was measured only beside a change since dropped (docs/kernels.md).
    "qkv": dict(BLOCK_R=16, K_SPLIT=256, BLOCK_K=256, num_warps=4, num_stages=1, ACC2D=0, PREFETCH=256, PREFETCH_MB=0,
                ATTN=0, ATTN_BLOCK_N=128),
    "swiglu": dict(BLOCK_R=16, K_SPLIT=2048, BLOCK_K=512, num_warps=4, num_stages=2, ACC2D=0, PREFETCH=0, PREFETCH_MB=0),
    "residual": dict(BLOCK_R=8, K_SPLIT=2048, BLOCK_K=512, num_warps=4, num_stages=3, ACC2D=0, PREFETCH=0, PREFETCH_MB=0),
    # the MLP's down projection (K = intermediate > N = hidden): linear_residual's down_config
    "down": dict(BLOCK_R=8, K_SPLIT=2048, BLOCK_K=512, num_warps=4, num_stages=3, ACC2D=0, PREFETCH=0, PREFETCH_MB=0),
    "lm_head": dict(BLOCK_R=16, K_SPLIT=2048, BLOCK_K=512, num_warps=4, num_stages=1, ACC2D=0, PREFETCH=0, PREFETCH_MB=0),
    # the same kernels on FP8 weights (quantization.FP8Weight), which the launchers take as
    # `fp8_config`: a byte per weight, so the tiles are wider in K (8 warps hold the fp32
    # products). First tuned 2026-12-01 (bench gemv --fp8 --tune: docs/gemv_fp8_bench.json);
    # qkv, residual (O) and lm_head re-picked by the one-token sweep of 2026-12-02, which made
    # the engine's graph 679.4 us against 717.7 (same run, docs/one_stream_confirm.json); down
    # keeps the old residual tiles (the new O tiles are slower on it: 9.56 us against 8.56).
    # gate/up since session 15: 16 rows x 512 columns of 4 warps (session 14's offline sm_90
    # build: no register spill, two programs per SM; the old tile spilled): graph 673.7 us
    # against 683.0 / 682.8 (same process, docs/kernels.md "One stream, session 15").
    "qkv_fp8": dict(BLOCK_R=8, K_SPLIT=2048, BLOCK_K=1024, num_warps=8, num_stages=2, ACC2D=1, PREFETCH=0, PREFETCH_MB=0,
                    ATTN=0, ATTN_BLOCK_N=128),
    "swiglu_fp8": dict(BLOCK_R=16, K_SPLIT=2048, BLOCK_K=512, num_warps=4, num_stages=2, ACC2D=0, PREFETCH=0, PREFETCH_MB=0),
    "residual_fp8": dict(BLOCK_R=8, K_SPLIT=2048, BLOCK_K=2048, num_warps=8, num_stages=1, ACC2D=0, PREFETCH=0, PREFETCH_MB=0),
    "down_fp8": dict(BLOCK_R=16, K_SPLIT=2048, BLOCK_K=1024, num_warps=8, num_stages=1, ACC2D=0, PREFETCH=0, PREFETCH_MB=0),
    "lm_head_fp8": dict(BLOCK_R=64, K_SPLIT=2048, BLOCK_K=512, num_warps=8, num_stages=2, ACC2D=0, PREFETCH=0, PREFETCH_MB=0),
})
CONFIG_ENV_VAR = "PAGEDLAB_GEMV_CONFIG"


def _config_from_env():
    path = os.environ.get(CONFIG_ENV_VAR)
    if not path:
        return H200_GEMV_CONFIG
    with open(path) as f:
        return merge_config(H200_GEMV_CONFIG, json.load(f), f"{CONFIG_ENV_VAR} ({path})")


GEMV_CONFIG = _config_from_env()
# Which entry of GEMV_CONFIG each launcher (by the name the model calls it) uses.
CONFIG_KEYS = {"norm_qkv_rope_store": "qkv", "linear_residual": "residual",
               "norm_swiglu": "swiglu", "norm_lm_head": "lm_head"}
# fp32 values of the [tokens, rows, columns] product one program of 4 warps multiplies per loop
# step (its registers; a program of 8 warps may hold twice as many); BLOCK_K is lowered to keep
# within it when there are many tokens.
MAX_PRODUCT_VALUES = 8192


# --------------------------------------------------------------------------------------------
# references: the unfused composition (CPU path, large batches, test oracle)
# --------------------------------------------------------------------------------------------
def _qkv_composed(norm, rope, kv_store, x, norm_w, eps, w, positions, cos_sin, k_cache, v_cache,
                  slot_mapping, num_heads):
    t = x.shape[0]
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    q, k, v = linear(norm(x, norm_w, eps), w).split([num_heads * d, hkv * d, hkv * d], dim=-1)
    q, k = rope(q.reshape(t, num_heads, d), k.reshape(t, hkv, d), positions, cos_sin)
    kv_store(k, v.reshape(t, hkv, d), k_cache, v_cache, slot_mapping)
    return q


def norm_qkv_rope_store_torch(x, norm_w, eps, w, positions, cos_sin, k_cache, v_cache,
                              slot_mapping, num_heads, prefetch=None):
    """x [T, H] (the residual stream) -> q [T, Hq, D]. Also writes each token's rotated K and its V
    into the paged caches [num_blocks, block_size, Hkv, D] at slot_mapping [T]. prefetch (the
    next matrix, which the Triton launchers may pull into L2) is ignored here, as below."""
    return _qkv_composed(rms_norm_torch, rope_torch, kv_store_torch, x, norm_w, eps, w, positions,
                         cos_sin, k_cache, v_cache, slot_mapping, num_heads)


def linear_residual_torch(x, w, residual, prefetch=None):
    """residual + x @ w^T (one matmul with the add in its epilogue)."""
    return linear(x, w, residual)


def norm_swiglu_torch(x, norm_w, eps, w_gate_up, prefetch=None):
    """silu(n Wg^T) * (n Wu^T) with n = rmsnorm(x); w_gate_up = [Wg; Wu] stacked [2I, H]."""
    return silu_and_mul_torch(linear(rms_norm_torch(x, norm_w, eps), w_gate_up))


def norm_lm_head_torch(x, norm_w, eps, w, greedy=False):
    """The final norm and the LM head: fp32 logits [T, vocab] (and, greedy=True, their argmax)."""
    logits = linear(rms_norm_torch(x, norm_w, eps), w).float()
    return (logits, logits.argmax(dim=-1)) if greedy else logits


# --------------------------------------------------------------------------------------------
# the shared part: one program's slice of K for its rows, then the split-K reduction
# --------------------------------------------------------------------------------------------
@triton.jit
def _partial_dot(x, w, acc, BLOCK_M: tl.constexpr):
    """acc[M, R] += x[M, K] . w[R, K]^T. One token: multiply-and-sum in fp32, no tensor cores, and
    no reshuffling of the weight tile into a matmul layout -- it is used exactly as it was loaded
    (2..8 tokens do the same one token at a time: _stream_each_row). From 16 tokens (rows padded
    to 16: fused_rows "dot", see DOT_ROWS) a tensor-core dot, in x's dtype (the model's: bf16/fp16
    x and weights; fp32 exactly, "ieee"), accumulating in fp32."""
    if BLOCK_M == 1:
        return acc + tl.sum(w.to(tl.float32) * x, axis=1)[None, :]          # x [1, K] broadcasts
    elif x.dtype == tl.float32:
        return tl.dot(x, tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    else:
        return tl.dot(x, tl.trans(w.to(x.dtype)), acc)


@triton.jit
def _stream_rows(x_ptr, stride_x, g_ptr, w_ptr, rows_a, rows_b, rmask, M, K, k_split,
                 HAS_NORM: tl.constexpr, PAIRED: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                 ACC2D: tl.constexpr = 0):
    """This program's partial sums over columns [split * k_split, (split + 1) * k_split) of K:
    acc_a[M, R] (and acc_b for the paired rows) and, for the norm, sum(x^2) per token.
    PDL (pdl.py): the weights never depend on the kernel before; x does, so wait before x.
    ACC2D (one token only): keep the products in an [R, BLOCK_K] fp32 accumulator and sum over K
    once after the loop, instead of a cross-thread sum (shuffles, a barrier between warps) per
    loop step -- the loop then only loads and multiplies-and-adds."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mmask = offs_m < M
    acc_a = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_lo = tl.program_id(1) * k_split
    k_hi = tl.minimum(k_lo + k_split, K)
    pdl_start(PDL)
    if ACC2D:
        tile_a = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
        tile_b = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
        sq = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            cols = k0 + offs_k
            kmask = cols < k_hi
            x = tl.load(x_ptr + cols, mask=kmask, other=0.0).to(tl.float32)
            if HAS_NORM:
                sq += x * x
                x = x * tl.load(g_ptr + cols, mask=kmask, other=0.0).to(tl.float32)
            wmask = rmask[:, None] & kmask[None, :]
            wa = tl.load(w_ptr + rows_a[:, None] * K + cols[None, :], mask=wmask, other=0.0)
            tile_a += wa.to(tl.float32) * x[None, :]
            if PAIRED:
                wb = tl.load(w_ptr + rows_b[:, None] * K + cols[None, :], mask=wmask, other=0.0)
                tile_b += wb.to(tl.float32) * x[None, :]
        main_loop_done(PDL)
        acc_a += tl.sum(tile_a, axis=1)[None, :]
        if PAIRED:
            acc_b += tl.sum(tile_b, axis=1)[None, :]
        sum_sq += tl.sum(sq, axis=0)
    else:
        for k0 in range(k_lo, k_hi, BLOCK_K):
            cols = k0 + offs_k
            kmask = cols < k_hi
            x = tl.load(x_ptr + offs_m[:, None] * stride_x + cols[None, :],
                        mask=mmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
            if HAS_NORM:
                sum_sq += tl.sum(x * x, axis=1)
                x = x * tl.load(g_ptr + cols, mask=kmask, other=0.0).to(tl.float32)[None, :]
            if BLOCK_M >= DOT_ROWS:                 # tensor cores: x in the model's dtype
                x = x.to(x_ptr.dtype.element_ty)
            wmask = rmask[:, None] & kmask[None, :]
            wa = tl.load(w_ptr + rows_a[:, None] * K + cols[None, :], mask=wmask, other=0.0)
            acc_a = _partial_dot(x, wa, acc_a, BLOCK_M)
            if PAIRED:
                wb = tl.load(w_ptr + rows_b[:, None] * K + cols[None, :], mask=wmask, other=0.0)
                acc_b = _partial_dot(x, wb, acc_b, BLOCK_M)
        main_loop_done(PDL)
    return acc_a, acc_b, sum_sq


@triton.jit
def _stream_each_row(x_ptr, stride_x, g_ptr, w_ptr, rows_a, rows_b, rmask, M, K, k_split,
                     HAS_NORM: tl.constexpr, PAIRED: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """_stream_rows for 2..8 tokens (a speculative verify step's rows): the weight tile is loaded
    and widened to fp32 ONCE, then each token's x row is multiplied against it exactly as the
    one-token kernel does (fp32 FMAs and a sum over K, no tensor cores, no transposed tile), its
    sums written into that token's row of the accumulators. The weights -- all the memory traffic
    -- are read once for all tokens; tokens past M (rows of a smaller step) are skipped."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    acc_a = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_lo = tl.program_id(1) * k_split
    k_hi = tl.minimum(k_lo + k_split, K)
    pdl_start(PDL)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        cols = k0 + offs_k
        kmask = cols < k_hi
        wmask = rmask[:, None] & kmask[None, :]
        wa = tl.load(w_ptr + rows_a[:, None] * K + cols[None, :], mask=wmask, other=0.0).to(tl.float32)
        if PAIRED:
            wb = tl.load(w_ptr + rows_b[:, None] * K + cols[None, :], mask=wmask, other=0.0).to(tl.float32)
        if HAS_NORM:
            g = tl.load(g_ptr + cols, mask=kmask, other=0.0).to(tl.float32)
        for m in tl.static_range(BLOCK_M):
            if m < M:
                x = tl.load(x_ptr + m * stride_x + cols, mask=kmask, other=0.0).to(tl.float32)
                here = offs_m == m
                if HAS_NORM:
                    sum_sq = tl.where(here, sum_sq + tl.sum(x * x, axis=0), sum_sq)
                    x = x * g
                acc_a = tl.where(here[:, None], acc_a + tl.sum(wa * x[None, :], axis=1)[None, :], acc_a)
                if PAIRED:
                    acc_b = tl.where(here[:, None], acc_b + tl.sum(wb * x[None, :], axis=1)[None, :], acc_b)
    main_loop_done(PDL)
    return acc_a, acc_b, sum_sq


@triton.jit
def _gather_splits(acc_a, acc_b, sum_sq, ws_ptr, cnt_ptr, PAIRED: tl.constexpr,
                   SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                   PF_BLOCKS: tl.constexpr = 0):
    """Split-K without a second launch: every program of a row block writes its partial sums to a
    workspace and bumps the block's counter (atomic, release: the partials are visible first).
    The program that bumps it last adds the partials up -- in split order, so the result does
    not depend on which program finished first -- resets the counter for the next launch, and
    alone goes on to the epilogue. Returns (is_last, acc_a, acc_b, sum_sq)."""
    TILE: tl.constexpr = BLOCK_M * BLOCK_R
    PER_SPLIT: tl.constexpr = 2 * TILE + BLOCK_M
    block = tl.program_id(0) - PF_BLOCKS                # the first PF_BLOCKS prefetch (_prefetch_l2)
    base = ws_ptr + block.to(tl.int64) * (SPLITS * PER_SPLIT)
    offs_m = tl.arange(0, BLOCK_M)
    tile = offs_m[:, None] * BLOCK_R + tl.arange(0, BLOCK_R)[None, :]
    mine = base + tl.program_id(1) * PER_SPLIT
    tl.store(mine + tile, acc_a)
    if PAIRED:
        tl.store(mine + TILE + tile, acc_b)
    tl.store(mine + 2 * TILE + offs_m, sum_sq)
    # (A scalar atomic is issued by one thread; Triton puts a CTA barrier before it -- bar.sync in
    # the PTX for sm75 and sm90 with Triton 3.6 and 3.9 -- so every warp's partials are written
    # before the count releases them. tests/test_kernel_ptx.py)
    arrived = tl.atomic_add(cnt_ptr + block, 1, sem="acq_rel")
    last = arrived == SPLITS - 1
    if last:
        acc_a = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            part = base + s * PER_SPLIT
            acc_a += tl.load(part + tile, cache_modifier=".cg")
            if PAIRED:
                acc_b += tl.load(part + TILE + tile, cache_modifier=".cg")
            sum_sq += tl.load(part + 2 * TILE + offs_m, cache_modifier=".cg")
        tl.atomic_xchg(cnt_ptr + block, 0)
    return last, acc_a, acc_b, sum_sq


@triton.jit
def _dot_rows(x_ptr, stride_x, g_ptr, w_ptr, s_ptr, rows_a, rows_b, rmask, M, K, k_split, eps,
              ws_ptr, cnt_ptr, HAS_NORM: tl.constexpr, PAIRED: tl.constexpr, HAS_SCALE: tl.constexpr,
              SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
              BLOCK_K: tl.constexpr, PDL: tl.constexpr, ACC2D: tl.constexpr = 0,
              PF_BLOCKS: tl.constexpr = 0):
    """What every kernel below starts with: this program's partial dot products (_stream_rows),
    the split-K sum (_gather_splits), the FP8 weights' per-row scales (HAS_SCALE: w holds fp8
    codes, s_ptr one fp32 scale per row; the sums were taken over the codes) and the norm's 1/rms.
    Returns (last, acc_a, acc_b): only the program with `last` set holds the full sums and goes
    on to its kernel's epilogue."""
    if BLOCK_M > 1 and BLOCK_M < DOT_ROWS:      # a few rows: each against the tile (_stream_each_row)
        acc_a, acc_b, sum_sq = _stream_each_row(x_ptr, stride_x, g_ptr, w_ptr, rows_a, rows_b, rmask, M, K,
                                                k_split, HAS_NORM, PAIRED, BLOCK_M, BLOCK_R, BLOCK_K, PDL)
    else:
        acc_a, acc_b, sum_sq = _stream_rows(x_ptr, stride_x, g_ptr, w_ptr, rows_a, rows_b, rmask, M, K,
                                            k_split, HAS_NORM, PAIRED, BLOCK_M, BLOCK_R, BLOCK_K, PDL,
                                            ACC2D)
    if SPLITS > 1:
        last, acc_a, acc_b, sum_sq = _gather_splits(acc_a, acc_b, sum_sq, ws_ptr, cnt_ptr, PAIRED,
                                                    SPLITS, BLOCK_M, BLOCK_R, PF_BLOCKS)
    else:
        last = True
    if HAS_SCALE:
        acc_a = acc_a * tl.load(s_ptr + rows_a, mask=rmask, other=0.0)[None, :]
        if PAIRED:
            acc_b = acc_b * tl.load(s_ptr + rows_b, mask=rmask, other=0.0)[None, :]
    if HAS_NORM:
        inv_rms = (1.0 / tl.sqrt(sum_sq / K + eps))[:, None]
        acc_a = acc_a * inv_rms
        acc_b = acc_b * inv_rms
    return last, acc_a, acc_b


@triton.jit
def _prefetch_l2(pf_ptr, pf_n, sink_ptr, PF_BLOCKS: tl.constexpr, PF_BLOCK: tl.constexpr):
    """An extra program of a launch (the first PF_BLOCKS row blocks of its grid, so the first to
    start): read its share of the first pf_n words of another weight -- the one the NEXT kernel
    streams -- so that it is in L2 when that kernel runs (evict_last: kept over streaming data).
    It waits for nothing (no PDL wait: weights never depend on an earlier kernel), so it runs
    while the launch's own programs wait, stream and reduce. (The next kernel's PDL wait still
    waits for it: it is part of this launch.) The words are summed into sink (one int32 per
    program) only so that the loads are kept."""
    n_progs = PF_BLOCKS * tl.num_programs(1)
    idx = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    chunk = tl.cdiv(tl.cdiv(pf_n, n_progs), PF_BLOCK) * PF_BLOCK
    lo = idx * chunk
    hi = tl.minimum(lo + chunk, pf_n)
    offs = tl.arange(0, PF_BLOCK)
    acc = tl.zeros([PF_BLOCK], dtype=tl.int32)
    for s in range(lo, hi, PF_BLOCK):
        acc += tl.load(pf_ptr + s + offs, mask=s + offs < hi, other=0, eviction_policy="evict_last")
    tl.store(sink_ptr + idx, tl.sum(acc, axis=0))


@triton.jit
def _linear_kernel(x_ptr, g_ptr, w_ptr, s_ptr, r_ptr, out_ptr, best_ptr, ws_ptr, cnt_ptr, M, N, K,
                   k_split, eps, stride_x, stride_r, stride_o, HAS_NORM: tl.constexpr,
                   HAS_RESIDUAL: tl.constexpr, ARGMAX: tl.constexpr, HAS_SCALE: tl.constexpr,
                   SPLITS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   IDX64: tl.constexpr, PDL: tl.constexpr, ACC2D: tl.constexpr = 0,
                   pf_ptr=None, pf_n=0, sink_ptr=None, PF_BLOCKS: tl.constexpr = 0,
                   PF_BLOCK: tl.constexpr = 1024):
    if PF_BLOCKS > 0:                        # the first PF_BLOCKS row blocks: L2 prefetch only
        if tl.program_id(0) < PF_BLOCKS:
            _prefetch_l2(pf_ptr, pf_n, sink_ptr, PF_BLOCKS, PF_BLOCK)
            return
    block = tl.program_id(0) - PF_BLOCKS
    rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < N
    w_rows = rows.to(tl.int64) if IDX64 else rows
    last, acc, _ = _dot_rows(x_ptr, stride_x, g_ptr, w_ptr, s_ptr, w_rows, w_rows, rmask, M, K, k_split,
                             eps, ws_ptr, cnt_ptr, HAS_NORM, False, HAS_SCALE, SPLITS, BLOCK_M, BLOCK_R,
                             BLOCK_K, PDL, ACC2D, PF_BLOCKS)
    if last:
        offs_m = tl.arange(0, BLOCK_M)
        omask = (offs_m < M)[:, None] & rmask[None, :]
        if HAS_RESIDUAL:
            acc += tl.load(r_ptr + offs_m[:, None] * stride_r + rows[None, :], mask=omask,
                           other=0.0).to(tl.float32)
        tl.store(out_ptr + offs_m[:, None] * stride_o + rows[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=omask)
        if ARGMAX:
            # greedy decoding: this row block's best row per token, as (value, index) partials
            # in best [2, M, row blocks] fp32; _argmax_merge_kernel picks the winner
            vals = tl.where(rmask[None, :], acc, float("-inf"))
            best = tl.max(vals, axis=1)
            # (min: where every logit is NaN the reduction may end on a masked lane past N;
            # a token id outside the vocabulary would be an illegal address a step later)
            idx = tl.minimum(tl.argmax(vals, axis=1) + tl.program_id(0) * BLOCK_R, N - 1)
            at = offs_m * tl.num_programs(0) + tl.program_id(0)
            tl.store(best_ptr + at, best, mask=offs_m < M)
            tl.store(best_ptr + M * tl.num_programs(0) + at, idx.to(tl.float32), mask=offs_m < M)


@triton.jit
def _argmax_merge_kernel(best_ptr, tok_ptr, M, P, BLOCK_P: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    m = tl.program_id(0)
    offs = tl.arange(0, BLOCK_P)
    vals = tl.load(best_ptr + m * P + offs, mask=offs < P, other=float("-inf"))
    win = tl.minimum(tl.argmax(vals, axis=0), P - 1)   # ties: the first block (smaller index)
    idx = tl.load(best_ptr + M * P + m * P + win)
    tl.store(tok_ptr + m, idx.to(tl.int64))


@triton.jit
def _swiglu_kernel(x_ptr, g_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, M, INTER, K, k_split, eps,
                   stride_x, stride_o, HAS_SCALE: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                   ACC2D: tl.constexpr = 0, pf_ptr=None, pf_n=0, sink_ptr=None,
                   PF_BLOCKS: tl.constexpr = 0, PF_BLOCK: tl.constexpr = 1024):
    if PF_BLOCKS > 0:
        if tl.program_id(0) < PF_BLOCKS:
            _prefetch_l2(pf_ptr, pf_n, sink_ptr, PF_BLOCKS, PF_BLOCK)
            return
    rows = (tl.program_id(0) - PF_BLOCKS) * BLOCK_R + tl.arange(0, BLOCK_R)     # gate rows; up = + INTER
    rmask = rows < INTER
    last, gate, up = _dot_rows(x_ptr, stride_x, g_ptr, w_ptr, s_ptr, rows, rows + INTER, rmask, M, K,
                               k_split, eps, ws_ptr, cnt_ptr, True, True, HAS_SCALE, SPLITS, BLOCK_M,
                               BLOCK_R, BLOCK_K, PDL, ACC2D, PF_BLOCKS)
    if last:
        out = gate / (1.0 + tl.exp(-gate)) * up
        offs_m = tl.arange(0, BLOCK_M)
        tl.store(out_ptr + offs_m[:, None] * stride_o + rows[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & rmask[None, :])


@triton.jit(do_not_specialize=["max_blocks"])
def _qkv_rope_store_kernel(x_ptr, g_ptr, w_ptr, s_ptr, q_ptr, kc_ptr, vc_ptr, pos_ptr, cs_ptr,
                           slot_ptr, ws_ptr, cnt_ptr, M, K, k_split, eps, stride_x,
                           HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HAS_SCALE: tl.constexpr,
                           SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_K: tl.constexpr, PDL: tl.constexpr, ACC2D: tl.constexpr = 0,
                           pf_ptr=None, pf_n=0, sink_ptr=None, PF_BLOCKS: tl.constexpr = 0,
                           PF_BLOCK: tl.constexpr = 1024,
                           o_ptr=None, bt_ptr=None, sl_ptr=None, gcnt_ptr=None, sm_scale=1.0,
                           max_blocks=0, ATTN: tl.constexpr = 0, BS: tl.constexpr = 16,
                           GP: tl.constexpr = 16, BLOCK_N: tl.constexpr = 128,
                           IEEE: tl.constexpr = 0, KV64: tl.constexpr = 0):
    # Output heads are stacked q (HQ), k (HKV), v (HKV). Each row block is BLOCK_R pairs
    # (i, i + D/2) of one head -- exactly the pairs RoPE rotates together.
    if PF_BLOCKS > 0:
        if tl.program_id(0) < PF_BLOCKS:
            _prefetch_l2(pf_ptr, pf_n, sink_ptr, PF_BLOCKS, PF_BLOCK)
            return
    HALF: tl.constexpr = D // 2
    PER_HEAD: tl.constexpr = (HALF + BLOCK_R - 1) // BLOCK_R
    block = tl.program_id(0) - PF_BLOCKS
    head = block // PER_HEAD
    i = (block % PER_HEAD) * BLOCK_R + tl.arange(0, BLOCK_R)
    imask = i < HALF
    rows = head * D + i
    last, a, b = _dot_rows(x_ptr, stride_x, g_ptr, w_ptr, s_ptr, rows, rows + HALF, imask, M, K, k_split,
                           eps, ws_ptr, cnt_ptr, True, True, HAS_SCALE, SPLITS, BLOCK_M, BLOCK_R,
                           BLOCK_K, PDL, ACC2D, PF_BLOCKS)
    if last:
        offs_m = tl.arange(0, BLOCK_M)
        mmask = offs_m < M
        omask = mmask[:, None] & imask[None, :]
        if head < HQ + HKV:                                 # q and k heads: rotate the pairs
            pos = tl.load(pos_ptr + offs_m, mask=mmask, other=0)
            cs = cs_ptr + pos[:, None] * D + i[None, :]      # cos_sin [max_pos, D] = cos | sin
            cos = tl.load(cs, mask=omask, other=0.0)
            sin = tl.load(cs + HALF, mask=omask, other=0.0)
            a, b = a * cos - b * sin, b * cos + a * sin
        if head < HQ:
            dst = q_ptr + offs_m[:, None] * (HQ * D) + rows[None, :]
            tl.store(dst, a.to(q_ptr.dtype.element_ty), mask=omask)
            tl.store(dst + HALF, b.to(q_ptr.dtype.element_ty), mask=omask)
        else:
            slot = tl.load(slot_ptr + offs_m, mask=mmask, other=-1).to(tl.int64)
            smask = omask & (slot >= 0)[:, None]             # a negative slot stores nothing
            if head < HQ + HKV:
                dst = kc_ptr + (slot * HKV + (head - HQ))[:, None] * D + i[None, :]
                tl.store(dst, a.to(kc_ptr.dtype.element_ty), mask=smask)
                tl.store(dst + HALF, b.to(kc_ptr.dtype.element_ty), mask=smask)
            else:
                dst = vc_ptr + (slot * HKV + (head - HQ - HKV))[:, None] * D + i[None, :]
                tl.store(dst, a.to(vc_ptr.dtype.element_ty), mask=smask)
                tl.store(dst + HALF, b.to(vc_ptr.dtype.element_ty), mask=smask)
        if ATTN:
            # Decode attention in this launch's tail (one token, one sequence: b = 0). A KV head's
            # group needs its G query heads, its K head and its V head: NEED row blocks. Each row
            # block's finishing program counts itself in (after a barrier, so all its threads'
            # stores are issued; the atomic releases them); the one that completes the count runs
            # the group's attention over the paged cache (every row it reads is in memory by then)
            # and resets the counter for the next launch. No program waits for another.
            G: tl.constexpr = HQ // HKV
            NEED: tl.constexpr = (G + 2) * PER_HEAD
            if head < HQ:
                grp = head // G
            elif head < HQ + HKV:
                grp = head - HQ
            else:
                grp = head - HQ - HKV
            tl.debug_barrier()
            arrived = tl.atomic_add(gcnt_ptr + grp, 1, sem="acq_rel")
            if arrived == NEED - 1:
                tl.debug_barrier()
                attend_group(q_ptr, kc_ptr, vc_ptr, o_ptr, bt_ptr, sl_ptr, sm_scale, grp * 0, grp, HKV, G,
                             GP, BS, D, BLOCK_N, max_blocks, IEEE, KV64)
                tl.atomic_xchg(gcnt_ptr + grp, 0)


# --------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------
_SINK: dict = {}          # prefetch programs: where each writes one word (so its loads are kept)


def _prefetch_args(prefetch, splits, cfg, block_m, device):
    """Kernel arguments of the L2 prefetch programs (_prefetch_l2) of a one-token launch: the
    first PREFETCH_MB (0: all) of `prefetch` (a weight or an FP8Weight: the matrix the next kernel
    streams), read by about cfg["PREFETCH"] extra programs, whole row blocks of the grid (no more
    than the words need). None or a config without PREFETCH: none."""
    programs = cfg.get("PREFETCH", 0)
    if prefetch is None or not programs or block_m != 1:
        return 0, {}
    words, _ = _codes_scale(prefetch)
    words = words.reshape(-1)
    words = words.view(torch.int32) if words.numel() * words.element_size() % 4 == 0 else words.view(torch.uint8)
    cap = cfg.get("PREFETCH_MB", 0)
    n = words.numel() if not cap else min(words.numel(), (int(cap) << 20) // words.element_size())
    programs = min(programs, triton.cdiv(n, PF_BLOCK))
    blocks = triton.cdiv(programs, splits)
    key = (device, blocks * splits)
    if key not in _SINK:
        _SINK[key] = torch.empty(blocks * splits, dtype=torch.int32, device=device)
    return blocks, dict(pf_ptr=words, pf_n=n, sink_ptr=_SINK[key], PF_BLOCKS=blocks, PF_BLOCK=PF_BLOCK)


# Words (int32) each prefetch program reads per loop step.
PF_BLOCK = 4096


def _plan(x, k, row_blocks, cfg, pdl, prefetch=None):
    """(grid, kernel keyword arguments, workspace, counters, k_split) for one launch. The
    split-K workspace and the counters (zero between launches) are allocated once per shape and
    reused, so the launch can live in a CUDA graph. prefetch: a weight to pull into L2 with
    extra programs (cfg's PREFETCH, one token only; _prefetch_args)."""
    block_m = triton.next_power_of_2(x.shape[0])
    block_r = cfg["BLOCK_R"]
    block_k = min(cfg["BLOCK_K"], triton.next_power_of_2(k))
    if block_m > 1 and _dot_rows_on(x):
        block_m = max(block_m, DOT_ROWS.value)       # rows padded: tensor cores
    if block_m >= DOT_ROWS.value:
        block_r = max(block_r, DOT_ROWS.value)       # tensor cores: 16 x 16 tiles at least
    else:                                            # fp32 products in registers: one token's at a
        cap = MAX_PRODUCT_VALUES * max(1, cfg["num_warps"] // 4)     # time (_stream_each_row)
        block_k = max(16, min(block_k, cap // block_r))
    k_split = triton.cdiv(min(cfg["K_SPLIT"], k), block_k) * block_k
    row_blocks = row_blocks(block_r)
    if 1 < block_m < DOT_ROWS.value:                 # a few tokens: their FMAs spread over more programs
        while row_blocks * triton.cdiv(k, k_split) < FMA_MIN_PROGRAMS and k_split > block_k:
            k_split = max(block_k, k_split // 2 // block_k * block_k)
    splits = triton.cdiv(k, k_split)
    ws = cnt = x
    if splits > 1:                                   # the owner's (kernels/scratch.py)
        ws, cnt = scratch.get(("gemv", x.device, block_m, block_r, row_blocks, splits), x.device, lambda: (
            torch.empty(row_blocks * splits * (2 * block_m * block_r + block_m), dtype=torch.float32,
                        device=x.device),
            torch.zeros(row_blocks, dtype=torch.int32, device=x.device)))
    flag = pdl_flag(x.device, pdl)
    pf_blocks, pf_kwargs = _prefetch_args(prefetch, splits, cfg, block_m, x.device)
    kwargs = dict(SPLITS=splits, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, PDL=flag,
                  ACC2D=int(bool(cfg.get("ACC2D", 0)) and block_m == 1),
                  num_warps=cfg["num_warps"], num_stages=num_stages(cfg["num_stages"], x.device),
                  **pf_kwargs, **launch_options(flag))
    return (row_blocks + pf_blocks, splits), kwargs, ws, cnt, k_split


def _rows2d(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def _codes_scale(w):
    """(weight tensor the kernel streams, its per-row scales or None): an FP8Weight's fp8 codes
    and fp32 scales, or a plain weight and None."""
    if isinstance(w, FP8Weight):
        return w.q, w.scale
    return w, None


class fused_rows:
    """`with fused_rows(mode): ...`: steps of a few tokens use the fused kernels (the modes above,
    True = "dot"; False / None: off), not cuBLAS and the separate small kernels."""

    def __init__(self, mode="dot"):
        mode = "dot" if mode is True else (mode or False)
        if mode is not False and mode not in FUSED_ROWS_MODES:
            raise ValueError(f"fused_rows mode must be one of {FUSED_ROWS_MODES}, found {mode!r}")
        self.mode = mode

    def __enter__(self):
        self._was, _FUSED_ROWS[0] = _FUSED_ROWS[0], self.mode

    def __exit__(self, *exc):
        _FUSED_ROWS[0] = self._was


def _dot_rows_on(x) -> bool:
    return _FUSED_ROWS[0] == "dot" and x.dtype in (torch.bfloat16, torch.float16)


def _use_fused(x, fused, lm_head: bool = False) -> bool:
    """fused=None: the fused kernel for 1..FUSE_UP_TO tokens (inside fused_rows(): up to FMA_ROWS,
    or MAX_ROWS of a 16-bit model in "dot" mode); True/False forces a path."""
    if fused is None:
        t, mode = x.shape[0], _FUSED_ROWS[0]
        if 0 < t <= FUSE_UP_TO:
            return True
        if mode == "fma" or (mode == "fma_layers" and not lm_head):
            return 0 < t <= FMA_ROWS
        return 0 < t <= MAX_ROWS and _dot_rows_on(x)
    if fused and x.shape[0] > MAX_ROWS:
        raise ValueError(f"the fused kernels take at most {MAX_ROWS} rows, got {x.shape[0]}")
    return fused and x.shape[0] > 0


def norm_qkv_rope_store_triton(x, norm_w, eps, w, positions, cos_sin, k_cache, v_cache,
                               slot_mapping, num_heads, config=GEMV_CONFIG["qkv"], fused=None,
                               pdl=None, fp8_config=GEMV_CONFIG["qkv_fp8"], prefetch=None):
    """Same contract as norm_qkv_rope_store_torch: one launch for up to MAX_ROWS tokens.
    config: launch parameters (an entry of GEMV_CONFIG); fused: None = the fused kernel up to
    FUSE_UP_TO tokens, True/False forces a path; pdl: the PDL mode (pdl.py, None = default);
    fp8_config: the launch parameters used instead of `config` when w is an FP8Weight;
    prefetch: the weight the next kernel streams, pulled into L2 by extra programs at one token
    where the config's PREFETCH asks for them (the result does not depend on it)."""
    if not _use_fused(x, fused):
        return _qkv_composed(rms_norm_triton, rope_triton, kv_store_triton, x, norm_w, eps, w,
                             positions, cos_sin, k_cache, v_cache, slot_mapping, num_heads)
    config = fp8_config if isinstance(w, FP8Weight) else config
    return _qkv_launch(x, norm_w, eps, w, positions, cos_sin, k_cache, v_cache, slot_mapping,
                       num_heads, config, pdl, prefetch)


def attn_block_n(config) -> int:
    """Keys a step of the QKV launch's attention tail: ATTN_BLOCK_N as a power of two, at least
    16 -- tl.dot's smallest K on Triton 3.6 (p [GP, BLOCK_N] @ v [BLOCK_N, D]); 3.9 takes 8, so a
    smaller setting compiled here and failed only on the GPU's Triton."""
    return max(16, triton.next_power_of_2(int(config.get("ATTN_BLOCK_N", 128))))


def _qkv_launch(x, norm_w, eps, w, positions, cos_sin, k_cache, v_cache, slot_mapping, num_heads,
                config, pdl, prefetch, attn=None):
    """The fused QKV launch: q [T, Hq, D]; with attn = (block_table, seq_lens, scale) (one
    token) the attention output [1, Hq, D] instead, computed in the launch's tail."""
    t, k = x.shape
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    w, scale = _codes_scale(w)
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and w.is_contiguous()
    assert cos_sin.is_contiguous() and cos_sin.shape[1] == d
    x = _rows2d(x)
    q = torch.empty((t, num_heads, d), dtype=x.dtype, device=x.device)
    grid, kw, ws, cnt, k_split = _plan(
        x, k, lambda r: (num_heads + 2 * hkv) * triton.cdiv(d // 2, r), config, pdl, prefetch)
    out = q
    if attn is not None:
        from .online_softmax import LOG2E
        block_table, seq_lens, sm = attn
        assert t == 1 and num_heads % hkv == 0 and block_table.is_contiguous()
        group_counts = scratch.get(("attn_groups", x.device, hkv), x.device,
                                   lambda: torch.zeros(hkv, dtype=torch.int32, device=x.device))
        out = torch.empty_like(q)
        g = num_heads // hkv
        kw.update(o_ptr=out, bt_ptr=block_table, sl_ptr=seq_lens, gcnt_ptr=group_counts,
                  sm_scale=sm * LOG2E, max_blocks=block_table.shape[1], ATTN=1,
                  BS=k_cache.shape[1], GP=max(16, triton.next_power_of_2(g)),
                  BLOCK_N=attn_block_n(config), IEEE=int(x.dtype == torch.float32),
                  KV64=int(k_cache.numel() >= INT32_LIMIT))
    _qkv_rope_store_kernel[grid](x, norm_w, w, scale if scale is not None else w, q, k_cache, v_cache,
                                 positions, cos_sin, slot_mapping, ws, cnt, t, k, k_split, eps,
                                 x.stride(0), HQ=num_heads, HKV=hkv, D=d,
                                 HAS_SCALE=scale is not None, **kw)
    return out


def norm_qkv_rope_store_attend_torch(x, norm_w, eps, w, positions, cos_sin, k_cache, v_cache,
                                     slot_mapping, num_heads, block_table, seq_lens, scale,
                                     max_seq_len=None, prefetch=None):
    """norm_qkv_rope_store, then decode attention for a step of decode tokens only (token i is
    sequence i's: block_table [T, M], seq_lens [T]): the attention output [T, Hq, D]."""
    q = norm_qkv_rope_store_torch(x, norm_w, eps, w, positions, cos_sin, k_cache, v_cache,
                                  slot_mapping, num_heads)
    return decode_attention_torch(q, k_cache, v_cache, block_table, seq_lens, scale, max_seq_len)


def attend_fused(x, k_cache, config, max_seq_len) -> bool:
    """Does norm_qkv_rope_store_attend_triton run the attention in the QKV launch (ATTN)? One
    token on the fused path, a config whose ATTN is at least the context bound (max_seq_len:
    the tail runs one program per KV head over the whole context, so long contexts stay with
    split_kv's many programs), a power-of-two head dim >= 16, and a GPU or the interpreter."""
    limit = config.get("ATTN", 0)
    d = k_cache.shape[3]
    return (bool(limit) and x.shape[0] == 1 and max_seq_len is not None and max_seq_len <= limit
            and d >= 16 and d & (d - 1) == 0 and k_cache.shape[2] > 0)


def norm_qkv_rope_store_attend_triton(x, norm_w, eps, w, positions, cos_sin, k_cache, v_cache,
                                      slot_mapping, num_heads, block_table, seq_lens, scale,
                                      max_seq_len=None, config=GEMV_CONFIG["qkv"], fused=None,
                                      pdl=None, fp8_config=GEMV_CONFIG["qkv_fp8"], prefetch=None,
                                      decode_attention=None):
    """Same contract as norm_qkv_rope_store_attend_torch. With the config's ATTN (attend_fused):
    ONE launch -- the QKV kernel, whose program that finishes a KV head group's last row block
    then runs that group's decode attention (decode_attention.attend_group, the gqa kernel's
    loop). Otherwise norm_qkv_rope_store_triton and `decode_attention` (the model's bound decode
    launcher; None: decode_attention_triton's defaults), two launches."""
    cfg = fp8_config if isinstance(w, FP8Weight) else config
    if not (_use_fused(x, fused) and attend_fused(x, k_cache, cfg, max_seq_len)):
        q = norm_qkv_rope_store_triton(x, norm_w, eps, w, positions, cos_sin, k_cache, v_cache,
                                       slot_mapping, num_heads, config=config, fused=fused, pdl=pdl,
                                       fp8_config=fp8_config, prefetch=prefetch)
        if decode_attention is None:
            from .decode_attention import decode_attention_triton as decode_attention
        return decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale, max_seq_len)
    return _qkv_launch(x, norm_w, eps, w, positions, cos_sin, k_cache, v_cache, slot_mapping,
                       num_heads, cfg, pdl, prefetch, attn=(block_table, seq_lens, scale))


def linear_residual_triton(x, w, residual, config=GEMV_CONFIG["residual"], fused=None, pdl=None,
                           fp8_config=GEMV_CONFIG["residual_fp8"], down_config=None, down_fp8_config=None,
                           prefetch=None):
    """Same contract as linear_residual_torch (config, fused, pdl: as norm_qkv_rope_store_triton).
    down_config / down_fp8_config: used instead of config / fp8_config for a matrix wider than
    tall (K > N: the MLP's down projection), where given (select_kernels gives GEMV_CONFIG's
    "down" entries)."""
    if not _use_fused(x, fused):
        return linear(x, w, residual)
    fp8 = isinstance(w, FP8Weight)
    if w.shape[1] > w.shape[0]:
        config = down_config or config
        fp8_config = down_fp8_config or fp8_config
    config = fp8_config if fp8 else config
    return _linear(x, None, 0.0, w, residual, residual.dtype, config, pdl, prefetch=prefetch)


def norm_lm_head_triton(x, norm_w, eps, w, config=GEMV_CONFIG["lm_head"], fused=None, greedy=False,
                        pdl=None, fp8_config=GEMV_CONFIG["lm_head_fp8"], tokens_out=None):
    """Same contract as norm_lm_head_torch. greedy=True also returns each row's argmax (int64),
    taken inside the fused kernel (per-row-block partials + one tiny merge launch), which writes
    them into `tokens_out` where given (int64 [T]: the decode graphs' buffer of the last tokens;
    on the unfused path the tokens come back in a new tensor as before)."""
    if not _use_fused(x, fused, lm_head=True):
        logits = linear(rms_norm_triton(x, norm_w, eps), w).float()
        return (logits, logits.argmax(dim=-1)) if greedy else logits
    config = fp8_config if isinstance(w, FP8Weight) else config
    return _linear(x, norm_w, eps, w, None, torch.float32, config, pdl, greedy, tokens_out=tokens_out)


# Warps of the argmax merge launch (one program per token over the row blocks' partials).
ARGMAX_MERGE_WARPS = 4


def _linear(x, norm_w, eps, w, residual, out_dtype, cfg, pdl, greedy=False, prefetch=None, tokens_out=None):
    t, k = x.shape
    n = w.shape[0]
    w, scale = _codes_scale(w)
    assert w.is_contiguous()
    assert not greedy or n < 2 ** 24           # indices travel as fp32 partials: exact below 2^24
    x = _rows2d(x)
    out = torch.empty((t, n), dtype=out_dtype, device=x.device)
    r = _rows2d(residual) if residual is not None else out
    grid, kw, ws, cnt, k_split = _plan(x, k, lambda r: triton.cdiv(n, r), cfg, pdl,
                                       None if greedy else prefetch)
    best = torch.empty((2, t, grid[0]), dtype=torch.float32, device=x.device) if greedy else out
    _linear_kernel[grid](
        x, norm_w if norm_w is not None else w, w, scale if scale is not None else w, r, out, best, ws,
        cnt, t, n, k, k_split, eps, x.stride(0), r.stride(0), out.stride(0), HAS_NORM=norm_w is not None,
        HAS_RESIDUAL=residual is not None, ARGMAX=greedy, HAS_SCALE=scale is not None,
        IDX64=w.numel() >= INT32_LIMIT, **kw)
    if not greedy:
        return out
    tokens = torch.empty(t, dtype=torch.int64, device=x.device) if tokens_out is None else tokens_out
    assert tokens.shape == (t,) and tokens.dtype == torch.int64 and tokens.is_contiguous()
    flag = kw["PDL"]
    _argmax_merge_kernel[(t,)](best, tokens, t, grid[0], BLOCK_P=triton.next_power_of_2(grid[0]),
                               PDL=flag, num_warps=ARGMAX_MERGE_WARPS, **launch_options(flag))
    return out, tokens


def norm_swiglu_triton(x, norm_w, eps, w_gate_up, config=GEMV_CONFIG["swiglu"], fused=None,
                       pdl=None, fp8_config=GEMV_CONFIG["swiglu_fp8"], prefetch=None):
    """Same contract as norm_swiglu_torch (config, fused, pdl: as norm_qkv_rope_store_triton)."""
    if not _use_fused(x, fused):
        return silu_and_mul_triton(linear(rms_norm_triton(x, norm_w, eps), w_gate_up))
    t, k = x.shape
    inter = w_gate_up.shape[0] // 2
    config = fp8_config if isinstance(w_gate_up, FP8Weight) else config
    w_gate_up, scale = _codes_scale(w_gate_up)
    assert w_gate_up.is_contiguous()
    x = _rows2d(x)
    out = torch.empty((t, inter), dtype=x.dtype, device=x.device)
    grid, kw, ws, cnt, k_split = _plan(x, k, lambda r: triton.cdiv(inter, r), config, pdl, prefetch)
    _swiglu_kernel[grid](x, norm_w, w_gate_up, scale if scale is not None else w_gate_up, out, ws, cnt,
                         t, inter, k, k_split, eps, x.stride(0), out.stride(0),
                         HAS_SCALE=scale is not None, **kw)
    return out

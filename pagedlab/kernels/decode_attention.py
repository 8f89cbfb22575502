"""Paged decode attention: one new query token per sequence attends to its whole paged context.

Decode does almost no arithmetic (one query row per head) but reads the WHOLE K/V context of every
sequence, every step: it is bound by memory bandwidth, and the measure of a decode kernel is how
close its K/V read rate gets to the device's copy bandwidth. Four Triton variants, from the
textbook one to the fast one, all reading K/V through the block table (key n of sequence b lives
in physical block block_table[b, n // block_size], row n % block_size):

  naive     one program per (sequence, query head), ONE key per loop iteration: a dot product,
            a scalar online-softmax update, acc += p * v. The pagedAttention kernel of the
            original, translated. Every key is a dependent round trip to memory: latency bound.
  blocked   one program per (sequence, query head), BLOCK_N keys per iteration (a [BLOCK_N, D]
            tile gathered from the pages), online softmax over the tile. Enough bytes in flight
            per program to approach bandwidth -- but each K/V tile is read once per QUERY head,
            i.e. Hq / Hkv times (4x for Llama-3.2-1B), relying on L2 to absorb the re-reads.
  gqa       one program per (sequence, KV head) that computes all G = Hq / Hkv query heads of the
            group at once: Q is a [G, D] tile (padded to 16 rows for tl.dot), S = Q K^T and
            O += P V are tensor-core dots, and each K/V tile leaves DRAM exactly once.
  split_kv  flash-decoding: the gqa program, but the context is also split across programs
            (grid B x Hkv x S). With small batches B * Hkv programs cannot fill 132 SMs; splitting
            the context restores parallelism. Each sequence splits its OWN length evenly (S is
            fixed at launch from the context bound; a short sequence uses only its first splits),
            so a CUDA graph captured for the longest context stays cheap at short ones. Each
            split writes its partial (max m, sum l, unnormalised acc) to a scratch buffer, and
            the last split of a (sequence, KV head) to finish merges them in the same launch:
            M = max_s m_s, w_s = 2^(m_s - M), out = sum_s w_s acc_s / sum_s w_s l_s.
  auto      picks gqa or split_kv (and the number of splits) from the batch size, the context
            bound and the SM count -- host-side numbers only, see choose_decode_plan().

All launch parameters (grid, number of splits) depend only on shapes and on the max_seq_len hint,
never on device values, and the split_kv scratch is cached per shape, so decode can be captured in
a CUDA graph. A sequence with seq_len 0 gives zeros. (The padding rows of a captured batch have
length 1 and read the pool's null block: cuda_graph.py.)

decode_attention_torch is the reference; decode_attention_triton has the same signature plus
`variant`, and the launch parameters as explicit keyword arguments: `config` (DECODE_CONFIG, the
H200-tuned defaults, unless given) and `pdl` (kernels/pdl.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import scratch
from .launch import INT32_LIMIT, freeze, num_stages, sm_count
from .online_softmax import LOG2E, online_softmax_update
from .paged import gather_pages
from .pdl import launch_options, main_loop_done, pdl_flag, start as pdl_start


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


VARIANTS = ("naive", "blocked", "gqa", "split_kv")

# Launch parameters per variant (tuned on the H200, bf16, head_dim 64; see docs/kernels.md).
# Sweep of (BLOCK_N, num_warps, num_stages) on 2026-11-29: (128, 4, 2) was fastest at batch
# 128 and 256 (e.g. 540 us vs 592 us for (64, 4, 2) at batch 256 x 4096). split_kv's MERGE_TILE:
# fp32 values per step of its merge (16 KB), see _merge_chunk. Read-only: pass another config
# (launch.merge_config(DECODE_CONFIG, {...})) instead of changing it.
# (Session 14 tried reading the first K/V tile before the PDL wait at one row, PRELOAD, and a
# one-round merge, ONE_PASS: inside the noise in bf16 and not token-identical in the engine;
# removed in session 15 -- docs/kernels.md "One stream, session 14/15".)
DECODE_CONFIG = freeze({
    "naive": {"num_warps": 1, "num_stages": 1},
    "blocked": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
    "gqa": {"BLOCK_N": 128, "num_warps": 4, "num_stages": 2},
    "split_kv": {"BLOCK_N": 128, "num_warps": 4, "num_stages": 2, "MERGE_TILE": 4096},
})
# auto: split the context when gqa would give each SM fewer than SPLIT_BELOW_PROGRAMS_PER_SM
# programs; then aim for SPLIT_PROGRAMS_PER_SM programs per SM, no split shorter than
# MIN_SPLIT_LEN keys. (Measured: at batch 1 x 32k, 8 KV heads, 33 splits took 37 us in a CUDA
# graph, unsplit gqa 806 us; at batch 64 x 1k unsplit gqa already beats SDPA.)
SPLIT_BELOW_PROGRAMS_PER_SM = 2
SPLIT_PROGRAMS_PER_SM = 8
MIN_SPLIT_LEN = 256
MAX_SPLITS = 128


# --------------------------------------------------------------------------------------------
# naive: one key at a time
# --------------------------------------------------------------------------------------------
@triton.jit
def _decode_naive_kernel(q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, sl_ptr, sm_scale,
                         stride_qb, stride_qh, stride_ob, stride_oh,
                         stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                         stride_bt, G: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // G
    seq_len = tl.load(sl_ptr + b)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + h * stride_qh + offs_d, mask=dmask,
                other=0.0).to(tl.float32) * sm_scale
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    zero = tl.sum(tl.zeros([BLOCK_D], dtype=tl.float32), axis=0)   # an fp32 scalar TENSOR, so
    m_i = zero - 1.0e30                                              # the loop-carried types stay
    l_i = zero                                                       # fixed when compiled
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for n in range(0, seq_len):
        blk = tl.load(bt_row + n // BS).to(tl.int64)
        tok = n % BS
        k = tl.load(k_ptr + blk * stride_kb + tok * stride_kt + kvh * stride_kh + offs_d,
                    mask=dmask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + blk * stride_vb + tok * stride_vt + kvh * stride_vh + offs_d,
                    mask=dmask, other=0.0).to(tl.float32)
        s = tl.sum(q * k, axis=0)
        m_new = tl.maximum(m_i, s)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        l_i = l_i * alpha + p
        acc = acc * alpha + p * v
        m_i = m_new
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)
    tl.store(o_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d,
             out.to(o_ptr.dtype.element_ty), mask=dmask)


# --------------------------------------------------------------------------------------------
# blocked: a tile of keys per iteration, one query head per program
# --------------------------------------------------------------------------------------------
@triton.jit
def _decode_blocked_kernel(q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, sl_ptr, sm_scale,
                           stride_qb, stride_qh, stride_ob, stride_oh,
                           stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                           stride_bt, G: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                           BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // G
    seq_len = tl.load(sl_ptr + b)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    dmask = offs_d < D
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + h * stride_qh + offs_d, mask=dmask,
                other=0.0).to(tl.float32) * sm_scale
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    zero = tl.sum(tl.zeros([BLOCK_D], dtype=tl.float32), axis=0)   # an fp32 scalar TENSOR, so
    m_i = zero - 1.0e30                                              # the loop-carried types stay
    l_i = zero                                                       # fixed when compiled
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        k_pos = start + offs_n
        kmask = k_pos < seq_len
        blk = tl.load(bt_row + k_pos // BS, mask=kmask, other=0).to(tl.int64)
        tok = (k_pos % BS).to(tl.int64)
        mask2 = kmask[:, None] & dmask[None, :]
        k = tl.load(k_ptr + (blk * stride_kb + tok * stride_kt + kvh * stride_kh)[:, None]
                    + offs_d[None, :], mask=mask2, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + (blk * stride_vb + tok * stride_vt + kvh * stride_vh)[:, None]
                    + offs_d[None, :], mask=mask2, other=0.0).to(tl.float32)
        s = tl.sum(q[None, :] * k, axis=1)
        s = tl.where(kmask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)
    tl.store(o_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d,
             out.to(o_ptr.dtype.element_ty), mask=dmask)


# --------------------------------------------------------------------------------------------
# gqa and split_kv: one program per (sequence, KV head[, split]), all query heads of the group
# --------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["max_blocks"])      # the table's width changes step to step
def _decode_gqa_kernel(q_ptr, k_ptr, v_ptr, o_ptr, ml_ptr, acc_ptr, cnt_ptr, bt_ptr, sl_ptr, sm_scale,
                       max_blocks, split_len,
                       HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BS: tl.constexpr,
                       D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                       NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr, IDX64: tl.constexpr,
                       PDL: tl.constexpr, GM: tl.constexpr = 1, MERGE_CH: tl.constexpr = 1):
    # Layouts are fixed (q/out [B, Hq, D], caches [N, BS, HKV, D], all contiguous), so every
    # stride is a compile-time constant: fewer kernel arguments = a cheaper launch, and cheaper
    # address arithmetic (int32 unless the pool has >= 2^31 elements).
    pdl_start(PDL)                  # programmatic dependent launch (pdl.py)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(sl_ptr + b)
    if NUM_SPLITS > 1:
        # Split THIS sequence's context evenly (whole BLOCK_N tiles): a short sequence uses only
        # its first few splits; the programs past its end do nothing and write nothing.
        split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start_n = split * split_len
    end_n = tl.minimum(start_n + split_len, seq_len)

    offs_g = tl.arange(0, GP)                 # query heads of the group, padded for tl.dot
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    gmask = offs_g < G
    dmask = offs_d < D
    heads = kvh * G + offs_g
    q_rows = b.to(tl.int64) * (HKV * G) + heads                      # row of q / out [B*Hq, D]
    q = tl.load(q_ptr + q_rows[:, None] * D + offs_d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    bt_row = bt_ptr + b.to(tl.int64) * max_blocks

    m_i = tl.full([GP], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([GP], dtype=tl.float32)
    acc = tl.zeros([GP, BLOCK_D], dtype=tl.float32)
    for start in range(start_n, end_n, BLOCK_N):
        k_pos = start + offs_n
        kmask = k_pos < end_n
        blk = tl.load(bt_row + k_pos // BS, mask=kmask, other=0)
        if IDX64:
            blk = blk.to(tl.int64)
        row_off = ((blk * BS + k_pos % BS) * HKV + kvh) * D             # [BLOCK_N]
        mask2 = kmask[:, None] & dmask[None, :]
        k = tl.load(k_ptr + row_off[:, None] + offs_d[None, :], mask=mask2, other=0.0)
        v = tl.load(v_ptr + row_off[:, None] + offs_d[None, :], mask=mask2, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * sm_scale
        s = tl.where(kmask[None, :], s, float("-inf"))
        acc, m_i, l_i = online_softmax_update(acc, m_i, l_i, s, v, IEEE)
    main_loop_done(PDL)

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(o_ptr + q_rows[:, None] * D + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=gmask[:, None] & dmask[None, :])
    else:
        # This split's partial result (max m, sum l, unnormalised acc) goes to the scratch buffers
        # ml [B*Hq, S, 2] and acc [B*Hq, S, BLOCK_D] (fp32). Then the split-K trick of gemv.py:
        # each split bumps the (sequence, KV head) counter, and the LAST one to arrive merges the
        # partials in a fixed order (deterministic) in this same launch and resets the counter.
        # Splits past the end of the sequence take no part (unless it is empty: split 0 then
        # writes m = -1e30, l = 0 and the output is zeros).
        used = tl.maximum(tl.cdiv(seq_len, tl.maximum(split_len, 1)), 1)
        if split < used:
            row = q_rows * NUM_SPLITS + split                            # [GP]
            tl.store(ml_ptr + row * 2, m_i, mask=gmask)
            tl.store(ml_ptr + row * 2 + 1, l_i, mask=gmask)
            tl.store(acc_ptr + row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=gmask[:, None])
            counter = cnt_ptr + b * HKV + kvh
            arrived = tl.atomic_add(counter, 1, sem="acq_rel")     # (a barrier before it: gemv.py)
            if arrived == used - 1:
                # M = max_s m_s, w_s = 2^(m_s - M), out = sum_s w_s acc_s / sum_s w_s l_s.
                # MERGE_CH splits at a time, as [GM heads, MERGE_CH splits, D] tiles: one load
                # latency per chunk instead of one per split.
                offs_h = tl.arange(0, GM)
                hmask = offs_h < G
                m_rows = (b.to(tl.int64) * (HKV * G) + kvh * G + offs_h) * NUM_SPLITS    # [GM]
                offs_s = tl.arange(0, MERGE_CH)
                m_max = tl.full([GM], -1.0e30, dtype=tl.float32)
                for s0 in range(0, used, MERGE_CH):
                    smask = hmask[:, None] & (s0 + offs_s < used)[None, :]
                    r = m_rows[:, None] + s0 + offs_s[None, :]                       # [GM, CH]
                    m_s = tl.load(ml_ptr + r * 2, mask=smask, other=-1.0e30, cache_modifier=".cg")
                    m_max = tl.maximum(m_max, tl.max(m_s, axis=1))
                l_tot = tl.zeros([GM], dtype=tl.float32)
                o = tl.zeros([GM, BLOCK_D], dtype=tl.float32)
                for s0 in range(0, used, MERGE_CH):
                    smask = hmask[:, None] & (s0 + offs_s < used)[None, :]
                    r = m_rows[:, None] + s0 + offs_s[None, :]
                    w = tl.exp2(tl.load(ml_ptr + r * 2, mask=smask, other=-1.0e30,
                                        cache_modifier=".cg") - m_max[:, None])       # 0 if masked
                    l_tot += tl.sum(w * tl.load(ml_ptr + r * 2 + 1, mask=smask, other=0.0,
                                                cache_modifier=".cg"), axis=1)
                    a = tl.load(acc_ptr + r[:, :, None] * BLOCK_D + offs_d[None, None, :],
                                mask=smask[:, :, None], other=0.0, cache_modifier=".cg")
                    o += tl.sum(w[:, :, None] * a, axis=1)
                out = o / tl.where(l_tot > 0.0, l_tot, 1.0)[:, None]
                o_rows = m_rows // NUM_SPLITS
                tl.store(o_ptr + o_rows[:, None] * D + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
                         mask=hmask[:, None] & dmask[None, :])
                tl.atomic_xchg(counter, 0)


@triton.jit
def group_attention(q_ptr, k_ptr, v_ptr, bt_ptr, sl_ptr, sm_scale, b, kvh,
                    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BS: tl.constexpr,
                    D: tl.constexpr, BLOCK_N: tl.constexpr, max_blocks, IEEE: tl.constexpr,
                    IDX64: tl.constexpr):
    """The gqa kernel's work (NUM_SPLITS = 1) as a function another kernel runs: all G query heads
    of KV head kvh of sequence b over the whole paged context, the same loop and online softmax as
    _decode_gqa_kernel. Returns (out [GP, D] fp32, its q rows, the mask of the G real heads). Every
    load goes through L2 (.cg), never a possibly stale L1 line: its callers read q and this step's
    K/V that OTHER programs of the same launch may have written (attend_group). D must be a power of two >= 16 (the launchers check)."""
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    gmask = offs_g < G
    seq_len = tl.load(sl_ptr + b)
    q_rows = b.to(tl.int64) * (HKV * G) + kvh * G + offs_g
    q = tl.load(q_ptr + q_rows[:, None] * D + offs_d[None, :], mask=gmask[:, None], other=0.0,
                cache_modifier=".cg")
    bt_row = bt_ptr + b.to(tl.int64) * max_blocks
    m_i = tl.full([GP], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([GP], dtype=tl.float32)
    acc = tl.zeros([GP, D], dtype=tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        k_pos = start + offs_n
        kmask = k_pos < seq_len
        blk = tl.load(bt_row + k_pos // BS, mask=kmask, other=0)
        if IDX64:
            blk = blk.to(tl.int64)
        row_off = ((blk * BS + k_pos % BS) * HKV + kvh) * D
        k = tl.load(k_ptr + row_off[:, None] + offs_d[None, :], mask=kmask[:, None], other=0.0,
                    cache_modifier=".cg")
        v = tl.load(v_ptr + row_off[:, None] + offs_d[None, :], mask=kmask[:, None], other=0.0,
                    cache_modifier=".cg")
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * sm_scale
        s = tl.where(kmask[None, :], s, float("-inf"))
        acc, m_i, l_i = online_softmax_update(acc, m_i, l_i, s, v, IEEE)
    return acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None], q_rows, gmask


@triton.jit
def attend_group(q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, sl_ptr, sm_scale, b, kvh,
                 HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BS: tl.constexpr,
                 D: tl.constexpr, BLOCK_N: tl.constexpr, max_blocks, IEEE: tl.constexpr,
                 IDX64: tl.constexpr):
    """group_attention, stored: the tail of gemv's QKV launch (the program that finishes a KV
    head's last row block runs it, see gemv._qkv_rope_store_kernel)."""
    out, q_rows, gmask = group_attention(q_ptr, k_ptr, v_ptr, bt_ptr, sl_ptr, sm_scale, b, kvh, HKV, G, GP,
                                         BS, D, BLOCK_N, max_blocks, IEEE, IDX64)
    offs_d = tl.arange(0, D)
    tl.store(o_ptr + q_rows[:, None] * D + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=gmask[:, None])


# --------------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------------
# split_len of the unsplit (gqa) kernel: longer than any context, so its one split is all of it.
WHOLE_CONTEXT = 1 << 30


def _merge_chunk(g: int, block_d: int, splits: int, merge_tile: int) -> int:
    """Splits merged per step of split_kv's merge: a [heads, chunk, D] fp32 tile of at most
    merge_tile values, and no more than there are splits."""
    return max(1, min(triton.next_power_of_2(splits),
                      merge_tile // (triton.next_power_of_2(g) * block_d)))


def choose_num_splits(batch: int, num_kv_heads: int, max_ctx: int, sm_count: int,
                      block_n: int = 128) -> int:
    """Splits of the context for split_kv: enough programs to give every SM
    SPLIT_PROGRAMS_PER_SM of them, but no split shorter than MIN_SPLIT_LEN keys -- rounded down
    to a power of two. NUM_SPLITS is a compile-time constant, and the decode parts of mixed steps
    (eager, every batch size and context) would otherwise compile a kernel for nearly every value
    from 2 to 128 as a server runs; powers of two are 7 kernels, compiled at load (warmup.py)."""
    programs = max(batch * num_kv_heads, 1)
    want = triton.cdiv(SPLIT_PROGRAMS_PER_SM * sm_count, programs)
    most = max(1, triton.cdiv(max_ctx, max(MIN_SPLIT_LEN, block_n)))
    n = int(max(1, min(want, most, MAX_SPLITS)))
    return 1 << (n.bit_length() - 1)


def choose_decode_plan(batch: int, num_kv_heads: int, max_ctx: int, sm_count: int,
                       block_n: int = 128):
    """auto: (variant, num_splits). gqa reads K/V once per group and beats naive and blocked at
    every measured shape. When gqa's batch * Hkv programs give each SM fewer than
    SPLIT_BELOW_PROGRAMS_PER_SM of them, split_kv (with choose_num_splits splits) wins."""
    if batch * num_kv_heads >= SPLIT_BELOW_PROGRAMS_PER_SM * sm_count:
        return ("gqa", 1)
    splits = choose_num_splits(batch, num_kv_heads, max_ctx, sm_count, block_n)
    return ("split_kv", splits) if splits > 1 else ("gqa", 1)


def _scratch(device, batch, hq, hkv, splits, block_d):
    """split_kv's partial results and its per-(sequence, KV head) arrival counters (zero between
    launches: the merging program resets its own), the current owner's (kernels/scratch.py)."""
    return scratch.get(("split_kv", device.type, device.index, batch, hq, hkv, splits, block_d), device, lambda: (
        torch.empty((batch * hq, splits, 2), dtype=torch.float32, device=device),
        torch.empty((batch * hq, splits, block_d), dtype=torch.float32, device=device),
        torch.zeros(batch * hkv, dtype=torch.int32, device=device)))


def decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                            max_seq_len: int | None = None, variant: str = "auto",
                            num_splits: int | None = None, *, config=DECODE_CONFIG,
                            pdl: str | None = None) -> torch.Tensor:
    """Same contract as decode_attention_torch, plus `variant` (naive | blocked | gqa | split_kv |
    auto) and, for split_kv, an optional fixed `num_splits`. max_seq_len (an upper bound on
    seq_lens, host int) only sizes the split_kv grid; without it the bound is
    block_table.shape[1] * block_size. `config`: launch parameters per variant (the layout of
    DECODE_CONFIG); `pdl`: the PDL mode of the gqa/split_kv launch (pdl.py; None = the device's
    default). No device->host sync; the split_kv scratch buffers are allocated once per shape and
    reused (CUDA-graph friendly)."""
    b, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    g = hq // hkv
    if not q.is_contiguous():
        q = q.contiguous()
    out = torch.empty((b, hq, d), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    max_ctx = max_seq_len if max_seq_len is not None else block_table.shape[1] * bs
    block_d = max(16, triton.next_power_of_2(d))
    scale2 = scale * LOG2E
    if variant == "auto":
        variant, plan_splits = choose_decode_plan(b, hkv, max_ctx, sm_count(q.device),
                                                  config["split_kv"]["BLOCK_N"])
        if num_splits is None:
            num_splits = plan_splits
    if variant in ("gqa", "split_kv"):
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and block_table.is_contiguous()
        cfg = config[variant]
        block_n = cfg["BLOCK_N"]
        if variant == "gqa":
            splits = 1
        else:
            splits = num_splits or choose_num_splits(b, hkv, max_ctx, sm_count(q.device), block_n)
        flag = pdl_flag(q.device, pdl)
        merge_ch = _merge_chunk(g, block_d, splits, cfg["MERGE_TILE"]) if splits > 1 else 1
        if splits > 1:
            ml_buf, acc_buf, cnt = _scratch(q.device, b, hq, hkv, splits, block_d)
        else:
            ml_buf = acc_buf = cnt = out                    # unused
        _decode_gqa_kernel[(b, hkv, splits)](
            q, k_cache, v_cache, out, ml_buf, acc_buf, cnt, block_table, seq_lens, scale2,
            block_table.shape[1], WHOLE_CONTEXT,
            HKV=hkv, G=g, GP=max(16, triton.next_power_of_2(g)), BS=bs, D=d, BLOCK_D=block_d,
            GM=triton.next_power_of_2(g),
            MERGE_CH=merge_ch, BLOCK_N=block_n, NUM_SPLITS=splits, IEEE=q.dtype == torch.float32,
            IDX64=k_cache.numel() >= INT32_LIMIT, PDL=flag, num_warps=cfg["num_warps"],
            num_stages=num_stages(cfg["num_stages"], q.device), **launch_options(flag))
        return out
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    common = (q.stride(0), q.stride(1), out.stride(0), out.stride(1),
              k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
              v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0))
    if variant == "naive":
        cfg = config["naive"]
        _decode_naive_kernel[(b, hq)](q, k_cache, v_cache, out, block_table, seq_lens, scale2,
                                      *common, G=g, BS=bs, D=d, BLOCK_D=block_d,
                                      num_warps=cfg["num_warps"],
                                      num_stages=num_stages(cfg["num_stages"], q.device))
    elif variant == "blocked":
        cfg = config["blocked"]
        _decode_blocked_kernel[(b, hq)](q, k_cache, v_cache, out, block_table, seq_lens, scale2,
                                        *common, G=g, BS=bs, D=d, BLOCK_D=block_d,
                                        BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"],
                                        num_stages=num_stages(cfg["num_stages"], q.device))
    else:
        raise ValueError(f"unknown decode attention variant {variant!r}; pick one of "
                         f"{VARIANTS + ('auto',)}")
    return out

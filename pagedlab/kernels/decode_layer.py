"""One decoder layer at one decode token in ONE launch: a persistent kernel with a tile queue.

At batch 1 a layer is five launches today (norm + QKV + RoPE + KV store, decode attention, O +
residual, norm + gate/up + SwiGLU, down + residual; gemv.py, decode_attention.py) and each costs a
few microseconds over the bytes it reads: a ramp, a drain, a boundary (docs/kernels.md, "where a
batch-1 step goes"). Here one launch of a few programs per SM does the whole layer. The layer is cut into tiles, in an order where every tile depends only on tiles before it:

    QKV rows (by KV-head group)  ->  attention (group x split)  ->  O rows  ->  gate/up rows  ->  down rows

A program takes the next tile from one atomic counter (the queue), loads the first slice of its
WEIGHTS -- which depend on nothing -- and only then waits for the tiles it reads from: a counter per
phase (per group for attention) that each finished tile bumps. So while the attention of group 0
runs, other programs already stream the O projection's weights; no SM idles at a launch boundary.
Because tiles are handed out in order, a tile waits only on tiles taken earlier by programs that
are running: no deadlock, however many programs are resident -- and the CPU interpreter, which
runs the programs one after another, never waits at all (the first program does every tile).

The last program to leave resets the counters, so the next launch (the next layer) starts clean.
Partial results live in fp32 scratch; the values the five-launch path rounds to the model's dtype
(normed inputs, q/k/v after RoPE, the attention output, the residual stream, the SwiGLU input) are
rounded the same way here. Batch 1, decode only, weights in the model's dtype or FP8 (e4m3 codes,
a scale per row: quantization.FP8Weight, the scale applied to each row's sum); shapes as Llama's:
head_dim, the group size, tiles and splits powers of two (check_shapes says what does not fit).

Status (session 26, 2026-12-03): correct on the CPU interpreter against the five-launch
composition and a float64 reference (tests/test_decode_layer.py); NOT yet measured on a GPU --
`python -m pagedlab bench layer` times it against the five launches in a CUDA graph. The
engine does not use it yet.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quantization import FP8Weight
from . import scratch
from .decode_attention import decode_attention_torch
from .gemv import linear_residual_torch, norm_qkv_rope_store_torch, norm_swiglu_torch
from .launch import sm_count
from .online_softmax import LOG2E, online_softmax_update

# Launch settings: R rows a GEMV tile (gate/up: R/2 gate rows with their R/2 up rows), BK columns a
# step of its loop (down: R/DOWN rows, BK*DOWN columns), S attention splits of the context per KV
# head, BLOCK_N keys a step of a split, DOT (1: the attention's products on tensor cores, the group
# padded to 16 rows; 0: CUDA cores), GRAB tiles taken from the queue at a time (one atomic for GRAB
# tiles; 4 costs 240 registers on sm90),
# PROGRAMS (0: PER_SM a streaming multiprocessor -- more than one, so that an SM has enough weight
# loads in flight; the queue needs none of them resident to make progress). Registers a thread,
# compiled without a GPU (scripts/compile_check.py; sm75 / sm80 / sm90): these defaults 231 / 226 /
# 230 under Triton 3.6, 217 / 215 / 166 under 3.9 -- two programs of 4 warps fit an SM (docs/kernels.md,
# session 26). Not tuned on a GPU yet: `bench layer --sweep`.
DECODE_LAYER_CONFIG = {"R": 16, "BK": 256, "DOWN": 4, "S": 8, "BLOCK_N": 16, "DOT": 0, "GRAB": 1,
                       "PROGRAMS": 0, "PER_SM": 2, "num_warps": 4}

LINEARS = ("qkv", "o", "gate_up", "down")
N_PHASE_COUNTERS = 5
N_COUNTERS = 16                     # so at most 11 KV-head groups
LINE = 32                           # int32s between two counters: each on its own 128-byte line, so the
#                                     waits' polls of one never queue behind the atomics on another
_LINE = tl.constexpr(LINE)
_QUEUE, _LEFT, _ATTN, _O, _GU, _GROUP = (tl.constexpr(i * LINE) for i in range(6))


def decode_layer_torch(h, layer, eps, positions, cos_sin, k_cache, v_cache, slot_mapping,
                       block_table, seq_lens, scale, num_heads):
    """The five-launch composition with the torch references: h [1, H] -> the layer's output
    [1, H] (and this token's K/V written into the caches). The CPU path and the kernel's check."""
    q = norm_qkv_rope_store_torch(h, layer["attn_norm"], eps, layer["qkv"], positions, cos_sin,
                                  k_cache, v_cache, slot_mapping, num_heads)
    o = decode_attention_torch(q, k_cache, v_cache, block_table, seq_lens, scale)
    h = linear_residual_torch(o.reshape(h.shape[0], -1), layer["o"], h)
    a = norm_swiglu_torch(h, layer["mlp_norm"], eps, layer["gate_up"])
    return linear_residual_torch(a, layer["down"], h)


@triton.jit
def _wait(cnt_ptr, target):
    """Spin until the counter reaches target, reading it with plain volatile loads (hundreds of
    waiting programs must not queue atomics at the one L2 line their producers bump), then one
    acquire: what the tiles wrote before their release is visible. Read it through L2 (.cg), never
    a stale L1 line."""
    while tl.load(cnt_ptr, volatile=True) < target:
        pass
    tl.atomic_add(cnt_ptr, 0, sem="acquire")     # (a scalar atomic: one thread issues it)
    tl.debug_barrier()                           # every thread's later loads after that acquire


@triton.jit
def _arrive(cnt_ptr):
    tl.debug_barrier()                      # every thread's stores issued before the release
    tl.atomic_add(cnt_ptr, 1, sem="release")


@triton.jit
def _rstd(x_ptr, H: tl.constexpr, HP: tl.constexpr, eps, CG: tl.constexpr):
    """1 / rms of the H values at x_ptr, read in ONE load of the whole vector (HP: H rounded up to a
    power of two): a loop of slices would wait for L2 once a slice, and a tile waits on this."""
    k = tl.arange(0, HP)
    if CG:
        x = tl.load(x_ptr + k, mask=k < H, other=0.0, cache_modifier=".cg")
    else:
        x = tl.load(x_ptr + k, mask=k < H, other=0.0).to(tl.float32)
    return 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)


@triton.jit
def _rope(x_ptr, rows, rmask, d, cos, sin, HD: tl.constexpr):
    """Rows [n] of head vectors at x_ptr (fp32, .cg) rotated: x*cos + rotate_half(x)*sin (rows
    outside rmask: zeros)."""
    HALF: tl.constexpr = HD // 2
    x = tl.load(x_ptr + rows[:, None] * HD + d[None, :], mask=rmask[:, None], other=0.0, cache_modifier=".cg")
    xp = tl.load(x_ptr + rows[:, None] * HD + ((d + HALF) % HD)[None, :], mask=rmask[:, None], other=0.0,
                 cache_modifier=".cg")
    sign = tl.where(d < HALF, -1.0, 1.0)
    return x * cos[None, :] + sign[None, :] * xp * sin[None, :]


@triton.jit
def _decode_layer_kernel(
        h_ptr, out_ptr, attn_norm_ptr, wqkv_ptr, wo_ptr, mlp_norm_ptr, wgu_ptr, wdown_ptr,
        sqkv_ptr, so_ptr, sgu_ptr, sdown_ptr,
        pos_ptr, cs_ptr, kc_ptr, vc_ptr, slot_ptr, bt_ptr, seq_ptr,
        qkv_ptr, part_ptr, ml_ptr, mid_ptr, act_ptr, cnt_ptr,
        eps, scale_log2, stride_cb, stride_cs, stride_ch, stride_vb, stride_vs, stride_vh,
        H: tl.constexpr, INTER: tl.constexpr, NQ: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr,
        PAGE: tl.constexpr, R: tl.constexpr, BK: tl.constexpr, S: tl.constexpr, BLOCK_N: tl.constexpr,
        GP: tl.constexpr, IEEE: tl.constexpr, DOT: tl.constexpr, FP8: tl.constexpr, GRAB: tl.constexpr,
        HP: tl.constexpr, DOWN: tl.constexpr):
    DT = h_ptr.dtype.element_ty                       # the model's dtype: what the five launches round to
    GQA: tl.constexpr = NQ // NKV
    QD: tl.constexpr = NQ * HD
    HALF: tl.constexpr = HD // 2
    HPI: tl.constexpr = BK // HD                      # heads an O step merges
    TPH: tl.constexpr = HD // R                       # QKV tiles a head
    G_T: tl.constexpr = (GQA + 2) * TPH               # QKV tiles a group (its q heads, k, v)
    N_QKV: tl.constexpr = NKV * G_T
    N_ATT: tl.constexpr = NKV * S
    N_O: tl.constexpr = H // R
    RG: tl.constexpr = R // 2
    N_GU: tl.constexpr = INTER // RG
    RD: tl.constexpr = R // DOWN
    BKD: tl.constexpr = BK * DOWN
    N_DN: tl.constexpr = H // RD
    E_ATT: tl.constexpr = N_QKV + N_ATT
    E_O: tl.constexpr = E_ATT + N_O
    E_GU: tl.constexpr = E_O + N_GU
    TOTAL: tl.constexpr = E_GU + N_DN
    r = tl.arange(0, R)
    kk = tl.arange(0, BK)
    d = tl.arange(0, HD)

    t0 = tl.atomic_add(cnt_ptr + _QUEUE, GRAB)            # GRAB tiles at a time, in order
    while t0 < TOTAL:
        for gi in range(GRAB):
            t = t0 + gi
            if t >= TOTAL:
                pass
            elif t < N_QKV:
                # ---- QKV rows of one head, group by group: y = W (rmsnorm(h) * w_norm), fp32 scratch
                g = t // G_T
                w = t % G_T
                row0 = tl.where(w < GQA * TPH, g * GQA * HD + w * R,
                                tl.where(w < (GQA + 1) * TPH, QD + g * HD + (w - GQA * TPH) * R,
                                         QD + NKV * HD + g * HD + (w - (GQA + 1) * TPH) * R))
                rows = row0 + r
                rstd = _rstd(h_ptr, H, HP, eps, False)
                acc = tl.zeros([R], dtype=tl.float32)
                for k0 in range(0, H, BK):
                    wt = tl.load(wqkv_ptr + rows[:, None] * H + (k0 + kk)[None, :]).to(tl.float32)
                    x = tl.load(h_ptr + k0 + kk).to(tl.float32)
                    xn = (x * rstd * tl.load(attn_norm_ptr + k0 + kk).to(tl.float32)).to(DT).to(tl.float32)
                    acc += tl.sum(wt * xn[None, :], axis=1)
                if FP8:                                    # W = codes x a scale per row
                    acc = acc * tl.load(sqkv_ptr + rows)
                y = acc.to(DT).to(tl.float32)
                tl.store(qkv_ptr + rows, y)
                _arrive(cnt_ptr + _GROUP + g * _LINE)
            elif t < E_ATT:
                # ---- attention of one KV-head group over one split of the context (flash-decoding);
                # the split holding the newest position also rotates + stores this token's K and V
                a = t - N_QKV
                g = a // S
                s = a % S
                _wait(cnt_ptr + _GROUP + g * _LINE, G_T)
                pos = tl.load(pos_ptr)
                seq = tl.load(seq_ptr)
                cos = tl.load(cs_ptr + pos * HD + d % HALF)
                sin = tl.load(cs_ptr + pos * HD + HALF + d % HALF)
                j = tl.arange(0, GP)                       # the group's query heads, padded for tl.dot
                jm = j < GQA
                CDT = kc_ptr.dtype.element_ty
                q = _rope(qkv_ptr, g * GQA + j, jm, d, cos, sin, HD).to(DT).to(CDT)              # [GP, HD]
                chunk = (seq + S - 1) // S
                start = s * chunk
                end = tl.minimum(start + chunk, seq)
                last = seq - 1                                                   # this token's position
                stop = tl.minimum(end, last)                                     # the cached keys' end
                sl = scale_log2                                                  # scores in log2 units
                m = tl.full([GP], -1.0e30, dtype=tl.float32)
                l = tl.zeros([GP], dtype=tl.float32)
                acc = tl.zeros([GP, HD], dtype=tl.float32)
                for n0 in range(start, stop, BLOCK_N):
                    n = n0 + tl.arange(0, BLOCK_N)
                    valid = n < stop
                    page = tl.load(bt_ptr + n // PAGE, mask=valid, other=0).to(tl.int64)
                    kt = tl.load(kc_ptr + page[:, None] * stride_cb + (n % PAGE)[:, None] * stride_cs
                                 + g * stride_ch + d[None, :], mask=valid[:, None], other=0.0)
                    vt = tl.load(vc_ptr + page[:, None] * stride_vb + (n % PAGE)[:, None] * stride_vs
                                 + g * stride_vh + d[None, :], mask=valid[:, None], other=0.0)
                    if DOT:                                    # tensor cores (the group padded to 16 rows)
                        if IEEE:
                            sc = tl.dot(q, tl.trans(kt), input_precision="ieee") * sl
                        else:
                            sc = tl.dot(q, tl.trans(kt)) * sl
                        sc = tl.where(valid[None, :], sc, float("-inf"))
                        acc, m, l = online_softmax_update(acc, m, l, sc, vt, IEEE)
                    else:                                      # CUDA cores: [G, BLOCK_N, D] products
                        sc = tl.sum(q.to(tl.float32)[:, None, :] * kt.to(tl.float32)[None, :, :], axis=2) * sl
                        sc = tl.where(valid[None, :], sc, float("-inf"))
                        m_new = tl.maximum(m, tl.max(sc, axis=1))
                        alpha = tl.exp2(m - m_new)
                        pr = tl.exp2(sc - m_new[:, None])
                        l = l * alpha + tl.sum(pr, axis=1)
                        acc = acc * alpha[:, None] + tl.sum(pr[:, :, None] * vt.to(tl.float32)[None, :, :], axis=1)
                        m = m_new
                if (start <= last) & (last < end):
                    one = tl.arange(0, 1)
                    k_new = _rope(qkv_ptr + QD, g + one, one < 1, d, cos, sin, HD).to(CDT)      # [1, HD]
                    v_new = tl.load(qkv_ptr + QD + NKV * HD + g * HD + d, cache_modifier=".cg").to(CDT)
                    slot = tl.load(slot_ptr).to(tl.int64)
                    tl.store(kc_ptr + (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs + g * stride_ch
                             + d[None, :], k_new)
                    tl.store(vc_ptr + (slot // PAGE) * stride_vb + (slot % PAGE) * stride_vs + g * stride_vh + d,
                             v_new)
                    sc = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), axis=1) * sl              # [GP]
                    m_new = tl.maximum(m, sc)
                    alpha = tl.exp2(m - m_new)
                    p = tl.exp2(sc - m_new)
                    l = l * alpha + p
                    acc = acc * alpha[:, None] + p[:, None] * v_new.to(tl.float32)[None, :]
                    m = m_new
                hrow = g * GQA + j
                tl.store(part_ptr + (hrow[:, None] * S + s) * HD + d[None, :], acc, mask=jm[:, None])
                tl.store(ml_ptr + (hrow * S + s) * 2, m, mask=jm)
                tl.store(ml_ptr + (hrow * S + s) * 2 + 1, l, mask=jm)
                _arrive(cnt_ptr + _ATTN)
            elif t < E_O:
                # ---- O rows: its first weights before the wait; the splits merged BK // HD heads
                # at a time in the loop (a step of the loop is one wait on memory); + the residual
                rows = (t - E_ATT) * R + r
                hh = tl.arange(0, HPI)
                wcols = hh[None, :, None] * HD + d[None, None, :]                    # [1, HPI, HD]
                w0 = tl.load(wo_ptr + rows[:, None, None] * QD + wcols).to(tl.float32)
                _wait(cnt_ptr + _ATTN, N_ATT)
                sp = tl.arange(0, S)
                acc = tl.zeros([R], dtype=tl.float32)
                for k0 in range(0, QD, BK):
                    if k0 == 0:
                        wt = w0
                    else:
                        wt = tl.load(wo_ptr + rows[:, None, None] * QD + k0 + wcols).to(tl.float32)
                    hs = k0 // HD + hh                                                  # [HPI] heads
                    ms = tl.load(ml_ptr + (hs[:, None] * S + sp[None, :]) * 2, cache_modifier=".cg")
                    ls = tl.load(ml_ptr + (hs[:, None] * S + sp[None, :]) * 2 + 1, cache_modifier=".cg")
                    parts = tl.load(part_ptr + ((hs[:, None, None] * S + sp[None, :, None]) * HD
                                                + d[None, None, :]), cache_modifier=".cg")   # [HPI, S, HD]
                    mx = tl.max(ms, axis=1)
                    f = tl.exp2(ms - mx[:, None])              # (log2 units, as the splits kept them)
                    o = tl.sum(f[:, :, None] * parts, axis=1) / tl.sum(f * ls, axis=1)[:, None]
                    o = o.to(DT).to(tl.float32)                                          # [HPI, HD]
                    acc += tl.sum(tl.sum(wt * o[None, :, :], axis=2), axis=1)
                if FP8:
                    acc = acc * tl.load(so_ptr + rows)
                y = (acc + tl.load(h_ptr + rows).to(tl.float32)).to(DT).to(tl.float32)
                tl.store(mid_ptr + rows, y)
                _arrive(cnt_ptr + _O)
            elif t < E_GU:
                # ---- R/2 gate rows and their R/2 up rows: silu(gate) * up of rmsnorm(mid)
                rg = (t - E_O) * RG + tl.arange(0, RG)
                wg0 = tl.load(wgu_ptr + rg[:, None] * H + kk[None, :]).to(tl.float32)
                wu0 = tl.load(wgu_ptr + (INTER + rg)[:, None] * H + kk[None, :]).to(tl.float32)
                _wait(cnt_ptr + _O, N_O)
                rstd = _rstd(mid_ptr, H, HP, eps, True)
                accg = tl.zeros([RG], dtype=tl.float32)
                accu = tl.zeros([RG], dtype=tl.float32)
                for k0 in range(0, H, BK):
                    if k0 == 0:
                        wg = wg0
                        wu = wu0
                    else:
                        wg = tl.load(wgu_ptr + rg[:, None] * H + (k0 + kk)[None, :]).to(tl.float32)
                        wu = tl.load(wgu_ptr + (INTER + rg)[:, None] * H + (k0 + kk)[None, :]).to(tl.float32)
                    x = tl.load(mid_ptr + k0 + kk, cache_modifier=".cg")
                    xn = (x * rstd * tl.load(mlp_norm_ptr + k0 + kk).to(tl.float32)).to(DT).to(tl.float32)
                    accg += tl.sum(wg * xn[None, :], axis=1)
                    accu += tl.sum(wu * xn[None, :], axis=1)
                if FP8:
                    accg = accg * tl.load(sgu_ptr + rg)
                    accu = accu * tl.load(sgu_ptr + INTER + rg)
                gt = accg.to(DT).to(tl.float32)
                up = accu.to(DT).to(tl.float32)
                act = (gt / (1.0 + tl.exp(-gt)) * up).to(DT).to(tl.float32)
                tl.store(act_ptr + rg, act)
                _arrive(cnt_ptr + _GU)
            else:
                # ---- down rows + the residual: the layer's output. Its K (the intermediate size)
                # is DOWN times longer, so its tiles are DOWN times narrower in rows and wider in
                # columns: as many steps, each as many bytes, as the other GEMV tiles'
                rows = (t - E_GU) * RD + tl.arange(0, RD)
                kd = tl.arange(0, BKD)
                w0 = tl.load(wdown_ptr + rows[:, None] * INTER + kd[None, :]).to(tl.float32)
                _wait(cnt_ptr + _GU, N_GU)
                acc = tl.zeros([RD], dtype=tl.float32)
                for k0 in range(0, INTER, BKD):
                    if k0 == 0:
                        wt = w0
                    else:
                        wt = tl.load(wdown_ptr + rows[:, None] * INTER + (k0 + kd)[None, :]).to(tl.float32)
                    acc += tl.sum(wt * tl.load(act_ptr + k0 + kd, cache_modifier=".cg")[None, :], axis=1)
                if FP8:
                    acc = acc * tl.load(sdown_ptr + rows)
                y = acc + tl.load(mid_ptr + rows, cache_modifier=".cg")
                tl.store(out_ptr + rows, y.to(DT))
        t0 = tl.atomic_add(cnt_ptr + _QUEUE, GRAB)
    # the last program out resets every counter for the next launch
    left = tl.atomic_add(cnt_ptr + _LEFT, 1, sem="acq_rel")
    if left == tl.num_programs(0) - 1:
        c = tl.arange(0, 16)
        tl.store(cnt_ptr + c * _LINE, tl.zeros([16], dtype=tl.int32))


def check_shapes(h, layer, k_cache, num_heads, config=DECODE_LAYER_CONFIG) -> str | None:
    """Why this kernel cannot run this layer (None: it can)."""
    def p2(n):
        return n > 0 and n & (n - 1) == 0
    H, nkv, hd = h.shape[-1], k_cache.shape[2], k_cache.shape[3]
    inter = layer["down"].shape[1]
    R, BK, S, BN = config["R"], config["BK"], config["S"], config["BLOCK_N"]
    if h.shape[0] != 1:
        return f"one decode token only (got {h.shape[0]} rows)"
    kinds = {isinstance(layer[k], FP8Weight) for k in LINEARS}
    if len(kinds) != 1 or not all(isinstance(layer[k], FP8Weight) or torch.is_tensor(layer[k]) for k in LINEARS):
        return "the four linear weights all in the model's dtype, or all FP8Weight"
    if num_heads % nkv or nkv + N_PHASE_COUNTERS > N_COUNTERS:
        return (f"{num_heads} query heads over {nkv} KV heads: a whole group each, "
                f"at most {N_COUNTERS - N_PHASE_COUNTERS} groups")
    DOWN = config["DOWN"]
    if not all(p2(n) for n in (hd, num_heads // nkv, R, BK, S, BN, DOWN)) or R < 2 or hd < 16 or BN < 16 \
            or DOWN > R:
        return ("head_dim, the group size, R, BK, DOWN, S and BLOCK_N must be powers of two "
                "(R >= 2, DOWN <= R; head_dim and BLOCK_N >= 16: tl.dot)")
    if hd % R or H % R or H % BK or inter % (BK * DOWN) or inter % (R // 2) or BK % hd or num_heads * hd % BK:
        return (f"hidden {H}, intermediate {inter} and head_dim {hd} must be multiples of R={R}; hidden, "
                f"intermediate (of BK*DOWN={BK * DOWN}) and the query width {num_heads * hd} of BK={BK}; BK of head_dim")
    return None


def _scratch(device, H, inter, nq, nkv, hd, S) -> dict:
    """The launch's fp32 partials and its counters: the current model's own (kernels/scratch.py)."""
    f = dict(device=device, dtype=torch.float32)
    return scratch.get(("decode_layer", device.type, device.index, H, inter, nq, nkv, hd, S), device, lambda: dict(
        qkv=torch.zeros((nq + 2 * nkv) * hd, **f), part=torch.zeros(nq * S * hd, **f),
        ml=torch.zeros(nq * S * 2, **f), mid=torch.zeros(H, **f), act=torch.zeros(inter, **f),
        cnt=torch.zeros(N_COUNTERS * LINE, device=device, dtype=torch.int32)))


def decode_layer_triton(h, layer, eps, positions, cos_sin, k_cache, v_cache, slot_mapping,
                        block_table, seq_lens, scale, num_heads, config=DECODE_LAYER_CONFIG, out=None):
    """The layer in one launch (see the module's text). Same arguments and result as
    decode_layer_torch; raises ValueError naming what does not fit (check_shapes)."""
    why = check_shapes(h, layer, k_cache, num_heads, config)
    if why:
        raise ValueError(f"decode_layer: {why}")
    H, nkv, hd, page = h.shape[-1], k_cache.shape[2], k_cache.shape[3], k_cache.shape[1]
    inter = layer["down"].shape[1]
    S = config["S"]
    sc = _scratch(h.device, H, inter, num_heads, nkv, hd, S)
    out = torch.empty_like(h) if out is None else out
    programs = config["PROGRAMS"] or config["PER_SM"] * sm_count(h.device)
    fp8 = isinstance(layer["qkv"], FP8Weight)
    # (an FP8Weight: its e4m3 codes and fp32 scale per row; a dtype weight: itself, no scales)
    ws = [(layer[k].q, layer[k].scale) if fp8 else (layer[k], layer[k]) for k in LINEARS]
    for t in [h] + [w for w, _ in ws]:
        assert t.is_contiguous()
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    _decode_layer_kernel[(programs,)](
        h, out, layer["attn_norm"], ws[0][0], ws[1][0], layer["mlp_norm"], ws[2][0], ws[3][0],
        ws[0][1], ws[1][1], ws[2][1], ws[3][1], positions, cos_sin, k_cache, v_cache, slot_mapping, block_table, seq_lens,
        sc["qkv"], sc["part"], sc["ml"], sc["mid"], sc["act"], sc["cnt"],
        eps, scale * LOG2E, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        H=H, INTER=inter, NQ=num_heads, NKV=nkv, HD=hd, PAGE=page, R=config["R"], BK=config["BK"],
        S=S, BLOCK_N=config["BLOCK_N"], GRAB=config["GRAB"], HP=triton.next_power_of_2(H),
        DOWN=config["DOWN"], GP=max(16, num_heads // nkv) if config["DOT"] else num_heads // nkv,
        IEEE=h.dtype == torch.float32, DOT=bool(config["DOT"]), FP8=fp8,
        num_warps=config["num_warps"])
    return out

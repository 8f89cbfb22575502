"""Prefill attention: causal attention for packed variable-length queries over paged K/V.

The prompts of one step are packed back to back into q [T, Hq, D]; cu_seqlens_q marks where each
sequence starts. Sequence b's new tokens may come after context already in the cache (a previous
chunk of a chunked prefill, or a cached prefix), so query i of b sits at position
seq_lens[b] - q_len[b] + i and sees every key up to that position -- keys that are read through
the block table from the paged pool, never from a contiguous copy.

The Triton kernel is FlashAttention-2 style: one program per (tile of BLOCK_M rows, sequence,
query head -- or group of query heads, see GQA below). It walks the keys in tiles of BLOCK_N, each
tile gathered from the pages (key n lives
at block_table[b, n // block_size], offset n % block_size), computes S = Q K^T with tl.dot, and
keeps a running (max m, sum l, output acc) -- the online softmax -- so the [q_len, seq_len] score
matrix never exists in memory. Work is in the base-2 domain (exp2, scale folded with log2 e).
The causal mask costs nothing off the diagonal, in one of two forms (a tier's choice):
  * split (long rows): two loops, the keys every query of the tile sees (no mask, no predicate:
    the bulk of the work) in tiles of BLOCK_N, then the tiles that cross the diagonal (masked) in
    narrower tiles of BLOCK_N_DIAG, so less masked-out work is done;
  * ONE_LOOP (short rows): one loop, so one software pipeline whose loads run ahead across the
    diagonal (two loops refill the pipeline there, and on a short row that wait is not hidden);
    key indices are clamped to the sequence (loads never predicated) and the mask is applied only
    on the tiles that reach past the tile's first query (a branch, taken once or twice per row).
The running max starts at a large FINITE negative number, so a row that sees no key at all gives
exp2(-inf - finite) = 0 and an output of 0, never NaN. Programs with the most work (the last query
tiles) are launched first: with M_SLOW the query tiles are the grid's last dimension, so the GPU,
which starts programs in grid order, starts the heaviest tiles of EVERY sequence and head before
any lighter one (without it, only within each sequence and head: the last heads' heavy tiles start
late and leave a long tail).

GQA: query head h reads KV head h // G (G = Hq // Hkv query heads per KV head). With PACK_GQA (the
default tiers) a tile's rows are (query, head) pairs of all G heads of one KV head -- BLOCK_M // G
queries each -- so every K/V tile is read once for the whole group. When G is not a power of two
or does not divide BLOCK_M, a tile holds one head's queries and the group's heads re-read the same
K/V tiles (mostly from L2).

prefill_attention_torch is the reference; prefill_attention_triton has the same signature, plus
its launch parameters as an explicit keyword argument `config` (PREFILL_CONFIG unless given).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import AMPERE, INT32_LIMIT, capability, freeze, num_stages
from .online_softmax import LOG2E
from .paged import gather_pages


def prefill_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float,
                            max_q_len: int | None = None) -> torch.Tensor:
    """q [T, Hq, D] packed: sequence b owns rows cu_seqlens_q[b]:cu_seqlens_q[b+1].
    seq_lens[b] counts all of b's tokens in the cache, the new ones included (their K/V are already
    stored), so query i of b sits at position seq_lens[b] - q_len[b] + i and sees keys 0..that.
    max_q_len, when the caller knows it, saves a device->host read. Computed in fp32: queries are
    padded per sequence, scores masked (no loop over sequences)."""
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


# Launch parameters per query length, picked on the H200 for Llama-3.2-1B's heads (32 query / 8 KV
# heads, head_dim 64) by `python -m pagedlab bench kernels --prefill --tune` (pick_prefill_tiers:
# the config whose worst speed against SDPA over a tier's shapes is highest; docs/kernels.md has
# the sweep). A launch takes the first tier whose "max_q_len" holds the step's longest query run.
# BLOCK_M counts tile ROWS: with PACK_GQA a row is (query, head of the group), so a tile holds
# BLOCK_M / G queries of all G heads that share one KV head and every K/V tile is read once for
# the whole group. ONE_LOOP: one key loop (short rows: one software pipeline, no refill at the
# diagonal); else two loops, the diagonal in tiles of BLOCK_N_DIAG keys. M_SLOW: query tiles last
# in the grid, so the heaviest tiles of every sequence and head start first. Read-only: pass
# another config (launch.merge_config(PREFILL_CONFIG, {"long": {...}})), or one flat config.
PREFILL_CONFIG = freeze({
    "short": {"max_q_len": 512, "BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2,
              "PACK_GQA": True, "ONE_LOOP": True, "M_SLOW": True},
    "medium": {"max_q_len": 1024, "BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 2,
               "PACK_GQA": True, "ONE_LOOP": True, "M_SLOW": True},
    "long": {"max_q_len": 4096, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_N_DIAG": 32, "num_warps": 4,
             "num_stages": 2, "PACK_GQA": True, "M_SLOW": True},
    "longest": {"max_q_len": None, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_N_DIAG": 16,
                "num_warps": 4, "num_stages": 2, "PACK_GQA": True, "M_SLOW": True},
})
# GPUs before Ampere (a T4: 64 KB of shared memory, no asynchronous copies): one safe config.
PREFILL_CONFIG_PRE_AMPERE = freeze({"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2,
                                    "PACK_GQA": True})
# Under the interpreter (CPU) every padded row and column is computed in numpy, one program after
# another: tiles no larger than the queries need (and at least MIN_BLOCK, tl.dot's minimum), and
# key tiles of at most CPU_BLOCK_N.
MIN_BLOCK = 16
CPU_BLOCK_N = 32
# CUDA's limit on a grid's second and third dimensions (M_SLOW puts the query tiles third)
GRID_Z_LIMIT = 65535


def prefill_launch_config(config, max_q_len: int, device) -> dict:
    """The launch parameters for a step whose longest query run is max_q_len: `config` is one flat
    config (BLOCK_M, BLOCK_N, num_warps, num_stages[, PACK_GQA]), used as given, or tiers as
    PREFILL_CONFIG (before Ampere: PREFILL_CONFIG_PRE_AMPERE whatever the tiers say)."""
    if "BLOCK_M" in config:                        # one flat config: as given
        return dict(config)
    if device.type == "cuda" and capability(device) < AMPERE:
        return dict(PREFILL_CONFIG_PRE_AMPERE)
    return dict(next(c for c in config.values() if c["max_q_len"] is None or max_q_len <= c["max_q_len"]))


def prefill_tier_lengths(config=PREFILL_CONFIG) -> list[int]:
    """A longest-query-run length in each tier of `config` (tiers as PREFILL_CONFIG), in order:
    one launch at each meets every tier's kernel once (warmup.py compiles them at load). A flat
    config has one kernel: [1]."""
    if "BLOCK_M" in config:
        return [1]
    out = []
    for tier in config.values():
        out.append(tier["max_q_len"] if tier["max_q_len"] is not None else (out[-1] if out else 0) + 1)
    return out


@triton.jit
def _prefill_tile(acc, m_i, l_i, q, k_ptr, v_ptr, bt_row_ptr, kvh, start, offs_n, offs_d, q_pos,
                  first_q_pos, seq_len, qk_scale, stride_kb, stride_kt, stride_kh, stride_vb,
                  stride_vt, stride_vh, D: tl.constexpr, BS: tl.constexpr, MASK: tl.constexpr,
                  IEEE: tl.constexpr, EVEN_D: tl.constexpr, IDX64: tl.constexpr):
    """One K/V tile of keys start..start+BLOCK_N: gather it from the pages, S = Q K^T, and the
    online-softmax update (online_softmax.py's recurrence, written out here so that the scale is
    folded into the exponent's subtraction (one FMA per score) and P V accumulates inside the
    matrix instruction, as in FlashAttention-2).
    MASK 0: every key of the tile is visible to every query (no mask, no predicate);
    MASK 1: a diagonal tile (predicated loads, causal + length mask);
    MASK 2: the one-loop form: key indices clamped to the sequence (loads never predicated) and
            the causal mask applied only when the tile reaches past the tile's first query."""
    k_pos = start + offs_n
    if MASK == 1:
        kmask = k_pos < seq_len
        blk = tl.load(bt_row_ptr + k_pos // BS, mask=kmask, other=0)
        tok = k_pos % BS
    elif MASK == 2:                            # keys past the end read the last key (masked below)
        k_idx = tl.minimum(k_pos, seq_len - 1)
        blk = tl.load(bt_row_ptr + k_idx // BS)
        tok = k_idx % BS
    else:
        blk = tl.load(bt_row_ptr + k_pos // BS)
        tok = k_pos % BS
    if IDX64:                                  # int32 address math unless the pool is huge
        blk = blk.to(tl.int64)
    k_ptrs = k_ptr + (blk * stride_kb + tok * stride_kt + kvh * stride_kh)[:, None] + offs_d[None, :]
    v_ptrs = v_ptr + (blk * stride_vb + tok * stride_vt + kvh * stride_vh)[:, None] + offs_d[None, :]
    if MASK == 1:
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
    if MASK == 1:
        allowed = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < seq_len)
        s = tl.where(allowed, s, float("-inf"))
    elif MASK == 2:
        if start + offs_n.shape[0] > first_q_pos + 1:      # a key past the first query's position
            s = tl.where(k_pos[None, :] <= q_pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    if IEEE:
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


# Integer arguments that change from step to step are not specialized on (Triton would otherwise
# compile a variant for each value that is 1 or a multiple of 16: more compiles at first sight).
@triton.jit(do_not_specialize=["stride_bt", "num_m_tiles"])
def _prefill_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, cu_ptr, sl_ptr, qk_scale,
                              stride_qt, stride_qh, stride_ot, stride_oh,
                              stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                              stride_bt, num_m_tiles,
                              G: tl.constexpr, HEADS: tl.constexpr, BS: tl.constexpr,
                              D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_N_DIAG: tl.constexpr,
                              ONE_LOOP: tl.constexpr, M_SLOW: tl.constexpr, IEEE: tl.constexpr,
                              EVEN_D: tl.constexpr, IDX64: tl.constexpr):
    """One program: a tile of BLOCK_M rows = BLOCK_M // HEADS queries x HEADS query heads (HEADS
    is 1, or G with PACK_GQA: the whole group of one KV head), of sequence b."""
    BM_Q: tl.constexpr = BLOCK_M // HEADS                 # queries per tile
    if M_SLOW:   # grid (head groups, sequences, query tiles): the GPU starts programs in grid
        # order, so every sequence's and head's last (heaviest) query tiles start first
        pid_m = num_m_tiles - 1 - tl.program_id(2)
        hg = tl.program_id(0)                             # which group of HEADS query heads
    else:        # grid (query tiles, sequences, head groups): heaviest first per sequence and head
        pid_m = num_m_tiles - 1 - tl.program_id(0)
        hg = tl.program_id(2)
    b = tl.program_id(1)
    kvh = (hg * HEADS) // G
    q_start = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_start
    seq_len = tl.load(sl_ptr + b)
    ctx = seq_len - q_len                                 # tokens already in the cache before q
    m_start = pid_m * BM_Q

    offs_r = tl.arange(0, BLOCK_M)
    offs_m = m_start + offs_r % BM_Q                      # row r: query m_start + r % BM_Q ...
    head = hg * HEADS + offs_r // BM_Q                    # ... of head hg * HEADS + r // BM_Q
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < q_len
    dmask = offs_d < D
    q_rows = (q_start + offs_m).to(tl.int64)
    row_off = q_rows * stride_qt + head * stride_qh
    q = tl.load(q_ptr + row_off[:, None] + offs_d[None, :], mask=row_ok[:, None] & dmask[None, :], other=0.0)
    q_pos = ctx + offs_m
    bt_row_ptr = bt_ptr + b.to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: empty rows give 0, not NaN
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    tile_live = m_start < q_len
    first_q_pos = ctx + m_start                           # the tile's first query's position
    diag_end = tl.where(tile_live, tl.minimum(first_q_pos + BM_Q, seq_len), 0)
    if ONE_LOOP:
        # one software pipeline over every key tile; the mask only where the diagonal is crossed
        for start in range(0, diag_end, BLOCK_N):
            acc, m_i, l_i = _prefill_tile(acc, m_i, l_i, q, k_ptr, v_ptr, bt_row_ptr, kvh, start,
                                          offs_n, offs_d, q_pos, first_q_pos, seq_len, qk_scale,
                                          stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                                          stride_vh, D, BS, 2, IEEE, EVEN_D, IDX64)
    else:
        # phase 1: keys [0, full_end) are visible to every query of the tile -> no mask
        full_end = tl.where(tile_live, (first_q_pos // BLOCK_N) * BLOCK_N, 0)
        for start in range(0, full_end, BLOCK_N):
            acc, m_i, l_i = _prefill_tile(acc, m_i, l_i, q, k_ptr, v_ptr, bt_row_ptr, kvh, start,
                                          offs_n, offs_d, q_pos, first_q_pos, seq_len, qk_scale,
                                          stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                                          stride_vh, D, BS, 0, IEEE, EVEN_D, IDX64)
        # phase 2: the tiles that cross the causal diagonal (and the end of the sequence) ->
        # masked, in tiles of BLOCK_N_DIAG keys (<= BLOCK_N: less masked-out work)
        offs_n2 = tl.arange(0, BLOCK_N_DIAG)
        for start in range(full_end, diag_end, BLOCK_N_DIAG):
            acc, m_i, l_i = _prefill_tile(acc, m_i, l_i, q, k_ptr, v_ptr, bt_row_ptr, kvh, start,
                                          offs_n2, offs_d, q_pos, first_q_pos, seq_len, qk_scale,
                                          stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                                          stride_vh, D, BS, 1, IEEE, EVEN_D, IDX64)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    o_off = q_rows * stride_ot + head * stride_oh
    tl.store(o_ptr + o_off[:, None] + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dmask[None, :])


def prefill_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
                             seq_lens: torch.Tensor, scale: float,
                             max_q_len: int | None = None, *, config=PREFILL_CONFIG) -> torch.Tensor:
    """Same contract as prefill_attention_torch; `config` holds the launch parameters (tiers as
    PREFILL_CONFIG, or one flat config). No device->host sync: without max_q_len the grid is
    bounded by min(T, block_table.shape[1] * block_size) (extra programs exit at once)."""
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
    cfg = prefill_launch_config(config, max_q_len, q.device)
    g = hq // hkv
    # the group's heads in one tile: needs a power-of-two group that divides the tile's rows
    heads = g if cfg.get("PACK_GQA", False) and g & (g - 1) == 0 and cfg["BLOCK_M"] % g == 0 else 1
    block_m = cfg["BLOCK_M"]
    block_n = cfg["BLOCK_N"]
    if q.device.type == "cpu":                       # interpreter: small tiles, less padding
        per_tile = min(block_m // heads, triton.next_power_of_2(max_q_len))     # queries per tile
        block_m = heads * max(per_tile, -(-MIN_BLOCK // heads))
        block_n = min(block_n, CPU_BLOCK_N)
    stages = cfg["num_stages"]
    if q.element_size() > 2:                         # fp32: twice the shared memory per tile
        block_n, stages = min(block_n, 64), min(stages, 2)
    block_n_diag = max(MIN_BLOCK, min(cfg.get("BLOCK_N_DIAG", block_n), block_n))
    one_loop = bool(cfg.get("ONE_LOOP", False))
    num_m_tiles = triton.cdiv(max_q_len, block_m // heads)
    m_slow = bool(cfg.get("M_SLOW", False)) and num_m_tiles <= GRID_Z_LIMIT
    grid = (hq // heads, b, num_m_tiles) if m_slow else (num_m_tiles, b, hq // heads)
    block_d = max(MIN_BLOCK, triton.next_power_of_2(d))
    ieee = q.dtype == torch.float32
    _prefill_attention_kernel[grid](
        q, k_cache, v_cache, out, block_table, cu_seqlens_q, seq_lens, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0), num_m_tiles,
        G=g, HEADS=heads, BS=bs, D=d, BLOCK_D=block_d,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_N_DIAG=block_n_diag, ONE_LOOP=one_loop, M_SLOW=m_slow,
        IEEE=ieee, EVEN_D=d == block_d,
        IDX64=max(k_cache.numel(), v_cache.numel()) >= INT32_LIMIT,
        num_warps=cfg["num_warps"], num_stages=num_stages(stages, q.device))
    return out

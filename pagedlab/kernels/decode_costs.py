"""What each paged decode-attention variant costs, computed from the shape alone (no device).

decode_costs(variant, batch, ctx, ...) counts, for one launch of pagedlab's decode kernels
(kernels/decode_attention.py) on `batch` sequences of `ctx` cached tokens each:

  kv_bytes       K and V bytes the kernel LOADS. naive and blocked run one program per query head,
                 so every K/V row is loaded once per query head of its group (G = heads / kv_heads
                 times; L2 may absorb some re-reads, DRAM sees between 1x and Gx). gqa and
                 split_kv load each row once.
  table_bytes    block-table entries loaded (int32, one per key per program: the kernels look the
                 page up for every key they read).
  q_bytes        the query rows loaded (split_kv: each split loads its group's queries).
  write_bytes    the output, plus split_kv's partials (fp32 m, l and a BLOCK_D accumulator per
                 query head and used split).
  scratch_read_bytes  split_kv's merge reading those partials back.
  programs       programs launched (the grid); programs_per_sm for a given SM count.
  flops          2 * D multiply-adds for Q.K and for P.V per (query head, key): 4 * B * Hq * L * D
                 (the useful arithmetic, the same for every variant; softmax exps not counted).
  intensity      flops / bytes (all bytes above). Decode is ~1-4 FLOP/byte: far below any GPU's
                 ridge point (the H200: ~990 TFLOP/s bf16 / 4.8 TB/s = ~200), so memory bound.

Pure arithmetic on ints: no torch, no device; `auto` resolves through the kernels' own
choose_decode_plan so the split count is the one the launcher would pick.
"""
from __future__ import annotations

from dataclasses import dataclass

# The shape of docs/kernels_bench.json's decode table (Llama-3.2-1B's attention, bf16, pages of 16).
BENCH_SHAPE = dict(heads=32, kv_heads=8, head_dim=64, block_size=16, dtype_bytes=2)
DEFAULT_BLOCK_N = {"naive": 1, "blocked": 64, "gqa": 128, "split_kv": 128}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class DecodeCost:
    variant: str
    num_splits: int
    programs: int
    programs_per_sm: float
    kv_bytes: int
    table_bytes: int
    q_bytes: int
    write_bytes: int
    scratch_read_bytes: int
    flops: int

    @property
    def bytes(self) -> int:
        return self.kv_bytes + self.table_bytes + self.q_bytes + self.write_bytes + self.scratch_read_bytes

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes


def used_splits(ctx: int, num_splits: int, block_n: int) -> int:
    """Splits of a ctx-long sequence that do work (split_kv splits each sequence's own length
    into whole BLOCK_N tiles; the last few splits may get nothing)."""
    if num_splits <= 1:
        return 1
    split_len = _cdiv(_cdiv(ctx, num_splits), block_n) * block_n
    return max(_cdiv(ctx, max(split_len, 1)), 1)


def decode_costs(variant: str, batch: int, ctx: int, heads: int = 32, kv_heads: int = 8,
                 head_dim: int = 64, block_size: int = 16, dtype_bytes: int = 2,
                 num_splits: int | None = None, block_n: int | None = None,
                 sm_count: int = 132) -> DecodeCost:
    """The counts above for one decode launch. num_splits (split_kv) defaults to the launcher's
    choose_num_splits; block_n to DECODE_CONFIG's BLOCK_N; sm_count to the H200's 132."""
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if variant == "auto":
        from .decode_attention import choose_decode_plan
        variant, plan = choose_decode_plan(batch, kv_heads, ctx, sm_count, block_n or DEFAULT_BLOCK_N["split_kv"])
        num_splits = num_splits or plan
    if variant not in DEFAULT_BLOCK_N:
        raise ValueError(f"unknown variant {variant!r}")
    block_n = block_n or DEFAULT_BLOCK_N[variant]
    g = heads // kv_heads
    row = head_dim * dtype_bytes                       # one head's K (or V, q, out) row
    flops = 4 * batch * heads * ctx * head_dim
    out_bytes = batch * heads * row
    if variant in ("naive", "blocked"):
        programs, splits = batch * heads, 1
        kv = 2 * programs * ctx * row                  # = G x the unique K/V
        table = programs * ctx * 4
        q = batch * heads * row
        write, scratch = out_bytes, 0
    else:
        if variant == "gqa":
            splits = 1
        else:
            if num_splits is None:
                from .decode_attention import choose_num_splits
                num_splits = choose_num_splits(batch, kv_heads, ctx, sm_count, block_n)
            splits = num_splits
        programs = batch * kv_heads * splits
        kv = 2 * batch * kv_heads * ctx * row          # each row once
        table = batch * kv_heads * ctx * 4
        used = used_splits(ctx, splits, block_n)
        q = batch * heads * row * used
        write, scratch = out_bytes, 0
        if splits > 1:
            partial = batch * heads * used * (2 + max(16, _pow2(head_dim))) * 4   # m, l, acc (fp32)
            write += partial
            scratch = partial
    return DecodeCost(variant, splits, programs, programs / sm_count, kv, table, q, write,
                      scratch, flops)


def h200_rows(bench: dict, variants=("naive", "blocked", "gqa", "split_kv")) -> list[dict]:
    """One row per (shape, variant) of a `bench kernels` decode table (docs/kernels_bench.json,
    the lab's H200 run: the course reads it with pagedlab.course.load_h200_bench()): the measured time and K/V
    TB/s (unique K/V bytes / time, as docs/kernels.md counts them) next to decode_costs at the
    same shape. split_kv's split count is what auto chose at that shape (auto_plan) when auto ran
    split_kv there, else the launcher's choose_num_splits."""
    sms = bench["meta"].get("sm_count", 132)
    rows = []
    for r in bench["table"]:
        b, ctx = r["batch"], r["ctx"]
        plan = r.get("auto_plan") or [None, None]
        for v in variants:
            if v not in r["us"]:
                continue
            splits = plan[1] if (v == "split_kv" and plan[0] == "split_kv") else None
            c = decode_costs(v, b, ctx, num_splits=splits, sm_count=sms, **BENCH_SHAPE)
            us = r["us"][v]
            unique_kv = 2 * b * ctx * BENCH_SHAPE["kv_heads"] * BENCH_SHAPE["head_dim"] * BENCH_SHAPE["dtype_bytes"]
            rows.append(dict(batch=b, ctx=ctx, variant=v, splits=c.num_splits, programs=c.programs,
                             programs_per_sm=c.programs_per_sm, mb_loaded=c.bytes / 1e6,
                             intensity=c.intensity, h200_us=us, h200_kv_tbs=unique_kv / (us * 1e-6) / 1e12))
    return rows

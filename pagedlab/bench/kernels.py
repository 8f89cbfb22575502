"""Benchmark the attention kernels: `python -m pagedlab bench kernels` (or python -m pagedlab.bench.kernels).

Decode: for each paged decode variant, the achieved K/V bandwidth = bytes of K and V read
(batch * context * Hkv * D * 2 tensors * element size) / median time from triton.testing.do_bench,
beside the device's copy bandwidth measured in the same run (read + write bytes of a 1 GiB
device-to-device copy / time) and torch's scaled_dot_product_attention on a CONTIGUOUS (unpaged)
cache of the same shape. Prefill: TFLOP/s of the causal paged prefill kernel beside torch SDPA
(causal, contiguous). Writes a JSON of every measurement, a markdown table and plots to --out.

Shapes are Llama-3.2-1B's attention: 32 query heads, 8 KV heads, head_dim 64, bf16, page 16,
every sequence's pages scattered (shuffled block table). Launch-config sweeps (--tune) pass each
config explicitly to the launchers (`config=`); the kernels' defaults are never changed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from pagedlab.bench.common import (copy_bandwidth_tbs, do_bench_us, metadata, out_dir, require_cuda,
                                   write_json)
from pagedlab.kernels import decode_attention as da
from pagedlab.kernels import prefill_attention as pa
from pagedlab.kernels.launch import merge_config, sm_count, to_plain
from pagedlab.kernels.paged import gather_pages

HQ, HKV, D, PAGE = 32, 8, 64, 16
DTYPE = torch.bfloat16

# The reference rows of the issue (H200, Triton 3.6, bf16, 2026-11-29): median microseconds.
TABLE_ROWS = [(1, 8192), (1, 32768), (4, 8192), (16, 2048), (64, 1024), (64, 2048), (128, 2048),
              (256, 4096)]
VLLM_US = {(1, 8192): 61.2, (1, 32768): 66.8, (4, 8192): 41.5, (16, 2048): 42.0,
           (64, 1024): 53.9, (64, 2048): 88.9, (128, 2048): 159.4, (256, 4096): 580.5}
ISSUE_SDPA_US = {(1, 8192): 16.0, (1, 32768): 32.0, (4, 8192): 31.2, (16, 2048): 32.2,
                 (64, 1024): 45.9, (64, 2048): 76.0, (128, 2048): 134.9, (256, 4096): 491.1}
SWEEP_BATCH = [1, 4, 16, 64, 256]
SWEEP_CTX = [128, 512, 2048, 8192, 32768]
MAX_TOKENS = 1 << 20                       # batch * context cap for the sweep (memory, time)
NAIVE_MAX_TOKENS = 1 << 16                 # ... and for the naive variant (one key at a time: slow)
TUNE_SPLITS = [1, 2, 4, 8, 16, 32, 64, 128]   # split counts --tune times split_kv with
PREFILL_LENS = [512, 1024, 2048, 4096, 8192]
PREFILL_TOKENS = 16384


def make_decode_case(batch, ctx, device, gen):
    blocks_per_seq = -(-ctx // PAGE)
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, PAGE, HKV, D, device=device, dtype=DTYPE, generator=gen)
    v_cache = torch.randn(num_blocks, PAGE, HKV, D, device=device, dtype=DTYPE, generator=gen)
    perm = torch.randperm(num_blocks, device=device, generator=gen)
    table = perm.view(batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(batch, HQ, D, device=device, dtype=DTYPE, generator=gen)
    return q, k_cache, v_cache, table, seq_lens


def kv_bytes(batch, ctx):
    return batch * ctx * HKV * D * 2 * torch.finfo(DTYPE).bits // 8


def bench_decode_shape(batch, ctx, device, gen, variants, graph=False, sdpa=True, configs=None,
                       splits=None, rep=100):
    """Returns {name: microseconds} for one shape. configs: {name: changes to split_kv's entry of
    DECODE_CONFIG}, each timed with split_kv and that config."""
    q, kc, vc, table, sl = make_decode_case(batch, ctx, device, gen)
    scale = D ** -0.5
    res = {}
    for v in variants:
        res[v] = do_bench_us(lambda: da.decode_attention_triton(q, kc, vc, table, sl, scale, ctx,
                                                           variant=v), rep=rep)
        if graph and v in ("gqa", "split_kv", "auto"):
            res[v + "_graph"] = do_bench_us(lambda: da.decode_attention_triton(
                q, kc, vc, table, sl, scale, ctx, variant=v), graph=True)
    for cfg_name, cfg in (configs or {}).items():
        config = merge_config(da.DECODE_CONFIG, {"split_kv": cfg})
        try:
            res[cfg_name] = do_bench_us(lambda: da.decode_attention_triton(
                q, kc, vc, table, sl, scale, ctx, variant="split_kv", config=config), rep=rep)
        except Exception as e:  # a config that does not compile (shared memory) is skipped
            res[cfg_name] = None
            print(f"  config {cfg_name} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
    for s in splits or []:
        res[f"splits={s}"] = do_bench_us(lambda: da.decode_attention_triton(
            q, kc, vc, table, sl, scale, ctx, variant="split_kv", num_splits=s), rep=rep)
    if sdpa:
        import torch.nn.functional as F
        # contiguous cache of the same size: q [B, Hq, 1, D], K/V [B, Hkv, L, D], enable_gqa
        k = torch.randn(batch, HKV, ctx, D, device=device, dtype=DTYPE, generator=gen)
        v = torch.randn(batch, HKV, ctx, D, device=device, dtype=DTYPE, generator=gen)
        q4 = q.view(batch, HQ, 1, D)

        def sdpa_fn():
            return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)
        res["sdpa"] = do_bench_us(sdpa_fn, rep=rep)
        if graph:
            res["sdpa_graph"] = do_bench_us(sdpa_fn, graph=True)
        del k, v
    out_ref = da.decode_attention_torch(q[:1], kc, vc, table[:1], sl[:1], scale) if ctx <= 8192 else None
    if out_ref is not None:   # sanity: the timed kernel is right at this shape
        out = da.decode_attention_triton(q[:1], kc, vc, table[:1], sl[:1], scale, ctx, variant="auto")
        err = ((out.float() - out_ref.float()).norm() / out_ref.float().norm()).item()
        assert err < 1e-2, f"auto decode wrong at B={batch} ctx={ctx}: rel err {err}"
    del q, kc, vc, table, sl
    torch.cuda.empty_cache()
    return res


def bench_prefill(device, gen, configs=None):
    import torch.nn.functional as F
    rows = []
    for L in PREFILL_LENS:
        batch = max(1, PREFILL_TOKENS // L)
        blocks = -(-L // PAGE)
        num_blocks = batch * blocks
        kc = torch.randn(num_blocks, PAGE, HKV, D, device=device, dtype=DTYPE, generator=gen)
        vc = torch.randn(num_blocks, PAGE, HKV, D, device=device, dtype=DTYPE, generator=gen)
        table = torch.randperm(num_blocks, device=device, generator=gen).view(batch, blocks).int()
        sl = torch.full((batch,), L, dtype=torch.int32, device=device)
        cu = torch.arange(0, batch + 1, device=device, dtype=torch.int32) * L
        q = torch.randn(batch * L, HQ, D, device=device, dtype=DTYPE, generator=gen)
        scale = D ** -0.5
        flops = 4 * batch * HQ * D * L * (L + 1) / 2          # causal: QK^T and PV, half the square
        row = {"seq_len": L, "batch": batch}
        row["triton_us"] = do_bench_us(lambda: pa.prefill_attention_triton(q, kc, vc, table, cu, sl,
                                                                      scale, L))
        for name, cfg in (configs or {}).items():
            config = merge_config(pa.PREFILL_CONFIG, cfg)
            try:
                row[name] = do_bench_us(lambda: pa.prefill_attention_triton(
                    q, kc, vc, table, cu, sl, scale, L, config=config))
            except Exception as e:
                row[name] = None
                print(f"  prefill config {name} failed: {type(e).__name__}: {str(e)[:120]}")
        qc = q.view(batch, L, HQ, D).transpose(1, 2)
        kcont = torch.randn(batch, HKV, L, D, device=device, dtype=DTYPE, generator=gen)
        vcont = torch.randn(batch, HKV, L, D, device=device, dtype=DTYPE, generator=gen)
        # flash backend, K/V expanded to all query heads (its fastest GQA path)
        ke = kcont.repeat_interleave(HQ // HKV, 1)
        ve = vcont.repeat_interleave(HQ // HKV, 1)
        row["sdpa_us"] = do_bench_us(lambda: F.scaled_dot_product_attention(
            qc, ke, ve, is_causal=True, scale=scale))
        row["triton_tflops"] = flops / (row["triton_us"] * 1e-6) / 1e12
        row["sdpa_tflops"] = flops / (row["sdpa_us"] * 1e-6) / 1e12
        row["flops"] = flops
        ref_rows = cu[1].item()            # sanity on the first sequence
        out = pa.prefill_attention_triton(q[:ref_rows], kc, vc, table[:1], cu[:2], sl[:1], scale, L)
        ref = F.scaled_dot_product_attention(
            qc[:1], pa_gather(kc, table[:1], L).repeat_interleave(HQ // HKV, 1),
            pa_gather(vc, table[:1], L).repeat_interleave(HQ // HKV, 1), is_causal=True,
            scale=scale)
        ref = ref[0].transpose(0, 1)
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        row["rel_err_vs_sdpa"] = err
        print(f"prefill L={L:5d} B={batch:3d}: triton {row['triton_us']:9.1f} us "
              f"{row['triton_tflops']:6.1f} TFLOP/s | sdpa {row['sdpa_us']:9.1f} us "
              f"{row['sdpa_tflops']:6.1f} TFLOP/s "
              f"| err {err:.2e}", flush=True)
        rows.append(row)
        del kc, vc, q, kcont, vcont, ke, ve
        torch.cuda.empty_cache()
    return rows


# the prefill shapes measured in docs/kernels.md: (batch, length), causal, Llama-3.2-1B heads, bf16
ISSUE_PREFILL_SHAPES = [(1, 512), (1, 1024), (1, 2048), (1, 4096), (1, 8192), (8, 512), (4, 2048)]
def _prefill_cfg(m, n, w, st, pack=True, one_loop=False, diag=None, m_slow=False):
    cfg = {"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": st, "PACK_GQA": pack}
    name = f"m{m}_n{n}_w{w}_s{st}" + ("" if pack else "_nopack")
    if one_loop:
        cfg["ONE_LOOP"] = True
        name = "one_" + name
    if diag is not None:
        cfg["BLOCK_N_DIAG"] = diag
        name += f"_d{diag}"
    if m_slow:
        cfg["M_SLOW"] = True
        name += "_mslow"
    return name, cfg


# flat launch configs the sweep (--prefill --tune) times at every shape: the key loop split in
# two (unmasked tiles, then the diagonal in tiles of BLOCK_N_DIAG keys) or one loop, the query
# tiles first or last in the grid (M_SLOW). The neighbourhood of the winners of a broader sweep
# of 28 configs (BLOCK_M 64-256, BLOCK_N 64/128, 4/8 warps, 2-4 stages, packed or not:
# docs/prefill_sweep_2026-12-01b.txt)
PREFILL_SWEEP = dict(_prefill_cfg(*a, **k) for a, k in [
    ((64, 64, 4, 3), {}), ((64, 64, 4, 2), {}), ((64, 64, 4, 2), {"m_slow": True}),
    ((64, 128, 4, 2), {"diag": 64}), ((64, 128, 4, 2), {"diag": 64, "m_slow": True}),
    ((64, 128, 4, 2), {"diag": 32}), ((64, 128, 4, 2), {"diag": 32, "m_slow": True}),
    ((64, 128, 4, 3), {"diag": 64, "m_slow": True}), ((64, 128, 4, 2), {"diag": 16, "m_slow": True}),
    ((128, 128, 4, 2), {}),
    ((64, 64, 4, 2), {"one_loop": True}), ((64, 64, 4, 2), {"one_loop": True, "m_slow": True}),
    ((64, 128, 4, 2), {"one_loop": True}), ((64, 128, 4, 2), {"one_loop": True, "m_slow": True}),
    ((64, 128, 4, 3), {"one_loop": True, "m_slow": True}),
])
# the default tiers before this sweep (session 9, 2026-12-01), timed beside the picked ones
PREFILL_BEFORE = {
    "short": {"max_q_len": 4096, "BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3,
              "PACK_GQA": True},
    "long": {"max_q_len": None, "BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 4, "num_stages": 2,
             "PACK_GQA": True},
}
# ragged batches every swept config must get right before it is timed (bf16 against the fp32
# torch reference): (query lengths, cached context lengths, page size). Pages of 16 only, the
# benchmark's: another page size is another compiled kernel per config (tests/test_kernels.py
# covers other page sizes).
PREFILL_RAGGED = [([1000], [0], 16), ([513, 77, 1, 300], [0, 0, 0, 0], 16),
                  ([200, 1, 0, 129], [700, 33, 5, 0], 16), ([37, 90], [5, 0], 16),
                  ([2048, 100], [1024, 3], 16)]


def _precompile_worker(names):
    """(a subprocess) compile the named PREFILL_SWEEP configs into Triton's on-disk cache by
    running each once on a tiny problem of the benchmark's shapes (same specialization)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")   # cpu: the interpreter
    gen = torch.Generator(device=device).manual_seed(0)
    kc = torch.randn(8, PAGE, HKV, D, device=device, dtype=DTYPE, generator=gen)
    table = torch.randperm(8, device=device, generator=gen).view(1, 8).int()
    sl = torch.tensor([100], dtype=torch.int32, device=device)
    cu = torch.tensor([0, 100], dtype=torch.int32, device=device)
    q = torch.randn(100, HQ, D, device=device, dtype=DTYPE, generator=gen)
    failed = {}
    for name in names:
        try:
            pa.prefill_attention_triton(q, kc, kc, table, cu, sl, D ** -0.5, 100,
                                        config=PREFILL_SWEEP[name])
        except Exception as e:                      # reported again (and skipped) by the sweep
            failed[name] = f"{type(e).__name__}: {str(e)[:160]}"
    if device.type == "cuda":
        torch.cuda.synchronize()
    return failed


def precompile_prefill_sweep(jobs: int, names=None) -> dict:
    """Compile every PREFILL_SWEEP config in `jobs` processes at once (a config compiles in
    seconds, one at a time); the timing process then finds them in Triton's cache."""
    import multiprocessing as mp
    names = list(PREFILL_SWEEP) if names is None else list(names)
    chunks = [names[i::jobs] for i in range(jobs)]
    with mp.get_context("spawn").Pool(jobs) as pool:
        failed = {}
        for f in pool.map(_precompile_worker, [c for c in chunks if c]):
            failed.update(f)
    return failed


def check_prefill_ragged(device, gen, config) -> float:
    """The largest relative error of `config` (bf16) against the fp32 torch reference over
    PREFILL_RAGGED (Llama-3.2-1B heads; stale pages, scattered tables)."""
    worst = 0.0
    for q_lens, ctx, bs in PREFILL_RAGGED:
        seq = [a + c for a, c in zip(q_lens, ctx)]
        need = [-(-n // bs) for n in seq]
        nb = sum(need) + 2
        kc = torch.randn(nb, bs, HKV, D, device=device, dtype=DTYPE, generator=gen)
        vc = torch.randn(nb, bs, HKV, D, device=device, dtype=DTYPE, generator=gen)
        perm = torch.randperm(nb, device=device, generator=gen).int()
        table = torch.full((len(seq), max(need) + 1), -1, dtype=torch.int32, device=device)
        used = 0
        for i, n in enumerate(need):
            table[i, :n] = perm[used:used + n]
            used += n
        sl = torch.tensor(seq, dtype=torch.int32, device=device)
        cu = torch.tensor([0] + q_lens, device=device).cumsum(0).int()
        q = torch.randn(sum(q_lens), HQ, D, device=device, dtype=DTYPE, generator=gen)
        out = pa.prefill_attention_triton(q, kc, vc, table, cu, sl, D ** -0.5, max(q_lens), config=config)
        ref = pa.prefill_attention_torch(q.float(), kc.float(), vc.float(), table, cu, sl, D ** -0.5,
                                         max(q_lens)).float()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        worst = max(worst, err if err == err else float("inf"))
    return worst


GRAPH_REP_MS = 20           # per graph timing (do_bench_cudagraph's rep): ~0.25 s a measurement


def bench_prefill_issue(device, gen, sweep: bool = True, save=None, configs=None,
                        budget_s: float | None = None, default_config=None) -> list[dict]:
    """The issue's shapes: the default tiers and (sweep) every config of `configs` (default
    PREFILL_SWEEP) against torch SDPA in the same run, all timed as CUDA-graph replays (GPU time
    alone: at batch 1 x 512 both take ~10 us, less than a Python launch) and the defaults and SDPA
    also under do_bench. SDPA: the fastest of flash on K/V expanded to 32 heads and
    enable_gqa=True, each timed before and after the Triton configs (drift shows as a difference).
    Each config's bf16 output is checked against fp32 SDPA (rel err < 1e-2), and the default tiers
    in fp32 too. Past budget_s seconds only the defaults and SDPA are timed (every shape is reached).
    default_config: what the "default" entry runs (PREFILL_CONFIG unless given)."""
    import time

    import torch.nn.functional as F
    rows = []
    t0 = time.perf_counter()
    sweep_configs = (PREFILL_SWEEP if configs is None else configs) if sweep else {}
    default = pa.PREFILL_CONFIG if default_config is None else default_config
    for batch, L in ISSUE_PREFILL_SHAPES:
        blocks = -(-L // PAGE)
        nb = batch * blocks
        kc = torch.randn(nb, PAGE, HKV, D, device=device, dtype=DTYPE, generator=gen)
        vc = torch.randn(nb, PAGE, HKV, D, device=device, dtype=DTYPE, generator=gen)
        table = torch.randperm(nb, device=device, generator=gen).view(batch, blocks).int()
        sl = torch.full((batch,), L, dtype=torch.int32, device=device)
        cu = torch.arange(0, batch + 1, device=device, dtype=torch.int32) * L
        q = torch.randn(batch * L, HQ, D, device=device, dtype=DTYPE, generator=gen)
        scale = D ** -0.5
        flops = 4 * batch * HQ * D * L * (L + 1) / 2
        qc = q.view(batch, L, HQ, D).transpose(1, 2).contiguous()
        kk = gather_pages(kc, table)[:, :L].transpose(1, 2).contiguous()      # [B, Hkv, L, D]
        vv = gather_pages(vc, table)[:, :L].transpose(1, 2).contiguous()
        ke, ve = kk.repeat_interleave(HQ // HKV, 1), vv.repeat_interleave(HQ // HKV, 1)
        ref = F.scaled_dot_product_attention(qc.float(), ke.float(), ve.float(), is_causal=True,
                                             scale=scale).transpose(1, 2).reshape(batch * L, HQ, D)
        row = {"batch": batch, "seq_len": L, "flops": flops, "graph_us": {}, "rel_err": {}}
        sd = {"sdpa_expanded": lambda: F.scaled_dot_product_attention(qc, ke, ve, is_causal=True, scale=scale),
              "sdpa_gqa": lambda: F.scaled_dot_product_attention(qc, kk, vv, is_causal=True, scale=scale,
                                                                 enable_gqa=True)}
        for name, fn in sd.items():
            try:
                row["graph_us"][name] = do_bench_us(fn, graph=True, rep=GRAPH_REP_MS)
                row[name + "_do_bench_us"] = do_bench_us(fn, rep=GRAPH_REP_MS)
            except Exception as e:
                row["graph_us"][name] = None
                print(f"  {name} failed: {type(e).__name__}: {str(e)[:120]}")
        late = budget_s is not None and time.perf_counter() - t0 > budget_s
        row["swept"] = not late and bool(sweep_configs)
        todo = {"default": default} | ({} if late else dict(sweep_configs))
        for name, cfg in todo.items():
            try:
                fn = lambda cfg=cfg: pa.prefill_attention_triton(q, kc, vc, table, cu, sl, scale, L, config=cfg)
                out = fn()
                row["rel_err"][name] = ((out.float() - ref).norm() / ref.norm()).item()
                assert row["rel_err"][name] < 1e-2, (name, row["rel_err"][name])
                row["graph_us"][name] = do_bench_us(fn, graph=True, rep=GRAPH_REP_MS)
            except Exception as e:
                row["graph_us"][name] = None
                print(f"  prefill config {name} failed at {batch} x {L}: {type(e).__name__}: {str(e)[:160]}")
        for name, fn in sd.items():                      # SDPA again, after the Triton configs
            try:
                row["graph_us"][name + "_after"] = do_bench_us(fn, graph=True, rep=GRAPH_REP_MS)
            except Exception:
                row["graph_us"][name + "_after"] = None
        row["sdpa_us"] = min(v for k, v in row["graph_us"].items() if k.startswith("sdpa") and v)
        row["default_do_bench_us"] = do_bench_us(
            lambda: pa.prefill_attention_triton(q, kc, vc, table, cu, sl, scale, L, config=default))
        try:
            out32 = pa.prefill_attention_triton(q.float(), kc.float(), vc.float(), table, cu, sl, scale,
                                                L, config=default)
            row["rel_err_fp32_default"] = ((out32 - ref).norm() / ref.norm()).item()
        except Exception as e:
            row["rel_err_fp32_default"] = float("nan")
            print(f"  fp32 default failed at {batch} x {L}: {type(e).__name__}: {str(e)[:160]}")
        timed = {k: v for k, v in row["graph_us"].items() if v and not k.startswith("sdpa")}
        row["best"] = min(timed, key=timed.get)
        row["ratio_default"] = row["sdpa_us"] / (row["graph_us"]["default"] or float("nan"))
        row["ratio_best"] = row["sdpa_us"] / timed[row["best"]]
        row["default_tflops"] = flops / (row["graph_us"]["default"] or float("nan")) / 1e6
        row["sdpa_tflops"] = flops / row["sdpa_us"] / 1e6
        print(f"prefill {batch} x {L:5d}: sdpa {row['sdpa_us']:8.1f} us ({row['sdpa_tflops']:5.1f} TFLOP/s) | "
              f"default {row['graph_us']['default'] or float('nan'):8.1f} us = {row['ratio_default']:.2f}x sdpa speed | best "
              f"{row['best']} {timed[row['best']]:8.1f} us = {row['ratio_best']:.2f}x | fp32 err "
              f"{row['rel_err_fp32_default']:.1e}", flush=True)
        print("  " + " ".join(f"{k}={v:.1f}" for k, v in row["graph_us"].items() if v), flush=True)
        row["elapsed_s"] = time.perf_counter() - t0
        rows.append(row)
        if save is not None:
            save(rows)                      # after every shape: a run cut short keeps what it measured
        del kc, vc, q, qc, kk, vv, ke, ve, ref
        torch.cuda.empty_cache()
    return rows


def pick_prefill_tiers(rows, tol: float = 0.01) -> dict:
    """Launch tiers from a sweep (bench_prefill_issue's rows): one tier per distinct longest query
    run among the shapes (max_q_len = the shape's length), each taking the swept config whose
    WORST speed against SDPA over that tier's shapes is the highest -- or the previous tier's
    config when that one is within `tol` of it (fewer kernels to compile) -- and neighbouring
    tiers with the same config merged. The last tier is open (max_q_len None)."""
    lengths = sorted({r["seq_len"] for r in rows})
    names = [k for k in rows[0]["graph_us"] if k in PREFILL_SWEEP]

    def worst(name, length):
        rs = [r for r in rows if r["seq_len"] == length]
        ratios = [r["sdpa_us"] / r["graph_us"][name] if r["graph_us"].get(name) else 0.0 for r in rs]
        return min(ratios)
    tiers = []                                   # [(max_q_len, config name)]
    for length in lengths:
        best = max(names, key=lambda n: worst(n, length))
        if tiers and worst(tiers[-1][1], length) >= worst(best, length) - tol:
            best = tiers[-1][1]
        if tiers and tiers[-1][1] == best:
            tiers[-1] = (length, best)
        else:
            tiers.append((length, best))
    out = {}
    for i, (bound, name) in enumerate(tiers):
        cfg = dict(PREFILL_SWEEP[name])
        cfg["max_q_len"] = None if i == len(tiers) - 1 else bound
        out[f"upto_{bound}" if i < len(tiers) - 1 else "longest"] = {"max_q_len": cfg.pop("max_q_len"), **cfg,
                                                                     "swept_as": name}
    return out


def pa_gather(cache, table, L):
    return gather_pages(cache, table)[:, :L].transpose(1, 2)      # [1, Hkv, L, D]


def best_variant(t):
    name = min(("naive", "blocked", "gqa", "split_kv", "auto"),
               key=lambda n: t.get(n) if t.get(n) is not None else float("inf"))
    return name, t[name]


def fmt_table(results, copy_bw):
    lines = ["| batch | context | naive | blocked | gqa | split_kv | auto | best paged | "
             "SDPA contiguous (this run) | vLLM Triton (issue) | SDPA (issue) | best / vLLM | "
             "best / SDPA (this run) | best K/V TB/s | auto in CUDA graph | SDPA in CUDA graph |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        b, c = r["batch"], r["ctx"]
        t = r["us"]
        name, best = best_variant(t)
        bw = kv_bytes(b, c) / (best * 1e-6) / 1e12

        def f(x):
            return "-" if x is None else f"{x:.1f}"
        lines.append(f"| {b} | {c:,} | {f(t.get('naive'))} | {f(t.get('blocked'))} | "
                     f"{f(t.get('gqa'))} | {f(t.get('split_kv'))} | {f(t.get('auto'))} | "
                     f"**{best:.1f}** ({name}) | {f(t.get('sdpa'))} | {VLLM_US[(b, c)]} | "
                     f"{ISSUE_SDPA_US[(b, c)]} | {best / VLLM_US[(b, c)]:.2f}x | "
                     f"{best / t['sdpa']:.2f}x | {bw:.2f} | {f(t.get('auto_graph'))} | "
                     f"{f(t.get('sdpa_graph'))} |")
    lines.append(f"\ncopy bandwidth (read + write) measured in the same run: {copy_bw:.2f} TB/s")
    return "\n".join(lines)


def launch_overhead(device, gen):
    """CPU microseconds per call of each launcher (no sync inside the timed loop): what
    do_bench sees when the kernel itself is shorter than the Python launch."""
    import time

    import torch.nn.functional as F
    q, kc, vc, table, sl = make_decode_case(1, 8192, device, gen)
    k = torch.randn(1, HKV, 8192, D, device=device, dtype=DTYPE)
    res = {}
    fns = {v: (lambda v=v: da.decode_attention_triton(q, kc, vc, table, sl, 0.125, 8192, variant=v))
           for v in ("blocked", "gqa", "split_kv")}
    fns["sdpa"] = lambda: F.scaled_dot_product_attention(q.view(1, HQ, 1, D), k, k, enable_gqa=True)
    for name, fn in fns.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        res[name] = (t1 - t0) / 200 * 1e6
    print("launch overhead (CPU us per call): " +
          " ".join(f"{k}={v:.1f}" for k, v in res.items()), flush=True)
    return res


def plot(sweep, prefill_rows, copy_bw, folder):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    batches = sorted({r["batch"] for r in sweep})
    fig, axes = plt.subplots(1, len(batches), figsize=(4 * len(batches), 3.8), sharey=True)
    for ax, b in zip(axes, batches):
        rows = sorted([r for r in sweep if r["batch"] == b], key=lambda r: r["ctx"])
        ctxs = [r["ctx"] for r in rows]
        for name, style in (("naive", ":"), ("blocked", "--"), ("gqa", "-."), ("split_kv", "-"),
                            ("auto", "-"), ("sdpa", "-")):
            ys = [kv_bytes(b, r["ctx"]) / (r["us"][name] * 1e-6) / 1e12 if r["us"].get(name) else None
                  for r in rows]
            xs = [c for c, y in zip(ctxs, ys) if y is not None]
            ys = [y for y in ys if y is not None]
            if ys:
                ax.plot(xs, ys, style, marker="o", ms=3,
                        label="SDPA contiguous" if name == "sdpa" else name,
                        color="black" if name == "sdpa" else None)
        ax.axhline(copy_bw, color="gray", lw=0.8, ls="--", label="copy BW (read + write)")
        ax.set_xscale("log", base=2)
        ax.set_title(f"batch {b}")
        ax.set_xlabel("context (tokens)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("K/V read bandwidth (TB/s)")
    axes[-1].legend(fontsize=7)
    fig.suptitle("Paged decode attention, H200, bf16, 32q/8kv heads, head_dim 64, page 16")
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "kernels_decode_bandwidth.png"), dpi=120)
    plt.close(fig)

    if prefill_rows:
        fig, ax = plt.subplots(figsize=(5, 3.8))
        ls = [r["seq_len"] for r in prefill_rows]
        ax.plot(ls, [r["triton_tflops"] for r in prefill_rows], marker="o", label="Triton paged prefill")
        ax.plot(ls, [r["sdpa_tflops"] for r in prefill_rows], marker="o", color="black",
                label="torch SDPA (contiguous)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (16k tokens per batch)")
        ax.set_ylabel("TFLOP/s (causal)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_title("Causal prefill attention, H200, bf16")
        fig.tight_layout()
        fig.savefig(os.path.join(folder, "kernels_prefill_tflops.png"), dpi=120)
        plt.close(fig)


DECODE_TUNE_CONFIGS = {
    f"cfg_n{n}_w{w}_s{s}": {"BLOCK_N": n, "num_warps": w, "num_stages": s}
    for n, w, s in [(64, 4, 2), (128, 4, 2), (128, 8, 2), (128, 4, 3)]
}
PREFILL_TUNE_CONFIGS = {
    f"cfg_m{m}_n{n}_w{w}_s{s}": {"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": s}
    for m, n, w, s in [(128, 64, 4, 3), (128, 64, 8, 4), (128, 32, 4, 3), (64, 64, 4, 4)]
}


def replot(json_path, folder):
    """Redraw the figures from a saved kernels_bench.json (no GPU needed)."""
    with open(json_path) as f:
        d = json.load(f)
    plot(d["sweep"] or d["table"], d["prefill"], d["meta"]["copy_bw_tbs"], folder)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m pagedlab bench kernels", description=__doc__)
    ap.add_argument("--out", default="figures", help="folder for the JSON, table and plots")
    ap.add_argument("--tune", action="store_true", help="also sweep launch configs and splits")
    ap.add_argument("--quick", action="store_true", help="only the table rows, no sweep")
    ap.add_argument("--prefill", action="store_true",
                    help="only the issue's prefill shapes against SDPA (with --tune: every PREFILL_SWEEP config)")
    ap.add_argument("--jobs", type=int, default=8,
                    help="--prefill --tune: processes that compile the swept configs at once (default 8)")
    ap.add_argument("--budget", type=float, default=None,
                    help="--prefill --tune: seconds after which only the defaults and SDPA are timed")
    args = ap.parse_args(argv)
    require_cuda("bench kernels")
    out = out_dir(args.out)
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    if args.prefill:
        meta = metadata("python -m pagedlab.bench.kernels", argv)
        meta.update(prefill_config=to_plain(pa.PREFILL_CONFIG))
        configs = None
        if args.tune:
            import time
            t0 = time.perf_counter()
            meta["compile_failed"] = precompile_prefill_sweep(args.jobs) if args.jobs > 1 else {}
            meta["compile_s"] = time.perf_counter() - t0
            print(f"compiled {len(PREFILL_SWEEP)} configs in {meta['compile_s']:.1f} s; failed: "
                  f"{meta['compile_failed']}", flush=True)
            meta["ragged_rel_err"] = {}
            for name, cfg in {"default": pa.PREFILL_CONFIG, **PREFILL_SWEEP}.items():
                try:
                    meta["ragged_rel_err"][name] = check_prefill_ragged(device, gen, cfg)
                except Exception as e:
                    meta["ragged_rel_err"][name] = f"{type(e).__name__}: {str(e)[:160]}"
            bad = {k: v for k, v in meta["ragged_rel_err"].items() if not isinstance(v, float) or v >= 1e-2}
            print(f"ragged batches, worst bf16 rel err vs fp32 reference: "
                  f"{max((v for v in meta['ragged_rel_err'].values() if isinstance(v, float)), default=float('nan')):.2e}; "
                  f"failed: {bad}", flush=True)
            configs = {k: v for k, v in PREFILL_SWEEP.items() if k not in bad}
        rows = bench_prefill_issue(device, gen, sweep=args.tune, configs=configs, budget_s=args.budget,
                                   save=lambda rows: write_json(out / "prefill_bench.json", {"meta": meta, "rows": rows}))
        print("| batch x length | SDPA us | default us | default / SDPA speed | best config | best / SDPA speed |")
        for r in rows:
            print(f"| {r['batch']} x {r['seq_len']} | {r['sdpa_us']:.1f} | {r['graph_us']['default'] or float('nan'):.1f} | "
                  f"{r['ratio_default']:.2f}x | {r['best']} | {r['ratio_best']:.2f}x |")
        if args.tune:                # every config's speed against SDPA at every shape
            names = [k for k in rows[0]["graph_us"] if not k.startswith("sdpa")]
            lines = ["config " + " ".join(f"{r['batch']}x{r['seq_len']}" for r in rows)]
            for k in names:
                lines.append(k + " " + " ".join(f"{r['sdpa_us'] / r['graph_us'][k]:.3f}"
                                                if r["graph_us"].get(k) else "-" for r in rows))
            (out / "prefill_sweep.txt").write_text("\n".join(lines) + "\n")
            print("\n".join(lines))
            # the tiers the sweep picks, timed again beside the current defaults and SDPA
            if not any(r.get("swept") for r in rows):
                return 0
            picked = pick_prefill_tiers([r for r in rows if r.get("swept")])
            meta["picked_tiers"] = picked
            print("picked tiers: " + json.dumps(picked), flush=True)
            confirm = bench_prefill_issue(
                device, gen, sweep=True, configs={"current_default": pa.PREFILL_CONFIG,
                                                  "before": PREFILL_BEFORE},
                default_config=picked,
                save=lambda rows: write_json(out / "prefill_confirm.json", {"meta": meta, "rows": rows}))
            print("| batch x length | SDPA us | picked us | picked / SDPA | current default / SDPA | "
                  "before / SDPA | fp32 err |")
            for r in confirm:
                cur, bef = r["graph_us"].get("current_default"), r["graph_us"].get("before")
                print(f"| {r['batch']} x {r['seq_len']} | {r['sdpa_us']:.1f} | {r['graph_us']['default'] or float('nan'):.1f} | "
                      f"{r['ratio_default']:.3f}x | {r['sdpa_us'] / cur if cur else float('nan'):.3f}x | "
                      f"{r['sdpa_us'] / bef if bef else float('nan'):.3f}x | "
                      f"{r['rel_err_fp32_default']:.1e} |", flush=True)
        return 0
    meta = metadata("python -m pagedlab.bench.kernels", argv)
    meta.update(decode_config=to_plain(da.DECODE_CONFIG), prefill_config=to_plain(pa.PREFILL_CONFIG))
    print(json.dumps(meta), flush=True)
    copy_bw = copy_bandwidth_tbs(device)
    meta["copy_bw_tbs"] = copy_bw
    print(f"copy bandwidth (read+write): {copy_bw:.2f} TB/s", flush=True)
    meta["launch_overhead_us"] = launch_overhead(device, gen)

    table = []
    for b, c in TABLE_ROWS:
        variants = ["naive", "blocked", "gqa", "split_kv", "auto"]
        res = bench_decode_shape(b, c, device, gen, variants, graph=True,
                                 configs=DECODE_TUNE_CONFIGS if args.tune else None,
                                 splits=TUNE_SPLITS if args.tune else None)
        plan = da.choose_decode_plan(b, HKV, c, sm_count(device),
                                     da.DECODE_CONFIG["split_kv"]["BLOCK_N"])
        table.append({"batch": b, "ctx": c, "us": res, "auto_plan": plan})
        print(f"decode B={b:3d} ctx={c:6d} plan={plan}: " +
              " ".join(f"{k}={v:.1f}" for k, v in res.items() if v is not None), flush=True)
    md = fmt_table(table, copy_bw)
    print(md, flush=True)

    sweep = []
    if not args.quick:
        for b in SWEEP_BATCH:
            for c in SWEEP_CTX:
                if b * c > MAX_TOKENS:
                    continue
                variants = ["blocked", "gqa", "split_kv", "auto"] + (["naive"] if b * c <= NAIVE_MAX_TOKENS else [])
                res = bench_decode_shape(b, c, device, gen, variants, rep=50)
                sweep.append({"batch": b, "ctx": c, "us": res})
                print(f"sweep B={b:3d} ctx={c:6d}: " +
                      " ".join(f"{k}={v:.1f}" for k, v in res.items() if v is not None), flush=True)
    prefill_rows = bench_prefill(device, gen, PREFILL_TUNE_CONFIGS if args.tune else None)

    write_json(out / "kernels_bench.json",
               {"meta": meta, "table": table, "sweep": sweep, "prefill": prefill_rows})
    (out / "kernels_table.md").write_text(md + "\n")
    try:
        plot(sweep or table, prefill_rows, copy_bw, out)
    except Exception as e:
        print(f"plot failed: {e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

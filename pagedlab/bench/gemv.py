"""Benchmark the decode-time linear layers (kernels/gemv.py): `python -m pagedlab bench gemv`.

For each weight matrix of a Llama-3.2-1B layer (and the LM head) at M = 1, 2, 4, 8 tokens: the fused
Triton kernel against the unfused composition it replaces (RMSNorm / RoPE / K-V store / SwiGLU
kernels around a cuBLAS matmul), both replayed from a CUDA graph as in the engine. The graph runs
the op over enough COPIES of the weight matrix (>= 256 MB, several times the L2) that every
call reads its weights from DRAM, like consecutive layers do. Reports microseconds per call and
the weight read rate (weight bytes / time) beside the device's copy bandwidth from the same run.

    python -m pagedlab bench gemv                 # table + JSON (+ figures/gemv_bench.png)
    python -m pagedlab bench gemv --tune          # also sweep launch configs; writes the best as
                                                  # JSON, usable via PAGEDLAB_GEMV_CONFIG=<file>
    python -m pagedlab bench gemv --fp8 [--tune]  # the same with FP8 weights (the *_fp8 configs;
                                                  # unfused = torch._scaled_mm on fp8 activations)
    python -m pagedlab bench gemv --one-stream    # one token: candidate configs per kernel (bf16 and
                                                  # FP8) alone, then the engine's one stream with the
                                                  # defaults and with the best (one_stream_probe.json)
    python -m pagedlab bench gemv --one-stream --before CONFIG.json
                                                  # the engine's one stream (and graph replay) with
                                                  # CONFIG against the defaults, same run; decode
                                                  # attention at batch 1 (one_stream_confirm.json)
    python -m pagedlab bench gemv --one-stream --variants [--budget-s S]
                                                  # where a batch-1 step goes (each launch, in
                                                  # order), and the engine's one stream with the
                                                  # attention in the QKV launch off and on, same
                                                  # run (one_stream_attn.json)
    python -m pagedlab bench gemv --one-stream --variants prefetch
                                                  # ... with each L2 prefetch variant
                                                  # (one_stream_variants.json)
    python -m pagedlab bench gemv --one-stream --variants latency
                                                  # the step's fixed costs: each launch change
                                                  # alone, then the best together, bf16 and FP8
                                                  # (one_stream_latency.json)

Each launch gets its config explicitly (`config=`); the tuned configs are used by passing them,
never by changing gemv.GEMV_CONFIG.
"""
from __future__ import annotations

import argparse

import torch

from pagedlab.bench.common import (copy_bandwidth_tbs, device_line, graph_time_us, metadata,
                                   out_dir, require_cuda, write_json)
from pagedlab.kernels import gemv
from pagedlab.kernels.launch import merge_config, to_plain
from pagedlab.kernels.rope import rope_cos_sin

HIDDEN, INTER, HQ, HKV, D, VOCAB = 2048, 8192, 32, 8, 64, 128256
ROWS = (1, 2, 4, 8)
MIN_BYTES = 256 << 20       # weight copies per op: at least this many bytes (several L2s)


def make_ops(m: int, device, dtype=torch.bfloat16, seed=0, fp8=False):
    """{op name: dict(bytes=weight bytes, key=config key, ws=weight copies, call=closure maker)},
    with enough weight copies per op that the calls stream their weights from DRAM.
    call(w, fused, cfg) -> a closure running the op on weights w with launch config cfg (an entry
    of GEMV_CONFIG's layout). fp8: the weights quantized (quantization.FP8Weight), configs *_fp8."""
    from pagedlab.quantization import quantize_weight
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    x_h, x_i = randn(m, HIDDEN), randn(m, INTER)
    o_in = randn(m, HQ * D)
    g = randn(HIDDEN)
    cos_sin = rope_cos_sin(D, 500000.0, 4096, device=device)
    pos = torch.randint(0, 4096, (m,), generator=gen, device=device)
    k_cache, v_cache = randn(64, 16, HKV, D), randn(64, 16, HKV, D)
    slots = torch.randperm(64 * 16, generator=gen, device=device)[:m]
    specs = {
        "qkv (norm+RoPE+KV store)": ((HQ + 2 * HKV) * D, HIDDEN, "qkv"),
        "o_proj (+residual)": (HIDDEN, HQ * D, "residual"),
        "gate_up (norm+SwiGLU)": (2 * INTER, HIDDEN, "swiglu"),
        "down_proj (+residual)": (HIDDEN, INTER, "down"),
        "lm_head (norm, fp32 out)": (VOCAB, HIDDEN, "lm_head"),
    }
    ops = {}
    for name, (n, k, key) in specs.items():
        nbytes = n * k * (1 if fp8 else 2)
        copies = max(1, -(-MIN_BYTES // nbytes))
        ws = [randn(n, k, scale=k ** -0.5) for _ in range(copies)]
        if fp8:
            ws = [quantize_weight(w) for w in ws]

        def call(w, fused, cfg, key=key):
            c = dict(config=cfg, fp8_config=cfg)
            if key == "qkv":
                return lambda: gemv.norm_qkv_rope_store_triton(x_h, g, 1e-5, w, pos, cos_sin, k_cache,
                                                               v_cache, slots, HQ, fused=fused, **c)
            if key == "swiglu":
                return lambda: gemv.norm_swiglu_triton(x_h, g, 1e-5, w, fused=fused, **c)
            if key == "lm_head":
                return lambda: gemv.norm_lm_head_triton(x_h, g, 1e-5, w, fused=fused, **c)
            xin = o_in if w.shape[1] == HQ * D else x_i
            return lambda: gemv.linear_residual_triton(xin, w, x_h, fused=fused, **c, down_config=cfg,
                                                       down_fp8_config=cfg)
        ops[name] = dict(bytes=nbytes, key=key + ("_fp8" if fp8 else ""), ws=ws, call=call)
    return ops


def tune(ops) -> dict:
    """Best launch config per kernel (ops sharing a kernel are scored by their summed time), in
    two rounds to keep compiles few: tiles (BLOCK_R x K_SPLIT x BLOCK_K) at 4 warps / 2 stages,
    then warps x stages around the best tile."""
    tuned = {}
    for key in dict.fromkeys(op["key"] for op in ops.values()):
        group = [op for op in ops.values() if op["key"] == key]

        def score(cfg):
            try:
                return sum(graph_time_us([op["call"](w, True, cfg) for w in op["ws"]]) for op in group)
            except Exception as e:                # out of shared memory / registers: skip
                print(f"  skip {cfg}: {type(e).__name__}")
                return float("inf")
        rs = (16, 32, 64) if key.startswith("lm_head") else (8, 16, 32)
        splits = ((256, 128), (256, 256), (512, 128), (512, 256), (512, 512), (1024, 256),
                  (1024, 512), (2048, 512))
        warps, stages = (2, 4, 8), (1, 2, 3)
        if key.endswith("_fp8"):       # a byte per weight: wider K tiles, a smaller sweep
            splits = ((512, 512), (1024, 512), (1024, 1024), (2048, 1024))
            warps, stages = (4, 8), (1, 2)
        tiles = [dict(BLOCK_R=r, K_SPLIT=ks, BLOCK_K=bk, num_warps=4 if bk <= 512 else 8, num_stages=2)
                 for r in rs for ks, bk in splits]
        best = min(((score(c), c) for c in tiles), key=lambda t: t[0])
        rest = [dict(best[1], num_warps=w, num_stages=st) for w in warps for st in stages
                if (w, st) != (best[1]["num_warps"], 2)]
        best = min([best] + [(score(c), c) for c in rest], key=lambda t: t[0])
        tuned[key] = best
        print(f"tune {key}: {best[1]}  {best[0]:.2f} us for {', '.join(n for n, op in ops.items() if op['key'] == key)}")
    return tuned


# --------------------------------------------------------------------------------------------
# one stream: where a batch-1 step's time goes, and launch configs tried in the engine itself
# --------------------------------------------------------------------------------------------
def _c(r, ks, bk, w, st, acc=0):
    return dict(BLOCK_R=r, K_SPLIT=ks, BLOCK_K=bk, num_warps=w, num_stages=st, ACC2D=acc)


# Candidates per kernel at one token (bf16; _fp8_candidate widens them for FP8 weights): the
# current default first, then no split-K (few big row blocks: no reduction round trips), fewer
# rows per program (more programs in flight), and ACC2D (one cross-thread sum per program).
ONE_TOKEN_CANDIDATES = {
    "qkv": [_c(16, 256, 256, 4, 1), _c(8, 256, 256, 4, 1), _c(4, 2048, 1024, 4, 1),
            _c(4, 2048, 2048, 8, 1), _c(2, 2048, 2048, 4, 1), _c(8, 2048, 512, 4, 2, 1),
            _c(4, 2048, 512, 4, 2, 1), _c(16, 512, 512, 8, 1)],
    "residual": [_c(8, 2048, 512, 4, 3), _c(8, 2048, 512, 4, 3, 1), _c(4, 2048, 512, 4, 3, 1),
                 _c(4, 2048, 1024, 8, 2, 1), _c(2, 2048, 2048, 8, 1), _c(4, 4096, 1024, 4, 2, 1),
                 _c(8, 1024, 1024, 8, 1), _c(2, 8192, 1024, 4, 2, 1)],
    "swiglu": [_c(16, 2048, 512, 4, 2), _c(16, 2048, 512, 4, 2, 1), _c(8, 2048, 512, 4, 2, 1),
               _c(8, 2048, 1024, 8, 2, 1), _c(4, 2048, 2048, 8, 1), _c(8, 2048, 2048, 8, 1),
               _c(4, 2048, 1024, 4, 2, 1), _c(16, 1024, 1024, 8, 1), _c(32, 2048, 256, 4, 2)],
    "lm_head": [_c(16, 2048, 512, 4, 1), _c(16, 2048, 512, 4, 1, 1), _c(8, 2048, 1024, 8, 1),
                _c(32, 2048, 256, 4, 1), _c(8, 2048, 512, 4, 2, 1), _c(4, 2048, 2048, 8, 1),
                _c(64, 2048, 256, 8, 2)],
}


def _fp8_candidate(c):
    bk = min(2 * c["BLOCK_K"], 4096)
    return dict(c, BLOCK_K=bk, K_SPLIT=max(c["K_SPLIT"], bk), num_warps=8 if bk >= 1024 else c["num_warps"])


def one_token_candidates(key: str) -> list:
    """The configs `--one-stream` tries for GEMV_CONFIG[key] (key may end in _fp8): the current
    default first."""
    fp8 = key.endswith("_fp8")
    name = key[:-4] if fp8 else key
    base = ONE_TOKEN_CANDIDATES["residual" if name == "down" else name]
    cands = [_fp8_candidate(c) for c in base[1:]] if fp8 else base[1:]
    default = dict(gemv.GEMV_CONFIG[key])
    cands = [default, dict(default, ACC2D=1)] + cands
    out = []
    for c in cands:
        if c not in out:
            out.append(c)
    return out


def sweep_one_token(dev, fp8: bool) -> dict:
    """Every candidate config of every op at one token: {op: [(us, config), ...]}, and per
    config key the best (ops sharing a key -- O and down -- scored by their summed time)."""
    ops = make_ops(1, dev, fp8=fp8)
    times = {name: [] for name in ops}
    best = {}
    for key in dict.fromkeys(op["key"] for op in ops.values()):
        group = {n: op for n, op in ops.items() if op["key"] == key}
        scored = []
        for cfg in one_token_candidates(key):
            tot = 0.0
            for n, op in group.items():
                try:
                    us = graph_time_us([op["call"](w, True, cfg) for w in op["ws"]])
                except Exception as e:          # out of registers / shared memory: skip
                    print(f"  skip {n} {cfg}: {type(e).__name__}: {str(e)[:80]}", flush=True)
                    us = float("inf")
                times[n].append(dict(us=us, tb_s=op["bytes"] / us / 1e6, config=cfg))
                tot += us
            scored.append((tot, cfg))
            print(f"  {key:13s} {tot:8.2f} us  {cfg}", flush=True)
        best[key] = min(scored, key=lambda t: t[0])
        print(f"best {key}: {best[key][1]}  {best[key][0]:.2f} us (default {scored[0][0]:.2f})", flush=True)
    for n in times:
        sep = min(times[n], key=lambda r: r["us"])
        print(f"  best for {n} alone: {sep['us']:.2f} us ({sep['tb_s']:.2f} TB/s) {sep['config']}")
    return dict(times=times, best={k: dict(us=v[0], config=v[1]) for k, v in best.items()})


_CKPT = None


def engine_one_stream(weights: str, gemv_config=None, pdl=None, profile=True, stream=True,
                      decode_variant="auto", long_context=0, breakdown=False, decode_config=None) -> dict:
    """One stream through the public API (bench engine's one_stream), the batch-1 graph replay
    (GPU only, context 256; long_context > 0: also at that context, graph_long_us) and,
    profile=True, its kernels' times (torch profiler); breakdown=True: the launches of one
    replay in order, labelled (step_breakdown)."""
    import gc
    from pagedlab.bench.common import event_time_us, kernel_times_us, random_prompt
    from pagedlab.bench.engine import finish, one_stream, step_until_decoding
    from pagedlab.llm import LLM
    from pagedlab.sampling import SamplingParams
    opts = {}
    if gemv_config is not None:
        opts["gemv_config"] = gemv_config
    if pdl is not None:
        opts["pdl"] = pdl
    if decode_config is not None:
        opts["decode_config"] = decode_config
    global _CKPT
    if _CKPT is None:
        from pagedlab.weights import load_checkpoint
        _CKPT = load_checkpoint("random:llama-3.2-1b", show_progress=False)
    llm = LLM(checkpoint=_CKPT, device="cuda", dtype="bfloat16", max_num_seqs=8,
              max_model_len=2048, show_progress=False, quantization=None if weights == "bf16" else weights,
              kernel_options=opts or None, decode_variant=decode_variant)
    res = dict(weights=weights, gemv_config=gemv_config, pdl=pdl, decode_variant=decode_variant)
    if stream:
        res["one_stream"] = one_stream(llm, random_prompt(), keep_tokens=True)
        res["token_ids"] = res["one_stream"].pop("token_ids")[0]
    eng = llm.engine
    eng.add_request(random_prompt(256, seed=256), SamplingParams(max_new_tokens=8, ignore_eos=True))
    step_until_decoding(eng)
    eng.step()
    torch.cuda.synchronize()
    graphs = eng.runner.graphs
    for _ in range(20):
        graphs.replay(1)
    res["graph_us"] = event_time_us(lambda: graphs.replay(1), calls_per_round=200, rounds=5)
    if profile:
        res["kernels_us"] = kernel_times_us(lambda: graphs.replay(1), 20)
        res["kernels_total_us"] = sum(res["kernels_us"].values())
    if breakdown:
        try:
            res["breakdown"] = step_breakdown(lambda: graphs.replay(1), llm.model, context=256 + 2)
        except Exception as e:                   # keep the run's other numbers
            res["breakdown"] = dict(error=f"{type(e).__name__}: {e}")
    finish(eng)
    if long_context:
        eng.add_request(random_prompt(long_context, seed=7), SamplingParams(max_new_tokens=4, ignore_eos=True))
        step_until_decoding(eng)
        eng.step()
        torch.cuda.synchronize()
        for _ in range(20):
            graphs.replay(1)
        res["long_context"] = long_context
        res["graph_long_us"] = event_time_us(lambda: graphs.replay(1), calls_per_round=200, rounds=5)
        finish(eng)
    del llm, eng, graphs
    gc.collect()
    torch.cuda.empty_cache()
    line = f"engine {weights} {'given config' if gemv_config else 'default'} pdl={pdl}: graph {res['graph_us']:.1f} us"
    if stream:
        itl = res["one_stream"]["itl_ms"]
        line += (f", one stream {res['one_stream']['tokens_per_s']:.1f} tok/s, ITL p50 "
                 f"{itl.get(50, itl.get('50', float('nan'))):.3f} ms")
    if long_context:
        line += f", graph at {long_context} {res['graph_long_us']:.1f} us"
    if profile:
        line += f", kernels {res['kernels_total_us']:.1f} us: " + ", ".join(
            f"{k[:28]} {v:.1f}" for k, v in list(res["kernels_us"].items())[:8])
    print(line, flush=True)
    return res


def _weight_bytes(w) -> int:
    return w.num_bytes() if hasattr(w, "num_bytes") else w.numel() * w.element_size()


def step_breakdown(replay, model, context: int, replays: int = 10) -> dict:
    """Where one batch-1 graph replay goes: every launch of `replays` replays (torch profiler,
    in order), labelled by its place in the step -- qkv, attention, o_proj, swiglu, down, lm_head,
    argmax, other -- with its GPU microseconds (median over the replays, summed per label), the
    launches per label, the bytes it must read (weights; attention: the K/V of `context` tokens)
    and the rate. span_us: first start to last end of a replay; gaps_us: the time in it when
    no kernel ran (with PDL on, kernels overlap: gaps shrink and times include PDL waits)."""
    from statistics import median
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            replay()
        torch.cuda.synchronize()
    ev = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                 if str(getattr(e, "device_type", "")).endswith("CUDA") and e.time_range.end > e.time_range.start),
                key=lambda t: t[0])
    # split into replays: each ends with the argmax merge (the LM head's greedy pick)
    steps, cur = [], []
    for e in ev:
        cur.append(e)
        if "argmax_merge" in e[2]:
            steps.append(cur)
            cur = []
    c = model.config
    layer0 = model.layers[0]
    kv = 2 * context * model.num_kv_heads * c.head_dim * model.dtype.itemsize
    nbytes = dict(qkv=_weight_bytes(layer0["qkv"]), attention=kv, o_proj=_weight_bytes(layer0["o"]),
                  swiglu=_weight_bytes(layer0["gate_up"]), down=_weight_bytes(layer0["down"]),
                  lm_head=_weight_bytes(model.lm_head))
    per_step = []
    for st in steps:
        labels, prev = [], None
        for start, end, name in st:
            if "qkv_rope_store" in name:
                lab = "qkv"
            elif "_decode_" in name:
                lab = "attention"
            elif "swiglu" in name:
                lab = "swiglu"
            elif "_linear_kernel" in name:
                lab = {"attention": "o_proj", "qkv": "o_proj", "swiglu": "down"}.get(prev, "lm_head")
            elif "argmax_merge" in name:
                lab = "argmax"
            else:
                lab = "other"
            labels.append((lab, end - start, name))
            prev = lab
        busy = sum(d for _, d, _ in labels)
        span = st[-1][1] - st[0][0]
        ends, idle = st[0][1], 0.0
        for start, end, _ in st[1:]:
            idle += max(0.0, start - ends)
            ends = max(ends, end)
        per_step.append(dict(labels=labels, busy=busy, span=span, gaps=idle))
    if not per_step:
        return dict(error="no replay found in the profile")
    # a label's total per step: median over steps
    names = sorted({lab for s in per_step for lab, _, _ in s["labels"]})
    rows = {}
    for lab in names:
        totals = [sum(d for l2, d, _ in s["labels"] if l2 == lab) for s in per_step]
        count = sum(1 for l2, _, _ in per_step[0]["labels"] if l2 == lab)
        us = median(totals)
        row = dict(us=round(us, 2), launches=count, us_per_launch=round(us / max(count, 1), 2))
        if lab in nbytes:
            b = nbytes[lab] * count
            row.update(bytes=b, tb_s=round(b / (us * 1e-6) / 1e12, 3) if us else None)
        rows[lab] = row
    other_names = sorted({n[:50] for s in per_step for lab, _, n in s["labels"] if lab == "other"})
    return dict(context=context, replays=len(per_step), launches=len(per_step[0]["labels"]),
                kernels_us=round(median(s["busy"] for s in per_step), 1),
                span_us=round(median(s["span"] for s in per_step), 1),
                gaps_us=round(median(s["gaps"] for s in per_step), 1), rows=rows, other=other_names)


def attention_one_token(dev, context: int = 256, layers: int = 16) -> list:
    """Decode attention at batch 1 (Llama-3.2-1B heads, pages of 16, bf16) over `layers` distinct
    caches, per launch config: the share of a one-stream step that is not weights."""
    from pagedlab.kernels import decode_attention as da
    from pagedlab.kernels.launch import merge_config
    gen = torch.Generator(device=dev).manual_seed(1)
    nb = (context + 15) // 16
    caches = [(torch.randn(nb, 16, HKV, D, generator=gen, device=dev).bfloat16(),
               torch.randn(nb, 16, HKV, D, generator=gen, device=dev).bfloat16()) for _ in range(layers)]
    q = torch.randn(1, HQ, D, generator=gen, device=dev).bfloat16()
    table = torch.randperm(nb, generator=gen, device=dev).int()[None]
    lens = torch.tensor([context], dtype=torch.int32, device=dev)
    trials = [("auto", None, {}), ("gqa", None, {"gqa": {"BLOCK_N": 64}}), ("gqa", None, {"gqa": {"BLOCK_N": 256}}),
              ("gqa", None, {"gqa": {"BLOCK_N": 128, "num_stages": 1}}),
              ("split_kv", 2, {"split_kv": {"BLOCK_N": 128}}), ("split_kv", 4, {"split_kv": {"BLOCK_N": 64}})]
    rows = []
    for variant, splits, change in trials:
        cfg = merge_config(da.DECODE_CONFIG, change)
        try:
            us = graph_time_us([lambda kc=kc, vc=vc: da.decode_attention_triton(
                q, kc, vc, table, lens, D ** -0.5, context, variant, splits, config=cfg) for kc, vc in caches])
        except Exception as e:
            print(f"  skip attention {variant} {change}: {type(e).__name__}", flush=True)
            continue
        rows.append(dict(variant=variant, num_splits=splits, change=change, context=context, us=us))
        print(f"  attention {variant} splits={splits} {change}: {us:.2f} us per layer", flush=True)
    return rows


def one_stream_probe(out, argv=None, before=None) -> dict:
    """`--one-stream`: the sweep at one token (bf16 and FP8), then the engine with the default
    configs and with the sweep's best, same process. Writes one_stream_probe.json after each part.
    before (a gemv_config mapping, `--before FILE`): no sweep; the engine with `before` against
    the defaults (one_stream_confirm.json)."""
    dev = torch.device("cuda")
    res = dict(meta=dict(metadata("python -m pagedlab bench gemv", argv),
                         copy_tb_s=round(copy_bandwidth_tbs(dev), 3)))
    print(device_line(res["meta"]), "copy", res["meta"]["copy_tb_s"], "TB/s", flush=True)
    if before is not None:
        path = out / "one_stream_confirm.json"
        res.update(before=before, after=to_plain(gemv.GEMV_CONFIG), engine=[])
        for weights in ("bf16", "fp8"):
            runs = [engine_one_stream(weights, cfg, profile=False) for cfg in (before, None)]
            a, b = runs[0].pop("token_ids"), runs[1].pop("token_ids")
            runs[1]["same_tokens_as_before"] = sum(x == y for x, y in zip(a, b)) / max(1, len(a))
            res["engine"] += runs
            write_json(path, res)
        res["attention"] = attention_one_token(dev)
        write_json(path, res)
        return res
    path = out / "one_stream_probe.json"
    res["engine"] = [engine_one_stream("bf16", pdl="off", stream=False)]   # true per-kernel times
    write_json(path, res)
    tuned = {}
    for fp8 in (False, True):
        sw = sweep_one_token(dev, fp8)
        res["sweep_fp8" if fp8 else "sweep_bf16"] = sw
        tuned.update({k: v["config"] for k, v in sw["best"].items()})
        write_json(path, res)
    res["tuned"] = tuned
    for weights in ("bf16", "fp8"):
        runs = [engine_one_stream(weights, cfg, profile=cfg is None) for cfg in (None, tuned)]
        a, b = runs[0].pop("token_ids"), runs[1].pop("token_ids")
        runs[1]["same_tokens_as_default"] = sum(x == y for x, y in zip(a, b)) / max(1, len(a))
        res["engine"] += runs
        write_json(path, res)
    return res


GEMV_KEYS = ("qkv", "swiglu", "residual", "down", "lm_head")


def prefetch_variants(programs: int = 256) -> dict:
    """Named gemv_config changes for `--one-stream --variants`: PREFETCH (extra programs pull the
    next kernel's matrix into L2; the model passes it: QKV -> O, O -> gate/up, gate/up -> down,
    down -> the next layer's QKV), set explicitly for every entry (bf16 and FP8) so a variant does
    not depend on the defaults. ("off" = no prefetch anywhere.)"""
    def cfg(**pf):
        out = {}
        for key in GEMV_KEYS:
            for k in (key, key + "_fp8"):
                out[k] = dict(PREFETCH=0, PREFETCH_MB=0)
                if key in pf:
                    out[k].update(PREFETCH=programs, PREFETCH_MB=pf[key])
        return out
    return {
        "off": cfg(),
        "pf_o": cfg(qkv=0),
        "pf_o_gu": cfg(qkv=0, residual=16),
        "pf_chain": cfg(qkv=0, residual=16, swiglu=8, down=0),
    }


def variants_result(argv, variants) -> dict:
    """The result of a `--one-stream --variants` run before its engines: versions, the device and
    its copy bandwidth measured now (printed), the variants, no engine runs yet."""
    meta = dict(metadata("python -m pagedlab bench gemv", argv),
                copy_tb_s=round(copy_bandwidth_tbs(torch.device("cuda")), 3))
    print(device_line(meta), "copy", meta["copy_tb_s"], "TB/s", flush=True)
    return dict(meta=meta, variants=variants, engine=[])


def one_stream_variants(out, argv=None, budget_s: float = 200.0, order=None) -> dict:
    """`--one-stream --variants`: the engine's one stream and batch-1 graph replay with each of
    prefetch_variants(), bf16 and FP8, in `order`, same process, until budget_s has passed
    (one_stream_variants.json; each run's tokens compared with the first run of its weights)."""
    import time
    t0 = time.time()
    variants = prefetch_variants()
    res = variants_result(argv, variants)
    path = out / "one_stream_variants.json"
    order = order or [("bf16", "off"), ("bf16", "pf_o"), ("fp8", "off"), ("fp8", "pf_o"),
                      ("bf16", "pf_o_gu"), ("bf16", "pf_chain"), ("fp8", "pf_chain"),
                      ("bf16", "off"), ("fp8", "off")]
    tokens = {}
    for weights, name in order:
        if time.time() - t0 > budget_s:
            print(f"budget: skipped {weights} {name}", flush=True)
            continue
        r = engine_one_stream(weights, variants[name], profile=False)
        r["variant"] = name
        r["wall_s"] = round(time.time() - t0, 1)
        ids = r.pop("token_ids")
        if weights not in tokens:
            tokens[weights] = ids
        r["same_tokens_as_first"] = sum(a == b for a, b in zip(ids, tokens[weights])) / max(1, len(ids))
        print(f"  {weights} {name}: graph {r['graph_us']:.1f} us, one stream "
              f"{r['one_stream']['tokens_per_s']:.1f} tok/s, same tokens {r['same_tokens_as_first']:.3f}, "
              f"t={r['wall_s']} s", flush=True)
        r.pop("gemv_config", None)
        res["engine"].append(r)
        write_json(path, res)
    return res


def attention_variants(limit: int = 2048) -> dict:
    """Named gemv_config changes for `--one-stream --variants` (session 13): ATTN (decode
    attention in the QKV launch's tail, for context bounds up to `limit`; the engine's graphs
    are captured for max_model_len = 2048 here), off and on, bf16 and FP8 entries alike."""
    return {"off": {"qkv": dict(ATTN=0), "qkv_fp8": dict(ATTN=0)},
            "attn": {"qkv": dict(ATTN=limit), "qkv_fp8": dict(ATTN=limit)},
            "attn256": {"qkv": dict(ATTN=limit, ATTN_BLOCK_N=256),
                        "qkv_fp8": dict(ATTN=limit, ATTN_BLOCK_N=256)}}


# (weights, variant, decode_variant, pdl, stream, breakdown): the session-13 run, in priority order
SESSION13_ORDER = [
    ("bf16", "off", "auto", "off", False, True),      # the breakdown: PDL off, so times add up
    ("bf16", "off", "auto", None, True, True),        # the engine as it is (PDL late)
    ("bf16", "attn", "auto", None, True, True),
    ("bf16", "off", "gqa", None, True, False),        # the unfused path with the same attention math
    ("fp8", "off", "auto", None, True, True),
    ("fp8", "attn", "auto", None, True, True),
    ("bf16", "attn", "auto", "off", False, True),     # the fused step's launches, PDL off
    ("bf16", "attn256", "auto", None, True, False),   # the tail's attention in tiles of 256 keys
    ("bf16", "off", "auto", None, True, False),       # off again (drift)
    ("fp8", "off", "auto", "off", False, True),
]


def one_stream_attention(out, argv=None, budget_s: float = 200.0, order=None, long_context=1900) -> dict:
    """`--one-stream --variants` (session 13): the batch-1 step's breakdown (step_breakdown) and
    the engine with ATTN off and on (attention_variants), bf16 and FP8, same process, graph
    replays at context 256 and `long_context`, until budget_s has passed (one_stream_attn.json;
    each run's tokens compared with the first run of its weights and with the gqa run)."""
    import time
    t0 = time.time()
    variants = attention_variants()
    res = variants_result(argv, variants)
    path = out / "one_stream_attn.json"
    tokens = {}
    for weights, name, dv, pdl_mode, stream, bd in order or SESSION13_ORDER:
        if time.time() - t0 > budget_s:
            print(f"budget: skipped {weights} {name} {dv} pdl={pdl_mode}", flush=True)
            continue
        try:
            r = engine_one_stream(weights, variants[name], pdl=pdl_mode, profile=False, stream=stream,
                                  decode_variant=dv, long_context=long_context if stream else 0,
                                  breakdown=bd)
        except Exception as e:                       # keep what was measured
            print(f"  {weights} {name} {dv}: {type(e).__name__}: {e}", flush=True)
            res["engine"].append(dict(weights=weights, variant=name, error=f"{type(e).__name__}: {e}"))
            write_json(path, res)
            continue
        r["variant"] = name
        r["wall_s"] = round(time.time() - t0, 1)
        if stream:
            ids = r.pop("token_ids")
            tokens.setdefault(weights, ids)
            if dv == "gqa":
                tokens[weights + "_gqa"] = ids
            r["same_tokens_as_first"] = sum(a == b for a, b in zip(ids, tokens[weights])) / max(1, len(ids))
            if weights + "_gqa" in tokens:
                r["same_tokens_as_gqa"] = sum(a == b for a, b in zip(ids, tokens[weights + "_gqa"])) / max(1, len(ids))
            tokens[(weights, name, dv)] = ids
        bdn = r.get("breakdown", {})
        print(f"  {weights} {name} decode={dv} pdl={pdl_mode}: graph {r['graph_us']:.1f} us"
              + (f" (at {long_context}: {r['graph_long_us']:.1f})" if "graph_long_us" in r else "")
              + (f", one stream {r['one_stream']['tokens_per_s']:.1f} tok/s, same tokens "
                 f"{r['same_tokens_as_first']:.3f}" if stream else "")
              + (f", launches {bdn.get('launches')}, kernels {bdn.get('kernels_us')} us, span "
                 f"{bdn.get('span_us')}, gaps {bdn.get('gaps_us')}: "
                 + ", ".join(f"{k} {v['us']}/{v['launches']}" for k, v in bdn.get("rows", {}).items())
                 if bdn else "") + f", t={r['wall_s']} s", flush=True)
        r.pop("gemv_config", None)
        res["engine"].append(r)
        write_json(path, res)
    # the fused run's tokens against the unfused gqa run (the same attention math)
    for weights in ("bf16", "fp8"):
        a, b = tokens.get((weights, "attn", "auto")), tokens.get(weights + "_gqa")
        if a and b:
            res.setdefault("attn_vs_gqa_tokens", {})[weights] = sum(x == y for x, y in zip(a, b)) / len(a)
    write_json(path, res)
    return res


# Session 14: the batch-1 step's fixed costs, one change at a time against the same baseline.
# Every variant is (gemv_config changes, decode_config changes). (Session 14's GEMV SELF_PF and
# attention PRELOAD / ONE_PASS rows measured no better and were removed in session 15.)
def latency_variants() -> dict:
    """name -> (group, gemv_config changes, decode_config changes or None = the defaults) for
    `--variants latency`. Variants of one group change the same thing; the combination takes each
    group's best. (Tile changes are bf16 entries only.)"""
    pf = prefetch_variants()
    return {
        "base": ("base", {}, None),
        "qkv_nosplit": ("qkv", {"qkv": dict(BLOCK_R=4, K_SPLIT=2048, BLOCK_K=512, num_stages=2)}, None),
        "down_nosplit": ("down", {"down": dict(BLOCK_R=4, K_SPLIT=8192, BLOCK_K=512)}, None),
        "pf_chain": ("prefetch", {k: v for k, v in pf["pf_chain"].items() if not k.endswith("_fp8")}, None),
        "pf_o_gu": ("prefetch", {k: v for k, v in pf["pf_o_gu"].items() if not k.endswith("_fp8")}, None),
        "o_r4": ("o", {"residual": dict(BLOCK_R=4)}, None),
        "swiglu_r8": ("swiglu", {"swiglu": dict(BLOCK_R=8)}, None),
    }


LATENCY_ORDER = ["base", "qkv_nosplit", "down_nosplit", "base", "pf_chain", "swiglu_r8", "o_r4",
                 "pf_o_gu", "base"]


def _merge_changes(parts) -> dict:
    out = {}
    for part in parts:
        for key, change in part.items():
            out.setdefault(key, {}).update(change)
    return out



def one_stream_latency(out, argv=None, budget_s: float = 120.0, order=None, margin_us: float = 2.0) -> dict:
    """`--one-stream --variants latency` (session 14): bf16 batch-1 graph replay (context 258) with
    each of latency_variants(), same process, in `order` while budget_s - 22 s allows; then the
    combination of each group's best variant that beat the baseline (the mean of its runs) by
    more than margin_us, with its one stream, the baseline's one stream again, and FP8 with the
    combination (its tile changes are bf16's only) against FP8's baseline (one_stream_latency.json;
    tokens compared with the baseline's of the same weights)."""
    import time
    t0 = time.time()
    variants = latency_variants()
    res = variants_result(argv, {k: dict(group=g, gemv=gc, decode=dc) for k, (g, gc, dc) in variants.items()})
    path = out / "one_stream_latency.json"
    tokens = {}

    def run(weights, name, gemv_cfg, decode_cfg, stream):
        try:
            r = engine_one_stream(weights, gemv_cfg, profile=False, stream=stream, decode_config=decode_cfg)
        except Exception as e:                       # keep what was measured
            print(f"  {weights} {name}: {type(e).__name__}: {e}", flush=True)
            res["engine"].append(dict(weights=weights, variant=name, error=f"{type(e).__name__}: {e}"))
            write_json(path, res)
            return None
        r.update(variant=name, wall_s=round(time.time() - t0, 1), gemv_changes=gemv_cfg,
                 decode_changes=decode_cfg)
        r.pop("gemv_config", None)
        if stream:
            ids = r.pop("token_ids")
            tokens.setdefault(weights, ids)
            r["same_tokens_as_base"] = sum(a == b for a, b in zip(ids, tokens[weights])) / max(1, len(ids))
        print(f"  {weights} {name}: graph {r['graph_us']:.1f} us"
              + (f", one stream {r['one_stream']['tokens_per_s']:.1f} tok/s, same tokens "
                 f"{r['same_tokens_as_base']:.3f}" if stream else "") + f", t={r['wall_s']} s", flush=True)
        res["engine"].append(r)
        write_json(path, res)
        return r

    graph = {}
    for i, name in enumerate(order or LATENCY_ORDER):
        if i > 0 and time.time() - t0 > budget_s - 22:
            print(f"budget: skipped {name}", flush=True)
            continue
        _, gc, dc = variants[name]
        r = run("bf16", name, gc or None, dc, stream=(i == 0))
        if r is not None:
            graph.setdefault(name, []).append(r["graph_us"])
    base = sum(graph["base"]) / len(graph["base"])
    best = {}
    for name, us in graph.items():
        group = variants[name][0]
        mean = sum(us) / len(us)
        if name != "base" and mean < base - margin_us and (group not in best or mean < best[group][1]):
            best[group] = (name, mean)
    chosen = [n for n, _ in best.values()]
    res["base_graph_us"] = base
    res["chosen"] = chosen
    print(f"baseline {base:.1f} us; combination: {chosen}", flush=True)
    gc = _merge_changes([variants[n][1] for n in chosen]) or None
    dc = _merge_changes([variants[n][2] for n in chosen if variants[n][2]]) or None
    res["combination"] = dict(gemv=gc, decode=dc)
    run("bf16", "combination", gc, dc, stream=True)
    run("fp8", "base", None, None, stream=True)
    run("fp8", "combination", gc, dc, stream=True)
    if time.time() - t0 < budget_s - 10:
        # FP8 gate/up and down in tiles that fit the registers (offline sm_90 builds, Triton 3.9:
        # the default gate/up tile, 32 rows x 512 of 8 warps, takes 255 registers and spills --
        # one program per SM; 16 x 512 of 4 warps takes 178, no spill, two per SM)
        res["fp8_tiles"] = fp8_tiles = dict(swiglu_fp8=dict(BLOCK_R=16, BLOCK_K=512, num_warps=4, num_stages=2),
                                            down_fp8=dict(BLOCK_R=8, BLOCK_K=1024, num_warps=4, num_stages=2))
        run("fp8", "combination+tiles", _merge_changes([gc or {}, fp8_tiles]), dc, stream=True)
    if time.time() - t0 < budget_s:
        run("bf16", "base", None, None, stream=True)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m pagedlab bench gemv", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="figures")
    ap.add_argument("--tune", action="store_true", help="sweep launch configs at M=1 first")
    ap.add_argument("--fp8", action="store_true", help="FP8 weights (the *_fp8 launch configs)")
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help="tokens per call (M)")
    ap.add_argument("--one-stream", action="store_true",
                    help="one token: sweep candidate configs per kernel (bf16, FP8), then one stream "
                         "through the engine with the defaults and with the best (one_stream_probe.json)")
    ap.add_argument("--before", default=None,
                    help="with --one-stream: a JSON gemv_config; no sweep, the engine's one stream with it "
                         "against the defaults, same run (one_stream_confirm.json)")
    ap.add_argument("--variants", nargs="?", const="attn", default=None, choices=("attn", "prefetch", "latency"),
                    help="with --one-stream: the batch-1 step's breakdown and the engine with the "
                         "attention in the QKV launch off and on (attn, the default: "
                         "one_stream_attn.json), or with each L2 PREFETCH variant (prefetch: "
                         "one_stream_variants.json), same run")
    ap.add_argument("--budget-s", type=float, default=200.0, help="with --variants: stop starting "
                    "new engines after this many seconds")
    args = ap.parse_args(argv)
    require_cuda("bench gemv")
    dev = torch.device("cuda")
    out = out_dir(args.out)
    if args.one_stream and args.variants:
        if args.variants == "prefetch":
            one_stream_variants(out, argv, args.budget_s)
        elif args.variants == "latency":
            one_stream_latency(out, argv, args.budget_s)
        else:
            one_stream_attention(out, argv, args.budget_s)
        return
    if args.one_stream:
        before = None
        if args.before:
            import json
            with open(args.before) as f:
                before = json.load(f)
        one_stream_probe(out, argv, before)
        return
    copy_bw = copy_bandwidth_tbs(dev)
    meta = dict(metadata("python -m pagedlab.bench.gemv", argv), copy_tb_s=round(copy_bw, 3))
    print(f"{device_line(meta)}  copy {copy_bw:.2f} TB/s")
    tuned = {}
    config = gemv.GEMV_CONFIG
    if args.tune:
        tuned = tune(make_ops(1, dev, fp8=args.fp8))
        best_cfg = {k: v[1] for k, v in tuned.items()}
        write_json(out / ("gemv_fp8_best_config.json" if args.fp8 else "gemv_best_config.json"), best_cfg)
        config = merge_config(gemv.GEMV_CONFIG, best_cfg)
    rows = []
    print(f"{'op':28s} {'M':>3s} {'fused us':>9s} {'TB/s':>6s} {'unfused us':>10s} {'TB/s':>6s} {'speedup':>7s}")
    for m in args.rows:
        for name, op in make_ops(m, dev, fp8=args.fp8).items():
            cfg = config[op["key"]]
            f_us = graph_time_us([op["call"](w, True, cfg) for w in op["ws"]])
            u_us = graph_time_us([op["call"](w, False, cfg) for w in op["ws"]])
            r = dict(op=name, m=m, fused_us=f_us, unfused_us=u_us, bytes=op["bytes"],
                     fused_tb_s=op["bytes"] / f_us / 1e6, unfused_tb_s=op["bytes"] / u_us / 1e6)
            rows.append(r)
            print(f"{name:28s} {m:3d} {f_us:9.2f} {r['fused_tb_s']:6.2f} {u_us:10.2f} "
                  f"{r['unfused_tb_s']:6.2f} {u_us / f_us:6.2f}x")
    layer = {m: (sum(r["fused_us"] for r in rows if r["m"] == m and "lm_head" not in r["op"]),
                 sum(r["unfused_us"] for r in rows if r["m"] == m and "lm_head" not in r["op"]))
             for m in args.rows}
    for m, (f, u) in layer.items():
        print(f"one layer's linear work at M={m}: fused {f:.1f} us, unfused {u:.1f} us")
    result = dict(meta=meta, config=to_plain(config), rows=rows,
                  tuned={k: dict(us=v[0], config=v[1]) for k, v in tuned.items()})
    name = "gemv_fp8_bench" if args.fp8 else "gemv_bench"
    write_json(out / f"{name}.json", result)
    plot(rows, copy_bw, out / f"{name}.png", "FP8" if args.fp8 else "bf16")


def plot(rows, copy_bw, path, weights="bf16"):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ops = list(dict.fromkeys(r["op"] for r in rows))
    fig, axes = plt.subplots(1, len(ops), figsize=(3.2 * len(ops), 3.2), sharey=True)
    for ax, op in zip(axes, ops):
        rs = [r for r in rows if r["op"] == op]
        ms = [r["m"] for r in rs]
        ax.plot(ms, [r["fused_tb_s"] for r in rs], "o-", label="fused Triton")
        ax.plot(ms, [r["unfused_tb_s"] for r in rs], "s--", label="unfused (cuBLAS + kernels)")
        ax.axhline(copy_bw, color="gray", lw=0.8, ls=":", label="device copy")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ms, [str(m) for m in ms])
        ax.set_title(op, fontsize=9)
        ax.set_xlabel("tokens in the step (M)")
    axes[0].set_ylabel("weight read rate (TB/s)")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Decode-time linear layers, Llama-3.2-1B shapes, {weights} weights (CUDA graph replay)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()

"""`python -m pagedlab bench layer`: the decoder layers of one batch-1 decode step, five launches a
layer (the engine's path: gemv.py + decode_attention.py, PDL as the device's default) against ONE
persistent launch a layer (kernels/decode_layer.py).

Llama-3.2-1B's 16 layers, random bf16 weights, one sequence whose pages are scattered over the
pool, at each --contexts length. For each variant: the GPU time of the 16 layers replayed from one
CUDA graph (median of rounds), per layer, and the weight bytes over that time (TB/s, against the
copy bandwidth measured in the same run); and the largest difference of the 16 layers' output from
the same layers in fp32 (torch), relative to its largest value -- the one launch must be as close
as the five. --sweep also times the one launch at other settings (R, BK, DOWN, S, BLOCK_N, DOT, GRAB,
PER_SM, num_warps: kernels/decode_layer.py). A launch that does not finish within --watchdog-s seconds (a
wait that never ends) is named in one line and the process killed (status 137 in a shell). Writes layer_bench.json.
"""
from __future__ import annotations

import argparse
import os
import signal
import threading
import time

import torch

from pagedlab.bench.common import (copy_bandwidth_tbs, device_line, graph_time_us, metadata, out_dir,
                                   require_cuda, write_json)

EPS = 1e-5
DEVICE, DTYPE = "cuda", torch.bfloat16     # (the tests run the command on the CPU, small and in fp32)
LLAMA_1B = dict(hidden=2048, inter=8192, heads=32, kv_heads=8, head_dim=64, layers=16, theta=500000.0)
SWEEP = [dict(PER_SM=1), dict(PER_SM=3), dict(PER_SM=4), dict(DOT=1, num_warps=8, PER_SM=1),
         dict(DOT=1, num_warps=8), dict(num_warps=8, PER_SM=1), dict(R=8), dict(R=32), dict(BK=128), dict(BK=512),
         dict(S=4), dict(S=16), dict(BLOCK_N=32, num_warps=8), dict(GRAB=2), dict(GRAB=4, PER_SM=1),
         dict(DOWN=1), dict(DOWN=2), dict(DOWN=8)]


def make_layers(shape, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    H, inter, hq, hkv, d = shape["hidden"], shape["inter"], shape["heads"], shape["kv_heads"], shape["head_dim"]

    def rnd(*s, scale):
        return (torch.randn(*s, generator=g, device=device) * scale).to(dtype)
    return [dict(attn_norm=1 + rnd(H, scale=0.1), qkv=rnd((hq + 2 * hkv) * d, H, scale=H ** -0.5),
                 o=rnd(H, hq * d, scale=(hq * d) ** -0.5), mlp_norm=1 + rnd(H, scale=0.1),
                 gate_up=rnd(2 * inter, H, scale=H ** -0.5), down=rnd(H, inter, scale=inter ** -0.5))
            for _ in range(shape["layers"])]


def make_sequence(shape, context, dtype, device, page=16, seed=1):
    """One sequence of `context` tokens (the last is this step's) in each layer's cache: its pages
    scattered over a pool twice its size, the earlier tokens' K/V random."""
    g = torch.Generator(device=device).manual_seed(seed)
    pages = -(-context // page)
    pool = 2 * pages + 1
    table = torch.randperm(pool, generator=g, device=device)[:pages].to(torch.int32)
    pos = context - 1
    slot = int(table[pos // page]) * page + pos % page
    cache = [torch.randn(pool, page, shape["kv_heads"], shape["head_dim"], generator=g, device=device).to(dtype)
             for _ in range(2 * shape["layers"])]
    return dict(k=cache[0::2], v=cache[1::2], positions=torch.tensor([pos], device=device),
                slot_mapping=torch.tensor([slot], device=device), block_table=table[None],
                seq_lens=torch.tensor([context], device=device, dtype=torch.int32), context=context,
                h=torch.randn(1, shape["hidden"], generator=g, device=device).to(dtype))


def five_launches(ops, layers, seq, cos_sin, shape):
    """The engine's layer loop (model.py), batch 1, decode only (prefetch=: the matrix the next
    launch streams, which the Triton launchers pull into L2; every kernels namespace takes it)."""
    h, scale = seq["h"], shape["head_dim"] ** -0.5
    for i, layer in enumerate(layers):
        nxt = layers[i + 1]["qkv"] if i + 1 < len(layers) else None
        q = ops.norm_qkv_rope_store(h, layer["attn_norm"], EPS, layer["qkv"], seq["positions"], cos_sin,
                                    seq["k"][i], seq["v"][i], seq["slot_mapping"], shape["heads"],
                                    prefetch=layer["o"])
        o = ops.decode_attention(q, seq["k"][i], seq["v"][i], seq["block_table"], seq["seq_lens"], scale,
                                 seq["context"])
        h = ops.linear_residual(o.reshape(1, -1), layer["o"], h, prefetch=layer["gate_up"])
        a = ops.norm_swiglu(h, layer["mlp_norm"], EPS, layer["gate_up"], prefetch=layer["down"])
        h = ops.linear_residual(a, layer["down"], h, prefetch=nxt)
    return h


def one_launch(fn, layers, seq, cos_sin, shape, **kw):
    h, scale = seq["h"], shape["head_dim"] ** -0.5
    for i, layer in enumerate(layers):
        h = fn(h, layer, EPS, seq["positions"], cos_sin, seq["k"][i], seq["v"][i], seq["slot_mapping"],
               seq["block_table"], seq["seq_lens"], scale, shape["heads"], **kw)
    return h


def clone_seq(seq):
    return {k: ([t.clone() for t in v] if isinstance(v, list) else v.clone() if torch.is_tensor(v) else v)
            for k, v in seq.items()}


def guarded(what: str, fn, watchdog_s: float):
    """fn() and a synchronize, or -- past watchdog_s -- a line naming `what`, and the process killed."""
    def fire():
        print(f"bench layer: {what} did not finish within {watchdog_s:.0f} s (a wait that never ends?)",
              flush=True)
        os.kill(os.getpid(), signal.SIGKILL)       # a kernel that spins forever: nothing else stops it
    timer = threading.Timer(watchdog_s, fire)
    timer.start()
    try:
        out = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return out
    finally:
        timer.cancel()


def rel_err(out, ref) -> float:
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m pagedlab bench layer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="258,1900", help="context lengths (tokens, this step's included)")
    p.add_argument("--layers", type=int, default=LLAMA_1B["layers"])
    p.add_argument("--rounds", type=int, default=30, help="graph replays timed (median)")
    p.add_argument("--sweep", action="store_true", help="also the one launch at other settings")
    p.add_argument("--engine", action="store_true",
                   help="also the engine: one stream (128-token prompt, 256 new tokens, median of 5) and its "
                        "batch-1 graph replay, the one launch off / on / off (LLM(kernel_options={'decode_layer': "
                        "True})), each a fresh engine in this process, and whether the tokens agree")
    p.add_argument("--skip-layers", action="store_true", help="only --engine")
    p.add_argument("--weights", default="bf16,fp8", help="bf16 and/or fp8 (e4m3 codes, a scale per row)")
    p.add_argument("--watchdog-s", type=float, default=60.0)
    p.add_argument("--out", default="figures")
    args = p.parse_args(argv)
    require_cuda("bench layer")
    from pagedlab.kernels import select_kernels
    from pagedlab.kernels.decode_layer import DECODE_LAYER_CONFIG, LINEARS, decode_layer_torch, decode_layer_triton
    from pagedlab.quantization import FP8Weight
    from pagedlab.kernels.launch import sm_count
    from pagedlab.kernels.rope import rope_cos_sin

    dev = torch.device(DEVICE)
    meta = metadata("python -m pagedlab bench layer", argv)
    shape = dict(LLAMA_1B, layers=args.layers)
    contexts = [int(c) for c in args.contexts.split(",")]
    kinds = [k.strip() for k in args.weights.split(",") if k.strip()]
    if not kinds or set(kinds) - {"bf16", "fp8"}:
        raise SystemExit(f"bench layer: --weights takes bf16 and/or fp8, got {args.weights!r}")
    print(device_line(meta), flush=True)
    tbs = copy_bandwidth_tbs(dev)
    cos_sin = rope_cos_sin(shape["head_dim"], shape["theta"], max(contexts) + 1, device=dev)
    ops = select_kernels("triton")
    sms = sm_count(dev)
    configs = [("one launch", dict(DECODE_LAYER_CONFIG))]
    if args.sweep:
        for change in SWEEP:
            c = dict(DECODE_LAYER_CONFIG, **change)
            configs.append(("one launch " + ",".join(f"{k}={v}" for k, v in change.items()), c))
    rows, weight_bytes = [], {}
    base_layers = [] if args.skip_layers else make_layers(shape, DTYPE, dev)
    for kind in ([] if args.skip_layers else kinds):
        layers = base_layers if kind == "bf16" else [quantized(layer) for layer in base_layers]
        # the reference: the same (dequantized) weights in fp32, the torch composition
        ref_layers = [{k: (v.dequantize(torch.float32) if isinstance(v, FP8Weight) else v.float())
                       for k, v in layer.items()} for layer in layers]
        wb = weight_bytes[kind] = sum(v.num_bytes() if isinstance(v, FP8Weight) else v.numel() * v.element_size()
                                      for k, v in layers[0].items() if k in LINEARS)
        print(f"{kind}: copy bandwidth {tbs:.3f} TB/s; {wb / 1e6:.1f} MB of weights a layer "
              f"({wb / tbs / 1e6:.2f} us a layer at copy speed); {sms} SMs", flush=True)
        for context in contexts:
            seq = make_sequence(shape, context, DTYPE, dev)
            ref_seq = clone_seq(seq)
            ref_seq.update(k=[t.float() for t in seq["k"]], v=[t.float() for t in seq["v"]], h=seq["h"].float())
            ref = one_launch(decode_layer_torch, ref_layers, ref_seq, cos_sin, shape)
            variants = [("five launches", lambda s: five_launches(ops, layers, s, cos_sin, shape), None)]
            for name, cfg in configs:
                variants.append((name, lambda s, cfg=cfg: one_launch(decode_layer_triton, layers, s, cos_sin, shape,
                                                                     config=cfg), cfg))
            for name, run, cfg in variants:
                s = clone_seq(seq)
                t0 = time.perf_counter()
                where = f"{kind} context {context:>5}  {name:<28}"
                try:
                    out = guarded(where, lambda: run(s), args.watchdog_s)
                except Exception as e:          # a setting that does not compile (registers, shared memory)
                    print(f"  {where} failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
                    rows.append(dict(weights=kind, context=context, variant=name, config=cfg,
                                     error=f"{type(e).__name__}: {e}"[:400]))
                    continue
                first_s = time.perf_counter() - t0
                err = rel_err(out, ref)
                us = guarded(where + " (graph)", lambda: graph_time_us([lambda: run(s)], rounds=args.rounds),
                             args.watchdog_s * 3)
                per = us / shape["layers"]
                row = dict(weights=kind, context=context, variant=name, config=cfg, step_us=us, layer_us=per,
                           weight_tbs=wb / (per * 1e-6) / 1e12, rel_err_vs_fp32=err, first_call_s=first_s)
                rows.append(row)
                print(f"  {where} {us:8.1f} us ({per:6.2f} a layer, {row['weight_tbs']:.2f} TB/s of weights)  "
                      f"err vs fp32 {err:.2e}", flush=True)
            del seq, ref_seq
    for r in rows:
        base = next((b for b in rows if b["weights"] == r["weights"] and b["context"] == r["context"]
                     and b["variant"] == "five launches" and "step_us" in b), None)
        if base is not None and "step_us" in r and r is not base:
            r["vs_five"] = r["step_us"] / base["step_us"]
    engine = [row for kind in kinds for row in engine_rows(args, contexts[0], kind)] if args.engine else []
    path = write_json(out_dir(args.out) / "layer_bench.json",
                      dict(meta=meta, copy_tbs=tbs, weight_bytes_per_layer=weight_bytes, shape=shape, rows=rows,
                           engine=engine))
    print(f"wrote {path}")
    return 0


def quantized(layer: dict) -> dict:
    """The layer with its linear weights in FP8 (per row, e4m3), as the engine quantizes at load."""
    from pagedlab.kernels.decode_layer import LINEARS
    from pagedlab.quantization import quantize_weight
    return {k: quantize_weight(v.float(), k) if k in LINEARS else v for k, v in layer.items()}


def engine_rows(args, context: int, kind: str = "bf16") -> list[dict]:
    """One stream and the batch-1 graph replay (at `context`), the one launch off / on / off."""
    import gc

    from pagedlab import LLM
    from pagedlab.bench.common import random_prompt
    from pagedlab.bench.engine import one_stream
    from pagedlab.bench.step import graph_step_us
    from pagedlab.weights import load_checkpoint
    ckpt = load_checkpoint("random:llama-3.2-1b", show_progress=False)
    prompt = random_prompt()
    rows, first = [], None
    for name, opts in (("five launches", {}), ("one launch", {"decode_layer": True}), ("five launches again", {})):
        llm = LLM(checkpoint=ckpt, device="cuda", dtype="bfloat16", max_num_seqs=1, max_model_len=2048,
                  show_progress=False, kernel_options=opts or None,
                  quantization="fp8" if kind == "fp8" else None)
        graph_us, kernels_us = guarded(f"the engine's graph, {name}", lambda llm=llm: graph_step_us(llm, context),
                                       args.watchdog_s * 3)
        run = guarded(f"one stream, {name}", lambda llm=llm: one_stream(llm, prompt, keep_tokens=True), args.watchdog_s * 5)
        tokens = run["token_ids"][0]
        first = tokens if first is None else first
        agree = sum(a == b for a, b in zip(tokens, first)) / len(first)
        row = dict(weights=kind, variant=name, graph_us=graph_us, kernels_us=kernels_us, one_stream_tok_s=run["tokens_per_s"],
                   runs_tok_s=run["runs_tokens_per_s"], itl_p50_ms=run["itl_ms"][50],
                   tokens_agree_with_first=agree)
        rows.append(row)
        print(f"  engine {kind} {name:<22} graph {graph_us:7.1f} us  one stream {run['tokens_per_s']:7.1f} tok/s "
              f"(runs {run['runs_tokens_per_s']})  tokens = first row's at {agree:.3f}", flush=True)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    raise SystemExit(main())

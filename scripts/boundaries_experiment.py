"""What a kernel boundary costs at batch 1, and whether one launch whose programs wait for each
other avoids it: `python scripts/boundaries_experiment.py [--out DIR]` (a CUDA GPU; pagedlab
installed or on PYTHONPATH).

An experiment, not part of pagedlab: it measured the one-launch "dataflow" design SLOWER than
separate launches (docs/engine.md, "What bounds the batch-1 step"), and is kept to reproduce that.

A decode step at batch 1 is a chain of ~85 kernels, each a short pass over a weight matrix, each
depending on the one before. Here the chain is N phases of

    x_k = x_{k-1} + W_k x_{k-1}          (W_k: [D, D] bf16, distinct per phase, all > L2 together)

run three ways, each replayed from a CUDA graph:

  separate    N launches of pagedlab's fused kernel (gemv.linear_residual_triton), with the
              device's default PDL mode (kernels/pdl.py) and with PDL off
  dataflow    ONE launch of N x P programs (P row blocks per phase), in phase order; a program of
              phase k first waits on an atomic counter until all P programs of phase k-1 have
              arrived, then computes its rows. No launch boundary at all -- but its waiting
              programs sit on the SMs (forward progress relies on the GPU dispatching programs in
              index order, as decoupled look-back scans do; a bounded wait reports a violation
              instead of hanging)
  preload     dataflow, and each program loads its first weight tile BEFORE it waits

It reports microseconds per phase and the weight read rate, against the copy bandwidth measured in
the same run, and checks that the three give the same x_N. On CPU (Triton's interpreter runs the
programs one after another, in index order) a wait never waits, so the kernel is tested there too.
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from pagedlab.bench.common import (copy_bandwidth_tbs, device_line, graph_time_us, metadata, out_dir,
                                   require_cuda, write_json)
from pagedlab.kernels import gemv, pdl

MAX_POLLS = 1 << 16          # polls (~1 us each); a legitimate wait is one phase, ~10 us
NUM_WARPS = 4


@triton.jit
def _dataflow_chain_kernel(x_ptr, w_ptr, done_ptr, err_ptr, D, P: tl.constexpr, N: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PRELOAD: tl.constexpr,
                           MAX_WAIT: tl.constexpr):
    """x [N + 1, D] (row 0 = input), w [N, D, D], done [N] int32 (zero between launches)."""
    pid = tl.program_id(0)
    phase = pid // P
    rows = (pid % P) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < D
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + phase.to(tl.int64) * D * D + rows[:, None] * D
    w0 = tl.zeros([BLOCK_R, BLOCK_K], dtype=w_ptr.dtype.element_ty)
    if PRELOAD:                          # the weights never depend on the previous phase
        w0 = tl.load(w_rows + offs_k[None, :], mask=rmask[:, None] & (offs_k < D)[None, :], other=0.0)
    if phase > 0:                        # wait until every program of the previous phase is done
        polls = 0
        while (tl.load(done_ptr + phase - 1, volatile=True) < P) & (polls < MAX_WAIT):
            polls += 1
        tl.atomic_add(done_ptr + phase - 1, 0, sem="acquire")      # order the loads below after it
        if polls >= MAX_WAIT:
            tl.store(err_ptr, 1)
    x_row = x_ptr + phase * D
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        cols = k0 + offs_k
        kmask = cols < D
        x = tl.load(x_row + cols, mask=kmask, other=0.0, cache_modifier=".cg").to(tl.float32)
        if PRELOAD and k0 == 0:
            w = w0
        else:
            w = tl.load(w_rows + cols[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    res = tl.load(x_row + rows, mask=rmask, other=0.0, cache_modifier=".cg").to(tl.float32)
    tl.store(x_row + D + rows, (acc + res).to(x_ptr.dtype.element_ty), mask=rmask)
    arrived = tl.atomic_add(done_ptr + phase, 1, sem="release")
    if (phase == N - 1) & (arrived == P - 1):    # the very last program: all others are done
        for k in range(0, N):
            tl.store(done_ptr + k, 0)


def dataflow_chain(x0, w, block_r=8, block_k=512, preload=False, state=None):
    """x0 [D], w [N, D, D] -> x [N + 1, D] (row k = phase k's output). One launch. `state` =
    (x, done, err) buffers to reuse (CUDA graphs)."""
    n, d, _ = w.shape
    x, done, err = state or (torch.empty(n + 1, d, dtype=w.dtype, device=w.device),
                             torch.zeros(n, dtype=torch.int32, device=w.device),
                             torch.zeros(1, dtype=torch.int32, device=w.device))
    x[0].copy_(x0)
    p = triton.cdiv(d, block_r)
    _dataflow_chain_kernel[(n * p,)](x, w, done, err, d, P=p, N=n, BLOCK_R=block_r,
                                     BLOCK_K=min(block_k, triton.next_power_of_2(d)),
                                     PRELOAD=preload, MAX_WAIT=MAX_POLLS, num_warps=NUM_WARPS)
    return x, done, err


def separate_chain(x0, w, pdl_mode=None):
    """The same chain as N launches of the engine's fused linear+residual kernel."""
    x = x0[None, :]
    for k in range(w.shape[0]):
        x = gemv.linear_residual_triton(x, w[k], x, fused=True, pdl=pdl_mode)
    return x[0]


def main(argv=None):
    p = argparse.ArgumentParser(prog="python scripts/boundaries_experiment.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=2048, help="D: the matrices are D x D (2048: O-size)")
    p.add_argument("--phases", type=int, default=32)
    p.add_argument("--out", default="figures")
    args = p.parse_args(argv)
    require_cuda("the boundaries experiment")
    dev = torch.device("cuda")
    d, n = args.dim, args.phases
    g = torch.Generator(device=dev).manual_seed(0)
    w = (torch.randn(n, d, d, device=dev, generator=g) * d ** -0.5).to(torch.bfloat16)
    x0 = torch.randn(d, device=dev, generator=g).to(torch.bfloat16)
    bw = copy_bandwidth_tbs(dev) * 1e12                     # bytes/s
    ref = x0.double()
    for k in range(n):
        ref = ref + w[k].double() @ ref
    rows, outs = [], {}
    default = pdl.default_mode(dev)
    separate = {"separate, PDL off": "off", f"separate, PDL {default}": default}   # one if default is off
    for name, mode in separate.items():
        us = graph_time_us([lambda: separate_chain(x0, w, mode)])
        outs[name] = separate_chain(x0, w, mode)
        rows.append((name, us))
    for name, preload in (("dataflow (one launch)", False), ("dataflow + preload", True)):
        state = dataflow_chain(x0, w, preload=preload)
        state[2].zero_()
        us = graph_time_us([lambda: dataflow_chain(x0, w, preload=preload, state=state)])
        torch.cuda.synchronize()
        if int(state[2].item()):
            rows.append((name + ": a wait timed out (dispatch order?)", float("nan")))
            continue
        outs[name] = dataflow_chain(x0, w, preload=preload, state=state)[0][n]
        rows.append((name, us))
    weight_bytes = w.numel() * w.element_size()
    res = dict(metadata("python scripts/boundaries_experiment.py", argv), dim=d, phases=n,
               copy_bandwidth_TBps=bw / 1e12,
               rows=[dict(variant=r, us_per_phase=us / n, weight_TBps=weight_bytes / (us * 1e-6) / 1e12)
                     for r, us in rows],
               rel_err_vs_fp64={k: float((v.double() - ref).norm() / ref.norm()) for k, v in outs.items()})
    write_json(out_dir(args.out) / "boundaries_bench.json", res)
    floor = weight_bytes / n / bw * 1e6
    print(f"{device_line(res)}: {n} phases of "
          f"{d}x{d} bf16 ({weight_bytes / n / 1e6:.1f} MB each); copy bandwidth {bw / 1e12:.2f} TB/s "
          f"-> {floor:.2f} us per phase at best")
    print("| variant | us per phase | weight TB/s | rel. err vs fp64 |\n|---|---|---|---|")
    for r in res["rows"]:
        err = res["rel_err_vs_fp64"].get(r["variant"])
        print(f"| {r['variant']} | {r['us_per_phase']:.2f} | {r['weight_TBps']:.2f} | "
              f"{'' if err is None else f'{err:.1e}'} |")


if __name__ == "__main__":
    main()

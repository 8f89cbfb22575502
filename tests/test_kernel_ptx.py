"""The cross-program counts of the split kernels, checked in the PTX Triton makes (no GPU needed:
Triton compiles for a CUDA target on any machine; a subprocess, since the CPU tests run kernels
under the interpreter, where @triton.jit gives no compilable function).

gemv.py's split-K reduction and split_kv decode attention let the program that arrives LAST sum
every program's partials. A program's count is one atomic, issued by ONE of its threads; the other
warps' partial sums must be written before it, or the last program may read stale ones. Triton puts
a CTA barrier (bar.sync) before a scalar atomic: this test holds that on sm75 (T4) and sm90 (H200),
for the kernels as the engine launches them (split-K with the greedy argmax; split_kv, bf16)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = r'''
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagedlab.kernels import decode_attention as da, gemv

def signature(fn, consts, ptrs, floats):
    sig, cx = {}, {}
    for i, n in enumerate(fn.arg_names):
        if n in consts:
            sig[n], cx[(i,)] = "constexpr", consts[n]
        elif n.endswith("_ptr"):
            sig[n] = ptrs.get(n, "*bf16")
        else:
            sig[n] = "fp32" if n in floats else "i32"
    return sig, cx

kernels = {
    "gemv split-K": (gemv._linear_kernel, dict(HAS_NORM=1, HAS_RESIDUAL=0, ARGMAX=1, HAS_SCALE=0, SPLITS=4,
        BLOCK_M=1, BLOCK_R=64, BLOCK_K=64, IDX64=0, PDL=0, ACC2D=0, PF_BLOCKS=0, PF_BLOCK=1024),
        {"out_ptr": "*fp32", "best_ptr": "*fp32", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "pf_ptr": "*i32",
         "sink_ptr": "*i32"}, {"eps"}),
    "split_kv decode": (da._decode_gqa_kernel, dict(HKV=8, G=4, GP=16, BS=16, D=64, BLOCK_D=64, BLOCK_N=64,
        NUM_SPLITS=8, IEEE=0, IDX64=0, PDL=0, GM=4, MERGE_CH=4),
        {"ml_ptr": "*fp32", "acc_ptr": "*fp32", "cnt_ptr": "*i32", "bt_ptr": "*i32", "sl_ptr": "*i32"},
        {"sm_scale"}),
}
for cap in (75, 90):
    for name, (fn, consts, ptrs, floats) in kernels.items():
        sig, cx = signature(fn, consts, ptrs, floats)
        ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx),
                             target=GPUTarget("cuda", cap, 32), options={"num_warps": 4}).asm["ptx"]
        code = [l.strip() for l in ptx.splitlines() if l.strip() and not l.strip().startswith((".loc", "//"))]
        adds = [i for i, l in enumerate(code) if "atom." in l and ".add." in l]
        assert adds, (cap, name, "no counting atomic")
        for i in adds:
            before = code[max(0, i - 6):i]
            assert any(l.startswith(("bar.sync", "barrier.sync")) for l in before), (cap, name, code[i - 8:i + 1])
        print(cap, name, len(adds))
'''


def test_split_counts_have_a_barrier_before_them():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    if r.returncode and "ptxas" in r.stderr and "not found" in r.stderr.lower():
        pytest.skip("this Triton has no CUDA backend tools (ptxas)")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("\n") == 4, r.stdout


"""Compile a Triton kernel of pagedlab for a GPU this machine does not have, and print what the
compiled code uses: `python scripts/compile_check.py [--arch 75,80,90] [SETTING=VALUE ...]`.

Triton compiles ahead of time for any target (its own ptxas is in the wheel), so a kernel's
compile errors, registers a thread and local-memory spills are known on a CPU-only machine --
before any GPU time is spent. Kernel: kernels/decode_layer.py at Llama-3.2-1B's shapes (bf16 on
sm80+, fp16 below; and with FP8 weights on sm90), settings from its DECODE_LAYER_CONFIG, changed by SETTING=VALUE. One line a
target: `sm90 regs 167 local 0 stack 0 shared 1024` (registers a thread; bytes of local memory
and of stack a thread -- ptxas puts its spills on the stack -- and of shared memory a program). Not under TRITON_INTERPRET (unset here).
"""
from __future__ import annotations

import argparse
import inspect
import os
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402


def layer_source(cfg: dict, dt: str, fp8: bool = False) -> ASTSource:
    from pagedlab.kernels import decode_layer as dl
    fn = dl._decode_layer_kernel
    names = list(inspect.signature(fn.fn).parameters)
    types = {n: dt for n in ("h_ptr", "out_ptr", "attn_norm_ptr", "mlp_norm_ptr", "kc_ptr", "vc_ptr")}
    types.update({n: "*fp8e4nv" if fp8 else dt for n in ("wqkv_ptr", "wo_ptr", "wgu_ptr", "wdown_ptr")})
    types.update({n: "*fp32" if fp8 else dt for n in ("sqkv_ptr", "so_ptr", "sgu_ptr", "sdown_ptr")})
    types.update(pos_ptr="*i64", slot_ptr="*i64", bt_ptr="*i32", seq_ptr="*i32", cnt_ptr="*i32", eps="fp32",
                 scale_log2="fp32", stride_cb="i64", stride_vb="i64", stride_cs="i32", stride_ch="i32",
                 stride_vs="i32", stride_vh="i32")
    types.update({n: "*fp32" for n in ("cs_ptr", "qkv_ptr", "part_ptr", "ml_ptr", "mid_ptr", "act_ptr")})
    const = dict(H=2048, INTER=8192, NQ=32, NKV=8, HD=64, PAGE=16, R=cfg["R"], BK=cfg["BK"], S=cfg["S"],
                 BLOCK_N=cfg["BLOCK_N"], GP=16 if cfg["DOT"] else 4, IEEE=False, DOT=bool(cfg["DOT"]), FP8=fp8,
                 GRAB=cfg["GRAB"], HP=2048, DOWN=cfg["DOWN"])
    sig = {n: types.get(n, "constexpr") for n in names}
    missing = [n for n in names if sig[n] == "constexpr" and n not in const]
    if missing:
        raise SystemExit(f"compile_check: no type for {missing}")
    try:                                                   # Triton 3.3+: constexprs by position
        return ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()})
    except TypeError:
        return ASTSource(fn=fn, signature=sig, constants=const)


def usage(cubin: bytes) -> dict:
    import triton.backends.nvidia as nv
    tool = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    line = next(x for x in out.splitlines() if "REG:" in x)
    fields = dict(part.split(":") for part in line.split() if ":" in part)
    return dict(regs=int(fields["REG"]), local=int(fields["LOCAL"]), stack=int(fields["STACK"]),
                shared=int(fields["SHARED"]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="75,80,90")
    p.add_argument("--fp8-arch", default="90", help="targets for FP8 weights (e4m3 codes; sm89+)")
    p.add_argument("settings", nargs="*", help="SETTING=VALUE: DECODE_LAYER_CONFIG's R, BK, S, BLOCK_N, DOT, num_warps")
    args = p.parse_args(argv)
    from pagedlab.kernels.decode_layer import DECODE_LAYER_CONFIG
    cfg = dict(DECODE_LAYER_CONFIG)
    for s in args.settings:
        k, v = s.split("=")
        if k not in cfg:
            raise SystemExit(f"compile_check: no setting {k!r} (one of {sorted(cfg)})")
        cfg[k] = int(v)
    targets = [(int(a), False) for a in args.arch.split(",")]
    targets += [(int(a), True) for a in args.fp8_arch.split(",") if a]
    for arch, fp8 in targets:
        dt = "*bf16" if arch >= 80 else "*fp16"
        k = triton.compile(layer_source(cfg, dt, fp8), target=GPUTarget("cuda", arch, 32),
                           options={"num_warps": cfg["num_warps"]})
        u = usage(k.asm["cubin"])
        print(f"sm{arch}{' fp8' if fp8 else ''} regs {u['regs']} local {u['local']} stack {u['stack']} "
              f"shared {u['shared']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

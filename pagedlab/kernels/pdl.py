"""Programmatic dependent launch (PDL, Hopper and newer): a kernel may start while the one before
it is still finishing.

A decode step at batch 1 is ~100 short kernels in a row. Between two of them the GPU drains the
first (its last programs finish one by one), then launches the second and ramps it up: a few
microseconds per boundary in which the memory system is half idle. With PDL the second kernel is
launched early; its programs start, do what does not depend on the first kernel's output, then
`gdc_wait()` until the first has completed and its writes are visible. Modes
(environment variable PAGEDLAB_PDL, read at import):

    off       plain launches
    wait      launched with PDL; each program waits at its very start (only launch latency hides)
    early     also tell the NEXT kernel it may launch as soon as all our programs have started
              (gdc_launch_dependents at the start)
    prefetch  early, and a weight-streaming kernel first asks for its first weight tile to be
              brought into L2 (the weights never depend on the previous kernel), then waits
    late      wait at the start; tell the next kernel it may launch once our programs have
              streamed their data (after the main loop, before the reduction and the stores)

A kernel launched with PDL must call wait() before it reads anything an earlier kernel wrote:
every kernel here that takes a PDL constexpr does so at its start.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

MODES = {"off": 0, "wait": 1, "early": 2, "prefetch": 3, "late": 4}
PDL = os.environ.get("PAGEDLAB_PDL", "late")     # fastest measured (docs/engine.md, bench step)
if PDL not in MODES:
    raise ValueError(f"PAGEDLAB_PDL must be one of {sorted(MODES)}, got {PDL!r}")

_SUPPORTED: dict = {}


def pdl_mode(device: torch.device) -> int:
    """The PDL constexpr for kernels launched on `device`: 0 (off) unless on a Hopper+ GPU."""
    key = (device.type, device.index)
    if key not in _SUPPORTED:
        _SUPPORTED[key] = (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
                           and _triton_has_pdl())
    return MODES[PDL] if _SUPPORTED[key] else 0


def _triton_has_pdl() -> bool:
    """Triton >= 3.3 has gdc_wait / gdc_launch_dependents and the launch_pdl launch option."""
    try:
        cuda = tl.extra.cuda
        return hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")
    except AttributeError:
        return False


def launch_options(mode: int) -> dict:
    return {"launch_pdl": True} if mode else {}


@triton.jit
def start(PDL: tl.constexpr):
    """At a kernel's start: let the next kernel launch (early), then wait for the previous one."""
    if PDL == 2 or PDL == 3:
        tl.extra.cuda.gdc_launch_dependents()
    if PDL >= 1:
        tl.extra.cuda.gdc_wait()


@triton.jit
def main_loop_done(PDL: tl.constexpr):
    """After a kernel's main loop ("late" mode): the next kernel may launch."""
    if PDL == 4:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask for the 128-byte lines at ptrs to be brought into L2 (no registers, no wait)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)

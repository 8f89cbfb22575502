"""Programmatic dependent launch (PDL, Hopper and newer): a kernel may start while the one before
it is still finishing.

A decode step at batch 1 is ~100 short kernels in a row. Between two of them the GPU drains the
first (its last programs finish one by one), then launches the second and ramps it up: a few
microseconds per boundary in which the memory system is half idle. With PDL the second kernel is
launched early; its programs start, then `gdc_wait()` until the first has completed and its
writes are visible. Two modes:

    off   plain launches
    late  launched with PDL; each program waits at its very start, and tells the NEXT kernel it
          may launch once our programs have streamed their data (after the main loop, before
          the reduction and the stores)

`late` was the fastest mode measured (docs/engine.md: a batch-1 step of 908.8 us against 966.4
with PDL off). The modes measured slower were retired: `wait` (no early launch of the next
kernel, 919.2 us), `early` (the next kernel may launch as soon as ours started, 946.7 us) and
`prefetch` (early, plus an L2 prefetch of the first weight tile, 975.8 us).

The mode is an argument of every launcher that uses PDL (`pdl=`, also bound by
select_kernels(..., pdl=...)). None means the default: `late` on devices that support it
(compute capability >= 9.0 and a Triton with gdc_wait), `off` elsewhere; the environment
variable PAGEDLAB_PDL=off turns the default off. A device without PDL support (a T4, an A100)
never gets a PDL launch, whatever the mode asked for.

A kernel launched with PDL must call wait() before it reads anything an earlier kernel wrote:
every kernel here that takes a PDL constexpr does so at its start (start()).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .launch import capability

MODES = ("off", "late")
HOPPER = (9, 0)
ENV_VAR = "PAGEDLAB_PDL"


def check_mode(mode: str, source: str = "the PDL mode") -> str:
    if mode not in MODES:
        raise ValueError(f"{source} must be one of {list(MODES)}, got {mode!r}")
    return mode


# What `pdl=None` asks for on a device that supports PDL (read once, at import).
REQUESTED_DEFAULT = check_mode(os.environ.get(ENV_VAR, "late"), ENV_VAR)


@functools.lru_cache(maxsize=None)
def _triton_has_pdl() -> bool:
    """Triton >= 3.3 has gdc_wait / gdc_launch_dependents and the launch_pdl launch option."""
    try:
        cuda = tl.extra.cuda
        return hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")
    except AttributeError:
        return False


def supported(device: torch.device) -> bool:
    """Whether kernels launched on `device` may use PDL: Hopper or newer, and a Triton with it."""
    return device.type == "cuda" and capability(device) >= HOPPER and _triton_has_pdl()


def default_mode(device: torch.device) -> str:
    """The mode `pdl=None` means on `device`."""
    return REQUESTED_DEFAULT if supported(device) else "off"


def effective_mode(device: torch.device, mode: str | None = None) -> str:
    """The mode launches on `device` get when `mode` is asked for (None: the default)."""
    if mode is None:
        return default_mode(device)
    check_mode(mode)
    return mode if supported(device) else "off"


def pdl_flag(device: torch.device, mode: str | None = None) -> int:
    """The PDL constexpr of a kernel launched on `device`: 1 (late) or 0 (off)."""
    return 1 if effective_mode(device, mode) == "late" else 0


def launch_options(flag: int) -> dict:
    return {"launch_pdl": True} if flag else {}


@triton.jit
def start(PDL: tl.constexpr):
    """At a kernel's start: wait for the previous kernel (its writes are then visible)."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def main_loop_done(PDL: tl.constexpr):
    """After a kernel's main loop: the next kernel may launch."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()

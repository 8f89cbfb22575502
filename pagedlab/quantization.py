"""FP8 weights: half the bytes of bf16 for every linear layer.

At one token per step (decode at batch 1) a forward pass is a stream of matrix-vector products:
each weight byte is read once and used for one multiply-add, so the step takes as long as reading
the weights does. Storing the linear weights in 8 bits instead of 16 halves that time -- the only
way for one stream to go faster than the bf16 bandwidth floor.

The format: float8 e4m3fn (4 exponent bits, 3 mantissa bits, finite values up to +-448, no
infinities) with one fp32 scale per OUTPUT channel (row n of W [N, K]):

    scale[n] = max_k |W[n, k]| / 448          (1.0 for an all-zero row: its codes are all 0)
    q[n, k]  = fp8(W[n, k] / scale[n])        (round to nearest; |W / scale| <= 448 by design)
    W[n, k] ~= q[n, k] * scale[n]             (dequantize)

Per-channel scales keep a large row from crushing the small ones (one outlier only costs its own
row precision). Inside a row the relative error of a value is at most 2^-4 (3 mantissa bits)
down to about the row's max / 2^15 (the smallest normal e4m3 value); below that the subnormal steps
are coarser, and a value under max / 458752 (448 * 2^10) rounds to zero.

A matmul with such a weight keeps the scale out of the inner loop: y[:, n] = (x . q[n, :]) *
scale[n]. Two ways to compute it (`fp8_linear`):
  * weights only in fp8 ("W8A16", the CPU path and the decode GEMV kernels of kernels/gemv.py):
    the fp8 codes are converted to the activation dtype exactly (every e4m3 value is a bf16/fp16/
    fp32 value), multiplied and summed, and each column is scaled once at the end;
  * activations in fp8 too ("W8A8", on CUDA sm89+ for the steps with more than one token: prefill
    and decode batches): each token's row of x is quantized like a weight row (one scale per
    token, computed on the fly) and torch._scaled_mm multiplies the two fp8 matrices on the fp8
    tensor cores, scaling rows and columns in its epilogue. Converting the weights instead costs
    a pass over all of them every step (torch's fp8 -> bf16 conversion ran at a fraction of the
    memory bandwidth on the H200: it made offline throughput 2.5x slower than bf16).

Embedding and norms are kept in the model dtype. The LM head is a linear layer and is quantized;
with tied embeddings (Llama-3.2-1B, SmolLM2) it gets its own fp8 copy, the lookup table stays.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from .config import QUANTIZATIONS
from .kernels.quant_fp8 import FP8_DTYPE, FP8_MAX, quantize_rows_fp8_triton
from .kernels.quant_fp8 import quantize_rows_fp8_torch as quantize_rows_fp8    # activations, per token
from .kernels.row_buckets import linear_rows
from .validation import check_choice

MIN_CAPABILITY = (8, 9)              # Ada (sm89) and Hopper (sm90) convert fp8 in hardware


class FP8Weight:
    """A linear weight W [N, K] stored as fp8 codes `q` [N, K] (float8_e4m3fn) and per-row fp32
    `scale` [N]: W ~= q * scale[:, None]. Duck-types the few tensor attributes the engine reads."""

    __slots__ = ("q", "scale")

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        if q.dtype != FP8_DTYPE or q.dim() != 2:
            raise ValueError(f"FP8Weight codes must be a 2-D {FP8_DTYPE} tensor, got {q.dtype} {tuple(q.shape)}")
        if scale.dtype != torch.float32 or scale.shape != (q.shape[0],):
            raise ValueError(f"FP8Weight scale must be float32 of shape ({q.shape[0]},), "
                             f"got {scale.dtype} {tuple(scale.shape)}")
        self.q, self.scale = q.contiguous(), scale.contiguous()

    shape = property(lambda self: self.q.shape)
    device = property(lambda self: self.q.device)
    dtype = property(lambda self: self.q.dtype)

    def num_bytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * 4

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return dequantize_fp8(self.q, self.scale, dtype)

    def to(self, device) -> "FP8Weight":
        return FP8Weight(self.q.to(device), self.scale.to(device))

    def __repr__(self):
        return f"FP8Weight(shape={tuple(self.shape)}, device={self.device})"


def quantize_fp8(w: torch.Tensor, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] (any float dtype) -> (q [N, K] float8_e4m3fn, scale [N] float32), one scale per
    output row. A non-finite value (inf, nan) is refused: it has no fp8 code, and its row's
    scale would be inf or nan -- the error names the tensor, the count and the first position."""
    if w.dim() != 2:
        raise ValueError(f"{name}: per-channel FP8 quantization needs a 2-D weight [out, in], "
                         f"got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point weight, got {w.dtype}")
    w32 = w.float()
    bad = ~torch.isfinite(w32)
    if bad.any():
        n, k = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name}: cannot quantize to FP8: {int(bad.sum())} non-finite value(s) "
                         f"(inf or nan), the first at [{n}, {k}] = {w32[n, k].item()}; "
                         f"the checkpoint is damaged or was saved after a diverged step")
    amax = w32.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    # |w / scale| <= 448 up to rounding of the division: clamp so no value overflows to nan
    q = (w32 / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """(q [N, K] fp8, scale [N]) -> W [N, K] in `dtype` (computed in fp32, or exactly in fp64
    when dtype is fp64, and rounded once)."""
    ct = torch.float64 if dtype == torch.float64 else torch.float32
    return (q.to(ct) * scale.to(ct)[:, None]).to(dtype)


def quantize_weight(w: torch.Tensor, name: str = "weight") -> FP8Weight:
    return FP8Weight(*quantize_fp8(w, name))


_SCALED_MM: dict = {}          # device -> whether torch._scaled_mm does row/column-scaled fp8 there


def scaled_mm_works(device) -> bool:
    """Whether torch._scaled_mm multiplies fp8 matrices with per-row and per-column scales on
    this device (CUDA sm89+, a torch build with row-wise scaling): tried once per device on a
    small product, checked against the dequantized matmul."""
    device = torch.device(device)
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    if device.index is None:              # "cuda" and "cuda:0" are one device: one probe, at load
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _SCALED_MM:
        try:
            g = torch.Generator(device=device).manual_seed(0)
            x = torch.randn(3, 64, device=device, generator=g, dtype=torch.bfloat16)
            w = quantize_weight(torch.randn(32, 64, device=device, generator=g))
            y = _scaled_mm_linear(x, w)
            xq, xs = quantize_rows_fp8(x)
            ref = (xq.float() * xs) @ w.dequantize().t()
            _SCALED_MM[device] = bool(((y.float() - ref).norm() / ref.norm()) < 1e-2)
        except (RuntimeError, TypeError, ValueError):
            _SCALED_MM[device] = False
    return _SCALED_MM[device]


def _scaled_mm_linear(x, w, residual=None):
    xq, xs = quantize_rows_fp8_triton(x)          # one launch instead of six
    y = torch._scaled_mm(xq, w.q.t(), scale_a=xs, scale_b=w.scale[None, :], out_dtype=x.dtype)
    return y if residual is None else y.add_(residual)


def fp8_linear(x: torch.Tensor, w: FP8Weight, residual: torch.Tensor | None = None,
               activations: str = "auto") -> torch.Tensor:
    """x [T, K] @ W^T (+ residual) in x's dtype for an FP8Weight.
    activations: "keep" (W8A16: the codes converted to x's dtype, exact; the matmul; each output
    column scaled once, in fp32 arithmetic), "fp8" (W8A8: torch._scaled_mm on per-token fp8
    activations; CUDA sm89+ only), "fp8-reference" (W8A8's arithmetic in plain torch, any
    device: what the CPU uses to measure it), or "auto" (fp8 where torch._scaled_mm works with
    16-aligned K and N and x is bf16/fp16, else keep)."""
    k, n = w.shape[1], w.shape[0]
    if activations == "auto":
        activations = "fp8" if (x.dtype in (torch.bfloat16, torch.float16) and k % 16 == 0
                                and n % 16 == 0 and scaled_mm_works(x.device)) else "keep"
    if activations == "fp8":
        return _scaled_mm_linear(_contiguous(x), w, residual)
    if activations == "fp8-reference":
        xq, xs = quantize_rows_fp8(x)
        x = (xq.float() * xs).to(x.dtype)
    elif activations != "keep":
        raise ValueError(f"activations must be 'auto', 'keep', 'fp8' or 'fp8-reference', got {activations!r}")
    y = F.linear(x, w.q.to(x.dtype))
    y.mul_(w.scale)                   # computed in fp32 (type promotion), stored in y's dtype
    return y if residual is None else y.add_(residual)


def _contiguous(x):
    return x if x.is_contiguous() else x.contiguous()


# How `linear` treats the activations of an FP8Weight's matmul (fp8_linear's `activations`);
# change it only through activations_mode (the quality benchmark measures W8A8 on the CPU so).
_ACTIVATIONS = ["auto"]


@contextlib.contextmanager
def activations_mode(mode: str):
    """Within the block, FP8 matmuls treat their activations as `mode` (see fp8_linear)."""
    _ACTIVATIONS.append(mode)
    try:
        yield
    finally:
        _ACTIVATIONS.pop()


def linear(x: torch.Tensor, w, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w^T (+ residual) for a plain weight tensor or an FP8Weight."""
    if isinstance(w, FP8Weight):
        return fp8_linear(x, w, residual, _ACTIVATIONS[-1])
    return linear_rows(x, w, residual)        # on CUDA at a few row counts (row_buckets.py says why)


def check_quantization(quantization, device) -> None:
    """quantization None or "fp8"; on CUDA, fp8 needs compute capability >= 8.9 (the error names
    the GPU). On the CPU fp8 runs through the torch reference path (slow, but anywhere)."""
    if quantization is None:
        return
    check_choice("quantization", quantization, QUANTIZATIONS)
    device = torch.device(device)
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if tuple(cap) < MIN_CAPABILITY:
            raise ValueError(
                f"quantization='fp8' needs an NVIDIA GPU of compute capability >= "
                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} (Ada, Hopper or later: L4, L40S, RTX 40xx, "
                f"H100, H200) for fp8 conversion in hardware; this one, "
                f"{torch.cuda.get_device_name(device)}, is sm{cap[0]}{cap[1]}. Run without "
                f"quantization (bf16/fp16) or on the CPU.")
        scaled_mm_works(device)       # probe it now, not first inside a CUDA graph capture


def quantization_error(w: torch.Tensor) -> dict:
    """How far the FP8 round trip lands from W: relative Frobenius error, max abs error, and the
    share of nonzero values that became zero."""
    w64 = w.double()
    back = quantize_weight(w).dequantize(torch.float64)
    nonzero = w64 != 0
    return {"rel_err": ((back - w64).norm() / w64.norm().clamp_min(1e-300)).item(),
            "max_abs_err": (back - w64).abs().max().item(),
            "flushed_to_zero": ((back == 0) & nonzero).sum().item() / max(1, int(nonzero.sum()))}

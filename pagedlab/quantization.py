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
scale[n] -- the fp8 codes are converted to the activation dtype exactly (every e4m3 value is a
bf16/fp16/fp32 value), multiplied and summed, and the column is scaled once at the end. That is
`fp8_linear` here (the CPU path and the reference) and what the fused GEMV kernels
(kernels/gemv.py) do in fp32.

Embedding and norms are kept in the model dtype. The LM head is a linear layer and is quantized;
with tied embeddings (Llama-3.2-1B, SmolLM2) it gets its own fp8 copy, the lookup table stays.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

QUANTIZATIONS = ("fp8",)
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0                      # torch.finfo(torch.float8_e4m3fn).max
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
    """(q [N, K] fp8, scale [N]) -> W [N, K] in `dtype` (computed in fp32, rounded once)."""
    return (q.float() * scale.float()[:, None]).to(dtype)


def quantize_weight(w: torch.Tensor, name: str = "weight") -> FP8Weight:
    return FP8Weight(*quantize_fp8(w, name))


def fp8_linear(x: torch.Tensor, w: FP8Weight, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ W^T (+ residual) in x's dtype for an FP8Weight: the codes are converted to x's
    dtype (exact) for the matmul and each output column is scaled once, in fp32."""
    y = F.linear(x, w.q.to(x.dtype)).float() * w.scale.to(x.device)
    if residual is not None:
        y = y + residual.float()
    return y.to(x.dtype)


def linear(x: torch.Tensor, w, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w^T (+ residual) for a plain weight tensor or an FP8Weight."""
    if isinstance(w, FP8Weight):
        return fp8_linear(x, w, residual)
    return F.linear(x, w) if residual is None else torch.addmm(residual, x, w.t())


def check_quantization(quantization, device) -> None:
    """quantization None or "fp8"; on CUDA, fp8 needs compute capability >= 8.9 (the error names
    the GPU). On the CPU fp8 runs through the torch reference path (slow, but anywhere)."""
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None or one of {QUANTIZATIONS}, got {quantization!r}")
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


def quantization_error(w: torch.Tensor) -> dict:
    """How far the FP8 round trip lands from W: relative Frobenius error, max abs error, and the
    share of nonzero values that became zero."""
    w64 = w.double()
    back = quantize_weight(w).dequantize(torch.float64)
    nonzero = w64 != 0
    return {"rel_err": ((back - w64).norm() / w64.norm().clamp_min(1e-300)).item(),
            "max_abs_err": (back - w64).abs().max().item(),
            "flushed_to_zero": ((back == 0) & nonzero).sum().item() / max(1, int(nonzero.sum()))}

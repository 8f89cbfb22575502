"""RMSNorm in one pass: out = x * rsqrt(mean(x^2) + eps) * weight, per token row.

Done in torch it is several passes over [T, hidden] in memory (square-mean, scale, multiply by the
weight), each one a kernel launch. The Triton kernel below does it in one: one program per token
row loads x, reduces sum(x^2) in fp32 registers and writes x * rsqrt(mean + eps) * weight. It is
purely memory bound. The engine does not call it on its own: kernels/gemv.py fuses the norm into
the matrix product that follows it at one token, and composes this kernel with cuBLAS above that.

rms_norm_torch is the reference (and the CPU path); rms_norm_triton has the same signature.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain-torch RMSNorm in fp32, returned in x's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * weight.float()).to(x.dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, H, stride_x, stride_o, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    mean_sq = tl.sum(x * x, axis=0) / H
    rstd = 1.0 / tl.sqrt(mean_sq + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as rms_norm_torch: one launch, one program per row of x [..., H]."""
    shape = x.shape
    h = shape[-1]
    x2 = x.reshape(-1, h)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    block = triton.next_power_of_2(h)
    if rows > 0:
        _rms_norm_kernel[(rows,)](x2, weight, out, h, x2.stride(0), out.stride(0), eps, BLOCK=block,
                                  num_warps=min(max(block // 256, 1), 16))
    return out.view(shape)

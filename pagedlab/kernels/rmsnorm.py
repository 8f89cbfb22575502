"""RMSNorm, optionally fused with the residual add that precedes it in every Llama layer.

Every Llama layer starts its attention and MLP halves with `s = x + residual; h = rmsnorm(s)`.
Done in torch, that is three or four passes over [T, hidden] in memory (add, square-mean, scale,
multiply by weight), each one a kernel launch. The Triton kernel below does all of it in one pass:
one program per token row loads x (and residual), writes the new residual stream s, reduces
sum(s^2) in fp32 registers, and writes s * rsqrt(mean + eps) * weight. It is purely memory bound,
so fusing the add saves a full read + write of the hidden state per layer half.

rms_norm_torch is the reference (and the CPU path); rms_norm_triton has the same signature.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None):
    """Plain-torch RMSNorm in fp32.

    Without `residual`: returns norm(x).
    With `residual`:    s = x + residual; returns (norm(s), s)  -- s is the new residual stream.
    """
    if residual is not None:
        s = (x.float() + residual.float()).to(x.dtype)
    else:
        s = x
    h = s.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = (h * weight.float()).to(x.dtype)
    return out if residual is None else (out, s)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, H, stride_x, stride_r,
                     stride_o, stride_ro, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(res_out_ptr.dtype.element_ty)     # the new residual, rounded like torch
        tl.store(res_out_ptr + row * stride_ro + offs, s, mask=mask)
        x = s.to(tl.float32)
    mean_sq = tl.sum(x * x, axis=0) / H
    rstd = 1.0 / tl.sqrt(mean_sq + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None):
    """Same contract as rms_norm_torch: one launch, one program per row of x [..., H]."""
    shape = x.shape
    h = shape[-1]
    x2 = x.reshape(-1, h)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if residual is not None:
        r2 = residual.reshape(-1, h)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        res_out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    else:
        r2, res_out = x2, out                      # unused placeholders
    rows = x2.shape[0]
    block = triton.next_power_of_2(h)
    if rows > 0:
        _rms_norm_kernel[(rows,)](x2, r2, weight, out, res_out, h, x2.stride(0), r2.stride(0),
                                  out.stride(0), res_out.stride(0), eps,
                                  HAS_RES=residual is not None, BLOCK=block,
                                  num_warps=min(max(block // 256, 1), 16))
    out = out.view(shape)
    return out if residual is None else (out, res_out.view(shape))

"""Per-token FP8 quantization of activations: the input of torch._scaled_mm (quantization.py).

A step of several tokens multiplies fp8 weights on the fp8 tensor cores (torch._scaled_mm), so
its activations x [T, K] must be fp8 too: each token's row gets its own scale, max |x| / 448, like
a weight row. In plain torch that is six small kernels (abs, amax, where, divide, clamp, convert)
-- at decode batches, where every launch costs microseconds, more than the matmul itself. The
kernel below does it in one launch: one program per token reads its row once, takes the max,
writes the codes and the scale.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0                      # torch.finfo(torch.float8_e4m3fn).max
MAX_BLOCK = 16384        # one program holds a whole row: K up to this


def quantize_rows_fp8_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (codes [T, K] float8_e4m3fn, scales [T, 1] float32): the reference. Each row
    gets the weight rule of quantization.quantize_fp8 (scale max |x| / 448), without its checks (no
    host sync: it runs inside CUDA graphs; a non-finite activation propagates as nan, as it would
    in bf16)."""
    amax = x.abs().amax(dim=1, keepdim=True).float()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, FP8_MAX_: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    scale = tl.where(amax > 0, amax / FP8_MAX_, 1.0)
    q = tl.minimum(tl.maximum(x / scale, -FP8_MAX_), FP8_MAX_)
    tl.store(q_ptr + row.to(tl.int64) * K + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


def quantize_rows_fp8_triton(x: torch.Tensor):
    """Same contract as quantize_rows_fp8_torch, one launch (rows longer than MAX_BLOCK: torch)."""
    t, k = x.shape
    if k > MAX_BLOCK or t == 0:
        return quantize_rows_fp8_torch(x)
    assert x.stride(-1) == 1
    q = torch.empty((t, k), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((t, 1), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(k)
    _quantize_rows_kernel[(t,)](x, q, s, k, x.stride(0), FP8_MAX_=FP8_MAX, BLOCK=block,
                                num_warps=4 if block <= 4096 else 8)
    return q, s

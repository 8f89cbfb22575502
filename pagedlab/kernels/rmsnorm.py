"""RMSNorm, optionally fused with the residual add that precedes it in every Llama layer."""
from __future__ import annotations

import torch


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

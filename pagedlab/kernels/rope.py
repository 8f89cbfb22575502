"""Rotary position embedding (RoPE), rotate-half convention, with optional llama3 frequency scaling."""
from __future__ import annotations

import math

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp64, with llama3 scaling when `scaling` asks for it."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = old_len / low, old_len / high
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > low_wavelen, inv_freq / factor,
                               torch.where(wavelen < high_wavelen, inv_freq, smoothed))
    elif scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise NotImplementedError(f"RoPE scaling {scaling!r} is not supported (only llama3 and none)")
    return inv_freq


def rope_cos_sin(head_dim: int, theta: float, max_positions: int,
                 scaling: dict | None = None, device=None) -> torch.Tensor:
    """Table [max_positions, head_dim] in fp32: cos in the first half, sin in the second."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float().to(device)


def rope_torch(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor):
    """Rotate q [T, Hq, D] and k [T, Hkv, D], each token at its own position. Returns new tensors."""
    half = q.shape[-1] // 2
    cs = cos_sin[positions]                      # [T, D]
    cos, sin = cs[:, None, :half], cs[:, None, half:]

    def rotate(x):
        x1, x2 = x.float()[..., :half], x.float()[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    return rotate(q), rotate(k)

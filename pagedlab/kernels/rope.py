"""Rotary position embedding (RoPE), rotate-half convention, with optional llama3 frequency scaling.

RoPE rotates each pair (x[i], x[i + D/2]) of a query/key head by the angle pos * inv_freq[i], so
that q.k depends only on the distance between the two tokens. llama3 scaling stretches the low
frequencies (long wavelengths) by `factor` and leaves the high ones alone, smoothing in between;
all of that is baked into the fp32 table cos_sin [max_pos, D] (cos | sin) built once at load time.

In a batch of continuous batching every token has its OWN position (a decode token of a long
sequence next to the 3rd prompt token of a new one), so the kernel looks the angle up per token:
one program per token loads its row of the table once and rotates all Hq query heads and all Hkv
key heads with it (one launch for Q and K). Math in fp32, rounded once to the input dtype.

rope_torch is the reference; rope_triton has the same signature and, like it, returns NEW
tensors (q and k are not modified), contiguous [T, H, D].
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


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


@triton.jit
def _rope_rotate_heads(x_ptr, o_ptr, t, cos, sin, H, stride_xt, stride_xh, stride_ot, stride_oh,
                       HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < H) & (offs_d[None, :] < HALF)
    x_base = x_ptr + t * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    o_base = o_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    x1 = tl.load(x_base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_base + HALF, mask=mask, other=0.0).to(tl.float32)
    c = cos[None, :]
    s = sin[None, :]
    tl.store(o_base, (x1 * c - x2 * s).to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(o_base + HALF, (x2 * c + x1 * s).to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, cs_ptr, HQ, HKV,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh,
                 stride_kot, stride_koh, stride_cs,
                 HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
                 BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    dmask = offs_d < HALF
    cos = tl.load(cs_ptr + pos * stride_cs + offs_d, mask=dmask, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + offs_d, mask=dmask, other=0.0).to(tl.float32)
    _rope_rotate_heads(q_ptr, qo_ptr, t, cos, sin, HQ, stride_qt, stride_qh, stride_qot, stride_qoh,
                       HALF, BLOCK_HQ, BLOCK_HALF)
    _rope_rotate_heads(k_ptr, ko_ptr, t, cos, sin, HKV, stride_kt, stride_kh, stride_kot, stride_koh,
                       HALF, BLOCK_HKV, BLOCK_HALF)


def rope_triton(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor):
    """Same contract as rope_torch: returns new rotated (q, k); the inputs are left untouched.
    q and k may be strided views (e.g. slices of a fused QKV projection) as long as D is contiguous."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if cos_sin.stride(-1) != 1:
        cos_sin = cos_sin.contiguous()
    qo = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    ko = torch.empty((t, hkv, d), dtype=k.dtype, device=k.device)
    half = d // 2
    if t > 0:
        _rope_kernel[(t,)](q, k, qo, ko, positions, cos_sin, hq, hkv,
                           q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                           qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1), cos_sin.stride(0),
                           HALF=half, BLOCK_HQ=triton.next_power_of_2(hq),
                           BLOCK_HKV=triton.next_power_of_2(hkv),
                           BLOCK_HALF=triton.next_power_of_2(half), num_warps=4)
    return qo, ko

"""Counter-based noise for sampling: uniform (0, 1) numbers that are a pure function of (seed,
position, token id), so a request's sampled token depends on the request alone -- never on its
batch, the step it lands in or the order of launches (sampling.sample draws with it by the
Gumbel-max trick; kernels/gumbel_sample.py does the same in one Triton pass). Plain torch, any
device: a 32-bit integer mixer over int64 tensors.
"""
from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer on int64 tensors (values stay below 2**63: no overflow)."""
    x = x & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def counter_bits(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """32 random bits [B, V] (int64 in [0, 2**32)), a pure function of (seed, position, token id)."""
    row = _hash32(_hash32(seeds) ^ _hash32(positions * 0x2545F491 + 0x9E3779B9))
    col = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    return _hash32(row[:, None] ^ _hash32(col * 0x27D4EB2D + 0x165667B1)[None, :])


_BELOW_ONE = 1.0 - 2.0**-24            # the largest float32 below 1


def counter_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform (0, 1) noise [B, V], a pure function of (seed, position, token id).
    Strictly below 1: in float32, (bits + 0.5) / 2**32 rounds to exactly 1.0 for the top ~2**-24 of
    the bits (one token in ~17M: about one sampling step in 130 at a 128k vocabulary), whose Gumbel
    noise would be +inf and pick that token whatever its logit -- or NaN, and still pick it, when
    top-k / top-p had masked it. Those values are clamped to the float32 just below 1."""
    u = (counter_bits(seeds, positions, vocab_size).float() + 0.5) / 4294967296.0
    return u.clamp_(max=_BELOW_ONE)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [B, V] from counter_uniform: argmax(logits / t + this) draws from
    softmax(logits / t) (the Gumbel-max trick)."""
    return -torch.log(-torch.log(counter_uniform(seeds, positions, vocab_size)))

"""Choosing the next token: greedy, temperature, top-k, top-p -- batched on the device.

Every row of the logits may have its own settings. Randomness is counter-based: the noise for
(request seed, position, token) is a hash of those three numbers, so a request with a seed gives the
same tokens whatever else shares its batch, its slot, or the step it runs in -- and no Python loop
over sequences is needed. Only the chosen token ids leave the device.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

_M32 = 0xFFFFFFFF


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0          # 0 -> greedy
    top_k: int = 0                    # 0 -> off
    top_p: float = 1.0                # 1 -> off
    seed: int | None = None           # None -> drawn from the engine's seed
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        def bad(msg):
            raise ValueError(f"SamplingParams: {msg}")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            bad(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0 or self.temperature == float("inf"):
            bad(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            bad(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            bad(f"seed must be an integer or None, got {self.seed!r}")
        self.stop_token_ids = list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer on int64 tensors (values stay below 2**63: no overflow)."""
    x = x & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def counter_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform (0, 1) noise [B, V], a pure function of (seed, position, token id)."""
    row = _hash32(_hash32(seeds) ^ _hash32(positions * 0x2545F491 + 0x9E3779B9))
    col = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    bits = _hash32(row[:, None] ^ _hash32(col * 0x27D4EB2D + 0x165667B1)[None, :])
    return (bits.float() + 0.5) / 4294967296.0


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seeds: torch.Tensor, positions: torch.Tensor, all_greedy: bool = False,
           any_top_filter: bool = True) -> torch.Tensor:
    """logits [B, V] fp32 -> token ids [B] (int64, on the device). Rows with temperature 0 are greedy.
    all_greedy / any_top_filter are host-side facts the caller knows (they skip work without a sync)."""
    greedy = logits.argmax(dim=-1)
    if all_greedy:
        return greedy
    b, v = logits.shape
    t = temperature.clamp(min=1e-5)[:, None]
    scaled = logits / t
    if any_top_filter:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        rank = torch.arange(v, device=logits.device)[None, :]
        k = torch.where(top_k > 0, top_k, v)[:, None]
        drop = rank >= k
        probs = sorted_logits.softmax(dim=-1)
        drop |= (probs.cumsum(dim=-1) - probs) > top_p[:, None]      # keep the smallest set reaching p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.empty_like(scaled).scatter_(1, order, sorted_logits)
    gumbel = -torch.log(-torch.log(counter_uniform(seeds, positions, v)))
    sampled = (scaled + gumbel).argmax(dim=-1)
    return torch.where(temperature > 0, sampled, greedy)

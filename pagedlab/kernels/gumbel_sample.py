"""Sampling in one pass: each row's token = argmax(logits / temperature + Gumbel noise).

sampling.sample() draws a token by the Gumbel-max trick with noise that is a pure function of
(seed, position, token id) (counter_noise.counter_uniform): the token depends on the request alone,
never on its batch. In torch that is ~30 elementwise passes over a [B, V] tensor -- the 32-bit hash
on int64, the uniform, two logs, the add -- and at B = 256, V = 128,256 each pass moves 130-260 MB:
on the H200 a sampled decode step of the serving burst took 4.3 ms against 1.8 ms greedy
(docs/serving.md, session 20). The kernel below reads the logits once and keeps everything else in
registers: per tile of the vocabulary it hashes the token ids, makes the noise, adds it and keeps
the running (max, index).

The arithmetic is torch's, bit for bit where it can be: the hash in uint32 (torch keeps the low 32
bits of int64 products: the same bits), the uniform as (bits + 0.5) / 2**32 clamped below 1,
division and log rounded as torch's CUDA kernels round them (div_rn, libdevice's logf). Ties go to
the lowest token id, as torch.argmax.

gumbel_argmax_torch is the reference (sampling.sample without top-k / top-p / min-p, also the CPU
path); gumbel_argmax_triton has the same signature. Launch: a grid of (rows, splits of the
vocabulary) so that a few rows still fill the GPU; each program writes its split's (max, index)
and a torch argmax over the splits picks the row's token (the first split on a tie: the lowest id).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .counter_noise import gumbel_noise
from .launch import sm_count

from triton.language.extra import libdevice      # its logf is what torch's CUDA log calls

BLOCK = 2048                          # vocabulary entries per tile
MIN_SPLIT = 4 * BLOCK                 # a split is at least this many entries


def gumbel_argmax_torch(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                        positions: torch.Tensor) -> torch.Tensor:
    """logits [B, V] fp32 -> token ids [B] int64: greedy where temperature <= 0, else the Gumbel-max
    draw of sampling.sample (no top-k / top-p / min-p): argmax(logits / t + Gumbel noise)."""
    greedy = logits.argmax(dim=-1)
    scaled = logits / temperature.clamp(min=1e-5)[:, None]
    gumbel = gumbel_noise(seeds, positions, logits.shape[1])
    return torch.where(temperature > 0, (scaled + gumbel).argmax(dim=-1), greedy)


@triton.jit
def _mix(x):
    """counter_noise._hash32 on uint32 (wrapping products keep the same low 32 bits)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B
    x = ((x >> 16) ^ x) * 0x45D9F3B
    return (x >> 16) ^ x


@triton.jit
def _log(x, LIBDEVICE: tl.constexpr):
    """logf as torch's CUDA kernels call it (libdevice); tl.log where there is no libdevice (the
    interpreter, whose numpy log is what torch's CPU log is checked against)."""
    if LIBDEVICE:
        return libdevice.log(x)
    return tl.log(x)


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, stride, temp_ptr, seed_ptr, pos_ptr, val_ptr, idx_ptr,
                          V, CHUNK, SPLITS, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(1)
    t = tl.load(temp_ptr + row)
    seed = tl.load(seed_ptr + row).to(tl.uint32)
    pos = tl.load(pos_ptr + row).to(tl.uint32)
    row_bits = _mix(_mix(seed) ^ _mix(pos * 0x2545F491 + 0x9E3779B9))
    sampled = t > 0
    t = tl.maximum(t, 1e-5)
    base = logits_ptr + row.to(tl.int64) * stride
    start = split * CHUNK
    end = tl.minimum(start + CHUNK, V)
    best = tl.full([], float("-inf"), tl.float32)
    best_i = start
    for v0 in range(start, end, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        mask = cols < end
        x = tl.load(base + cols, mask=mask, other=float("-inf"))
        if sampled:
            bits = _mix(row_bits ^ _mix(cols.to(tl.uint32) * 0x27D4EB2D + 0x165667B1))
            u = (bits.to(tl.float32) + 0.5) * 2.3283064365386963e-10         # / 2**32, exact
            u = tl.minimum(u, 0.99999994039535522461)                        # 1 - 2**-24
            x = tl.math.div_rn(x, t) - _log(-_log(u, LIBDEVICE), LIBDEVICE)
            x = tl.where(mask, x, float("-inf"))
        m = tl.max(x, axis=0)
        i = tl.argmax(x, axis=0, tie_break_left=True)
        if m > best:
            best = m
            best_i = v0 + i
    tl.store(val_ptr + row * SPLITS + split, best)
    tl.store(idx_ptr + row * SPLITS + split, best_i.to(tl.int64))


def plan_splits(rows: int, vocab: int, device: torch.device) -> tuple[int, int]:
    """(splits, entries per split): about two programs per SM over all rows, each split a whole
    number of tiles and at least MIN_SPLIT entries."""
    splits = max(1, min(triton.cdiv(2 * sm_count(device), max(rows, 1)), vocab // MIN_SPLIT))
    chunk = triton.cdiv(triton.cdiv(vocab, splits), BLOCK) * BLOCK
    return triton.cdiv(vocab, chunk), chunk


def gumbel_argmax_triton(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                         positions: torch.Tensor) -> torch.Tensor:
    """Same contract as gumbel_argmax_torch: one launch and one small argmax over the splits."""
    b, v = logits.shape
    if b == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    splits, chunk = plan_splits(b, v, logits.device)
    vals = torch.empty(b, splits, dtype=torch.float32, device=logits.device)
    idx = torch.empty(b, splits, dtype=torch.int64, device=logits.device)
    _gumbel_argmax_kernel[(b, splits)](
        logits, logits.stride(0), temperature.float().contiguous(), seeds.contiguous(),
        positions.contiguous(), vals, idx, v, chunk, splits, BLOCK=BLOCK,
        LIBDEVICE=logits.device.type == "cuda", num_warps=8)
    if splits == 1:
        return idx[:, 0]
    return idx.gather(1, vals.argmax(dim=1, keepdim=True))[:, 0]

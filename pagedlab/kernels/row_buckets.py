"""Matmuls at a few row counts: cuBLAS pays for every shape it has not seen.

A step with prompt tokens in it runs eagerly (CUDA graphs hold only the decode steps): each of
its matmuls multiplies [T, K] activations by a weight, T = the tokens in the step. In a server T
is new almost every step -- requests arrive in different groups each burst -- and cuBLAS chooses
a kernel for every new (T, N, K) the first time it meets it. Measured on the H200 (torch 2.11,
2026-12-01): a bf16 [T, 2048] x [2048, 8192] matmul took 357 us at a T it had not seen and 169 us
at one it had (addmm with the residual: 502 vs 373 us). Llama-3.2-1B runs 65 matmuls a step, so a
step of a new size paid ~10 ms more: the same 512-request burst's mixed steps took 21 ms (p50) in a
server's first burst and 12 ms in a second offline pass whose step sizes all repeated.

So: past SMALL_ROWS, T is rounded up to one of 8 sizes per power of two (at most 12.5% more rows).
The runner pads a whole eager step once, on its host lists (padding tokens that store no K/V and
attend to nothing, runner._host_inputs), so every kernel of the step already meets a bucketed
count; `linear_rows` pads (zero rows, outputs dropped) only a matmul that arrives unpadded -- a
pad per matmul costs two copies, and the ~95 of a step were 2.3 ms of its 18 ms of host time under
cProfile on the H200 (such a step is launch-bound: 10.4 ms host, 10.6 ms GPU). Every size a
process can meet is run once, for each weight shape, the first time that shape is used outside a
CUDA graph capture
(`_warm`: ~300 sizes; the engine's own warm-up at load comes through here first). Up to
SMALL_ROWS rows (decode batches) nothing is padded: those sizes are warmed as they are; nor is
anything inside a CUDA graph capture (a graph's shapes are fixed: cuBLAS chooses once, at capture).
Only on CUDA; the CPU path is plain F.linear / addmm.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

SMALL_ROWS = 256          # up to here: exact row counts (each warmed); above: 8 buckets per octave
MAX_ROWS = 8192           # warmed up to this many rows (max_num_batched_tokens' default)...
WARM_BYTES = 128 << 20    # ...or fewer, so that no warm-up operand passes this (the LM head: 512)


def bucket_rows(m: int) -> int:
    """The row count a matmul of m rows runs at: m itself up to SMALL_ROWS, else m rounded up to a
    multiple of 2^(floor(log2 m) - 3) (8 sizes per power of two, <= 12.5% padding)."""
    if m <= SMALL_ROWS:
        return m
    step = 1 << (m.bit_length() - 4)
    return -(-m // step) * step


def all_buckets(max_rows: int = MAX_ROWS) -> list[int]:
    """Every row count bucket_rows returns for 1..max_rows (those of at most max_rows)."""
    out, m = list(range(1, min(SMALL_ROWS, max_rows) + 1)), SMALL_ROWS + 1
    while bucket_rows(m) <= max_rows:
        out.append(bucket_rows(m))
        m = out[-1] + 1
    return out


_warmed: set = set()      # (N, K, dtype, device, residual?) whose every bucket ran in this process


def _warm(x: torch.Tensor, w: torch.Tensor, residual: bool) -> None:
    key = (w.shape[0], w.shape[1], w.dtype, x.dtype, str(x.device), residual)
    if key in _warmed or torch.cuda.is_current_stream_capturing():
        return
    _warmed.add(key)
    n, k = w.shape
    rows = max(1, min(MAX_ROWS, WARM_BYTES // (max(n, k) * x.element_size())))
    xs = torch.zeros((rows, k), dtype=x.dtype, device=x.device)
    out = torch.zeros((rows, n), dtype=x.dtype, device=x.device) if residual else None
    for m in all_buckets(rows):
        if residual:
            torch.addmm(out[:m], xs[:m], w.t())
        else:
            F.linear(xs[:m], w)
    del xs, out


def linear_rows(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w^T (+ residual) for x [T, K], w [N, K], run at bucket_rows(T) rows on CUDA."""
    if not x.is_cuda or x.dim() != 2:
        return F.linear(x, w) if residual is None else torch.addmm(residual, x, w.t())
    _warm(x, w, residual is not None)
    pad = bucket_rows(x.shape[0]) - x.shape[0]
    if pad and torch.cuda.is_current_stream_capturing():
        pad = 0             # a CUDA graph fixes its shapes once: padding would only add kernels to it
    return padded_linear(x, w, residual, pad)


def padded_linear(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None, pad: int) -> torch.Tensor:
    """x @ w^T (+ residual) computed on x with `pad` zero rows appended; the first rows returned."""
    if pad == 0:
        return F.linear(x, w) if residual is None else torch.addmm(residual, x, w.t())
    m = x.shape[0]
    xp = F.pad(x, (0, 0, 0, pad))
    if residual is None:
        return F.linear(xp, w)[:m]
    return F.pad(residual, (0, 0, 0, pad)).addmm_(xp, w.t())[:m]

"""Notebook 14's hands-on piece and its check: per-channel FP8 quantization.

    quantize_fp8, dequantize_fp8 = quant_course.check_fp8(quantize_fp8, dequantize_fp8)

`check_fp8` runs the learner's `quantize_fp8(w) -> (q, scale)` and `dequantize_fp8(q, scale)` and
pagedlab's (pagedlab.quantization) on the same weights -- random irregular shapes, rows of very
different magnitudes, bf16 input, an all-zero matrix, a zero row, an outlier -- and compares codes,
scales and round trips exactly; a weight holding inf or nan must be refused with a ValueError.
A mistake raises `CheckFailed` (pagedlab.checks) with the case, what was expected and what was
found, and a hint naming the likely bug.

The solutions live with the notebooks, in notebooks/solutions/pieces_quant.py; with
PAGEDLAB_SOLUTIONS=1 the check runs them instead of the learner's code.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..quantization import FP8_DTYPE, FP8_MAX, dequantize_fp8, quantize_fp8
from .chapter import Chapter, CheckFailed

# the solutions: notebooks/solutions/pieces_quant.py ("quantize_fp8", "dequantize_fp8")
chapter = Chapter("pieces_quant.py", module="quant_course")
solution, show_solution = chapter.solution, chapter.show_solution


def _cases():
    """(name, weight) pairs: what per-channel FP8 must get exactly right."""
    g = torch.Generator().manual_seed(14)
    out = []
    for n, k in ((1, 1), (7, 13), (33, 250)):
        out.append((f"random {n}x{k}", torch.randn(n, k, generator=g)))
    out.append(("rows of magnitudes 1e-6 .. 1e3", torch.randn(10, 40, generator=g) * torch.logspace(-6, 3, 10)[:, None]))
    out.append(("bf16 input", (torch.randn(6, 30, generator=g) * 0.02).to(torch.bfloat16)))
    out.append(("all zeros", torch.zeros(4, 9)))
    w = torch.randn(5, 20, generator=g)
    w[2] = 0.0
    out.append(("a zero row among others", w))
    w = torch.randn(6, 64, generator=g)
    w[1, 7] = 1e4
    out.append(("an outlier (1e4) in row 1", w))
    out.append(("all negative", -torch.rand(3, 17, generator=g) - 0.5))
    return out


def _hint_scale(w, mine, ref) -> str:
    w32 = w.float()
    if mine.shape != ref.shape:
        return ("one scale per OUTPUT row (channel): scale has one value per row of w, shape "
                "[rows] -- amax over dim=1, not over the whole tensor or over the columns")
    if torch.isnan(mine).any() or torch.isinf(mine).any() or (mine == 0).any():
        return ("an all-zero row has amax 0: dividing by a zero scale gives nan. Give such a row "
                "the scale 1.0 (its codes are all 0 anyway): torch.where(amax > 0, amax / 448, 1.0)")
    if len(ref) > 1 and torch.allclose(mine, w32.abs().amax() / FP8_MAX * torch.ones_like(mine)):
        return "that is ONE scale for the whole tensor (per-tensor): take the max of each row (dim=1)"
    top = w32.amax(1) == w32.abs().amax(1)              # rows whose largest value is their largest magnitude
    if torch.allclose(mine[top], ref[top]) and not torch.allclose(mine[~top], ref[~top]):
        return "the scale must come from the largest MAGNITUDE of the row: w.abs().amax(dim=1), not w.amax(dim=1)"
    if torch.allclose(mine, ref * FP8_MAX ** 2) or torch.allclose(mine, 1 / ref):
        return "scale = amax / 448 (so that w / scale fills [-448, 448]), not amax * 448 or 448 / amax"
    return "scale[n] = max_k |w[n, k]| / 448 in float32 (448 = torch.finfo(torch.float8_e4m3fn).max)"


ROWS_HINT = ("Hint: a [rows] tensor of scales meets a [rows, columns] weight only as scale[:, None] (one "
             "value per row, broadcast over the columns); scale of shape [columns] (amax over dim=0) or a "
             "bare `* scale` pairs each COLUMN with a scale")


def _call(fn, name, *args):
    """chapter.call, with the hint for the usual shape mistake when the shapes do not broadcast."""
    try:
        return chapter.call(fn, name, *args)
    except CheckFailed as e:
        if "must match the size of tensor" in str(e) or "broadcast" in str(e):
            raise CheckFailed(f"{e}\n{ROWS_HINT}") from None
        raise


def _hint_codes(mine, ref, scale) -> str:
    m, r = mine.float(), ref.float()
    if torch.isnan(m).any():
        return ("nan codes: a value beyond +-448 has no e4m3fn code (no infinities) and becomes nan. "
                "Clamp w / scale to [-448, 448] before .to(torch.float8_e4m3fn) -- the division can "
                "round just past 448 -- and give an all-zero row a nonzero scale")
    if torch.equal(m.t() if m.shape[::-1] == r.shape else m, r) and m.shape != r.shape:
        return "the codes have the transposed shape: keep w's [rows, columns] layout"
    return ("codes = (w / scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn): divide each ROW "
            "by its own scale (scale[:, None] broadcasts over the columns; scale[None, :] would mix rows)")


def check_fp8(quantize, dequantize):
    """Check the learner's per-channel FP8 quantize / dequantize against pagedlab.quantization."""
    quantize = chapter.pick(quantize, "quantize_fp8")
    dequantize = chapter.pick(dequantize, "dequantize_fp8")
    for name, w in _cases():
        ref_q, ref_s = quantize_fp8(w)
        got = _call(quantize, "quantize_fp8", w.clone())
        if not (isinstance(got, tuple) and len(got) == 2):
            raise CheckFailed(f"quantize_fp8 ({name}) must return (codes, scale), got {type(got).__name__}")
        q, s = got
        if not torch.is_tensor(q) or q.dtype != FP8_DTYPE:
            raise CheckFailed(f"quantize_fp8 ({name}): codes must be a {FP8_DTYPE} tensor, got "
                              f"{getattr(q, 'dtype', type(q).__name__)}.\nHint: end with .to(torch.float8_e4m3fn)")
        if q.shape != w.shape:
            raise CheckFailed(f"quantize_fp8 ({name}): codes of shape {tuple(q.shape)}, expected {tuple(w.shape)}.\n"
                              f"Hint: {_hint_codes(q, ref_q, ref_s)}")
        if not torch.is_tensor(s) or s.dtype != torch.float32:
            raise CheckFailed(f"quantize_fp8 ({name}): scale must be a float32 tensor, got "
                              f"{getattr(s, 'dtype', type(s).__name__)}.\nHint: compute it from w.float()")
        if s.shape != ref_s.shape or not torch.allclose(s, ref_s, rtol=1e-6, atol=0):
            raise CheckFailed(f"quantize_fp8 ({name}): scale {s.flatten()[:6].tolist()}..., expected "
                              f"{ref_s[:6].tolist()}...\nHint: {_hint_scale(w, s.flatten(), ref_s)}")
        if not torch.equal(q.float(), ref_q.float()):
            bad = (q.float() != ref_q.float()).nonzero()[0].tolist()
            raise CheckFailed(f"quantize_fp8 ({name}): code at {bad} is {q.float()[tuple(bad)].item()}, expected "
                              f"{ref_q.float()[tuple(bad)].item()} (w = {w.float()[tuple(bad)].item():.6g}, "
                              f"scale {ref_s[bad[0]].item():.6g}).\nHint: {_hint_codes(q, ref_q, ref_s)}")
        back = _call(dequantize, "dequantize_fp8", ref_q, ref_s)
        ref_back = dequantize_fp8(ref_q, ref_s)
        if not torch.is_tensor(back) or back.shape != w.shape or not torch.allclose(back.float(), ref_back, rtol=1e-6, atol=0):
            raise CheckFailed(f"dequantize_fp8 ({name}): does not give the codes times their row's scale.\n"
                              f"Hint: q.float() * scale[:, None] (convert the codes first: fp8 has almost "
                              f"no arithmetic of its own)")
    for bad in (float("inf"), float("nan")):
        w = torch.randn(4, 8)
        w[1, 3] = bad
        try:
            quantize(w)
        except NotImplementedError as e:
            raise CheckFailed(chapter.not_written("quantize_fp8", e)) from None
        except ValueError:
            continue
        except Exception as e:
            raise CheckFailed(f"quantize_fp8 on a weight holding {bad} raised {type(e).__name__}: {e}, "
                              f"not a ValueError") from None
        raise CheckFailed(f"quantize_fp8 accepted a weight holding {bad}.\nHint: an inf would make its row's "
                          f"scale inf and every code of the row 0 or nan -- silently. Refuse it: if not "
                          f"torch.isfinite(w).all(): raise ValueError(...) saying where")
    chapter.passed("quantize_fp8 / dequantize_fp8", f"{len(_cases())} cases equal pagedlab's codes, scales "
                  "and round trips (zeros, an outlier, bf16 input); inf and nan refused")
    return quantize, dequantize


# -- the committed H200 measurement ------------------------------------------------------------

def load_fp8_speed(path: str | Path | None = None) -> dict | None:
    """docs/fp8_speed.json (the lab's run on an H200: bench fp8), or None when it is not here."""
    from .data import load_json
    return load_json("fp8_speed.json", path)


def weight_bytes_per_token(config, bytes_per_weight: float) -> dict:
    """Bytes one decode step at batch 1 reads for `config`'s weights: every linear weight (the
    LM head included; with tied embeddings it is the lookup table read whole), one embedding row,
    the norms (bf16: 2 bytes) and, in FP8, one fp32 scale per output row."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    rows = config.num_layers * ((q + 2 * kv) + h + 2 * i + h) + v
    linear = config.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * i) + v * h
    scales = 4 * rows if bytes_per_weight < 2 else 0
    norms = 2 * (2 * config.num_layers + 1) * h
    return dict(linear=linear * bytes_per_weight, scales=scales, norms=norms, embed_row=2 * h,
                total=linear * bytes_per_weight + scales + norms + 2 * h)

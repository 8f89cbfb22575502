"""Notebook 14's piece: per-channel FP8 quantization (checked by pagedlab.course.quant.check_fp8)."""
import torch

FP8_MAX = 448.0        # torch.finfo(torch.float8_e4m3fn).max


def quantize_fp8(w):
    """w [N, K] -> (codes [N, K] float8_e4m3fn, scale [N] float32): one scale per output row."""
    w = w.float()
    if not torch.isfinite(w).all():
        n, k = (int(i) for i in (~torch.isfinite(w)).nonzero()[0])
        raise ValueError(f"cannot quantize to FP8: non-finite value {w[n, k].item()} at [{n}, {k}]")
    amax = w.abs().amax(dim=1)                                        # each row's largest magnitude
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))   # a zero row: scale 1
    codes = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def dequantize_fp8(codes, scale):
    """(codes [N, K], scale [N]) -> w [N, K] in float32."""
    return codes.float() * scale[:, None]

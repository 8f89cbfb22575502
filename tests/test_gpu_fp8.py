"""The fused decode-time linear layers (kernels/gemv.py) with FP8 weights (quantization.FP8Weight)
against a float64 reference on the DEQUANTIZED weights: the kernels must add nothing to the error
the quantization itself makes.

On a GPU (sm89+, `-m gpu`): bf16 activations at Llama-3.2-1B shapes and at irregular ones. On the
CPU the same kernels run in Triton's interpreter (which loads float8 e4m3fn and converts it
exactly) in fp32 at small irregular shapes. Each case also runs above MAX_ROWS, the composed path:
on the CPU the fp8 codes converted to the activation dtype, the matmul, the scale per output
column; on a GPU (K and N multiples of 16) torch._scaled_mm on activations quantized per token,
whose reference is the same arithmetic in fp64 (quantization.activations_mode("fp8-reference"))
on the same bf16 activations: the norm's output rounded to bf16 before it is quantized, as the GPU
does (quantizing the fp64 norm instead flips a few percent of the codes by a step: ~1-2% apart).
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagedlab.kernels import gemv  # noqa: E402
from pagedlab.kernels.activation import silu_and_mul_torch  # noqa: E402
from pagedlab.kernels.kv_store import kv_store_torch  # noqa: E402
from pagedlab.kernels.rmsnorm import rms_norm_torch  # noqa: E402
from pagedlab.kernels.rope import rope_cos_sin, rope_torch  # noqa: E402
from pagedlab.quantization import (FP8Weight, activations_mode, quantize_weight,  # noqa: E402
                                   scaled_mm_works)

GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float32
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}[DTYPE]
# (hidden, intermediate, Hq, Hkv, D, vocab)
SMALL = [(200, 344, 6, 2, 32, 333)]
LARGE = [(2048, 8192, 32, 8, 64, 128256), (1000, 2730, 12, 4, 64, 5003)]
gpu_only = [pytest.mark.gpu, pytest.mark.skipif(not GPU, reason="needs a CUDA GPU of sm89+")]
SHAPES = ([pytest.param(s, id="small") for s in SMALL] +
          [pytest.param(s, id=f"h{s[0]}", marks=gpu_only) for s in LARGE])
SPLIT = dict(BLOCK_R=8, K_SPLIT=64, BLOCK_K=32, num_warps=4, num_stages=2)   # split-K even when small
CONFIGS = {"default": {}, "split": {"config": SPLIT}}
# (launch config, tokens): the fused kernel at 1 and 3 tokens, with the default tiles and with
# split-K; the composed path above MAX_ROWS (the interpreter is slow: not every pair on the CPU)
CASES = [("default", 1), ("default", 3), ("split", 3), ("default", gemv.MAX_ROWS + 3)] + \
    ([("split", 1)] if DEV == "cuda" else [])
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

if DEV == "cuda" and not GPU:
    pytest.skip("FP8 kernels need sm89+", allow_module_level=True)


def rand(*shape, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(DTYPE).to(DEV)


def fp8_weight(n, k, gen, scale):
    """Random [n, k] weight with the cases quantization must survive: one all-zero row, rows of
    very different magnitudes (a 1000x row), one large outlier inside a row."""
    w = torch.randn(n, k, generator=gen) * scale
    w[n // 3] = 0.0
    w[n // 2] *= 1000.0
    w[n - 1, k // 2] = 50.0 * scale
    return quantize_weight(w.to(DEV))


def f64(t):
    return t.dequantize(torch.float64) if isinstance(t, FP8Weight) else t.double()


def check(out, ref):
    assert torch.isfinite(out).all()
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < TOL, f"relative error {err:.3g} >= {TOL}"


def fused(t):
    return t <= gemv.MAX_ROWS


def w8a8(t, w):
    """Whether the launcher's matmul quantized its activations (quantization.fp8_linear's auto)."""
    n, k = w.shape
    return not fused(t) and k % 16 == 0 and n % 16 == 0 and scaled_mm_works(DEV)


def reference_mode(t, w):
    return "fp8-reference" if w8a8(t, w) else "keep"


def norm_ref(t, w):
    """The reference's RMSNorm: fp64, rounded to the activation dtype where the GPU quantizes it."""
    if w8a8(t, w):
        return lambda x, g, eps: rms_norm_torch(x, g, eps).to(DTYPE).double()
    return rms_norm_torch


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("config,t", CASES)
def test_fp8_linear_residual(config, shape, t):
    gen = torch.Generator().manual_seed(t)
    hidden, inter = shape[:2]
    for k, n in [(hidden, hidden), (inter, hidden)]:
        x, w, r = rand(t, k, gen=gen), fp8_weight(n, k, gen, k ** -0.5), rand(t, n, gen=gen)
        out = gemv.linear_residual_triton(x, w, r, fused=fused(t), **CONFIGS[config])
        assert out.shape == (t, n) and out.dtype == DTYPE
        with activations_mode(reference_mode(t, w)):
            check(out, gemv.linear_residual_torch(f64(x), w, f64(r)))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("config,t", CASES)
def test_fp8_norm_swiglu(config, shape, t):
    gen = torch.Generator().manual_seed(10 + t)
    hidden, inter = shape[:2]
    x, g = rand(t, hidden, gen=gen, scale=3.0), rand(hidden, gen=gen)
    w = fp8_weight(2 * inter, hidden, gen, hidden ** -0.5)
    out = gemv.norm_swiglu_triton(x, g, 1e-5, w, fused=fused(t), **CONFIGS[config])
    assert out.shape == (t, inter) and out.dtype == DTYPE
    with activations_mode(reference_mode(t, w)):
        check(out, silu_and_mul_torch(gemv.linear(norm_ref(t, w)(f64(x), f64(g), 1e-5), w)))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("config,t", CASES)
def test_fp8_norm_lm_head(config, shape, t):
    gen = torch.Generator().manual_seed(20 + t)
    hidden, vocab = shape[0], shape[5]
    x, g = rand(t, hidden, gen=gen, scale=0.5), rand(hidden, gen=gen)
    w = fp8_weight(vocab, hidden, gen, 0.05)
    logits, tokens = gemv.norm_lm_head_triton(x, g, 1e-5, w, greedy=True, fused=fused(t), **CONFIGS[config])
    assert logits.shape == (t, vocab) and logits.dtype == torch.float32
    with activations_mode(reference_mode(t, w)):
        check(logits, gemv.linear(norm_ref(t, w)(f64(x), f64(g), 1e-5), w))
    assert torch.equal(tokens, logits.argmax(-1))         # the in-kernel argmax of the same logits


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("config,t", CASES)
def test_fp8_norm_qkv_rope_store(config, shape, t):
    gen = torch.Generator().manual_seed(30 + t)
    hidden, _, hq, hkv, d, _ = shape
    x, g = rand(t, hidden, gen=gen, scale=2.0), rand(hidden, gen=gen)
    w = fp8_weight((hq + 2 * hkv) * d, hidden, gen, hidden ** -0.5)
    cos_sin = rope_cos_sin(d, 500000.0, 40000, LLAMA3_SCALING, device=DEV)
    positions = torch.randint(0, 40000, (t,), generator=gen).to(DEV)
    bs, nb = 5, t // 5 + 3
    k_cache, v_cache = rand(nb, bs, hkv, d, gen=gen), rand(nb, bs, hkv, d, gen=gen)
    slots = torch.randperm(nb * bs, generator=gen)[:t].to(DEV)
    kc, vc = k_cache.clone(), v_cache.clone()
    q = gemv.norm_qkv_rope_store_triton(x, g, 1e-5, w, positions, cos_sin, kc, vc, slots, hq,
                                        fused=fused(t), **CONFIGS[config])
    kr, vr = f64(k_cache), f64(v_cache)
    with activations_mode(reference_mode(t, w)):
        qr = gemv._qkv_composed(norm_ref(t, w), rope_torch, kv_store_torch, f64(x), f64(g), 1e-5, w,
                                positions, cos_sin.double(), kr, vr, slots, hq)
    assert q.shape == (t, hq, d) and q.dtype == DTYPE
    check(q, qr)
    flat = lambda c: c.reshape(-1, hkv, d)   # noqa: E731
    check(flat(kc)[slots], flat(kr)[slots])
    check(flat(vc)[slots], flat(vr)[slots])


def test_fp8_kernels_read_the_scale_of_each_row():
    """A weight whose rows differ only in their scale: every output is its row's scale times the
    same dot product -- a kernel that applied one row's scale to another (or none) fails here."""
    gen = torch.Generator().manual_seed(3)
    k, n = 200, 37
    codes = (torch.randn(1, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.logspace(-4, 3, n)
    w = FP8Weight(codes.expand(n, k).contiguous().to(DEV), scale.to(DEV))
    x, r = rand(1, k, gen=gen), torch.zeros(1, n, dtype=DTYPE, device=DEV)
    out = gemv.linear_residual_triton(x, w, r, config=SPLIT, fused=True).double()
    dot = (x.double() @ codes.double().to(DEV).t()).item()
    check(out, dot * scale.double().to(DEV)[None, :])


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="Triton's interpreter rounds fp32 -> fp8 wrongly at powers of two")
@pytest.mark.parametrize("shape", [(1, 2048), (19, 8192), (5, 1000), (256, 3000)])
def test_quantize_rows_kernel(shape):
    """The one-launch per-token quantization of activations gives torch's codes and scales."""
    from pagedlab.kernels.quant_fp8 import quantize_rows_fp8_torch, quantize_rows_fp8_triton
    gen = torch.Generator().manual_seed(shape[0])
    x = (torch.randn(*shape, generator=gen) * torch.logspace(-4, 3, shape[0])[:, None]).to(DTYPE).to(DEV)
    x[shape[0] // 2] = 0.0
    q, s = quantize_rows_fp8_triton(x)
    qr, sr = quantize_rows_fp8_torch(x)
    assert torch.equal(s, sr)
    assert torch.equal(q.float(), qr.float())

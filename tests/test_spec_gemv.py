"""The fused decode kernels for a speculative verify step's few rows (kernels/gemv.py fused_rows):
inside fused_rows("fma"), steps of 2..8 tokens run the fused kernels with each token against the
weight tile as loaded; inside fused_rows("dot"), steps of 2..16 tokens of a 16-bit model run them
with their rows padded to 16 (tensor-core dots) -- instead of cuBLAS + the separate small kernels.
Checked against the plain-torch references in fp64 on the same (rounded) inputs; on CPU under the
Triton interpreter in fp16 / fp32 at small irregular shapes, on a GPU in bf16 at Llama-3.2-1B's.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagedlab.kernels import gemv  # noqa: E402
from pagedlab.kernels.rope import rope_cos_sin  # noqa: E402

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
DTYPE = torch.bfloat16 if GPU else torch.float16
TOL = 1e-2 if GPU else 5e-3
# (hidden, intermediate, Hq, Hkv, D, vocab)
SHAPE = (2048, 8192, 32, 8, 64, 128256) if GPU else (200, 344, 6, 2, 32, 1001)


def rand(*shape, dtype=DTYPE, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEV)


def check(out, ref):
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all()
    err = ((out - ref).norm() / ref.norm()).item()
    assert err < TOL, f"relative error {err:.3g} >= {TOL}"


@pytest.fixture
def launches(monkeypatch):
    """The BLOCK_M of each fused launch (none: the composed cuBLAS path ran)."""
    seen, plan = [], gemv._plan

    def spy(*a, **kw):
        out = plan(*a, **kw)
        seen.append((out[1]["BLOCK_M"], out[1]["BLOCK_R"]))
        return out
    monkeypatch.setattr(gemv, "_plan", spy)
    return seen


def run_all(t, gen, dtype=DTYPE):
    """Every fused function at t tokens (fused=None: the launcher's own choice) and its reference."""
    hidden, inter, hq, hkv, d, vocab = SHAPE
    out = []
    x = rand(t, hidden, dtype=dtype, gen=gen, scale=2.0)
    g = rand(hidden, dtype=dtype, gen=gen)
    w = rand((hq + 2 * hkv) * d, hidden, dtype=dtype, gen=gen, scale=hidden ** -0.5)
    cos_sin = rope_cos_sin(d, 500000.0, 4096, None, device=DEV)
    pos = torch.randint(0, 4096, (t,), generator=gen).to(DEV)
    kc, vc = rand(8, 16, hkv, d, dtype=dtype, gen=gen), rand(8, 16, hkv, d, dtype=dtype, gen=gen)
    slots = torch.randperm(8 * 16, generator=gen)[:t].to(DEV)
    kr, vr = kc.double(), vc.double()
    q = gemv.norm_qkv_rope_store_triton(x, g, 1e-5, w, pos, cos_sin, kc, vc, slots, hq)
    qr = gemv.norm_qkv_rope_store_torch(x.double(), g.double(), 1e-5, w.double(), pos, cos_sin.double(),
                                        kr, vr, slots, hq)
    out += [(q, qr), (kc.reshape(-1, hkv, d)[slots], kr.reshape(-1, hkv, d)[slots]),
            (vc.reshape(-1, hkv, d)[slots], vr.reshape(-1, hkv, d)[slots])]
    for k in (hidden, inter):                                       # o_proj, down_proj
        a, wo = rand(t, k, dtype=dtype, gen=gen), rand(hidden, k, dtype=dtype, gen=gen, scale=k ** -0.5)
        r = rand(t, hidden, dtype=dtype, gen=gen)
        out.append((gemv.linear_residual_triton(a, wo, r),
                    gemv.linear_residual_torch(a.double(), wo.double(), r.double())))
    wgu = rand(2 * inter, hidden, dtype=dtype, gen=gen, scale=hidden ** -0.5)
    out.append((gemv.norm_swiglu_triton(x, g, 1e-5, wgu), gemv.norm_swiglu_torch(x.double(), g.double(), 1e-5,
                                                                                  wgu.double())))
    wl = rand(vocab, hidden, dtype=dtype, gen=gen, scale=0.05)
    logits, tokens = gemv.norm_lm_head_triton(x, g, 1e-5, wl, greedy=True)
    out.append((logits, gemv.norm_lm_head_torch(x.double(), g.double(), 1e-5, wl.double())))
    assert torch.equal(tokens, logits.argmax(-1))                   # in-kernel argmax of its own logits
    return out


@pytest.mark.parametrize("t", [2, 5])
def test_fused_rows_dot_match_the_references(t, launches):
    with gemv.fused_rows("dot"):
        pairs = run_all(t, torch.Generator().manual_seed(t))
    for out, ref in pairs:
        check(out, ref)
    # every launch was a fused one with its rows padded to 16 (and 16-wide row blocks: tensor cores)
    assert launches and all(m == 16 and r >= 16 for m, r in launches), launches


def test_outside_fused_rows_and_in_fp32_nothing_changes(launches):
    """A plain engine's few-row steps keep cuBLAS; an fp32 model keeps it even inside fused_rows."""
    run_all(3, torch.Generator().manual_seed(1))
    assert launches == []
    with gemv.fused_rows():
        with gemv.fused_rows(False):
            run_all(3, torch.Generator().manual_seed(2))
        assert launches == []
        run_all(3, torch.Generator().manual_seed(3), dtype=torch.float32)
    assert launches == []
    assert not gemv._FUSED_ROWS[0]


@pytest.mark.parametrize("t,dtype", [(2, DTYPE), (5, DTYPE), (3, torch.float32)])
def test_fused_rows_fma_match_the_references(t, dtype, launches):
    """Each of the t rows against the weight tile: every launch fused, rows NOT padded to 16 (BLOCK_M
    the next power of two), any dtype; t=5 runs BLOCK_M 8 with rows 5..7 skipped."""
    with gemv.fused_rows("fma"):
        pairs = run_all(t, torch.Generator().manual_seed(10 + t), dtype=dtype)
    for out, ref in pairs:
        check(out, ref)
    assert len(launches) == 5 and all(m == 1 << (t - 1).bit_length() for m, _ in launches), launches


def test_fused_rows_fma_layers_keeps_the_cublas_lm_head(launches):
    with gemv.fused_rows("fma_layers"):
        pairs = run_all(4, torch.Generator().manual_seed(4))
    for out, ref in pairs:
        check(out, ref)
    assert len(launches) == 4          # qkv, o, swiglu, down fused; the LM head composed
    with gemv.fused_rows("fma"):
        run_all(gemv.FMA_ROWS + 1, torch.Generator().manual_seed(9))    # above FMA_ROWS: composed
    assert len(launches) == 4
    with pytest.raises(ValueError, match="fused_rows mode"):
        gemv.fused_rows("fast")


def test_fma_min_programs_splits_k_further(monkeypatch):
    """FMA_MIN_PROGRAMS: a few-token launch splits K until it has that many programs (the split-K
    sums then gathered in the same launch), the result unchanged; one token keeps its split."""
    gen = torch.Generator().manual_seed(7)
    cfg = dict(BLOCK_R=8, K_SPLIT=2048, BLOCK_K=64, num_warps=4, num_stages=1)
    a, w, r = rand(5, 344, gen=gen), rand(200, 344, gen=gen, scale=344 ** -0.5), rand(5, 200, gen=gen)
    grids, plan = [], gemv._plan
    monkeypatch.setattr(gemv, "_plan", lambda *x, **kw: grids.append(plan(*x, **kw)[0]) or plan(*x, **kw))
    monkeypatch.setattr(gemv, "FMA_MIN_PROGRAMS", 64)
    with gemv.fused_rows("fma"):
        out = gemv.linear_residual_triton(a, w, r, config=cfg)
        one = gemv.linear_residual_triton(a[:1], w, r[:1], config=cfg)
    check(out, gemv.linear_residual_torch(a.double(), w.double(), r.double()))
    check(one, gemv.linear_residual_torch(a[:1].double(), w.double(), r[:1].double()))
    (blocks, splits), one_grid = grids
    assert blocks == 25 and splits > 1 and blocks * splits >= 64 and one_grid == (25, 1), grids

"""Decode attention inside the O projection's launch (pagedlab/kernels/attend_o.py) against the two
launches' math in fp64: the paged context scattered over pages with a ragged last page, G query
heads per KV head a power of two and not (Llama's 4, SmolLM2's 3), several row blocks with a partial
last one, plain and FP8 weights; twice in a row (the split-K counters reset), bit for bit equal.
CPU: the Triton interpreter in fp32 / fp16 at small shapes; GPU: bf16 at Llama-3.2-1B's."""
import pytest
import torch

# (conftest.py sets TRITON_INTERPRET=1 without a GPU, before any kernel is defined)
from pagedlab.kernels.attend_o import attend_o_residual_torch, attend_o_residual_triton
from pagedlab.quantization import quantize_weight

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
DTYPES = [torch.bfloat16] if GPU else [torch.float32, torch.float16]
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 1e-2}
# (hidden, Hq, Hkv, D, context): GPU = Llama-3.2-1B at a short and a long context
SHAPES = [(2048, 32, 8, 64, 258), (2048, 32, 8, 64, 1900)] if GPU else [(72, 6, 2, 16, 43), (40, 9, 3, 16, 17)]


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_attention_inside_the_o_projection(shape, dtype, fp8):
    hidden, hq, hkv, d, ctx = shape
    gen = torch.Generator().manual_seed(hidden + ctx + fp8)

    def rand(*s, scale=1.0):
        return (torch.randn(*s, generator=gen) * scale).to(dtype).to(DEV)
    bs = 16 if GPU else 5
    pages = -(-ctx // bs)
    nb = pages + 7
    table = torch.randperm(nb, generator=gen)[:pages].int()[None].to(DEV)      # pages scattered
    lens = torch.tensor([ctx], dtype=torch.int32, device=DEV)
    k_cache, v_cache = rand(nb, bs, hkv, d), rand(nb, bs, hkv, d)
    q = rand(1, hq, d)
    w = rand(hidden, hq * d, scale=(hq * d) ** -0.5)
    residual = rand(1, hidden)
    if fp8:
        w = quantize_weight(w)
        w_ref = w.q.double() * w.scale.double()[:, None]
    else:
        w_ref = w.double()
    scale = d ** -0.5
    ref = attend_o_residual_torch(q.double(), k_cache.double(), v_cache.double(), table, lens, scale, w_ref,
                                  residual.double())
    config = {"BLOCK_R": 16} if not GPU else None      # several row blocks, the last one partial
    first = attend_o_residual_triton(q, k_cache, v_cache, table, lens, scale, w, residual, config=config)
    again = attend_o_residual_triton(q, k_cache, v_cache, table, lens, scale, w, residual, config=config)
    assert first.shape == residual.shape and first.dtype == dtype
    assert torch.equal(first, again), "the split-K counters did not reset, or the sum order moved"
    tol = max(TOL[dtype], 2e-2) if fp8 else TOL[dtype]
    assert rel_err(first, ref) < tol
    # and it is the attention that counts: another context length gives another answer
    other = attend_o_residual_triton(q, k_cache, v_cache, table, lens - 1, scale, w, residual, config=config)
    assert rel_err(other, ref) > 10 * rel_err(first, ref)


def test_the_launcher_refuses_what_it_does_not_run():
    q = torch.zeros(2, 4, 16, device=DEV)
    cache = torch.zeros(3, 4, 2, 16, device=DEV)
    table, lens = torch.zeros(2, 1, dtype=torch.int32, device=DEV), torch.ones(2, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="one sequence"):
        attend_o_residual_triton(q, cache, cache, table, lens, 0.25, torch.zeros(8, 64, device=DEV),
                                 torch.zeros(2, 8, device=DEV))
    with pytest.raises(ValueError, match="do not fit"):
        attend_o_residual_triton(q[:1], cache, cache, table[:1], lens[:1], 0.25, torch.zeros(8, 60, device=DEV),
                                 torch.zeros(1, 8, device=DEV))

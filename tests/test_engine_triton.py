"""The engine on the Triton kernels gives the torch backend's tokens (fp32; on CPU the Triton
kernels run in the interpreter, on a GPU for real, without CUDA graphs to compare kernels alone)."""
import pytest
import torch

from helpers import tiny_llm
from pagedlab import SamplingParams

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("budget", [8192, 7])       # 7: prompts prefilled in chunks over cached pages
def test_triton_backend_engine_matches_torch_backend(budget):
    prompts = [[5, 6, 7, 8, 9], [11] * 19, [3, 4]]
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
    kw = dict(max_num_seqs=2, num_blocks=32, block_size=4, max_num_batched_tokens=budget, device=DEV,
              dtype="float32", cuda_graphs=False)
    ref = [o.token_ids for o in tiny_llm(attention_backend="torch", **kw).generate(prompts, sp)]
    for variant in ("naive", "blocked", "gqa", "split_kv"):
        got = [o.token_ids for o in tiny_llm(attention_backend="triton", decode_variant=variant, **kw).generate(prompts, sp)]
        assert got == ref, variant



@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 2e-3)])
@pytest.mark.parametrize("t,inter", [(1, 7), (5, 160), (3, 1500)])
def test_silu_and_mul(dtype, tol, t, inter):
    from pagedlab.kernels.activation import silu_and_mul_torch, silu_and_mul_triton
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = (torch.randn(t, 2 * inter, generator=torch.Generator().manual_seed(t)) * 3).to(dev, dtype)
    ref = torch.nn.functional.silu(x.double()[:, :inter]) * x.double()[:, inter:]
    for fn in (silu_and_mul_torch, silu_and_mul_triton):
        out = fn(x)
        assert out.shape == (t, inter) and out.dtype == dtype
        assert ((out.double() - ref).norm() / ref.norm()).item() < tol


def test_one_stream_with_prefetch_gives_the_same_tokens():
    """One stream (every decode step one token: the fused GEMV kernels), with the model passing
    each kernel the next matrix to prefetch: PREFETCH on in every launch (K split in two)
    give the torch backend's tokens. (Bit-for-bit equality with them off: tests/test_gemv.py.)"""
    from pagedlab.bench.gemv import prefetch_variants
    sp = SamplingParams(max_new_tokens=4, ignore_eos=True)
    kw = dict(max_num_seqs=1, num_blocks=16, block_size=4, device=DEV, dtype="float32", cuda_graphs=False)
    prompt = [[5, 6, 7, 8, 9, 10, 3]]
    ref = tiny_llm(attention_backend="torch", **kw).generate(prompt, sp)[0].token_ids
    tiles = dict(BLOCK_R=16, K_SPLIT=64, BLOCK_K=32, num_warps=4, num_stages=1)
    change = {k: dict(v, **tiles, PREFETCH=2 if v["PREFETCH"] else 0)
              for k, v in prefetch_variants()["pf_chain"].items()}
    got = tiny_llm(attention_backend="triton", kernel_options=dict(gemv_config=change), **kw).generate(prompt, sp)
    assert got[0].token_ids == ref


def test_one_stream_with_attention_in_qkv_launch(monkeypatch):
    """One stream with the decode attention run in the QKV launch's tail (GEMV_CONFIG's ATTN,
    K split in two): the torch backend's tokens, and every decode step's layers took that path."""
    from pagedlab.kernels import gemv
    fused = []
    launch = gemv._qkv_launch

    def spy(*args, attn=None, **kw):
        fused.append(attn is not None)
        return launch(*args, attn=attn, **kw)
    monkeypatch.setattr(gemv, "_qkv_launch", spy)
    sp = SamplingParams(max_new_tokens=3, ignore_eos=True)
    kw = dict(max_num_seqs=1, num_blocks=16, block_size=4, device=DEV, dtype="float32", cuda_graphs=False)
    prompt = [[5, 6, 7, 8, 9, 10, 3, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 3]]   # 19-21 keys:
    ref = tiny_llm(attention_backend="torch", **kw).generate(prompt, sp)[0].token_ids   # two key tiles
    tiles = dict(BLOCK_R=16, K_SPLIT=64, BLOCK_K=32, num_warps=4, num_stages=1, ATTN=64, ATTN_BLOCK_N=16)
    got = tiny_llm(attention_backend="triton", kernel_options=dict(gemv_config={"qkv": tiles}), **kw)
    assert got.generate(prompt, sp)[0].token_ids == ref
    assert fused.count(True) >= 2 * got.model.config.num_layers      # two decode steps, every layer
    plain = tiny_llm(attention_backend="triton", **kw)                # ATTN off (the default): the
    assert not hasattr(plain.model.kernels, "norm_qkv_rope_store_attend")    # model's two launches
    # a step of fewer than 16 keys compiles with Triton 3.9 but not 3.6 (tl.dot's K): rounded up
    assert [gemv.attn_block_n({"ATTN_BLOCK_N": n}) for n in (1, 8, 16, 17, 256)] == [16, 16, 16, 32, 256]

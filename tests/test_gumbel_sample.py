"""kernels/gumbel_sample.py: the one-pass Gumbel-max draw against sampling.sample (its torch
reference) under Triton's interpreter -- the same token, row for row, at irregular vocabulary sizes,
splits and temperatures (greedy rows included); and the engine routing rows with top-k / top-p /
min-p to sample() apart, so a row's token never depends on its batch-mates."""
import pytest
import torch

from pagedlab.kernels.gumbel_sample import gumbel_argmax_torch, gumbel_argmax_triton, plan_splits
from pagedlab.sampling import sample


def draw(b, v, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, v, generator=g) * scale
    temp = torch.tensor([0.0, 1.0, 0.7, 1.3, 2.0, 0.05, 1e-6] * 10)[:b]
    seeds = torch.randint(0, 2**31, (b,), generator=g)
    pos = torch.randint(0, 2**31 - 1, (b,), generator=g)
    return logits, temp, seeds, pos


@pytest.mark.parametrize("b,v", [(1, 257), (3, 1000), (7, 8193), (5, 20001), (2, 50000), (33, 3001)])
def test_the_same_token_as_the_torch_reference(b, v):
    logits, temp, seeds, pos = draw(b, v, b * 1000 + v)
    want = gumbel_argmax_torch(logits, temp, seeds, pos)
    engine = sample(logits, temp, torch.zeros(b, dtype=torch.int64), torch.ones(b), seeds, pos)
    assert want.tolist() == engine.tolist()        # the reference is sampling.sample without filters
    got = gumbel_argmax_triton(logits, temp, seeds, pos)
    assert got.dtype == torch.int64 and got.shape == (b,)
    assert got.tolist() == want.tolist()
    greedy = temp <= 0
    assert got[greedy].tolist() == logits[greedy].argmax(dim=-1).tolist()


def test_ties_and_masked_logits_go_to_the_lowest_id():
    v = 17000                                      # 2 splits at 2 rows (4 SMs under the interpreter)
    logits = torch.full((2, v), -float("inf"))
    logits[:, [17, 5000, 12000]] = 5.0             # the same best logit in both splits
    temp = torch.tensor([0.0, 0.0])
    seeds, pos = torch.tensor([1, 2]), torch.tensor([3, 4])
    assert plan_splits(2, v, logits.device)[0] == 2
    assert gumbel_argmax_triton(logits, temp, seeds, pos).tolist() == [17, 17]
    all_masked = torch.full((1, 5000), -float("inf"))      # torch.argmax's answer: 0
    assert gumbel_argmax_triton(all_masked, torch.tensor([1.0]), seeds[:1], pos[:1]).tolist() == \
        gumbel_argmax_torch(all_masked, torch.tensor([1.0]), seeds[:1], pos[:1]).tolist() == [0]


def test_the_draw_follows_the_softmax():
    """Many positions of one row: the token counts follow softmax(logits / t) (chi-square)."""
    v, n, t = 6, 3000, 0.8
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, -3.0]]).repeat(n, 1)
    got = gumbel_argmax_triton(logits, torch.full((n,), t), torch.full((n,), 11), torch.arange(n))
    counts = torch.bincount(got, minlength=v).double()
    expect = torch.softmax(logits[0].double() / t, dim=0) * n
    chi2 = ((counts - expect) ** 2 / expect).sum().item()
    assert chi2 < 20.5                             # chi-square, 5 degrees of freedom: p < 0.001


def test_the_engine_routes_filtered_rows_apart(monkeypatch):
    """runner._device_tokens with the fused path on (the interpreter's kernel on CPU): rows with
    top-k / top-p / min-p get sample()'s token, rows without get the kernel's, and each equals the
    token the row draws alone."""
    from helpers import tiny_llm
    from pagedlab import SamplingParams
    llm = tiny_llm(max_num_seqs=6, num_blocks=64)
    runner = llm.engine.runner
    params = [SamplingParams(max_new_tokens=6, temperature=0.9, seed=1, ignore_eos=True),
              SamplingParams(max_new_tokens=6, temperature=0.9, top_k=5, seed=2, ignore_eos=True),
              SamplingParams(max_new_tokens=6, temperature=1.2, top_p=0.8, seed=3, ignore_eos=True),
              SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True),
              SamplingParams(max_new_tokens=6, temperature=1.0, min_p=0.1, seed=4, ignore_eos=True),
              SamplingParams(max_new_tokens=6, temperature=0.5, seed=5, ignore_eos=True)]
    prompts = [[5 + i, 9, 13 + 2 * i] for i in range(len(params))]
    runner.fused_sampling = False
    want = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, params)]
    calls = []
    import pagedlab.kernels.gumbel_sample as gs
    real = gs.gumbel_argmax_triton
    monkeypatch.setattr(gs, "gumbel_argmax_triton", lambda lg, *a: calls.append(lg.shape[0]) or real(lg, *a))
    runner.fused_sampling = True
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert calls                                   # the kernel drew tokens
    assert got == want == alone

"""The OpenAI-shaped sampling features on the GPU (run on the device machine): penalties and logprobs
against transformers in fp32, and the captured-graph + overlap engine against the plain one, with
stop strings, logprobs, penalties and min_p mixed in one stream. Skipped without CUDA."""
import random

import pytest
import torch

from helpers import hf_model, mixed_params, random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

VOCAB = 512


@pytest.fixture(scope="module")
def ckpt():
    from pagedlab import tiny_config
    from pagedlab.weights import random_checkpoint
    return random_checkpoint(tiny_config(VOCAB), 0)


def make(ckpt, **kw):
    from pagedlab import LLM
    kw.setdefault("max_num_seqs", 5)
    return LLM(checkpoint=ckpt, device="cuda", dtype="float32", show_progress=False, **kw)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(4, VOCAB, torch.Generator().manual_seed(11), lo=3, hi=30)


def test_repetition_penalty_and_logprobs_vs_transformers(ckpt, prompts):
    from pagedlab import SamplingParams
    llm, hf = make(ckpt), hf_model(ckpt, torch.float32, "cuda")
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=1.3))
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=12, do_sample=False,
                              repetition_penalty=1.3, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert o.token_ids == ref
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=4))
    for p, o in zip(prompts, outs):
        ids = list(p)
        for tok, lp in zip(o.token_ids, o.logprobs):
            with torch.no_grad():
                ref = torch.log_softmax(hf(torch.tensor([ids], device="cuda")).logits[0, -1].double(), -1)
            assert lp.logprob == pytest.approx(float(ref[tok]), abs=1e-3)
            assert [t for t, _ in lp.top] == ref.topk(4).indices.tolist()
            ids.append(tok)


def test_graphs_and_overlap_match_the_plain_loop_with_every_feature(ckpt):
    from pagedlab import SamplingParams
    rng, rnd = torch.Generator().manual_seed(2), random.Random(2)
    prompts = random_prompts(16, VOCAB, rng, lo=2, hi=40)
    plain = make(ckpt, cuda_graphs=False)
    free = plain.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    params = mixed_params(free, rnd, max_tokens=20)
    graphs = make(ckpt)
    assert graphs.engine.runner.graphs is not None and graphs.engine.overlap
    a, b = plain.generate(prompts, params), graphs.generate(prompts, params)
    for x, y in zip(a, b):
        assert (x.token_ids, x.text, x.finish_reason) == (y.token_ids, y.text, y.finish_reason)
    assert graphs.engine.scheduler.allocator.num_used == 0


def test_sampled_steps_run_ahead_on_captured_graphs(ckpt, monkeypatch):
    """ModelRunner.RUN_AHEAD_SAMPLED on captured graphs: seeded sampling chosen on the device after
    the replay, the next replay reading it -- every request's tokens equal the plain loop's (fp32),
    and sampled steps ran ahead."""
    from pagedlab import SamplingParams
    from pagedlab.runner import ModelRunner
    monkeypatch.setattr(ModelRunner, "RUN_AHEAD_SAMPLED", True)
    rng, rnd = torch.Generator().manual_seed(4), random.Random(4)
    prompts = random_prompts(12, VOCAB, rng, lo=2, hi=40)
    params = [SamplingParams(max_tokens=rnd.randint(4, 24), ignore_eos=True, seed=rnd.randrange(1000),
                             temperature=rnd.choice([0.0, 0.7, 1.2]), top_k=rnd.choice([0, 20]),
                             top_p=rnd.choice([1.0, 0.9]), min_p=rnd.choice([0.0, 0.05])) for _ in prompts]
    want = [o.token_ids for o in make(ckpt, cuda_graphs=False).generate(prompts, params)]
    llm = make(ckpt)
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.capture
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert llm.engine.num_overlapped > 0
    assert llm.engine.scheduler.allocator.num_used == 0


@pytest.mark.parametrize("b,v", [(1, 128256), (3, 50001), (64, 32000), (256, 128256)])
def test_fused_gumbel_draw_is_the_torch_draw_on_the_gpu(b, v):
    """kernels/gumbel_sample.py against sampling.sample on CUDA: the same token in every row (the
    hash in uint32, div_rn, libdevice's logf -- torch's own rounding), greedy rows the argmax."""
    from pagedlab.kernels.gumbel_sample import gumbel_argmax_torch, gumbel_argmax_triton
    g = torch.Generator(device="cuda").manual_seed(b + v)
    logits = torch.randn(b, v, device="cuda", generator=g) * 4
    temp = torch.tensor([0.0, 1.0, 0.6, 1.5, 0.05] * 60, device="cuda")[:b]
    seeds = torch.randint(0, 2**31, (b,), device="cuda", generator=g)
    pos = torch.randint(0, 2**31 - 1, (b,), device="cuda", generator=g)
    want = gumbel_argmax_torch(logits, temp, seeds, pos)
    got = gumbel_argmax_triton(logits, temp, seeds, pos)
    assert got.tolist() == want.tolist()


def test_fused_sampling_gives_the_torch_tokens_in_the_engine(ckpt):
    """The engine with ModelRunner.fused_sampling on and off: the same tokens for mixed sampling
    parameters (rows with top-k / top-p / min-p drawn by sample() apart)."""
    from pagedlab import SamplingParams
    rng, rnd = torch.Generator().manual_seed(6), random.Random(6)
    prompts = random_prompts(14, VOCAB, rng, lo=2, hi=40)
    params = [SamplingParams(max_tokens=rnd.randint(4, 24), ignore_eos=True, seed=rnd.randrange(1000),
                             temperature=rnd.choice([0.0, 0.7, 1.2]), top_k=rnd.choice([0, 0, 20]),
                             top_p=rnd.choice([1.0, 1.0, 0.9]), min_p=rnd.choice([0.0, 0.0, 0.05]))
              for _ in prompts]
    llm = make(ckpt)
    llm.engine.runner.fused_sampling = True       # (on by default since session 21; set both ways here)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    llm.engine.runner.fused_sampling = False
    want = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want

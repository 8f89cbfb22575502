"""OpenAI / vLLM-shaped sampling: stop strings, n, logprobs, presence / frequency / repetition
penalties, min_p -- checked against transformers (same weights, fp32) or a float64 reference, and
with the overlap loop against the plain one."""
import random

import pytest
import torch

from helpers import hf_model, mixed_params, random_prompts, tiny_llm
from pagedlab import SamplingParams
from pagedlab.weights import random_checkpoint
from pagedlab import tiny_config

VOCAB = 512


@pytest.fixture(scope="module")
def ckpt():
    return random_checkpoint(tiny_config(VOCAB), 0)


@pytest.fixture(scope="module")
def llm(ckpt):
    from pagedlab import LLM
    return LLM(checkpoint=ckpt, device="cpu", dtype="float32", show_progress=False, max_num_seqs=6)


@pytest.fixture(scope="module")
def hf(ckpt):
    return hf_model(ckpt)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(4, VOCAB, torch.Generator().manual_seed(11), lo=3, hi=30)


def hf_logits(hf, ids) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].double()


# ---------------------------------------------------------------- penalties
def test_repetition_penalty_matches_transformers(llm, hf, prompts):
    new = 14
    for r in (1.3, 0.7):
        outs = llm.generate(prompts[:3], SamplingParams(max_tokens=new, ignore_eos=True, repetition_penalty=r))
        for p, o in zip(prompts, outs):
            with torch.no_grad():
                ref = hf.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False, repetition_penalty=r,
                                  eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            assert o.token_ids == ref, (r, p)


def test_presence_and_frequency_penalties_match_a_float64_reference(llm, hf, prompts):
    new = 10
    for pres, freq in ((1.5, 0.0), (-0.5, 1.2)):
        outs = llm.generate(prompts[:3], SamplingParams(max_tokens=new, ignore_eos=True, presence_penalty=pres,
                                                    frequency_penalty=freq))
        for p, o in zip(prompts, outs):
            ids, out = list(p), []
            for _ in range(new):
                logits = hf_logits(hf, ids)
                counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=VOCAB).double()
                logits = logits - freq * counts - pres * (counts > 0).double()
                tok = int(logits.argmax())
                out.append(tok)
                ids.append(tok)
            assert o.token_ids == out, (pres, freq, p)
        # the penalty changes something (else this test checks nothing)
    plain = llm.generate(prompts, SamplingParams(max_tokens=new, ignore_eos=True))
    pen = llm.generate(prompts, SamplingParams(max_tokens=new, ignore_eos=True, frequency_penalty=2.0))
    assert any(a.token_ids != b.token_ids for a, b in zip(plain, pen))


def test_penalties_leave_batch_mates_alone(llm, prompts):
    """A penalized request and a plain one in the same step: the plain one's tokens are its own."""
    alone = llm.generate(prompts[1], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    mixed = llm.generate(prompts[:2], [SamplingParams(max_tokens=10, ignore_eos=True, presence_penalty=2.0),
                                       SamplingParams(max_tokens=10, ignore_eos=True)])
    assert mixed[1].token_ids == alone.token_ids


# ---------------------------------------------------------------- logprobs
def test_logprobs_match_transformers(llm, hf, prompts):
    k = 5
    for sp in (SamplingParams(max_tokens=8, ignore_eos=True, logprobs=k),
               SamplingParams(max_tokens=8, ignore_eos=True, logprobs=k, temperature=0.9, seed=4)):
        outs = llm.generate(prompts, sp)
        for p, o in zip(prompts, outs):
            assert len(o.logprobs) == len(o.token_ids)
            ids = list(p)
            for tok, lp in zip(o.token_ids, o.logprobs):
                ref = torch.log_softmax(hf_logits(hf, ids), dim=-1)
                assert lp.token_id == tok
                assert lp.logprob == pytest.approx(float(ref[tok]), abs=1e-4)
                top = ref.topk(k)
                assert [t for t, _ in lp.top] == top.indices.tolist()
                assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
                ids.append(tok)
    # greedy with logprobs: the same tokens as without, and the chosen token is the most likely one
    plain = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    with_lp = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True, logprobs=0))
    assert [o.token_ids for o in plain] == [o.token_ids for o in with_lp]
    assert all(lp.top == [] for o in with_lp for lp in o.logprobs)
    assert all(o.logprobs is None for o in plain)


# ---------------------------------------------------------------- min_p
def test_min_p_keeps_only_likely_tokens(llm, prompts):
    # min_p = 1 keeps only the most likely token: any seed gives the greedy tokens
    greedy = llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    for seed in range(3):
        outs = llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0,
                                                    seed=seed, min_p=1.0))
        assert [o.token_ids for o in outs] == [o.token_ids for o in greedy]
    # min_p = 0.5 at temperature 1: every drawn token is at least half as likely as the best one
    # (the raw logprobs are the temperature-1 distribution); without min_p many are not
    import math
    def ratios(min_p):
        outs = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.0, seed=7,
                                                    logprobs=1, min_p=min_p))
        return [lp.logprob - lp.top[0][1] for o in outs for lp in o.logprobs]
    assert min(ratios(0.5)) >= math.log(0.5) - 1e-5
    assert min(ratios(0.0)) < math.log(0.5)


# ---------------------------------------------------------------- n
def test_n_samples_are_requests_with_consecutive_seeds(llm, prompts):
    sp = SamplingParams(max_tokens=9, ignore_eos=True, temperature=1.0, seed=100, n=4)
    outs = llm.generate(prompts[:2], sp)
    assert len(outs) == 2
    for p, o in zip(prompts, outs):
        assert len(o.outputs) == 4 and o.outputs[0].token_ids == o.token_ids
        singles = [llm.generate(p, SamplingParams(max_tokens=9, ignore_eos=True, temperature=1.0, seed=100 + j))[0]
                   for j in range(4)]
        assert [x.token_ids for x in o.outputs] == [s.token_ids for s in singles]
        assert len({tuple(x.token_ids) for x in o.outputs}) > 1
        assert o.usage["completion_tokens"] == 36 and o.usage["prompt_tokens"] == len(p)
    with pytest.raises(ValueError, match="n=2"):
        llm.engine.add_request(prompts[0], SamplingParams(n=2, temperature=1.0))
    with pytest.raises(ValueError, match="n=3"):
        next(llm.stream(prompts[0], SamplingParams(n=3, temperature=1.0)))
    assert not llm.engine.has_work()


# ---------------------------------------------------------------- stop strings
def check_stop_strings(llm, prompt, rnd, chat=False, new=40, tries=6):
    """Stop strings cut from the free-running text: the stopped request's text is the free text up
    to the earliest stop string, its tokens a prefix of the free tokens, and its stream joins to the
    same text without ever showing a stop string."""
    free = llm.generate(prompt, SamplingParams(max_tokens=new, ignore_eos=True), chat=chat)[0]
    text = free.text
    checked = 0
    for _ in range(tries):
        if len(text) < 8:
            break
        stops = []
        while len(stops) < rnd.randint(1, 3):
            a = rnd.randrange(1, len(text) - 1)
            s = text[a:a + rnd.randint(1, 5)]
            if "\ufffd" not in s:          # (a broken character is not text anyone stops on)
                stops.append(s)
        sp = SamplingParams(max_tokens=new, ignore_eos=True, stop=stops)
        out = llm.generate(prompt, sp, chat=chat)[0]
        cut = min(free.text.find(s) for s in stops)
        first = min((free.text.find(s), s) for s in stops)
        assert out.finish_reason == "stop" and out.stop_reason == first[1]
        assert out.text == free.text[:cut]
        assert out.token_ids == free.token_ids[:len(out.token_ids)]
        deltas = list(llm.stream(prompt, sp, chat=chat))
        assert "".join(d.text for d in deltas) == out.text
        assert not any(s in d.text for d in deltas for s in stops)
        assert deltas[-1].output.token_ids == out.token_ids
        checked += 1
    assert checked >= 3


def test_stop_strings_on_random_text(llm, prompts):
    rnd = random.Random(3)
    for p in prompts[:2]:
        check_stop_strings(llm, p, rnd, tries=4)


@pytest.mark.slow
def test_stop_strings_on_real_text(smollm2_llm):
    rnd = random.Random(5)
    check_stop_strings(smollm2_llm, "Write three short sentences about the sea.", rnd, chat=True, new=48)


def test_a_stop_string_that_never_appears_changes_nothing(llm, prompts):
    free = llm.generate(prompts, SamplingParams(max_tokens=15, ignore_eos=True))
    outs = llm.generate(prompts, SamplingParams(max_tokens=15, ignore_eos=True, stop=["\u2603never\u2603"]))
    assert [o.token_ids for o in outs] == [o.token_ids for o in free]
    assert [o.text for o in outs] == [o.text for o in free]
    assert all(o.finish_reason == "length" for o in outs)


# ---------------------------------------------------------------- the overlap loop
def test_mixed_features_under_the_overlap_loop_match_the_plain_loop():
    """Random requests mixing plain greedy (run ahead), stop strings, logprobs and penalties, on the
    graph path run eagerly with overlap and on the plain loop: the same tokens, text and logprobs."""
    rng, rnd = torch.Generator().manual_seed(2), random.Random(2)
    prompts = random_prompts(14, VOCAB, rng, lo=2, hi=25)
    plain = tiny_llm(max_num_seqs=5, num_blocks=64, block_size=4, cuda_graphs=False)
    free = plain.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    params = mixed_params(free, rnd, max_tokens=16)
    over = tiny_llm(max_num_seqs=5, num_blocks=64, block_size=4, cuda_graphs="eager")
    assert over.engine.overlap
    a, b = plain.generate(prompts, params), over.generate(prompts, params)
    for x, y in zip(a, b):
        assert (x.token_ids, x.text, x.finish_reason) == (y.token_ids, y.text, y.finish_reason)
        assert (x.logprobs is None) == (y.logprobs is None)
        if x.logprobs is not None:
            assert [l.token_id for l in x.logprobs] == [l.token_id for l in y.logprobs]
            assert [l.logprob for l in x.logprobs] == pytest.approx([l.logprob for l in y.logprobs], abs=1e-5)
    assert over.engine.num_overlapped > 0
    assert over.engine.scheduler.allocator.num_used == 0


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize("kw,field", [
    (dict(stop=[""]), "stop"), (dict(stop=5), "stop"), (dict(stop=["a"] * 17), "stop"), (dict(stop=[b"x"]), "stop"),
    (dict(n=0), "n"), (dict(n=True), "n"), (dict(n=1.0), "n"),
    (dict(logprobs=21), "logprobs"), (dict(logprobs=-1), "logprobs"), (dict(logprobs=True), "logprobs"),
    (dict(min_p=1.5), "min_p"), (dict(min_p=float("nan")), "min_p"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty="1"), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(repetition_penalty=float("inf")), "repetition_penalty"),
])
def test_bad_openai_fields_are_refused_by_name(kw, field):
    with pytest.raises(ValueError, match=rf"SamplingParams: {field}\b"):
        SamplingParams(**kw)

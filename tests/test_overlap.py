"""Overlapped decode steps (Engine.step with overlap): step n+1 is launched before step n's tokens
are read. The bookkeeping around it -- tokens in flight (counted, never in an output list), stops found one step late, rows that ran in
vain, length limits, admissions, preemption -- is checked on CPU by running the graph path eagerly
(DecodeGraphs(capture=False)) under randomized request streams: outputs must equal the plain
engine's, token for token, and the scheduler's invariants must hold after every step."""
import random

import pytest
import torch

from helpers import random_prompts, tiny_llm
from pagedlab import SamplingParams, tiny_config
# the same randomized stream (some requests stop on EOS) and its one-at-a-time reference
from test_scheduler import check_invariants, reference, run_stream, stream  # noqa: F401


def overlapped_llm(**kw):
    """A tiny CPU engine that takes the graph path (run eagerly) with overlap on."""
    llm = tiny_llm(cuda_graphs="eager", **kw)
    assert llm.engine.overlap
    return llm


@pytest.mark.parametrize("slots,block_size,num_blocks,seed",
                         [(1, 16, 64, 0), (3, 4, 256, 1), (5, 1, 4096, 2), (4, 7, 12, 3)])
def test_overlap_gives_the_same_outputs(stream, reference, slots, block_size, num_blocks, seed):
    """Random arrivals; the last case's pool is small enough to force preemption."""
    prompts, params = stream
    rnd = random.Random(seed)
    arrival = [rnd.randint(0, 30) for _ in prompts]
    llm = overlapped_llm(max_num_seqs=slots, block_size=block_size, num_blocks=num_blocks)
    got = run_stream(llm, prompts, params, arrival)
    cap = llm.engine.max_model_len
    for i in range(len(prompts)):
        assert got[i] == reference[i][:len(got[i])]
        assert len(got[i]) == min(len(reference[i]), cap - len(prompts[i]))
    assert llm.engine.num_overlapped > 0, "no step was overlapped: the test checks nothing"


def test_stop_tokens_found_one_step_late():
    """A request that stops on a token is only seen to stop after the next step was launched for
    it: that spare row must leave no token behind, and the other requests go on unchanged."""
    rng = torch.Generator().manual_seed(5)
    prompts = random_prompts(6, 512, rng, lo=2, hi=20)
    free = tiny_llm(max_num_seqs=6, num_blocks=128).generate(
        prompts, SamplingParams(max_new_tokens=20, ignore_eos=True))
    params = []
    for i, o in enumerate(free):      # stop on a token each sequence produces mid-run
        params.append(SamplingParams(max_new_tokens=20, stop_token_ids=[o.token_ids[3 + i]]))
    expect = []
    for o, sp in zip(free, params):
        k = o.token_ids.index(sp.stop_token_ids[0])
        expect.append(o.token_ids[:k + 1])
    llm = overlapped_llm(max_num_seqs=6, num_blocks=128)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == expect
    assert all(o.finish_reason == "stop" for o in outs)
    assert all(min(o.token_ids, default=0) >= 0 for o in outs)
    assert llm.engine.num_overlapped > 0
    # the engine's own requests, checked after every step: the spare row's token in flight is
    # dropped with the request (none left in flight once it finished)
    llm = overlapped_llm(max_num_seqs=6, num_blocks=128)
    got = run_stream(llm, prompts, params, [0] * len(prompts))
    assert [got[i] for i in range(len(prompts))] == expect
    assert llm.engine.num_overlapped > 0


def test_length_limits_and_requests_added_between_steps():
    llm = overlapped_llm(max_num_seqs=2, num_blocks=64, max_model_len=24)
    eng = llm.engine
    a = eng.add_request([5, 6, 7], SamplingParams(max_new_tokens=10, ignore_eos=True))
    eng.step()
    eng.step()
    eng.step()
    b = eng.add_request([3] * 15, SamplingParams(max_new_tokens=50, ignore_eos=True))
    done = {}
    while eng.has_work():
        for r in eng.step():
            done[r.request_id] = r
        check_invariants(eng)
    assert len(done[a].output_token_ids) == 10 and done[a].finish_reason == "length"
    assert len(done[b].output_token_ids) == 24 - 15 and done[b].finish_reason == "length"
    assert eng.num_overlapped > 0
    assert eng.scheduler.allocator.num_used == 0


def test_sampling_steps_are_not_overlapped(monkeypatch):
    """Non-greedy sampling reads its tokens on the host side of the step unless
    ModelRunner.RUN_AHEAD_SAMPLED (on by default; off here): no overlap, and the same seeded outputs as the
    plain engine."""
    from pagedlab.runner import ModelRunner
    monkeypatch.setattr(ModelRunner, "RUN_AHEAD_SAMPLED", False)
    prompts = [[4, 5, 6], [7, 8]]
    params = [SamplingParams(max_new_tokens=8, temperature=0.8, seed=3, ignore_eos=True)] * 2
    want = [o.token_ids for o in tiny_llm(max_num_seqs=2, num_blocks=64).generate(prompts, params)]
    llm = overlapped_llm(max_num_seqs=2, num_blocks=64)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert llm.engine.num_overlapped == 0


def test_steps_run_ahead_while_requests_wait_for_a_slot(stream, reference):
    """Every slot taken and requests waiting: the next step is still a decode of exactly the
    running requests, so it is launched before the step in flight is read (a slot freed by a stop
    token is refilled one step later) -- and every output is unchanged."""
    prompts, params = stream
    llm = overlapped_llm(max_num_seqs=3, block_size=4, num_blocks=256)
    eng, launch, waited = llm.engine, llm.engine.runner.launch, []

    def watched(batch, after=None):
        waited.append(after is not None and bool(eng.scheduler.waiting))
        return launch(batch, after=after)
    eng.runner.launch = watched
    got = run_stream(llm, prompts, params, [0] * len(prompts))
    assert [got[i] for i in range(len(prompts))] == reference
    assert any(waited), "no step ran ahead while requests waited"


def test_steps_run_ahead_while_admit_group_holds_the_queue(stream, reference):
    """A queue held for admit_group makes the next step a decode of exactly the running requests
    too: it runs ahead, and the outputs are unchanged."""
    prompts, params = stream
    llm = overlapped_llm(max_num_seqs=5, block_size=4, num_blocks=256, admit_group=4, admit_wait=6)
    eng, launch, held = llm.engine, llm.engine.runner.launch, []

    def watched(batch, after=None):
        s = eng.scheduler
        held.append(after is not None and bool(s.waiting) and None in s.slots)
        return launch(batch, after=after)
    eng.runner.launch = watched
    got = run_stream(llm, prompts, params, [0] * len(prompts))
    assert [got[i] for i in range(len(prompts))] == reference
    assert any(held), "no step ran ahead while the queue was held"


@pytest.mark.parametrize("past_ends", [True, False])
@pytest.mark.parametrize("slots,max_model_len,seed", [(4, 64, 0), (7, 40, 1), (3, 2048, 2)])
def test_steps_run_ahead_past_requests_ending_by_length(monkeypatch, past_ends, slots, max_model_len, seed):
    """Requests ending by length (max_new_tokens, or the model's length where it is short) while
    others wait: with RUN_AHEAD_PAST_ENDS the step after a request's last token is launched before
    that token is read, without a row for it (no spare row: its end was certain), its slot refilled
    one step later. Outputs equal the plain engine's, token for token, and the scheduler's
    invariants hold after every step; without it those steps are read first, as before."""
    from pagedlab.scheduler import Scheduler
    monkeypatch.setattr(Scheduler, "RUN_AHEAD_PAST_ENDS", past_ends)
    rng, rnd = torch.Generator().manual_seed(seed), random.Random(seed)
    prompts = random_prompts(14, 512, rng, lo=2, hi=30)
    params = [SamplingParams(max_new_tokens=rnd.randint(1, 40), ignore_eos=True) for _ in prompts]
    # a model whose own limit allows max_model_len (2048: past the tiny model's 256, which is refused)
    kw = dict(max_num_seqs=slots, num_blocks=512, max_model_len=max_model_len,
              config=tiny_config(max_position_embeddings=max(256, max_model_len)))
    want = [o.token_ids for o in tiny_llm(**kw).generate(prompts, params)]
    llm = overlapped_llm(**kw)
    eng, launch, past = llm.engine, llm.engine.runner.launch, []

    def watched(batch, after=None):
        s = eng.scheduler
        for r in batch.sampled:           # never a row for a request whose end is already in flight
            assert not (len(r.output_token_ids) + r.num_in_flight >= r.params.max_new_tokens
                        or r.num_tokens >= s.max_model_len), "a row past the request's length"
        past.append(after is not None and any(s.ends_in_flight(r) for r in s.admitted))
        return launch(batch, after=after)
    eng.runner.launch = watched
    got = run_stream(llm, prompts, params, [0] * len(prompts))
    assert [got[i] for i in range(len(prompts))] == want
    assert eng.scheduler.allocator.num_used == 0
    if past_ends:
        assert any(past), "no step ran ahead past a request's last token"
    else:
        assert not any(past)


def sampled_params(n, rnd, max_tokens=30):
    """Seeded sampling of every kind the device can choose alone (temperature, top-k, top-p,
    min-p), greedy between them, and now and then a request with penalties or logprobs."""
    params = []
    for _ in range(n):
        kind = rnd.choice(["t", "top_k", "top_p", "min_p", "greedy", "t", "penalty", "logprobs"])
        kw = dict(max_tokens=rnd.randint(1, max_tokens), ignore_eos=True, seed=rnd.randrange(10_000))
        if kind != "greedy":
            kw["temperature"] = rnd.choice([0.5, 0.9, 1.3])
        if kind == "top_k":
            kw["top_k"] = rnd.randint(1, 40)
        elif kind == "top_p":
            kw["top_p"] = rnd.choice([0.3, 0.8])
        elif kind == "min_p":
            kw["min_p"] = 0.05
        elif kind == "penalty":
            kw.update(presence_penalty=0.4, repetition_penalty=1.2)
        elif kind == "logprobs":
            kw["logprobs"] = rnd.randint(0, 3)
        params.append(SamplingParams(**kw))
    return params


@pytest.mark.parametrize("slots,num_blocks,seed", [(4, 512, 0), (6, 40, 1), (1, 64, 2)])
def test_sampled_steps_run_ahead_and_give_the_same_tokens(monkeypatch, slots, num_blocks, seed):
    """RUN_AHEAD_SAMPLED: a replayed step of seeded sampling (no penalties, no logprobs) chooses its
    tokens on the device, where the next replay reads them, and the overlap loop runs ahead of it
    as of greedy steps. Every request's tokens equal the plain engine's (the noise depends on the
    seed and the position only); requests with penalties or logprobs still make the loop read
    first; random arrivals, a pool small enough to preempt in the second case."""
    from pagedlab.runner import ModelRunner
    monkeypatch.setattr(ModelRunner, "RUN_AHEAD_SAMPLED", True)
    rng, rnd = torch.Generator().manual_seed(seed), random.Random(seed)
    prompts = random_prompts(16, 512, rng, lo=2, hi=24)
    params = sampled_params(len(prompts), rnd)
    arrival = [rnd.randint(0, 25) for _ in prompts]
    want = run_stream(tiny_llm(max_num_seqs=slots, num_blocks=num_blocks), prompts, params, arrival)
    llm = overlapped_llm(max_num_seqs=slots, num_blocks=num_blocks)
    eng, launch, ahead = llm.engine, llm.engine.runner.launch, []

    def watched(batch, after=None):
        if after is not None:
            ahead.append([r.params for r in batch.sampled])
            assert all(r.params.chosen_on_device for r in eng.scheduler.admitted)
        return launch(batch, after=after)
    eng.runner.launch = watched
    got = run_stream(llm, prompts, params, arrival)
    assert got == want
    assert any(not p.greedy for ps in ahead for p in ps), "no sampled step ran ahead: the test checks nothing"



def test_sampled_steps_send_their_inputs_without_waiting(monkeypatch):
    """runner._device_tokens moves the rows' sampling inputs (and the penalties') to the device only
    with non-blocking copies: torch.tensor(list, device=...) or a blocking .to() waits on CUDA for
    everything queued before it (the step's replay), which kept sampled steps from overlapping
    (H200, session 20). Checked on CPU by watching every tensor creation and copy the step makes."""
    import pagedlab.runner as runner_mod
    from pagedlab.runner import ModelRunner
    llm = tiny_llm(max_num_seqs=4, num_blocks=64)
    blocking = []
    real_to, real_tensor = torch.Tensor.to, torch.tensor

    def to(self, *a, **kw):
        if (a and isinstance(a[0], (torch.device, str))) or "device" in kw:
            if not kw.get("non_blocking", False):
                blocking.append("Tensor.to")
        return real_to(self, *a, **kw)

    def tensor(*a, **kw):
        if kw.get("device") is not None:
            blocking.append("torch.tensor(device=...)")
        return real_tensor(*a, **kw)
    real = ModelRunner._device_tokens

    def watched(self, *a, **kw):
        monkeypatch.setattr(torch.Tensor, "to", to)
        monkeypatch.setattr(runner_mod.torch, "tensor", tensor)
        try:
            return real(self, *a, **kw)
        finally:
            monkeypatch.setattr(torch.Tensor, "to", real_to)
            monkeypatch.setattr(runner_mod.torch, "tensor", real_tensor)
    monkeypatch.setattr(ModelRunner, "_device_tokens", watched)
    params = [SamplingParams(max_new_tokens=5, temperature=0.8, seed=1, ignore_eos=True),
              SamplingParams(max_new_tokens=5, temperature=1.1, top_p=0.9, top_k=7, seed=2, ignore_eos=True),
              SamplingParams(max_new_tokens=5, temperature=0.7, min_p=0.1, presence_penalty=0.5, seed=3,
                             ignore_eos=True)]
    outs = llm.generate([[4, 5, 6], [7, 8], [9, 10, 11, 12]], params)
    assert all(len(o.token_ids) == 5 for o in outs)
    assert blocking == []

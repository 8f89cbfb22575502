"""Speculative decoding (pagedlab/spec/), on the tiny random model in fp32 on CPU:

* the n-gram proposer (plain rule and numpy path agree on random sequences; edge cases) and the
  accept rule (no match, all kept, stop token and budget inside the guesses);
* greedy identity: randomized request streams through the speculative engine -- arrivals between
  steps, preemption (a small pool), chunked prefill, prefix caching, stop tokens and max_tokens
  inside the guesses, aborts, the CUDA-graph code path run eagerly -- give token for token what
  the plain engine gives, and after EVERY step the block accounting is exact (each running
  request holds no block past its tokens: those taken for rejected guesses went back;
  reference counts equal holders; nothing leaks at the end);
* seeded sampling, penalties, logprobs, stop strings through LLM.generate: identical too (a verify
  row draws with the noise of its position, sampling.py);
* rejection sampling keeps the target distribution (chi-square, seeded), for a general draft
  distribution and for one-hot guesses;
* proposed / accepted counts reach RequestOutput; config errors name the key.
"""
import random
import sys

import numpy as np
import pytest
import torch

from helpers import mixed_params, tiny_llm
from pagedlab import SamplingParams
from pagedlab.kv_cache import blocks_needed
from pagedlab.spec import accept_greedy, emit, propose_ngram, rejection_sample
from pagedlab.spec.ngram import propose_ngram_np

VOCAB = 512
# fixed k: the adaptive one weighs measured step times, which would make the counts below vary
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "adaptive": False}


# ----------------------------------------------------------------------------- units
def test_ngram_edge_cases():
    assert propose_ngram([1, 2, 3, 4], 3, 2) == []                       # no match
    assert propose_ngram([5, 6, 7, 5, 6], 3, 2) == [7, 5, 6]             # longest n, its continuation
    assert propose_ngram([5, 6, 7, 5, 6], 1, 2) == [7]                   # k caps it
    assert propose_ngram([9, 5, 6, 9], 4, 2) == [5, 6, 9]                # match near the end: fewer than k
    assert propose_ngram([1, 2, 1, 3, 1], 2, 1) == [3, 1]                # the latest occurrence wins
    assert propose_ngram([1, 2, 3, 1, 2], 2, 3, 3) == []                 # n below prompt_lookup_min: none
    assert propose_ngram([4, 4, 4], 3, 2) == [4]                         # overlapping repeat
    assert propose_ngram([7], 3, 2) == [] and propose_ngram([1, 1], 0, 2) == []


def test_ngram_numpy_path_matches_the_rule():
    rnd = random.Random(0)
    for _ in range(300):
        v = rnd.choice([2, 3, 8])
        t = [rnd.randrange(v) for _ in range(rnd.randint(1, 40))]
        k, n_max = rnd.randint(0, 6), rnd.randint(1, 5)
        n_min = rnd.randint(1, n_max)
        assert propose_ngram_np(np.array(t), k, n_max, n_min) == propose_ngram(t, k, n_max, n_min), (t, k, n_max, n_min)


def test_accept_rule():
    assert accept_greedy([], [7]) == [7]
    assert accept_greedy([1, 2, 3], [9, 2, 3, 4]) == [9]                 # first guess wrong: the correction
    assert accept_greedy([1, 2, 3], [1, 2, 8, 4]) == [1, 2, 8]
    assert accept_greedy([1, 2, 3], [1, 2, 3, 4]) == [1, 2, 3, 4]        # all kept + the bonus token
    assert emit([1, 2, 3], [1, 2, 3, 4], stop_ids={2}) == [1, 2]         # EOS inside the guesses
    assert emit([1, 2, 3], [1, 2, 3, 4], budget=2) == [1, 2]             # max_tokens inside them
    assert emit([1, 2, 3], [5, 2, 3, 4], stop_ids={2}, budget=3) == [5]


# ----------------------------------------------------------------------------- the engine
def copy_prompts(rnd, n):
    """Prompts that repeat themselves (n-grams match) with random tails."""
    out = []
    for _ in range(n):
        base = [rnd.randrange(3, VOCAB) for _ in range(rnd.randint(2, 9))]
        p = (base * rnd.randint(1, 5))[:rnd.randint(3, 45)]
        out.append(p + [rnd.randrange(3, VOCAB) for _ in range(rnd.randint(0, 4))])
    return out


def check_blocks(engine):
    """Exact block accounting: each running request holds blocks for its computed tokens and at
    most for all its tokens (none left over from rejected guesses), the allocator's reference
    counts are the holders, free + held + cached = the pool."""
    s = engine.scheduler
    alloc, holders = s.allocator, {}
    for r in s.admitted:
        bs = s.block_size
        assert blocks_needed(r.num_computed, bs) <= len(r.blocks) <= blocks_needed(r.num_tokens, bs), \
            (r.request_id, len(r.blocks), r.num_computed, r.num_tokens)
        assert r.num_computed <= r.num_tokens and not r.spec_token_ids
        for b in r.blocks:
            holders[b] = holders.get(b, 0) + 1
    assert holders == alloc.ref_count
    assert len(alloc.free_blocks) + len(alloc.cached) + len(alloc.ref_count) == alloc.num_blocks


def run_stream(llm, prompts, params, seed, abort_at=()):
    """Requests arrive between steps; abort_at: request indices aborted after their first token."""
    eng, rnd = llm.engine, random.Random(seed)
    ids, done, pending = {}, {}, list(range(len(prompts)))
    while pending or eng.has_work():
        for _ in range(rnd.randint(0, 3)):
            if pending:
                i = pending.pop(0)
                ids[eng.add_request(prompts[i], params[i])] = i
        for r in eng.step():
            done[ids[r.request_id]] = r
        check_blocks(eng)
        for i in abort_at:
            rid = next((k for k, v in ids.items() if v == i), None)
            if rid is not None and rid in eng.scheduler.requests and eng.scheduler.requests[rid].output_token_ids:
                eng.abort(rid)
    assert eng.scheduler.allocator.num_used == 0
    return [done[i] for i in range(len(prompts))]


@pytest.mark.parametrize("variant", ["preempt+prefix", "graphs-eager+chunked", "overlap+adaptive", "overlap+shadow",
                                     "overlap+switching"])
def test_greedy_identity_on_random_streams(variant, monkeypatch):
    """overlap+adaptive: the overlap loop runs a step ahead wherever nobody guesses (requests the
    adaptive k paused), and reads the step in flight first where someone will. overlap+shadow: the
    same with the lookups' replay deciding who guesses (spec/shadow.py); overlap+switching: the replay
    where one sequence decodes, the gate's probes where more do (arrivals switch between them; the
    default switches the same way at Speculator.SHADOW_MAX_BATCH = 16 sequences)."""
    rnd = random.Random(len(variant))
    prompts = copy_prompts(rnd, 10)
    prompts += [prompts[0] + prompts[1][:5], prompts[2][:20]]        # shared prefixes (prefix caching)
    kw = dict(dtype="float32", max_num_seqs=4, cuda_graphs=False)
    if variant == "preempt+prefix":
        kw.update(num_blocks=14, block_size=4, prefix_caching=True)
    elif variant == "graphs-eager+chunked":
        kw.update(cuda_graphs="eager", max_num_batched_tokens=24, block_size=8)
    else:
        kw.update(cuda_graphs="eager", block_size=8)
    plain = tiny_llm(**kw)
    ref = plain.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True))
    # stop ids and max_tokens chosen to fall inside a step's guesses
    params = []
    for o in ref:
        kind = rnd.choice(["len", "stop", "long"])
        if kind == "stop":
            params.append(SamplingParams(max_tokens=30, ignore_eos=True,
                                         stop_token_ids=[o.token_ids[rnd.randrange(len(o.token_ids))]]))
        else:
            params.append(SamplingParams(max_tokens=rnd.randint(1, 30) if kind == "len" else 30, ignore_eos=True))
    want = run_stream(plain, prompts, params, seed=1)
    sc = NGRAM
    if variant.startswith("overlap+"):      # fixed costs (not timed: the same pauses each run): a verify step
        from pagedlab.spec.speculator import Speculator          # 2.5 plain ones per request, 1.2 the batch's
        monkeypatch.setattr(Speculator, "cost", property(lambda self: 1.0 if variant == "overlap+switching" else 2.5))
        monkeypatch.setattr(Speculator, "batch_cost", lambda self, b: 1.2 if variant == "overlap+adaptive" else 1.0)
        if variant != "overlap+switching":
            monkeypatch.setattr(Speculator, "SHADOW", variant == "overlap+shadow")
        monkeypatch.setattr(Speculator, "SHADOW_MAX_BATCH", 1 if variant == "overlap+switching" else 1 << 30)
        sc = dict(NGRAM, adaptive=True)
    spec = tiny_llm(speculative_config=sc, **kw)
    if variant in ("overlap+shadow", "overlap+switching"):    # the gate open whenever a request's replayed lookups pay,
        spec.engine.speculator.gate.open_margin = 0.0           # and a low bar for each: verify steps
        spec.engine.speculator.row_gain = 1.2                   # and steps run ahead both
    regimes = []
    if variant == "overlap+switching":
        s, plan = spec.engine.speculator, spec.engine.speculator.plan

        def watched(sched, step):
            plan(sched, step)
            if step.decode:
                regimes.append(s._shadow_regime)
        s.plan = watched
    got = run_stream(spec, prompts, params, seed=2, abort_at=(3, 7))
    for i, (a, b) in enumerate(zip(want, got)):
        if b.finish_reason == "abort":
            assert a.output_token_ids[:len(b.output_token_ids)] == b.output_token_ids, i
        else:
            assert (a.output_token_ids, a.finish_reason) == (b.output_token_ids, b.finish_reason), i
    s = spec.engine.speculator
    assert s.num_accepted > 5 and s.num_proposed > s.num_accepted      # it guessed, kept some, lost some
    if variant == "preempt+prefix":
        assert sum(r.num_preemptions for r in got) > 0 and spec.engine.scheduler.allocator.prefix_hits > 0
    if variant.startswith("overlap+"):
        assert spec.engine.overlap and spec.engine.num_overlapped >= 5, spec.engine.num_overlapped
        assert (s.shadow is not None) == (variant != "overlap+adaptive")
    if variant == "overlap+switching":          # both rules ran (the stream ends with one sequence)
        assert True in regimes and False in regimes, regimes


def test_sampling_penalties_logprobs_stop_strings_identical():
    rnd = random.Random(5)
    prompts = copy_prompts(rnd, 8)
    kw = dict(dtype="float32", max_num_seqs=3)
    plain = tiny_llm(**kw)
    free = plain.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    params = mixed_params(free, rnd, max_tokens=16)
    params[0] = SamplingParams(max_tokens=16, temperature=1.0, seed=3, ignore_eos=True)   # sampled, surely
    want = plain.generate(prompts, params)
    spec = tiny_llm(speculative_config=dict(NGRAM, num_speculative_tokens=3), **kw)
    got = spec.generate(prompts, params)
    for a, b in zip(want, got):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        assert (a.logprobs is None) == (b.logprobs is None)
        if a.logprobs:
            assert [x.token_id for x in a.logprobs] == [x.token_id for x in b.logprobs]
    assert sum(o.num_spec_proposed for o in got) == spec.engine.speculator.num_proposed > 0
    assert sum(o.num_spec_accepted for o in got) == spec.engine.speculator.num_accepted
    assert all(o.num_spec_accepted <= o.num_spec_proposed for o in got)
    assert all(o.num_spec_proposed == 0 for o, p in zip(got, params) if p.has_penalties or p.logprobs is not None)


def test_a_failing_proposer_costs_only_its_guesses():
    """A proposer that raises (every third call) wedges nothing: the output is the plain engine's."""
    rnd = random.Random(4)
    prompts = copy_prompts(rnd, 5)
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    want = tiny_llm(dtype="float32", max_num_seqs=3).generate(prompts, sp)
    llm = tiny_llm(dtype="float32", max_num_seqs=3, speculative_config=NGRAM)
    spec, calls = llm.engine.speculator, [0]
    good = spec.proposer.propose

    def flaky(reqs, ks):
        calls[0] += 1
        if calls[0] % 3 == 0:
            raise RuntimeError("proposer broke")
        return good(reqs, ks)
    spec.proposer.propose = flaky
    got = llm.generate(prompts, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert spec.num_proposer_errors > 0 and "proposer broke" in spec.last_proposer_error
    assert spec.num_accepted > 0 and llm.engine.scheduler.allocator.num_used == 0


def test_metrics_count_guesses():
    """/metrics: pagedlab_spec_proposed_tokens / _accepted_tokens add up the finished requests'."""
    pytest.importorskip("prometheus_client")
    from pagedlab.server.metrics import ServerMetrics
    llm = tiny_llm(dtype="float32", max_num_seqs=2, speculative_config=NGRAM)
    outs = llm.generate(copy_prompts(random.Random(3), 3), SamplingParams(max_tokens=12, ignore_eos=True))
    m = ServerMetrics(lambda: {})
    for o in outs:
        m.on_finish(o)
    text = m.render().decode()
    for name, n in (("proposed", sum(o.num_spec_proposed for o in outs)), ("accepted", sum(o.num_spec_accepted for o in outs))):
        assert f"pagedlab_spec_{name}_tokens_total {float(n)}" in text
    assert sum(o.num_spec_proposed for o in outs) > 0


def test_adaptive_k_backs_off():
    """A request whose guesses are all wrong stops proposing (k = 0) for a while."""
    from pagedlab.spec import AdaptiveK
    from pagedlab.request import Request
    r = Request(0, [1], SamplingParams(), 0)
    ak = AdaptiveK(4)
    assert ak.k(r) == 4
    ks = []
    for _ in range(40):
        k = ak.k(r)
        ks.append(k)
        ak.update(r, k, 0)
    first_pause = ks.index(0)
    assert first_pause <= 5 and ks.count(0) >= 30 and max(ks[first_pause:]) <= 2, ks   # paused, short probes
    # every guess kept, but a verify step costs 3x a plain one and emits 2 tokens: it does not pay
    r2, ks = Request(1, [1], SamplingParams(), 0), []
    for _ in range(20):
        k = ak.k(r2, cost=3.0)
        ks.append(k)
        ak.update(r2, min(k, 1), min(k, 1), cost=3.0)
    assert ks[0] > 0 and ks.count(0) >= 14, ks
    # pauses after short probes double (up to max_pause): text where guessing does not pay stops
    # paying for the probes; a long paying run starts them short again
    r3, pauses = Request(2, [1], SamplingParams(), 0), []

    def probe(kept):                             # guess until paused; the pause it got
        while not r3.spec_pause:
            k = ak.k(r3)
            ak.update(r3, k, kept(k))
        pauses.append(r3.spec_pause)
        while r3.spec_pause:
            assert ak.k(r3) == 0
    for _ in range(6):
        probe(lambda k: 0)
    assert pauses == [16, 32, 64, 128, 256, 256], pauses
    runs = []
    probe(lambda k: runs.append(k) or (k if len(runs) < 12 else 0))   # 12 paying steps, then none
    assert pauses[-1] == 16 and len(runs) > 12, (pauses, runs)
    # a lookup that finds nothing: a pause as long as the misses in a row (up to max_miss_pause)
    r4, pauses = Request(3, [1], SamplingParams(), 0), []
    for _ in range(4):
        ak.proposed(r4, False)
        pauses.append(r4.spec_pause)
        while r4.spec_pause:
            ak.k(r4)
    assert pauses == [1, 2, 2, 2], pauses
    ak.proposed(r4, True)
    assert r4.spec_misses == 0


def test_trace_records_guesses():
    """trace=True: each step's record names each request's guesses and how many were kept (the
    explorer's slot labels show them); the step's token count includes the guess rows."""
    llm = tiny_llm(dtype="float32", max_num_seqs=2, trace=True, speculative_config=NGRAM)
    outs = llm.generate(copy_prompts(random.Random(6), 3), SamplingParams(max_tokens=16, ignore_eos=True))
    steps = list(llm.trace.steps)
    logged = [(g, kept) for s in steps for g, kept in s.spec.values()]
    assert logged and sum(k for _, k in logged) == sum(o.num_spec_accepted for o in outs)
    assert sum(len(g) for g, _ in logged) == sum(o.num_spec_proposed for o in outs)
    s = next(s for s in steps if s.spec and not any(p == "prefill" for p in s.slot_phase))
    assert s.num_tokens == len(s.emitted) + sum(len(g) for g, _ in s.spec.values())


def test_cli_flag(capsys):
    """--speculative-config: vLLM's JSON; bad JSON or a bad key is refused in one line."""
    from pagedlab.__main__ import main
    base = ["generate", "--model", "random:tiny", "--device", "cpu", "--max-tokens", "6"]
    for bad, word in (("{bad", "must be JSON"), ('{"method": "eagle"}', "method")):
        with pytest.raises(SystemExit):
            main(base + ["--speculative-config", bad, "hi"])
        assert word in capsys.readouterr().err
    assert main(base + ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
                        "a b a b a b"]) in (0, None)
    assert "stopped at 6 tokens" in capsys.readouterr().err


def test_bad_speculative_config_is_refused():
    from pagedlab.config import ConfigError, EngineConfig
    for bad, word in (({"method": "medusa"}, "method"), ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
                      ({"prompt_lookup_mx": 3}, "prompt_lookup_mx"), ("ngram", "dict"),
                      ({"prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min")):
        with pytest.raises(ConfigError, match=word):
            EngineConfig(speculative_config=bad)


def test_ctrl_c_anywhere_while_speculating():
    """Real SIGINTs aimed at sites of the bookkeeping -- the speculator's included -- during a
    randomized copy-heavy stream (test_interrupts' machinery): after each, every request and
    block is accounted for; the outputs equal the plain engine's; the engine runs on."""
    import os
    import test_interrupts as ti
    from helpers import interrupts_in_finalizers_dropped
    from pagedlab.spec import speculator
    rnd = random.Random(8)
    prompts = copy_prompts(rnd, 8)
    params = [SamplingParams(max_tokens=rnd.randint(4, 16), ignore_eos=True) for _ in prompts]
    stream = (prompts, params, [rnd.randint(0, 6) for _ in prompts])
    want = ti.outputs(ti.run_stream(ti.engine_for("plain+prefix"), stream, ti.plain_step))
    eng = ti.engine_for("plain+prefix", speculative_config=NGRAM)
    spec_file = os.path.abspath(speculator.__file__)
    hook = ti.SignalAt(ti.BOOKKEEPING | {spec_file})
    sweep, everyone = ti.SiteSweep(hook, seed=2), []
    with interrupts_in_finalizers_dropped():
        assert ti.outputs(ti.run_stream(eng, stream, sweep, everyone)) == want
    assert ti.outputs(ti.run_stream(eng, stream, ti.plain_step, everyone)) == want
    assert sweep.interrupts > 0 and any(f == spec_file for f, _, _, _ in hook.fired)
    assert eng.speculator.num_accepted > 0


# ----------------------------------------------------------------------------- draft model
@pytest.mark.parametrize("draft", ["same", "random"])
def test_draft_model(draft):
    """A draft equal to the target keeps (almost) every guess; a random draft keeps almost none;
    the output is the plain engine's either way (with preemption in a small pool)."""
    from pagedlab import tiny_config
    from pagedlab.weights import random_checkpoint
    rnd = random.Random(11)
    prompts = copy_prompts(rnd, 6)
    kw = dict(dtype="float32", max_num_seqs=3, num_blocks=20, block_size=4, cuda_graphs="eager")
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    want = tiny_llm(**kw).generate(prompts, sp)
    ckpt = random_checkpoint(tiny_config(), 0 if draft == "same" else 99)
    llm = tiny_llm(speculative_config={"method": "draft", "model": ckpt, "num_speculative_tokens": 3,
                                       "adaptive": False}, **kw)
    got = llm.generate(prompts, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    proposed, kept = sum(o.num_spec_proposed for o in got), sum(o.num_spec_accepted for o in got)
    assert proposed > 30
    if draft == "same":
        assert kept >= 0.95 * proposed, (kept, proposed)
    else:
        assert kept <= 0.1 * proposed, (kept, proposed)
    prop = llm.engine.speculator.proposer
    assert not prop.shadows and prop.allocator.num_used == 0     # every shadow's blocks went back


# ----------------------------------------------------------------------------- rejection sampling
def chi2_p(counts, probs):
    n = counts.sum()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    expected = probs[keep] * n
    x = float((((counts[keep] - expected) ** 2) / expected).sum())
    df = int(keep.sum()) - 1                         # P(chi2_df > x) = Q(df / 2, x / 2)
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(x / 2, dtype=torch.float64)))


@pytest.mark.parametrize("one_hot", [False, True])
def test_rejection_sampling_keeps_the_target_distribution(one_hot):
    g = torch.Generator().manual_seed(7 + one_hot)
    V, k, N = 5, 2, 3000
    p = torch.softmax(torch.randn(k + 1, V, generator=g, dtype=torch.float64) * 1.5, -1)
    q = torch.softmax(torch.randn(k, V, generator=g, dtype=torch.float64) * 1.5, -1)
    p[1, 4] = 0.0                                    # a token the target never emits at position 1
    p[1] /= p[1].sum()
    first, second, kept = np.zeros(V), np.zeros(V), 0
    for _ in range(N):
        drafts = torch.multinomial(q, 1, generator=g)[:, 0]
        out = rejection_sample(p, drafts, None if one_hot else q, generator=g)
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
        kept += len(out) - 1
    # target rows here do not depend on the tokens before them: position i is p[i] whatever came first
    assert chi2_p(first, p[0].numpy()) > 1e-3
    assert chi2_p(second, p[1].numpy()) > 1e-3
    assert 0 < kept < N * k


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_bench_spec_repeats_and_breakdown(tmp_path):
    """bench spec --small: runs alternate off / on, medians per variant, and the instrumented run's
    steps split by kind add up to the engine's steps (verify steps included), with the same tokens."""
    from pagedlab.bench.spec import run
    # (the gate's rule, not the lookups' replay: on the tiny random model the replay rightly sees
    # nothing worth a verify step in 16 tokens, and this test needs verify steps to count)
    res = run(["--small", "--workloads", "copy", "--modes", "one_stream", "--repeats", "2", "--breakdown",
               "--max-tokens", "16", "--fused-rows", "off@shadow=off", "--out", str(tmp_path)])
    r = res["runs"]["copy/one_stream"]
    for v in ("off", "on"):
        x = r["variants"][v]
        assert len(x["tokens_per_s"]) == 2 and min(x["tokens_per_s"]) <= x["median"] <= max(x["tokens_per_s"])
        assert x["same_tokens"] == 1.0
    assert r["variants"]["on"]["median_run"]["accepted"] > 0
    for v, b in res["breakdown"].items():       # each launch emits one token per request, + kept guesses
        launches = sum(k["steps"] for k in b["kinds"].values())
        assert b["kinds"]["prefill"]["steps"] == 4 and launches + b["accepted"] == b["tokens"], (v, b)
    assert res["breakdown"]["copy/on"]["kinds"]["verify"]["rows"] > 1
    assert "verify" not in res["breakdown"]["copy/off"]["kinds"]
    assert (tmp_path / "spec_bench.md").read_text().count("| copy | one_stream |") == 2


def test_bench_spec_graph_prefill_variants(tmp_path):
    """bench spec --graph-prefill 0,8: off and on once per value in one engine, each on-run's speed-up
    against the off-run of its own value, the runner's own setting back after."""
    from pagedlab.bench.spec import run
    from pagedlab.runner import ModelRunner
    res = run(["--small", "--workloads", "copy", "--modes", "one_stream", "--max-tokens", "8",
               "--graph-prefill", "0,8", "--out", str(tmp_path)])
    vs = res["runs"]["copy/one_stream"]["variants"]
    assert list(vs) == ["off (graph prefill 0)", "on (graph prefill 0)", "off (graph prefill 8)", "on (graph prefill 8)"]
    for v, x in vs.items():
        assert x["against"] == v.replace("on", "off") and x["same_tokens"] == 1.0
        assert x["speedup"] == pytest.approx(x["median"] / vs[x["against"]]["median"])
    assert res["graph_prefill_rows"] == [0, 8] and ModelRunner.GRAPH_PREFILL_ROWS is None   # (class untouched)


def test_bench_spec_fused_rows_bound_per_variant(monkeypatch):
    """--fused-rows fma_layers:3: that variant's graphs are captured with the fused kernels up to 3
    rows (gemv.FMA_ROWS while they are captured, put back after, also when a capture raises);
    MODE:N is refused for the modes without a row bound."""
    import types
    import pagedlab.cuda_graph as cuda_graph
    from pagedlab.bench.spec import run, variant_graphs
    from pagedlab.kernels import gemv
    seen = []

    class Recorder:
        def __init__(self, *args, **kwargs):
            if gemv.FMA_ROWS == 2:
                raise RuntimeError("capture failed")
            seen.append((gemv._FUSED_ROWS[0], gemv.FMA_ROWS))

    monkeypatch.setattr(cuda_graph, "DecodeGraphs", Recorder)
    own = types.SimpleNamespace(capture=True, max_seq_len=64, sizes=[1, 2, 4])
    runner = types.SimpleNamespace(graphs=own, spec_fused_rows="fma_layers", model=None, kv_cache=None,
                                   block_table=types.SimpleNamespace(table=None))
    llm = types.SimpleNamespace(engine=types.SimpleNamespace(runner=runner))
    bound = gemv.FMA_ROWS
    out = variant_graphs(llm, ["fma_layers", "fma_layers:3", "fma:4", "off"])
    assert out["fma_layers"] is own
    assert seen == [("fma_layers", 3), ("fma", 4), (False, bound)]
    assert gemv.FMA_ROWS == bound and gemv._FUSED_ROWS[0] is False
    with pytest.raises(RuntimeError):
        variant_graphs(llm, ["fma:2"])
    assert gemv.FMA_ROWS == bound and gemv._FUSED_ROWS[0] is False
    for bad in ("dot:3", "fma:0", "fma_layers:x", "off:2"):
        with pytest.raises(SystemExit, match="--fused-rows"):
            run(["--small", "--fused-rows", bad])

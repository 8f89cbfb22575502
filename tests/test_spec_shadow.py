"""The lookups' replay (spec/shadow.py): what n-gram guessing would keep, read from the tokens the
plain steps emit. The incremental index gives propose_ngram's guesses; the replay's lookups and
their kept counts are a speculating stream's, however the tokens arrive; with the replay on, the
speculative engine (tiny random model, fp32, CPU, the overlap loop on the graph code path run
eagerly) gives the plain engine's tokens, guesses only where the replay said it pays, and runs
ahead elsewhere."""
import random

import pytest

from helpers import tiny_llm
from pagedlab import SamplingParams
from pagedlab.spec.ngram import propose_ngram
from pagedlab.spec.shadow import NgramIndex, Shadow
from pagedlab.spec.speculator import Speculator


def test_index_gives_the_rules_guesses():
    rnd = random.Random(0)
    for _ in range(400):
        vocab = rnd.choice([2, 3, 5, 40])
        toks = [rnd.randrange(vocab) for _ in range(rnd.randint(0, 70))]
        n_max = rnd.randint(1, 5)
        n_min, k = rnd.randint(1, n_max), rnd.randint(0, 6)
        idx = NgramIndex(n_max, n_min)
        lengths = sorted(rnd.sample(range(len(toks) + 1), k=min(len(toks) + 1, rnd.randint(1, 12))))
        if rnd.random() < 0.2:
            lengths = lengths[::-1]           # filled past a length already: still the rule's answer
        for L in lengths:
            assert idx.propose(toks, k, L) == propose_ngram(toks[:L], k, n_max, n_min), (toks, L, n_max, n_min, k)


class Req:
    def __init__(self, prompt):
        self.request_id, self.prompt_token_ids, self.output_token_ids = 7, prompt, []


def stream(prompt, out, k, n_max, n_min):
    """A speculating stream's lookups over these tokens (each guessing k, the first after the
    prefill's token): the guesses each one keeps, for those the tokens decide."""
    toks, at, kept = prompt + out, len(prompt) + 1, []
    while at <= len(toks):
        g = propose_ngram(toks[:at], k, n_max, n_min)
        m = 0
        while m < len(g) and at + m < len(toks) and toks[at + m] == g[m]:
            m += 1
        if g and at + m >= len(toks):
            break                             # (its next token not known yet)
        kept.append(m)
        at += m + 1
    return kept


def test_the_replay_keeps_what_a_speculating_stream_keeps():
    rnd = random.Random(1)
    for _ in range(300):
        vocab = rnd.choice([2, 3, 8, 30])
        prompt = [rnd.randrange(vocab) for _ in range(rnd.randint(1, 12))]
        out = [rnd.randrange(vocab) for _ in range(rnd.randint(0, 60))]
        k, n_max = rnd.randint(1, 5), rnd.randint(1, 4)
        sh = Shadow(k, n_max, 1, weight=0.3)
        kept, finish = [], sh._finish
        sh._finish = lambda s, m: (kept.append(m), finish(s, m))
        r, i = Req(prompt), 0
        while i < len(out):                   # tokens in bursts (verify steps keep several)
            i += rnd.choice([1, 2, 3, 5, 40])    # (40: catching up after larger batches)
            r.output_token_ids = out[:i]
            sh.update(r)
            if rnd.random() < 0.3:            # a real lookup in between (a verify step)
                assert sh.propose(r, k) == propose_ngram(prompt + r.output_token_ids, k, n_max, 1)
        want = stream(prompt, out, k, n_max, 1)
        assert kept == want, (prompt, out, k)
        if want:                              # the running mean: plain averages first, then weight 0.3
            g = None
            for c, m in enumerate(want, 1):
                g = 1 + m if g is None else g + max(0.3, 1 / c) * (1 + m - g)
            assert sh.gain(r) == pytest.approx(g) or sh.states[7].matched
        else:
            assert sh.gain(r) is None or sh.states[7].matched
    sh.forget_except(set())
    assert sh.states == {}


def run(prompts, max_tokens=40, cost=1.5, shadow=True, laggards=None, **kw):
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    kw = dict(dtype="float32", max_num_seqs=len(prompts), cuda_graphs="eager", block_size=8, **kw)
    want = tiny_llm(**kw).generate(prompts, sp)
    llm = tiny_llm(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
                   **kw)
    spec = llm.engine.speculator
    spec.shadow_on, spec.shadow_max_batch = shadow, 1 << 30       # its rule at every batch size
    if laggards is not None:
        spec.gate.laggards = laggards
    assert llm.engine.overlap and spec.shadow is not None or not shadow
    steps, plan = [], spec.plan

    def watched(sched, step):
        est = spec.shadow_estimate(sched, step.decode) if shadow and step.decode else None
        pays = {r.request_id: spec._pays(spec.shadow, r) for r in step.decode} if shadow else {}
        plan(sched, step)
        steps.append(dict(est=est, guessed=step.guessed, open=spec.gate.open, decode=len(step.decode),
                          ahead=any(r.num_in_flight for r in step.decode),
                          who=[r.request_id for r in step.decode if r.spec_token_ids], pays=pays))
    spec.plan = watched
    got = llm.generate(prompts, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]       # verification is exact
    assert llm.engine.scheduler.allocator.num_used == 0
    return spec, steps, want


@pytest.fixture
def fixed_costs(monkeypatch):
    monkeypatch.setattr(Speculator, "cost", property(lambda self: 1.5))
    monkeypatch.setattr(Speculator, "batch_cost", lambda self, b: 1.5)


def test_guesses_only_where_the_replay_says_it_pays(monkeypatch):
    cost = 1.15                               # a cheap verify step: the loops below pay for the batch
    monkeypatch.setattr(Speculator, "cost", property(lambda self: cost))
    monkeypatch.setattr(Speculator, "batch_cost", lambda self, b: cost)
    rnd = random.Random(3)
    # the tiny random model falls into loops: some requests' text repeats (lookups find it), some not
    prompts = [[rnd.randrange(3, 400) for _ in range(rnd.randint(4, 14))] for _ in range(6)]
    spec, steps, want = run(prompts, max_tokens=60, laggards=0)    # (the mean gain: see the estimate's test)
    gate = spec.gate
    verify = [s for s in steps if s["guessed"]]
    assert verify and spec.num_accepted > 0
    for s in verify:                          # opened at cost + open_margin or kept open above the cost
        assert s["est"] >= cost and all(s["pays"][rid] for rid in s["who"])
    for s in steps:
        if s["est"] is not None and s["est"] < cost:
            assert not s["guessed"] and not s["open"]
    # a fresh batch starts closed: nobody guesses before a lookup's fate is known
    assert not steps[0]["guessed"] and not steps[1]["guessed"]
    assert gate.num_opens >= 1 and gate.num_probes == 0
    # the steps the gate kept closed ran ahead (but the first decode step and those after a verify step)
    closed = [i for i, s in enumerate(steps) if s["decode"] and not s["open"]]
    synced = [i for i in closed if not steps[i]["ahead"]]
    assert len(synced) <= 2 + 2 * gate.num_opens, (len(synced), gate.num_opens)


def test_the_estimate_is_the_batch_ends_speed_up_without_a_queue():
    """Nobody waiting: the batch lasts as long as its slowest sequence -- max(left) / max(left / gain);
    with a queue, or laggards=0, the mean gain; a request whose gain is under row_gain counts 1."""
    from types import SimpleNamespace as NS
    s = Speculator(proposer=None, k_max=4)
    s.shadow_on = True
    from pagedlab.spec.ngram import NgramProposer
    s.proposer = NgramProposer(3)
    sh = s.shadow

    def req(rid, gain, out, max_new=100):
        r = NS(request_id=rid, params=NS(max_new_tokens=max_new, has_penalties=False, logprobs=None),
               output_token_ids=[0] * out, num_in_flight=0, num_tokens=10 + out, prompt_token_ids=[1] * 10)
        st = sh.state(r)
        st.gain = gain
        return r
    sched = NS(waiting=[], max_model_len=1000)
    loop, plain = [req(i, 5.0, 20) for i in range(4)], [req(10 + i, 1.0, 20) for i in range(12)]
    assert s.shadow_estimate(sched, loop + plain) == pytest.approx(1.0)       # equal budgets: the slowest
    assert s.shadow_estimate(sched, loop) == pytest.approx(5.0)
    near_end = [req(20 + i, 1.0, 95) for i in range(12)]                      # 5 tokens left each
    assert s.shadow_estimate(sched, loop + near_end) == pytest.approx(5.0)    # they end first anyway
    mixed = [req(30, 3.0, 20), req(31, 1.2, 60)]                              # 80 / 3 vs 40 / 1 (1.2 < row_gain)
    assert s.shadow_estimate(sched, mixed) == pytest.approx(80 / 40)
    assert s.shadow_estimate(NS(waiting=[object()], max_model_len=1000), loop + plain) == pytest.approx(2.0)
    s.gate.laggards = 0
    assert s.shadow_estimate(sched, loop + plain) == pytest.approx(2.0)
    assert s.shadow_estimate(sched, [req(40, 4.0, 0)]) == 4.0


def test_text_that_never_repeats_never_verifies(fixed_costs, monkeypatch):
    """Guesses that are never right (the replay sees every lookup miss): no verify step at all, every
    decode step but the first runs ahead -- the plain engine's pace."""
    from pagedlab.spec import shadow as shadow_mod
    monkeypatch.setattr(shadow_mod.NgramIndex, "propose", lambda self, tokens, k, length=None: [])
    rnd = random.Random(4)
    prompts = [[rnd.randrange(3, 400) for _ in range(rnd.randint(4, 14))] for _ in range(4)]
    spec, steps, _ = run(prompts, max_tokens=30)
    assert spec.num_proposed == 0 and spec.gate.num_opens == 0
    dec = [s for s in steps if s["decode"]]
    assert sum(not s["ahead"] for s in dec) <= 1, [s["ahead"] for s in dec]


def test_copying_opens_fast_and_stays_open(fixed_costs, monkeypatch):
    """Lookups that always find what comes (an oracle on the plain engine's tokens: a copy from the
    first token on): the replay says so after its first lookup, the gate opens and stays open."""
    from pagedlab.spec import shadow as shadow_mod
    rnd = random.Random(5)
    prompts = [[rnd.randrange(3, 400) for _ in range(rnd.randint(4, 14))] for _ in range(3)]
    ref = tiny_llm(dtype="float32", max_num_seqs=3).generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True))
    ref = {tuple(p): o.token_ids for p, o in zip(prompts, ref)}

    def oracle(self, tokens, k, length=None):
        L = len(tokens) if length is None else length
        p = next(p for p in ref if tuple(tokens[:len(p)]) == p)
        return ref[p][L - len(p):L - len(p) + k]
    monkeypatch.setattr(shadow_mod.NgramIndex, "propose", oracle)
    spec, steps, want = run(prompts, max_tokens=30)
    assert spec.num_accepted >= 0.9 * spec.num_proposed > 0
    first = next(i for i, s in enumerate(steps) if s["guessed"])
    assert first <= 4 and spec.gate.num_closes == 0, (first, spec.gate.num_closes)
    assert sum(s["guessed"] for s in steps) <= 30 / 5 + 4


def test_off_and_other_proposers_keep_the_old_rule():
    s = Speculator(proposer=None, k_max=4)
    assert s.shadow is None
    from pagedlab.spec.ngram import NgramProposer
    s = Speculator(proposer=NgramProposer(3), k_max=4)
    assert s.shadow is not None and (s.shadow.k, s.shadow.n_max) == (4, 3)
    b = Speculator.SHADOW_MAX_BATCH           # up to 16 decoding sequences by default
    assert s.shadow_rules(1) is s.shadow and s.shadow_rules(b) is s.shadow and s.shadow_rules(b + 1) is None
    s.shadow_on = False
    assert s.shadow is None and s.shadow_rules(1) is None
    s.shadow_on = True
    s.proposer = NgramProposer(3, fn=propose_ngram)     # the chapter's own rule: not replayed
    assert s.shadow is None
    s.proposer, s.adaptive = NgramProposer(3), None      # a fixed k: every step guesses
    assert s.shadow is None


def test_bench_spec_shadow_variant(tmp_path):
    from pagedlab.bench.spec import run as bench
    res = bench(["--small", "--workloads", "copy", "--modes", "batched", "--copies", "2", "--max-tokens", "8",
                 "--fused-rows", "off,off@shadow=on+row_gain=1.5", "--out", str(tmp_path)])
    vs = res["runs"]["copy/batched"]["variants"]
    assert [v["median_run"]["shadow"] for v in vs.values()] == [None, Speculator.SHADOW_MAX_BATCH, 1 << 30]
    assert all(x["same_tokens"] == 1.0 for x in vs.values())
    with pytest.raises(SystemExit):
        bench(["--small", "--fused-rows", "off@shadow=maybe", "--out", str(tmp_path)])


def test_the_gate_with_a_shadow_opens_above_the_margin_and_closes_below_the_cost():
    from pagedlab.spec.gate import BatchGate
    g = BatchGate(open_margin=0.3, default_cost=1.7)
    assert not g.shadow_step(0, 5.0, 1.5) and not g.open           # a fresh batch: closed
    assert not g.shadow_step(4, 1.79, 1.5)                         # under cost + margin: stays closed
    assert g.shadow_step(4, 1.8, 1.5) and g.num_opens == 1          # at it: opens
    assert g.shadow_step(4, 1.5, 1.5)                              # open while >= the cost
    assert not g.shadow_step(4, 1.49, 1.5) and g.num_closes == 1
    assert not g.decide(1.99, None) and g.decide(2.0, None)        # no cost measured: default_cost
    assert g.num_probes == 0 and g.num_plain_steps == 2             # (nobody decoding: no plain step)


def test_a_pending_lookup_counts_what_it_kept_so_far():
    sh = Shadow(4, 2, 1)
    r = Req([5, 6, 7, 8, 9, 5])
    r.output_token_ids = [6]                  # the lookup after [.., 5, 6] guesses 7 8 9 5
    sh.update(r)
    assert sh.gain(r) is None
    r.output_token_ids = [6, 7, 8]            # two confirmed: a verify step would emit >= 3
    sh.update(r)
    assert sh.gain(r) == 3 and sh.states[7].count == 0
    r.output_token_ids = [6, 7, 8, 1]         # the third one wrong: kept 2, done; the lookup after
    sh.update(r)                              # [.., 8, 1] finds nothing: a plain step there (1 token)
    assert sh.states[7].count == 2 and sh.gain(r) == 2 and sh.states[7].at == 11

"""The batch's gate (spec/gate.py BatchGate): speculation turned off for the whole batch where a
verify step costs more than the guesses it keeps, plain steps run ahead meanwhile, probes that come
back. The rule step by step, then the engine (tiny random model, fp32, CPU, the overlap loop on
the graph code path run eagerly) with proposers whose acceptance is chosen: always wrong, always
right (the plain engine's own tokens), wrong then right. The step costs are fixed (not timed: the
same switches each run); the tokens are the plain engine's every time."""
import random

import pytest

from helpers import tiny_llm
from pagedlab import SamplingParams
from pagedlab.spec.gate import BatchGate
from pagedlab.spec.speculator import Speculator

COST = 1.5          # a verify step costs 1.5 plain ones run ahead


def closed_steps(gate, b=4):
    """Plain steps until the gate opens again (each one counted down by step())."""
    n = 0
    while not gate.step(b, False):
        n += 1
    return n


def test_gate_closes_probes_doubles_and_comes_back():
    g = BatchGate()
    for _ in range(10):                               # 4 sequences keep 8 guesses a step: 3 tokens each
        assert g.step(4, False)
        g.verified(4, 8, COST)
    assert g.open and g.num_closes == 0
    waits = []
    for _ in range(6):                                # nothing kept: 1 token a sequence, < 1.5
        while g.open:
            assert g.step(4, False)
            g.verified(4, 0, COST)
        waits.append(g.wait)
        assert g.closed_next() and closed_steps(g) == waits[-1] and g.open
    assert waits == [16, 32, 64, 128, 256, 256], waits      # each short probe doubles the wait
    assert g.run == 0 and g.gain is None and g.num_probes == 6
    for _ in range(12):                               # the probe pays: it stays open
        assert g.step(4, False)
        g.verified(4, 3, COST)                        # 1.75 tokens a sequence
    assert g.open and g.num_closes == 6
    g.verified(4, 0, COST)
    g.verified(4, 0, COST)                            # a long paying run ended: short again
    assert not g.open and g.wait == 16
    # a prefill (a new request) brings the probe within `pause` steps; a dry engine starts afresh
    g.wait, g.streak = 200, 5
    g.step(4, True)
    assert g.wait == 15
    assert g.step(0, False) and g.open and g.streak == 0 and g.wait == 0
    # the cost at this size not measured yet: a few plain steps to measure it, not counted a close
    for _ in range(3):
        g.verified(4, 0, None)
    assert not g.open and g.wait == g.calibrate_steps and g.num_closes == 7 and g.streak == 0
    # judged only after min_steps verify steps of a phase
    g.reset()
    g.verified(4, 0, COST)
    g.verified(4, 0, COST)
    assert g.open


class ChosenProposer:
    """Guesses from the plain engine's outputs (`ref`: prompt -> tokens): right while
    `right(call, prompt)` says so, else each guess off by one (never kept)."""

    def __init__(self, ref, right):
        self.ref, self.right, self.calls = ref, right, 0

    def propose(self, reqs, ks):
        self.calls += 1
        out = []
        for r, k in zip(reqs, ks):
            n = len(r.output_token_ids)
            want = self.ref[tuple(r.prompt_token_ids)][n:n + k]
            ok = self.right(self.calls, tuple(r.prompt_token_ids))
            out.append(want if ok else [(t + 1) % 400 + 3 for t in want])
        return out


def run(right, n=4, max_tokens=48, seed=0, **gate):
    """The plain engine's tokens, the speculative engine's with the chosen proposer, and per plan():
    (the gate had closed the step, it guessed, rows of guesses, it ran a step ahead)."""
    rnd = random.Random(seed)
    prompts = [[rnd.randrange(3, 400) for _ in range(rnd.randint(4, 12))] for _ in range(n)]
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    kw = dict(dtype="float32", max_num_seqs=n, cuda_graphs="eager", block_size=8)
    want = tiny_llm(**kw).generate(prompts, sp)
    llm = tiny_llm(speculative_config={"method": "ngram", "num_speculative_tokens": 4}, **kw)
    spec = llm.engine.speculator
    assert llm.engine.overlap and spec.gate is not None
    spec.proposer = ChosenProposer({tuple(p): o.token_ids for p, o in zip(prompts, want)}, right)
    spec.adaptive.min_rate = 0.0        # the requests never pause themselves: the gate alone decides
    for name, value in gate.items():
        setattr(spec.gate, name, value)
    steps, plan = [], spec.plan

    def watched(sched, step):
        closed = spec.gate.closed_next()
        plan(sched, step)
        steps.append((closed, step.guessed, sum(len(r.spec_token_ids) for r in step.decode),
                      any(r.num_in_flight for r in step.decode)))
    spec.plan = watched
    got = llm.generate(prompts, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]       # verification is exact
    assert llm.engine.scheduler.allocator.num_used == 0
    return llm, spec, steps, prompts


@pytest.fixture
def fixed_costs(monkeypatch):
    monkeypatch.setattr(Speculator, "cost", property(lambda self: 1.0))    # (each request's AdaptiveK)
    monkeypatch.setattr(Speculator, "batch_cost", lambda self, b: COST)


def test_low_acceptance_switches_to_plain_steps_run_ahead(fixed_costs):
    llm, spec, steps, _ = run(right=lambda call, p: False)
    gate = spec.gate
    assert gate.num_closes >= 2 and spec.num_accepted == 0
    closed = [s for s in steps if s[0]]
    assert len(closed) >= len(steps) // 2, (len(closed), len(steps))    # most steps are plain ones
    assert all(not guessed and rows == 0 for _, guessed, rows, _ in closed)   # no guesses, no extra rows
    assert sum(ahead for *_, ahead in closed) >= len(closed) - 2 * gate.num_closes   # ... run ahead
    first = 1                           # verify steps until the start (just above the cost) falls below it
    start = min(gate.start_gain, COST + gate.start_margin)
    while first < gate.min_steps or 1 + (start - 1) * (1 - gate.weight) ** first >= COST:
        first += 1
    assert sum(s[1] for s in steps) == first + gate.probe_steps * gate.num_probes   # then the probes only
    # what the gate weighs on a real engine: step times per kind and batch size (sequences decoding)
    assert spec.times["verify"] and spec.times["ahead"] and set(spec.times["ahead"]) <= {1, 2, 3, 4}
    assert all(t > 0 for kind in spec.times.values() for t in kind.values())


def test_step_costs_are_read_at_the_nearest_batch_size():
    from pagedlab.spec.speculator import nearest
    s = Speculator(proposer=None, k_max=4)
    assert s.batch_cost(8) is None
    s.times["verify"].update({16: 3.0, 2: 1.0})
    s.times["sync"][16] = 1.5
    assert s.batch_cost(14) == pytest.approx(2.0)             # plain: the synced ones, none run ahead
    s.times["ahead"].update({15: 1.0, 2: 0.8})
    assert s.batch_cost(14) == pytest.approx(3.0) and s.batch_cost(2) == pytest.approx(1.25)
    assert s.batch_cost(8) == pytest.approx(1.25)             # measured elsewhere: the nearest size's ratio
    del s.times["ahead"][2]
    assert s.batch_cost(3) == pytest.approx(3.0)
    assert nearest({15: 1.0}, 12) == 1.0 and nearest({15: 1.0}, 11) is None


def test_copy_heavy_batch_keeps_speculating(fixed_costs):
    llm, spec, steps, _ = run(right=lambda call, p: True)
    assert spec.gate.num_closes == 0 and spec.gate.num_plain_steps == 0
    assert spec.num_accepted >= 0.9 * spec.num_proposed > 0
    tokens = 4 * 48
    assert sum(s[1] for s in steps) < tokens / 4 / 2          # each sequence > 2 tokens a step


def test_the_gate_probes_and_comes_back(fixed_costs):
    # wrong in the first phase (min_steps verify steps at a batch's start just above the cost), then right
    llm, spec, steps, _ = run(right=lambda call, p: call > 3, max_tokens=64)
    gate = spec.gate
    assert gate.num_closes == 1 and gate.num_probes == 1 and gate.open
    first_closed = next(i for i, s in enumerate(steps) if s[0])
    reopened = next(i for i, s in enumerate(steps) if i > first_closed and not s[0])
    assert any(s[1] for s in steps[reopened:])                # guessing again after the probe
    assert spec.num_accepted > spec.num_proposed / 2


def test_a_batch_starts_just_above_the_cost_one_stream_optimistic():
    """A fresh batch's first phase starts at cost + start_margin: where nothing is kept it closes
    after min_steps verify steps; one stream keeps the optimistic start_gain (a copy often starts
    after a few words); start_margin large: session 13's rule, the optimistic start at any batch."""
    def first_phase(b, **kw):
        g = BatchGate(**kw)
        n = 0
        while g.open:
            assert g.step(b, False)
            g.verified(b, 0, COST)
            n += 1
        return n
    g = BatchGate()
    optimistic = g.min_steps
    while 1 + (g.start_gain - 1) * (1 - g.weight) ** optimistic >= COST:
        optimistic += 1
    assert optimistic > g.min_steps
    assert first_phase(4) == g.min_steps and first_phase(16) == g.min_steps
    assert first_phase(1) == optimistic and first_phase(4, start_margin=99.0) == optimistic
    g = BatchGate()                       # a copy from the start: the start does not matter
    for _ in range(10):
        assert g.step(4, False)
        g.verified(4, 12, COST)
    assert g.open and g.gain > 3.5


def test_a_probe_is_judged_after_probe_steps_then_by_the_running_mean():
    g = BatchGate()
    while g.open:
        g.step(4, False)
        g.verified(4, 0, COST)
    closed_steps(g)
    assert g.open and g.probing
    g.verified(4, 0, COST)                # one verify step of nothing kept: closed at once
    assert not g.open and g.num_closes == 2 and g.wait == 2 * g.pause
    closed_steps(g)
    g.verified(4, 4, COST)                # a probe that pays (2 tokens a sequence) stays open ...
    assert g.open and not g.probing
    g.verified(4, 0, COST)                # ... judged by the running mean after min_steps
    assert g.open and g.run < g.min_steps
    g.verified(4, 0, COST)
    assert not g.open and g.num_closes == 3
    g = BatchGate(probe_steps=3)          # session 13: a probe of min_steps
    while g.open:
        g.step(4, False)
        g.verified(4, 0, COST)
    closed_steps(g)
    for _ in range(2):
        g.verified(4, 0, COST)
        assert g.open
    g.verified(4, 0, COST)
    assert not g.open


def test_the_gain_is_read_over_the_sequences_the_batch_waits_for():
    """With nobody waiting for a slot, guesses kept by the half of the batch closest to its end do
    not count (the batch lasts as long as the others); with a queue, or laggards=0, all do."""
    from types import SimpleNamespace as NS

    from pagedlab.request import RequestStatus

    class Req:                            # (hashed by identity, as pagedlab's Request)
        def __init__(self, **kw):
            self.__dict__.update(kw)

    def req(out, max_new=100, status=RequestStatus.RUNNING):
        return Req(status=status, params=NS(max_new_tokens=max_new), output_token_ids=[0] * out, num_tokens=10 + out)
    s = Speculator(proposer=None, k_max=4)
    s.gate.laggards = 0.5
    sched = NS(waiting=[], max_model_len=1000)
    a, b, c, d = req(50), req(50), req(10), req(12)        # (outputs after the step)
    kept = {a: 4, b: 4, d: 1}                              # c guessed nothing or was not asked
    # left before the step: a, b 54; c 90; d 89 -> the half with the most to go: c and d
    assert s.gate_sample(sched, [a, b, c, d], kept) == (2, 1)
    assert s.gate_sample(sched, [a, b, c, d, req(90, status=RequestStatus.FINISHED)], kept) == (2, 1)
    e = req(60, max_new=1000)                              # far from its end: it is waited for
    assert s.gate_sample(sched, [a, b, c, d, e], kept) == (3, 1)
    short = NS(waiting=[], max_model_len=75)               # max_model_len ends e first (5 left)
    assert s.gate_sample(short, [c, e], {c: 2}) == (2, 2)
    assert s.gate_sample(short, [c, d, e], {c: 2}) == (2, 2)
    assert s.gate_sample(sched, [a, b], {a: 4}) == (2, 4)  # two: both
    assert s.gate_sample(NS(waiting=[object()], max_model_len=1000), [a, b, c, d], kept) == (4, 9)
    s.gate.laggards = 0.75                                 # three quarters: a or b too (tied: both)
    assert s.gate_sample(sched, [a, b, c, d], kept) == (4, 9)
    s.gate.laggards = 0.25                                 # a quarter: c alone
    assert s.gate_sample(sched, [a, b, c, d], kept) == (1, 0)
    for s.gate.laggards in (0, 1):                         # every sequence
        assert s.gate_sample(sched, [a, b, c, d], kept) == (4, 9)


def test_guesses_kept_by_requests_ending_early_do_not_keep_the_gate_open(fixed_costs):
    """Half the batch copies (every guess right), half does not: the copying half runs ahead and
    ends early, the batch lasts as long as the other half, so the gate closes within a few verify
    steps; with laggards=0 (every sequence's guesses count) it stays open while the copiers run.
    The plain engine's tokens either way (run() checks)."""
    def right(call, prompt):
        return prompt in copiers
    firsts = {}
    for lag in (0.5, 0.0):
        copiers = set()
        _, _, _, prompts = run(right=lambda call, p: False, laggards=lag)       # (the prompts: same seed)
        copiers = {tuple(p) for p in prompts[::2]}
        llm, spec, steps, _ = run(right=right, laggards=lag)
        closed = [i for i, s in enumerate(steps) if s[0]]
        firsts[lag] = sum(s[1] for s in steps[:closed[0]]) if closed else len(steps)
        assert spec.num_accepted > 0
    assert firsts[0.5] <= 4 < firsts[0.0], firsts


def test_bench_spec_batch_gate_variants(tmp_path):
    """bench spec --batch-gate off,on: each speculative variant with the gate off and on, one engine."""
    from pagedlab.bench.spec import run
    res = run(["--small", "--workloads", "free", "--modes", "batched", "--copies", "2", "--max-tokens", "8",
               "--batch-gate", "off,on", "--out", str(tmp_path)])
    vs = res["runs"]["free/batched"]["variants"]
    assert list(vs) == ["off", "on (off@gate=off)", "on (off@gate=on)"], list(vs)
    assert vs["on (off@gate=off)"]["median_run"]["gate"] is None
    assert set(vs["on (off@gate=on)"]["median_run"]["gate"]) == {"num_closes", "num_probes", "num_plain_steps"}
    assert all(x["same_tokens"] == 1.0 and x["against"] == "off" for x in vs.values())
    with pytest.raises(SystemExit):
        run(["--small", "--batch-gate", "maybe", "--out", str(tmp_path)])

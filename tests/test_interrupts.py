"""A Ctrl-C at any moment of a step never breaks the engine's books (interrupts.py).

Every interrupt here is a real SIGINT, so it goes through the handler the engine's deferred
sections put in place:

* sent from inside the engine by a tracer (`SignalAt`) at a chosen site of the bookkeeping code --
  a line (a superset of the loops' backward jumps, where Python checks for signals), a function's
  entry or return, the return from a C call (`list.append`, `deque.popleft`, ...). Each step is
  retried after every KeyboardInterrupt with a signal aimed at a site not hit yet; for each
  function that used to break, until every one of its sites reached has had a signal;
* sent by a timer thread at random moments (`SigintTimer`), the way a learner presses Ctrl-C.

The device side is the model (tiny, random, fp32) or `PureDevice`, a pure function of each
sequence that makes a step all bookkeeping (cheap enough to aim at hundreds of sites). On
randomized streams (plain and overlap loops, prefix caching on and off, trace on): after every
interrupt each request is in exactly one place and every block and reference count adds up;
at the end every request was handed out exactly once, the outputs equal a clean engine's token
for token, and the same stream run again on the interrupted engine gives them once more. With
the deferral switched off (`interrupts._install` a no-op) the aimed tests fail: those are the
defects (block freed twice or leaked, a token in flight no step will read, a request neither
running nor waiting, an ending lost from the trace).
"""
import os
import random
import signal
import sys
import threading
import time

import pytest

from helpers import interrupts_in_finalizers_dropped, tiny_llm
from pagedlab import SamplingParams, interrupts
from pagedlab.request import RequestStatus
from pagedlab.runner import Launch
from test_prefix_cache import check_prefix_invariants, shared_prefix_prompts
from test_scheduler import check_in_flight

PAGEDLAB = os.path.dirname(interrupts.__file__)
# the code whose every site gets a signal: the bookkeeping, the deferral itself, and the runner's
# host side (device work: a signal there is raised at once)
BOOKKEEPING = {os.path.join(PAGEDLAB, f) for f in (
    "engine.py", "scheduler.py", "kv_cache.py", "prefix_cache.py", "trace.py", "request.py",
    "interrupts.py", "runner.py")}
# Python checks for signals after a call returns, at a function's start and at a loop's backward
# jump -- not at every line. interrupts.py relies on exactly that, so it gets no signal at a line.
INTERRUPTS = os.path.join(PAGEDLAB, "interrupts.py")
RUNNER = os.path.join(PAGEDLAB, "runner.py")


class SignalAt:
    """A tracer (sys.settrace for lines, sys.setprofile for calls and C returns) that sends this
    process a real SIGINT at one chosen event inside the BOOKKEEPING files.

    `aim(sites)`: fire at the first event whose site is in `sites` (None: at the `at`-th event).
    A site is (file, line, event, callee): what the signal lands after."""

    def __init__(self, files=BOOKKEEPING, only_in=None):
        self.files, self.only_in = files, only_in     # only_in: function names, or None for all
        self.seen, self.fired, self.fired_names = set(), set(), set()
        self.sites = self.at = self.last = None
        self.count, self.after, self.shot = 0, 0, False

    def aim(self, sites=None, at=None, after=0):
        """Fire at the first event past the `after`-th whose site is in `sites`, or at the
        `at`-th event."""
        self.sites, self.at, self.after, self.count, self.shot = sites, at, after, 0, False

    def _event(self, frame, event, callee=""):
        code = frame.f_code
        if self.shot or code.co_filename not in self.files or (self.only_in and code.co_name not in self.only_in):
            return              # (after the shot: the rest of the attempt, the unwinding, is not a site)
        site = (code.co_filename, frame.f_lineno, event, callee)
        self.seen.add(site)
        self.count += 1
        if (self.sites is not None and self.count > self.after and site in self.sites) or self.count == self.at:
            self.sites, self.at, self.shot = None, None, True
            self.fired.add(site)
            self.fired_names.add((code.co_filename, code.co_name, event))
            self.last = (os.path.basename(code.co_filename), code.co_name, frame.f_lineno, event, callee)
            signal.raise_signal(signal.SIGINT)

    def _line(self, frame, event, arg):
        if event == "line" and frame.f_code.co_filename != INTERRUPTS:
            self._event(frame, event)
        return self._line

    def _trace(self, frame, event, arg):
        return self._line if frame.f_code.co_filename in self.files else None

    def _profile(self, frame, event, arg):
        if event in ("call", "return"):
            self._event(frame, event)
        elif event == "c_return":
            self._event(frame, event, getattr(arg, "__qualname__", str(arg)))

    def __enter__(self):
        sys.settrace(self._trace)
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.settrace(None)
        sys.setprofile(None)


def check_books(eng, everyone):
    """Every block and reference count accounted for (check_prefix_invariants), every request in
    exactly one place, only real tokens in any output list, and a token in flight only where an
    unsettled step will bring it (check_in_flight)."""
    check_prefix_invariants(eng, None, everyone)
    s = eng.scheduler
    for r in s.admitted:
        assert r.status is RequestStatus.RUNNING and r.slot is not None
    for r in s.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) and r.slot is None and not r.blocks
    placed = [r.request_id for r in list(s.admitted) + list(s.waiting)]
    assert len(placed) == len(set(placed)), "a request both running and waiting"
    assert sorted(placed) == sorted(s.requests), "a request neither running nor waiting"
    for r in s.finished:
        assert r.status is RequestStatus.FINISHED and r.request_id not in s.requests
        assert r.num_in_flight == 0 and min(r.output_token_ids, default=0) >= 0
    check_in_flight(eng)


def make_stream(seed, caching):
    """Random prompts (sharing prefixes when caching), random lengths and stops, greedy and
    seeded sampling, random arrival steps; a small pool (preemption) and chunked prefill."""
    rnd = random.Random(seed)
    if caching:
        prompts = shared_prefix_prompts(rnd, 12, 4)
    else:
        prompts = [[rnd.randrange(3, 512) for _ in range(rnd.randint(1, 30))] for _ in range(12)]
    params = []
    for _ in prompts:
        kw = dict(max_new_tokens=rnd.randint(1, 14), ignore_eos=rnd.random() < 0.6)
        if rnd.random() < 0.25:
            kw.update(temperature=0.9, seed=rnd.randrange(1000))
        params.append(SamplingParams(**kw))
    arrival = [rnd.randint(0, 10) for _ in prompts]
    return prompts, params, arrival


CONFIGS = {     # name: engine settings
    "plain": dict(),
    "plain+prefix": dict(prefix_caching=True),
    "overlap": dict(cuda_graphs="eager"),
    "overlap+prefix": dict(cuda_graphs="eager", prefix_caching=True),
    "trace+prefix": dict(trace=True, prefix_caching=True),
}


def engine_for(config, **kw):
    kw = dict(max_num_seqs=3, block_size=4, num_blocks=24, max_num_batched_tokens=20) | kw
    kw |= CONFIGS[config]
    llm = tiny_llm(dtype="float32", **kw)
    assert llm.engine.overlap == ("cuda_graphs" in CONFIGS[config])
    return llm.engine


def run_stream(eng, stream, step, everyone=None, aborts=None):
    """Feed the stream at its arrival steps; `step(eng, got, everyone)` runs one step, appending
    what it hands out to `got`. Returns prompt index -> finished Request; checks each is handed
    out once and that nothing is left held. everyone: every request this engine ever ran (the
    prefix cache's keys come from all of them). aborts: prompt index -> the step before which it
    is aborted (if it has not finished)."""
    prompts, params, arrival = stream
    order = sorted(range(len(prompts)), key=lambda i: arrival[i])
    everyone = [] if everyone is None else everyone
    ids, got, n, k = {}, [], 0, 0
    while k < len(order) or eng.has_work():
        while k < len(order) and arrival[order[k]] <= n:
            rid = eng.add_request(prompts[order[k]], params[order[k]])
            ids[rid] = order[k]
            everyone.append(eng.scheduler.requests[rid])
            k += 1
        for rid, i in ids.items():
            if (aborts or {}).get(i) == n:
                eng.abort(rid)
        step(eng, got, everyone)
        n += 1
    handed = [r.request_id for r in got]
    assert len(handed) == len(set(handed)), "a request handed out twice"
    assert sorted(handed) == sorted(ids), "a request never handed out"
    s = eng.scheduler
    assert s.allocator.num_used == 0 and not s.allocator.ref_count and not any(s.slots) and not s.requests
    assert s.allocator.num_free == s.allocator.num_blocks
    check_books(eng, everyone)
    for r in got:
        assert r.status is RequestStatus.FINISHED and min(r.output_token_ids, default=0) >= 0
        assert r.finish_reason in ("stop", "length") or (aborts and r.finish_reason == "abort")
    return {ids[r.request_id]: r for r in got}


def plain_step(eng, got, everyone):
    eng.step(into=got)


def outputs(done):
    return {i: (r.output_token_ids, r.finish_reason) for i, r in done.items()}


def assert_clean(done, want) -> int:
    """Each output equals the clean run's; an aborted one, the beginning of it. Returns how many
    were aborted."""
    assert sorted(done) == sorted(want)
    for i, r in done.items():
        tokens, reason = want[i]
        if r.finish_reason == "abort":
            assert r.output_token_ids == tokens[:len(r.output_token_ids)], i
        else:
            assert (r.output_token_ids, r.finish_reason) == (tokens, reason), i
    return sum(r.finish_reason == "abort" for r in done.values())


# -- the mechanism itself ------------------------------------------------------------------------

def test_a_deferred_sigint_is_raised_at_the_end_and_the_handler_given_back():
    before = signal.getsignal(signal.SIGINT)
    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts.deferred():
            signal.raise_signal(signal.SIGINT)
            done.append("after the signal")
            with interrupts.deferred():             # nested: still held
                done.append("nested")
            done.append("end of the section")
    assert done == ["after the signal", "nested", "end of the section"]
    assert signal.getsignal(signal.SIGINT) is before
    with interrupts.deferred():                     # no signal: nothing raised, nothing left over
        pass
    assert signal.getsignal(signal.SIGINT) is before


def test_a_hole_raises_a_waiting_signal_on_entry_and_a_new_one_at_once():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts.deferred():
            signal.raise_signal(signal.SIGINT)
            with interrupts.interruptible():
                done.append("in the hole")          # never: the waiting signal is raised first
    with pytest.raises(KeyboardInterrupt):
        with interrupts.deferred():
            with interrupts.interruptible():
                signal.raise_signal(signal.SIGINT)
                done.append("after a signal in the hole")
    assert done == []
    with interrupts.interruptible():                # outside a deferred section: nothing to do
        pass


def test_a_second_sigint_is_delivered_at_once():
    """The way out of a section stuck in a loop: press Ctrl-C twice."""
    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts.deferred():
            signal.raise_signal(signal.SIGINT)
            done.append("first held")
            signal.raise_signal(signal.SIGINT)
            done.append("second held")
    assert done == ["first held"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_previous_handler_gets_the_signal_and_an_ignored_one_stays_ignored():
    calls = []
    before = signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
    try:
        with interrupts.deferred():
            signal.raise_signal(signal.SIGINT)
            assert calls == []
        assert calls == [signal.SIGINT]
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with interrupts.deferred():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            signal.raise_signal(signal.SIGINT)
        assert calls == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, before)


def test_sections_off_the_main_thread_change_nothing():
    seen = []

    def work():
        with interrupts.deferred():
            seen.append(signal.getsignal(signal.SIGINT))
            with interrupts.interruptible():
                seen.append(interrupts._state.depth)
    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert seen == [signal.default_int_handler, 0]


class PureDevice:
    """The runner's device side replaced by a pure function of each sequence (its prompt, length
    and last token): a step costs microseconds instead of a forward pass, so a signal can be
    aimed at every site of the bookkeeping, plain and overlap loops alike. As on a GPU, a greedy
    decode step's tokens stay unread (read_later) and the next step may take them from there."""

    def __init__(self, runner):
        self.graphs, self.block_table, self.last = runner.graphs, runner.block_table, None

    @staticmethod
    def next_token(req, prev: int) -> int:
        return (prev * 7919 + req.num_tokens * 104729 + sum(req.prompt_token_ids)) % 509 + 3

    def launch(self, batch, after=None):
        self.last = None
        tokens = []
        for r in batch.sampled:
            assert min(r.output_token_ids, default=0) >= 0, "a placeholder inside a request's output"
            prev = r.last_token_id
            if after is not None and r.request_id in after.rows:     # in flight: on the "device"
                prev = after.replay[after.rows[r.request_id]]
            tokens.append(self.next_token(r, prev))
        self.block_table.write(batch.table_edits)
        later = self.graphs is not None and not batch.prefill and all(r.params.plain_greedy for r in batch.sampled)
        self.last = launch = Launch({r.request_id: i for i, r in enumerate(batch.sampled)},
                                    None if later else tokens, tokens if later else None)
        return launch

    def read(self, launch):
        return launch.tokens if launch.tokens is not None else list(launch.replay)

    def run(self, batch):
        return self.read(self.launch(batch))


class SiteSweep:
    """A step function for run_stream: the step is run with a signal aimed at a site not hit yet
    (the first one past a random event of the step), and again after every KeyboardInterrupt
    until a run goes through. (A signal inside a deferred section lets the section finish, so an
    interrupted step has often done its work: the retry is the next step.) Every third call
    starts with one signal at a random event, sites hit or not."""

    def __init__(self, hook: SignalAt, seed: int, into: bool = True):
        self.hook, self.rnd, self.into = hook, random.Random(seed), into
        self.interrupts, self.steps, self.span = 0, 0, 1

    def __call__(self, eng, got, everyone):
        self.steps += 1
        at_random = self.steps % 3 == 0
        while True:
            if at_random:
                self.hook.aim(at=self.rnd.randint(1, self.span))
            else:
                self.hook.aim(sites=self.hook.seen - self.hook.fired or None, after=self.rnd.randrange(self.span))
            at_random = False
            try:
                with self.hook:
                    if self.into:
                        eng.step(into=got)
                    else:                   # (signals land in the engine only: not after it returns)
                        got += eng.step()
            except KeyboardInterrupt:
                self.interrupts += 1
                try:
                    check_books(eng, everyone)
                except AssertionError as e:
                    raise AssertionError(f"after a signal at {self.hook.last}: {e}") from e
                continue
            self.span = max(self.span, self.hook.count)
            return


def sweep_rounds(config, hook, rounds, seed=0, into=True, **engine_kw):
    """`rounds` random streams, one after another on one engine (device: PureDevice) driven by a
    SiteSweep, three requests of each aborted at random steps; each stream's outputs must equal
    a clean engine's (an aborted one: its beginning), and after the last one the same stream
    again, undisturbed. A hook aimed at some functions only (only_in) stops the rounds once each
    of their sites reached has had its signal. Returns the engine."""
    clean, eng = engine_for(config, **engine_kw), engine_for(config, **engine_kw)
    clean.runner, eng.runner = PureDevice(clean.runner), PureDevice(eng.runner)
    sweep, everyone, aborted = SiteSweep(hook, seed, into), [], 0
    for r in range(rounds):
        stream = make_stream(100 * seed + r, "prefix" in config)
        want = outputs(run_stream(clean, stream, plain_step))
        rnd = random.Random(r)
        aborts = {i: rnd.randint(0, 12) for i in rnd.sample(range(len(stream[0])), 3)}
        with interrupts_in_finalizers_dropped():
            aborted += assert_clean(run_stream(eng, stream, sweep, everyone, aborts), want)
        if r and hook.only_in and hook.seen == hook.fired:
            break
    assert aborted > 0
    assert outputs(run_stream(eng, stream, plain_step, everyone)) == want     # the next run is clean
    assert sweep.interrupts > 0
    if eng.overlap:
        assert eng.num_overlapped > 0
    if eng.trace is not None:
        finished = [rid for s in eng.trace.steps for rid in s.finished]
        assert len(finished) == len(set(finished)) == len(everyone), "the trace lost or repeated an ending"
    return eng


@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_signal_at_sites_all_over_the_bookkeeping(config):
    hook = SignalAt(BOOKKEEPING - {RUNNER})
    sweep_rounds(config, hook, rounds=4)
    hit = {(os.path.basename(f), e) for f, _, e, _ in hook.fired}
    for where in ("scheduler.py", "kv_cache.py", "engine.py", "interrupts.py"):
        for event in ("line", "call", "return", "c_return"):
            assert (where, event) in hit or (where, event) == ("interrupts.py", "line"), \
                f"no signal after a {event} in {where}"


# Each defect the deferral fixes: signals at every site of the function that used to break.
DEFECTS = {    # name: (config, functions, engine settings)
    "free-twice": ("plain+prefix", {"free"}, {}),
    "advance-plain": ("plain", {"advance"}, {}),
    "advance-overlap": ("overlap", {"advance"}, {}),
    "finish": ("plain", {"finish", "_release"}, {}),
    "preempt": ("overlap+prefix", {"preempt", "preempt_in_step", "make_room"}, dict(num_blocks=12)),
    "allocate-leak": ("plain+prefix", {"allocate"}, dict(num_blocks=12)),
    "trace-record": ("trace+prefix", {"_record", "append", "__init__"}, {}),
    # step() returning its list (no into=): the finished requests of a step interrupted at its
    # end are handed out, and named in the trace, by the next step -- once
    "trace-record-returned": ("trace+prefix", {"_record", "append", "__init__"}, dict(into=False)),
}


@pytest.mark.parametrize("defect", list(DEFECTS))
def test_a_signal_anywhere_in_the_function_that_broke(defect):
    config, functions, kw = DEFECTS[defect]
    hook = SignalAt(BOOKKEEPING - {RUNNER, INTERRUPTS}, only_in=functions)
    sweep_rounds(config, hook, rounds=20, seed=1, **kw)
    names = {n for _, n, _ in hook.fired_names}
    assert names >= functions - {"__init__", "make_room"}, names
    assert hook.fired == hook.seen, f"{len(hook.seen - hook.fired)} sites never got a signal"


@pytest.mark.parametrize("config", ["overlap", "overlap+prefix"])
def test_signals_around_the_model(config):
    """With the model and the runner: signals aimed at sites of the runner's host side and of
    the bookkeeping around it, one round."""
    stream = make_stream(11, "prefix" in config)
    want = outputs(run_stream(engine_for(config), stream, plain_step))
    eng = engine_for(config)
    hook = SignalAt()
    sweep, everyone = SiteSweep(hook, seed=4), []
    with interrupts_in_finalizers_dropped():
        assert outputs(run_stream(eng, stream, sweep, everyone)) == want
    assert outputs(run_stream(eng, stream, plain_step, everyone)) == want
    assert {os.path.basename(f) for f, _, _, _ in hook.fired} >= {"runner.py", "scheduler.py", "engine.py"}
    assert eng.num_overlapped > 0


class SigintTimer(threading.Thread):
    """Sends SIGINT to the main thread after random delays, one at a time: the next only once the
    main thread has caught the last one and is back in its loop -- it sets `caught` (how many it
    caught) as the first thing inside its try. Two signals in flight would be a double Ctrl-C,
    which interrupts.py delivers at once on purpose."""

    def __init__(self, seed: int, max_delay_s: float):
        super().__init__(daemon=True)
        self.rnd, self.max_delay_s = random.Random(seed), max_delay_s
        self.lock, self.stopped, self.sent, self.caught = threading.Lock(), False, 0, -1

    def run(self):
        main = threading.main_thread().ident
        while not self.stopped:
            if self.caught < self.sent:
                time.sleep(0.0002)
                continue
            time.sleep(self.rnd.uniform(0, self.max_delay_s))
            with self.lock:
                if self.stopped:
                    return
                signal.pthread_kill(main, signal.SIGINT)
                self.sent += 1

    def stop(self):
        with self.lock:
            self.stopped = True


def run_with_sigints(eng, stream, timer: SigintTimer, everyone) -> tuple[dict, int]:
    """run_stream, with `timer` sending SIGINTs meanwhile. The driver's own bookkeeping between
    steps runs deferred too (a signal may land there); it resumes after every KeyboardInterrupt,
    wherever it was raised. Returns (prompt index -> finished Request, interrupts caught)."""
    prompts, params, arrival = stream
    order = sorted(range(len(prompts)), key=lambda i: arrival[i])
    st = dict(ids={}, got=[], n=0, k=0, caught=0)

    def drive():
        while True:
            with interrupts.deferred():
                while st["k"] < len(order) and arrival[order[st["k"]]] <= st["n"]:
                    i = order[st["k"]]
                    rid = eng.add_request(prompts[i], params[i])
                    st["ids"][rid] = i
                    everyone.append(eng.scheduler.requests[rid])
                    st["k"] += 1
                if st["k"] == len(order) and not eng.has_work():
                    return
            eng.step(into=st["got"])
            with interrupts.deferred():
                st["n"] += 1

    timer.start()
    try:
        while True:
            try:
                timer.caught = st["caught"]
                drive()
                timer.stop()
                break
            except KeyboardInterrupt:
                st["caught"] += 1
                check_books(eng, everyone)
    finally:
        timer.stop()
        timer.join()
    assert st["caught"] == timer.sent, "a SIGINT was lost, or raised twice"
    handed = [r.request_id for r in st["got"]]
    assert len(handed) == len(set(handed)) and sorted(handed) == sorted(st["ids"]), "lost or handed out twice"
    assert eng.scheduler.allocator.num_used == 0 and not eng.has_work()
    return {st["ids"][r.request_id]: r for r in st["got"]}, st["caught"]


MIN_SIGINTS = 40


@pytest.mark.parametrize("config,device", [("plain", "model"), ("plain+prefix", "pure"),
                                           ("overlap+prefix", "pure"), ("trace+prefix", "pure")])
def test_sigint_at_random_moments(config, device):
    """Streams one after another on one engine, SIGINTs at random moments, until at least
    MIN_SIGINTS were sent; each stream's outputs equal a clean engine's, no signal is lost or
    raised twice. (Random moments seldom fall into the narrow windows where an undeferred
    interrupt breaks the books -- the aimed tests above hit every one of those; this checks the
    whole thing under signals that really arrive from outside, as a learner's Ctrl-C does.)"""
    clean, eng = engine_for(config), engine_for(config)
    if device == "pure":
        clean.runner, eng.runner = PureDevice(clean.runner), PureDevice(eng.runner)
    delay = 0.004 if device == "model" else 0.0003
    everyone, caught, rounds = [], 0, 0
    while rounds < 2 or caught < MIN_SIGINTS:
        stream = make_stream(50 + rounds, "prefix" in config)
        want = outputs(run_stream(clean, stream, plain_step))
        done, n = run_with_sigints(eng, stream, SigintTimer(seed=rounds, max_delay_s=delay), everyone)
        assert outputs(done) == want
        caught += n
        rounds += 1
    assert outputs(run_stream(eng, stream, plain_step, everyone)) == want     # the next run is clean
    if eng.trace is not None:
        finished = [rid for s in eng.trace.steps for rid in s.finished]
        assert len(finished) == len(set(finished)) == len(everyone), "the trace lost or repeated an ending"



def interrupt_generate_then_rerun(seed, kw: dict, times: int, watch_books: bool = False) -> None:
    """llm.generate(...) stopped by a Ctrl-C at a random moment, then run again, `times` times: each
    rerun gives the clean engine's outputs and leaves no work and no block behind."""
    rnd = random.Random(seed)
    prompts = [[rnd.randrange(3, 512) for _ in range(rnd.randint(2, 30))] for _ in range(8)]
    params = [SamplingParams(max_new_tokens=rnd.randint(1, 12), ignore_eos=True) for _ in prompts]
    clean = tiny_llm(**kw)
    t0 = time.perf_counter()
    want = [o.token_ids for o in clean.generate(prompts, params)]
    duration = time.perf_counter() - t0
    llm = tiny_llm(**kw)
    everyone, add = [], llm.engine.scheduler.add
    if watch_books:
        llm.engine.scheduler.add = lambda req: (everyone.append(req), add(req))
    main, interrupted = threading.main_thread().ident, 0
    for _ in range(times):
        timer = threading.Timer(rnd.uniform(0, duration), signal.pthread_kill, (main, signal.SIGINT))
        try:
            timer.start()
            llm.generate(prompts, params)
            timer.join()              # (a signal after generate returned is raised here)
        except KeyboardInterrupt:
            interrupted += 1
            timer.join()
        if watch_books:
            check_books(llm.engine, everyone)
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
        assert not llm.engine.has_work() and llm.engine.scheduler.allocator.num_used == 0
    assert interrupted == times


@pytest.mark.parametrize("config", ["plain", "overlap+prefix", "trace+prefix"])
def test_generate_interrupted_then_rerun(config):
    """The notebooks' way: llm.generate(...) stopped by a Ctrl-C at a random moment, then run
    again -- the rerun gives the clean outputs, and nothing is left behind."""
    kw = dict(max_num_seqs=3, block_size=4, num_blocks=24, dtype="float32") | CONFIGS[config]
    interrupt_generate_then_rerun(config, kw, times=6, watch_books=True)


def _pieces():
    """The learner's pieces as the notebooks' solutions write them (07's Allocator, 10's make_room)."""
    import importlib.util
    from pagedlab.course.data import path
    spec = importlib.util.spec_from_file_location("solution_pieces", path("solutions/pieces.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("piece", ["07 allocator", "10 make_room"])
def test_a_notebook_engine_with_learner_pieces_interrupted_then_rerun(piece):
    """Notebooks 07-10 run the engine with the learner's own pieces plugged in (plugins.py); a
    Ctrl-C at a random moment of such a run, then the same run again: the rerun gives the clean
    outputs (preemption included: a small pool) and every block is back."""
    from pagedlab.plugins import scheduler_with_make_room
    pieces = _pieces()
    plug = dict(allocator=pieces.Allocator) if piece.startswith("07") else \
        dict(scheduler=scheduler_with_make_room(pieces.make_room))
    kw = dict(max_num_seqs=3, block_size=4, num_blocks=16, dtype="float32", trace=True) | plug
    interrupt_generate_then_rerun(piece, kw, times=4)

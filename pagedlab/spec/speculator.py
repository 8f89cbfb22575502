"""The scheduler's side of speculation: ask for guesses, make room for them, keep what verifies.

    schedule():  plan(scheduler, step)        after the decodes got room for their next token
    accept():    rows(batch, tokens)          the runner's rows -> one token per sampled request
                 settle(scheduler, batch, v)  after the plain settle: the kept guesses

A verifying request keeps num_scheduled = 1 (its last token, as in any decode: advance() counts it
computed) and carries its guesses in `spec_token_ids`; each guess is one more decode row
(runner.py). settle() appends the target's tokens the accept rule keeps, one at a time through the
scheduler's own stop check (EOS, stop ids, max_tokens, max_model_len inside the guesses all stop
there), advances num_computed over the kept guesses only, and gives back the blocks that were
taken for guesses that were not kept.
"""
from __future__ import annotations

import math
import time

from ..interrupts import atomic
from ..kv_cache import blocks_needed
from ..request import RequestStatus
from .accept import AdaptiveK, accept_greedy
from .gate import BatchGate
from .ngram import NgramProposer
from .shadow import Shadow


def num_guesses(batch) -> int:
    return sum(len(r.spec_token_ids) for r in batch.decode)


def can_speculate(req) -> bool:
    """Penalties read the output so far (a guess row would need the guesses before it counted) and
    logprobs are one per sampled row: such requests decode one token per step."""
    return not req.params.has_penalties and req.params.logprobs is None


def take_guesses(sched, step, req, guesses: list[int]) -> int:
    """Blocks for req's guesses (no preemption for a guess: as many as fit), then they are its
    spec_token_ids for this step. Returns how many it keeps."""
    n = req.num_tokens
    if not sched._grow(req, n + len(guesses)):
        guesses = guesses[:len(req.blocks) * sched.block_size - n]
    req.spec_token_ids = list(guesses)
    step.guessed = step.guessed or bool(guesses)
    return len(guesses)


def nearest(times: dict, b: int):
    """The running mean measured at the batch size nearest b, within a quarter of b (+1); None.
    (Looked up outward from b: a server's dict may hold every size up to its slots.)"""
    for d in range(int(b / 4 + 1) + 1):
        for size in (b - d, b + d):
            if size in times:
                return times[size]
    return None


class Speculator:
    # n-gram lookup, adaptive: replay the lookups on the emitted tokens (shadow.py) and let what they
    # would have kept decide who guesses and when the batch verifies (no probes) -- where at most
    # SHADOW_MAX_BATCH sequences decode (larger batches: the gate's probes, gate.py). Measured on the
    # H200 (docs/speculative.md): session 15, one stream free-running 0.94x -> 0.99x, copy the same;
    # session 17, batch 16 with the batch end's estimate: free-running 0.96x -> 0.98x (no guess
    # made), copy 1.07x -> 1.14x -- so up to 16. Past that the replay's per-request Python work each
    # step (~n_max dict stores a token) is not measured against what it saves: the probes stay there.
    # Per instance: shadow_on, shadow_max_batch.
    SHADOW = True
    SHADOW_MAX_BATCH = 16

    def __init__(self, proposer, k_max: int, adaptive: bool = True, accept=accept_greedy, on_verify=None):
        """accept: the rule (drafts, targets) -> emitted tokens (the chapter plugs the learner's in);
        on_verify(request, guesses, emitted): called after each verify (to watch it work).
        adaptive: each request's k follows its acceptance (AdaptiveK) and the batch's gate
        (BatchGate, `gate`; None: every step may guess) turns guessing off where it costs the
        batch more than it gains."""
        self.proposer, self.k_max, self.accept, self.on_verify = proposer, k_max, accept, on_verify
        self.adaptive = AdaptiveK(k_max) if adaptive else None
        self.gate = BatchGate() if adaptive else None
        self.num_proposed = self.num_accepted = self.num_verify_steps = 0
        self.num_proposer_errors, self.last_proposer_error = 0, None
        # measured seconds of a decode-only step without guesses and with (running means): their
        # ratio is what a verify costs, which the adaptive k weighs against what it gains. A step's
        # time is from its plan() to the next one's: with the overlap loop (engine.py) that is
        # what a plain step costs in a stream of them, and a verify step's includes its wait.
        self.step_s = {False: None, True: None}
        # the same per kind and batch size (decoding sequences) for the gate: "verify", "ahead" (a
        # plain step planned while the previous one ran: the overlap loop's pace), "sync" (other plain)
        self.times = {"verify": {}, "ahead": {}, "sync": {}}
        self.num_steps = {"verify": 0, "ahead": 0, "sync": 0}   # decode steps planned, per kind (bench)
        self._last = None        # (time, batch, guessed, ran ahead) of the latest plan()
        self.shadow_on, self.shadow_max_batch = self.SHADOW, self.SHADOW_MAX_BATCH
        self._shadow_regime = False      # the last plan() ran the shadow's rule (switching back: a fresh gate)
        self.row_gain = 1.3      # with a shadow: a request guesses when its replayed gain is at least this
        self._shadow = None

    @property
    def shadow(self) -> Shadow | None:
        """The lookups' replay (shadow.py) where it applies: on, adaptive, and the proposer is the
        plain n-gram rule (not a draft model, not the chapter's own rule); else None."""
        p = self.proposer
        if not (self.shadow_on and self.adaptive is not None and type(p) is NgramProposer and p.fn is None):
            return None
        sh = self._shadow
        if sh is None or (sh.k, sh.n_max, sh.n_min) != (self.k_max, p.n_max, p.n_min):
            sh = self._shadow = Shadow(self.k_max, p.n_max, p.n_min)
        return sh

    def shadow_rules(self, b: int) -> Shadow | None:
        """The shadow, where its rule decides a step of b decoding sequences; else None."""
        sh = self.shadow
        return sh if sh is not None and self.gate is not None and b <= self.shadow_max_batch else None

    def _pays(self, sh, r) -> bool:
        g = sh.gain(r)
        return g is not None and g >= self.row_gain and can_speculate(r)

    def shadow_estimate(self, sched, decode: list) -> float:
        """What a verify step would be worth now, in plain steps, by the replayed lookups (a request
        that would not guess -- its gain under row_gain -- counts 1 token a step). With requests
        waiting for a slot (a finished one's slot is refilled at once) the mean tokens per
        sequence. Without (laggards > 0): the batch lasts as long as its slowest sequence, so the
        speed-up of the batch's end, max(left) / max(left / gain) over the sequences (left: tokens
        to go before max_tokens / max_model_len) -- with equal budgets the smallest gain; a
        sequence far from its end that does not guess holds it at 1. (Session 15's H200 run with
        the laggards' mean instead: at batch 16 the gate opened while one topic of four looped, 400
        guesses kept, 4 steps fewer; see docs/speculative.md.) One sequence: its gain either way."""
        sh = self.shadow
        gains = [sh.gain(r) if self._pays(sh, r) else 1.0 for r in decode]
        if not gains:
            return 1.0
        if sched.waiting or len(gains) == 1 or not self.gate.laggards:
            return sum(gains) / len(gains)
        left = [max(1, min(r.params.max_new_tokens - len(r.output_token_ids) - r.num_in_flight,
                           sched.max_model_len - r.num_tokens)) for r in decode]
        return max(left) / max(t / g for t, g in zip(left, gains))

    @property
    def cost(self) -> float:
        plain, verify = self.step_s[False], self.step_s[True]
        return verify / plain if plain and verify else 1.0

    def batch_cost(self, b: int) -> float | None:
        """What a verify step of b sequences costs against a plain one (run ahead where this engine
        runs ahead at all): the ratio measured at the batch size nearest b where both were
        measured (about b); None: nowhere yet."""
        plain = self.times["ahead"] if self.times["ahead"] else self.times["sync"]
        verify = self.times["verify"]
        if not verify or not plain:
            return None
        far = max(max(verify) - b, b - min(verify))
        for d in range(far + 1):                     # outward from b: the nearest size that has both
            for size in (b - d, b + d):
                if size in verify and (p := nearest(plain, size)):
                    return verify[size] / p
        return None

    @atomic
    def plan(self, sched, step) -> None:
        """Guesses for this step's decodes, within the token budget and the blocks free now
        (never preempting anyone for a guess)."""
        self._plan(sched, step)
        if step.decode:
            kind = "verify" if step.guessed else "ahead" if self._last[3] else "sync"
            self.num_steps[kind] += 1

    def _plan(self, sched, step) -> None:
        prev = self._last and self._last[1]          # the step planned last time (now complete)
        self._time_last_step(time.perf_counter(), idle=not step.decode)
        for r in sched.admitted:
            r.spec_token_ids = []
        forget = getattr(self.proposer, "forget_except", None)
        if forget is not None:                       # a draft model frees what left the slots
            forget({r.request_id for r in sched.admitted})
        ahead = any(r.num_in_flight for r in step.decode)
        self._last = (self._last[0], step, False, ahead)
        sh = self.shadow_rules(len(step.decode))
        if sh is not None:
            self._shadow_regime = True
            self._plan_shadow(sched, step, sh, ahead)
            return
        if self._shadow_regime and self.gate is not None:    # back from the shadow's rule: a fresh gate
            self._shadow_regime = False
            self.gate.reset()
        cost = self.cost
        if self.gate is not None and not self.gate.step(len(step.decode), bool(prev and prev.prefill)):
            for r in step.decode:                    # a plain step: paused requests count it
                if r.spec_pause > 0 and can_speculate(r):
                    self.adaptive.k(r, cost)
            return
        room_rows = sched.max_num_batched_tokens - len(step.decode)
        reqs, ks = [], []
        for r in step.decode:
            if not can_speculate(r):
                continue
            k = self.adaptive.k(r, cost) if self.adaptive else self.k_max    # (counts paused steps down)
            if r.num_in_flight:           # the overlap loop ran ahead: its last token is not known yet
                continue
            left = min(r.params.max_new_tokens - len(r.output_token_ids), sched.max_model_len - r.num_tokens)
            k = min(k, left - 1, room_rows)
            if k > 0:
                reqs.append(r)
                ks.append(k)
                room_rows -= k
        if not reqs:
            return
        try:
            proposals = self.proposer.propose(reqs, ks)
        except Exception as e:              # guesses are optional: a proposer that fails costs them only
            self.num_proposer_errors += 1
            self.last_proposer_error = f"{type(e).__name__}: {e}"
            reset = getattr(self.proposer, "reset", None)
            if reset is not None:
                reset()
            return
        for r, guesses in zip(reqs, proposals):
            if self.adaptive is not None:
                self.adaptive.proposed(r, bool(guesses))
            if guesses:
                take_guesses(sched, step, r, guesses)
        self._last = (self._last[0], step, step.guessed, ahead)

    def _plan_shadow(self, sched, step, sh, ahead) -> None:
        """_plan with the lookups' replay: the gate opens where the replayed gain pays, and then
        only the requests whose own replayed gain pays guess (k from their acceptance)."""
        b = len(step.decode)
        if not self.gate.shadow_step(b, self.shadow_estimate(sched, step.decode) if b else 1.0,
                                     self.batch_cost(b)):
            return
        room_rows = sched.max_num_batched_tokens - b
        for r in step.decode:
            if r.num_in_flight or not self._pays(sh, r):
                continue
            left = min(r.params.max_new_tokens - len(r.output_token_ids), sched.max_model_len - r.num_tokens)
            k = min(self.adaptive.k_rate(r), left - 1, room_rows)
            if k <= 0:
                continue
            guesses = sh.propose(r, k)
            if guesses:
                room_rows -= take_guesses(sched, step, r, guesses)
        self._last = (self._last[0], step, step.guessed, ahead)

    def _time_last_step(self, now: float, idle: bool = False) -> None:
        """The step planned last time took until now: a running mean per kind (with or without
        guesses), of decode-only steps, not counting a pause of the engine (idle between them;
        idle: nobody decodes now, the batch ended and may have waited since). Per batch size
        too, where a time far below the mean replaces it (the first steps of a size may have
        compiled kernels)."""
        last, self._last = self._last, (now, None, False, False)
        if idle or last is None or last[1] is None or last[1].prefill or not last[1].decode:
            return
        dt = now - last[0]
        old = self.step_s[last[2]]
        if old is None:
            self.step_s[last[2]] = dt
        elif dt < 4 * old:
            self.step_s[last[2]] = old + 0.1 * (dt - old)
        kind = "verify" if last[2] else "ahead" if last[3] else "sync"
        table, b = self.times[kind], len(last[1].decode)
        old = table.get(b)
        if old is None or dt < old / 4:
            table[b] = dt
        elif dt < 4 * old:
            table[b] = old + 0.1 * (dt - old)

    def wants_sync(self, sched) -> bool:
        """Must the engine read the step in flight before the next one (engine.py's overlap loop)?
        Yes if that step verifies guesses (what it keeps decides the next step's rows) or if the
        next step asks someone for guesses (a proposal starts from the last token)."""
        if self.adaptive is None:
            return any(can_speculate(r) for r in sched.admitted)
        decode = [r for r in sched.admitted if r.output_token_ids or r.num_in_flight]
        sh = self.shadow_rules(len(decode))
        if sh is not None:
            if any(r.spec_token_ids for r in sched.admitted):
                return True
            if not decode or not any(self._pays(sh, r) for r in decode):
                return False
            return self.gate.decide(self.shadow_estimate(sched, decode), self.batch_cost(len(decode)))
        if self.gate is not None and self.gate.closed_next():     # a plain step next
            return any(r.spec_token_ids for r in sched.admitted)
        ask = self.adaptive.will_propose
        return any(r.spec_token_ids or (ask(r) and can_speculate(r)) for r in sched.admitted)

    def gate_sample(self, sched, decode: list, kept_by: dict) -> tuple[int, int]:
        """(sequences, guesses they kept) that the gate's gain reads after a verify step: every
        decoding sequence, or -- with the gate's `laggards` share (0 < share < 1) and nobody waiting
        for a slot -- that share of them with the most tokens still to go before this step (ties
        all in): the batch lasts as long as they do; what the others keep ends them sooner, and
        nothing takes their place."""
        share = self.gate.laggards
        if not (0 < share < 1 and not sched.waiting and len(decode) > 2):
            return len(decode), sum(kept_by.values())
        left = []
        for r in decode:
            if r.status is RequestStatus.FINISHED and r not in kept_by:
                continue                             # (ended at its first token: nothing to wait for)
            k = kept_by.get(r, 0)
            left.append((min(r.params.max_new_tokens - len(r.output_token_ids),
                             sched.max_model_len - r.num_tokens) + k, k))
        if not left:
            return len(decode), sum(kept_by.values())
        bar = sorted((t for t, _ in left), reverse=True)[max(1, math.ceil(share * len(left))) - 1]
        lag = [k for t, k in left if t >= bar]
        return len(lag), sum(lag)

    @staticmethod
    def rows(batch, tokens: list[int]) -> tuple[list[int], list[list[int]]]:
        """The runner's per-row tokens -> (first token per sampled request, all rows of each).
        The step's logprobs (one per row too) become one per sampled request, as the plain
        settle reads them (a request asking for logprobs guesses nothing: its one row's)."""
        first, per_req, i, at = [], [], 0, []
        for r in batch.sampled:
            m = 1 + len(r.spec_token_ids)
            per_req.append(tokens[i:i + m])
            first.append(tokens[i])
            at.append(i)
            i += m
        if getattr(batch, "logprobs", None) is not None and len(batch.logprobs) == i:
            batch.logprobs = [batch.logprobs[j] for j in at]
        return first, per_req

    @atomic
    def settle(self, sched, batch, per_req: list[list[int]] | None) -> None:
        """After the plain settle put each request's first token in: the kept guesses' tokens
        (per_req None: nobody guessed this step). Then a draft model forgets who left."""
        now, bs = time.perf_counter(), sched.block_size
        cost = self.cost
        log = {}                                     # for the trace: request id -> (guesses, kept)
        kept_by = {}                                 # request -> guesses it kept (for the gate)
        for r, targets in zip(batch.sampled, per_req or ()):
            guesses = r.spec_token_ids
            if not guesses:
                continue
            r.spec_token_ids = []
            out = list(self.accept(guesses, targets))
            self.num_verify_steps += 1
            if self.adaptive is not None:
                self.adaptive.update(r, len(guesses), len(out) - 1, cost)
            kept = 0
            if r.status is not RequestStatus.FINISHED:      # (it may have stopped at its first token)
                for tok in out[1:]:
                    r.num_computed += 1                     # the guess before it is now a real token
                    r.output_token_ids.append(tok)
                    r.token_times.append(now)
                    kept += 1
                    reason = sched.stop_reason(r, len(r.output_token_ids) - 1)
                    if reason:
                        sched.finish(r, reason)
                        break
            log[r.request_id] = (list(guesses), kept)
            if self.on_verify is not None:
                self.on_verify(r, guesses, out[:1 + kept])
            r.num_spec_proposed += len(guesses)
            r.num_spec_accepted += kept
            kept_by[r] = kept
            self.num_proposed += len(guesses)
            self.num_accepted += kept
            if r.status is not RequestStatus.FINISHED:
                keep = blocks_needed(r.num_tokens, bs)      # room for the next token, no more
                if len(r.blocks) > keep:
                    extra = r.blocks[keep:]
                    del r.blocks[keep:]
                    sched.allocator.free(extra)
        sh = self.shadow_rules(len(batch.decode) + len(batch.prefill))
        if sh is not None:          # (larger batches: no replay work; it catches up when it decides again)
            for r in batch.sampled:
                sh.update(r)
            if len(sh.states) > 2 * len(sched.admitted) + 8:       # who left (by id; rebuilt if back)
                sh.forget_except({r.request_id for r in sched.admitted})
        if log:
            batch.spec_log = log
            if self.gate is not None and self.shadow_rules(len(batch.decode)) is None:
                b = len(batch.decode)
                n, kept = self.gate_sample(sched, batch.decode, kept_by)
                self.gate.verified(n, kept, self.batch_cost(b), batch=b)
        forget = getattr(self.proposer, "forget_except", None)
        if forget is not None:
            forget({r.request_id for r in sched.admitted})


def use(engine, speculator: Speculator | None) -> None:
    """Speculation on (a Speculator) or off (None) on an idle engine."""
    if engine.scheduler.has_work():
        raise RuntimeError("switch speculation only on an idle engine")
    while engine._unread:              # a step the overlap loop launched ahead: read it first
        engine._read_oldest()
    cfg = engine.config
    engine.speculator = engine.scheduler.speculator = speculator
    if speculator is not None:
        engine.runner.speculative = True     # (graphs were captured for 1 + k rows per sequence
                                             # only if the engine was built with speculative_config)
    engine.overlap = cfg.overlap and engine.runner.graphs is not None and not cfg.trace

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

import time

from ..interrupts import atomic
from ..kv_cache import blocks_needed
from ..request import RequestStatus
from .accept import AdaptiveK, accept_greedy


def num_guesses(batch) -> int:
    return sum(len(r.spec_token_ids) for r in batch.decode)


def can_speculate(req) -> bool:
    """Penalties read the output so far (a guess row would need the guesses before it counted) and
    logprobs are one per sampled row: such requests decode one token per step."""
    return not req.params.has_penalties and req.params.logprobs is None


class Speculator:
    def __init__(self, proposer, k_max: int, adaptive: bool = True, accept=accept_greedy, on_verify=None):
        """accept: the rule (drafts, targets) -> emitted tokens (the chapter plugs the learner's in);
        on_verify(request, guesses, emitted): called after each verify (to watch it work)."""
        self.proposer, self.k_max, self.accept, self.on_verify = proposer, k_max, accept, on_verify
        self.adaptive = AdaptiveK(k_max) if adaptive else None
        self.num_proposed = self.num_accepted = self.num_verify_steps = 0
        self.num_proposer_errors, self.last_proposer_error = 0, None
        # measured seconds of a decode-only step without guesses and with (running means): their
        # ratio is what a verify costs, which the adaptive k weighs against what it gains. A step's
        # time is from its plan() to the next one's: with the overlap loop (engine.py) that is
        # what a plain step costs in a stream of them, and a verify step's includes its wait.
        self.step_s = {False: None, True: None}
        self._last = None        # (time, batch, guessed) of the latest plan()

    @property
    def cost(self) -> float:
        plain, verify = self.step_s[False], self.step_s[True]
        return verify / plain if plain and verify else 1.0

    @atomic
    def plan(self, sched, step) -> None:
        """Guesses for this step's decodes, within the token budget and the blocks free now
        (never preempting anyone for a guess)."""
        self._time_last_step(time.perf_counter())
        for r in sched.admitted:
            r.spec_token_ids = []
        forget = getattr(self.proposer, "forget_except", None)
        if forget is not None:                       # a draft model frees what left the slots
            forget({r.request_id for r in sched.admitted})
        room_rows = sched.max_num_batched_tokens - len(step.decode)
        reqs, ks = [], []
        cost = self.cost
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
        self._last = (self._last[0], step, False)
        if not reqs:
            return
        bs = sched.block_size
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
            if not guesses:
                continue
            n = r.num_tokens
            if not sched._grow(r, n + len(guesses)):        # no preemption for a guess: fit what fits
                guesses = guesses[:len(r.blocks) * bs - n]
            r.spec_token_ids = list(guesses)
            step.guessed = step.guessed or bool(guesses)
        self._last = (self._last[0], step, step.guessed)

    def _time_last_step(self, now: float) -> None:
        """The step planned last time took until now: a running mean per kind (with or without
        guesses), of decode-only steps, not counting a pause of the engine (idle between them)."""
        last, self._last = self._last, (now, None, False)
        if last is None or last[1] is None or last[1].prefill or not last[1].decode:
            return
        dt, old = now - last[0], self.step_s[last[2]]
        if old is None:
            self.step_s[last[2]] = dt
        elif dt < 4 * old:
            self.step_s[last[2]] = old + 0.1 * (dt - old)

    def wants_sync(self, sched) -> bool:
        """Must the engine read the step in flight before the next one (engine.py's overlap loop)?
        Yes if that step verifies guesses (what it keeps decides the next step's rows) or if the
        next step asks someone for guesses (a proposal starts from the last token)."""
        if self.adaptive is None:
            return any(can_speculate(r) for r in sched.admitted)
        ask = self.adaptive.will_propose
        return any(r.spec_token_ids or (ask(r) and can_speculate(r)) for r in sched.admitted)

    @staticmethod
    def rows(batch, tokens: list[int]) -> tuple[list[int], list[list[int]]]:
        """The runner's per-row tokens -> (first token per sampled request, all rows of each)."""
        first, per_req, i = [], [], 0
        for r in batch.sampled:
            m = 1 + len(r.spec_token_ids)
            per_req.append(tokens[i:i + m])
            first.append(tokens[i])
            i += m
        return first, per_req

    @atomic
    def settle(self, sched, batch, per_req: list[list[int]] | None) -> None:
        """After the plain settle put each request's first token in: the kept guesses' tokens
        (per_req None: nobody guessed this step). Then a draft model forgets who left."""
        now, bs = time.perf_counter(), sched.block_size
        cost = self.cost
        log = {}                                     # for the trace: request id -> (guesses, kept)
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
            self.num_proposed += len(guesses)
            self.num_accepted += kept
            if r.status is not RequestStatus.FINISHED:
                keep = blocks_needed(r.num_tokens, bs)      # room for the next token, no more
                if len(r.blocks) > keep:
                    extra = r.blocks[keep:]
                    del r.blocks[keep:]
                    sched.allocator.free(extra)
        if log:
            batch.spec_log = log
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

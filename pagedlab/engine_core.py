"""The engine core: the Engine behind a narrow door that speaks in batches.

    core = EngineCore(engine)
    core.add([(request_id, token_ids, text, params), ...])     # checked requests
    core.abort([request_id, ...])
    step = core.step()          # one engine step -> one StepOutput: every request's new tokens

It is the only thing that steps the engine and takes its finished requests, so every token and
every ending is handed out exactly once, as data (output_processor.StepOutput), never as text.
LLM drives one in this process; a core process (core_process.py) drives one for AsyncLLM and the
server, with nothing else on its interpreter. Requests added to the engine behind its back
(engine.add_request) are the caller's own: their finished Request objects wait in `foreign` for
whoever added them.
"""
from __future__ import annotations

import time

from .output_processor import Finished, RequestUpdate, StepOutput
from .request import PENDING


def num_known(out: list[int]) -> int:
    """How many output tokens are real (the overlap loop's launched-but-unread tokens are not)."""
    n = len(out)
    while n and out[n - 1] == PENDING:
        n -= 1
    return n


class EngineCore:
    def __init__(self, engine):
        self.engine = engine
        self.sent: dict[int, int] = {}        # request id -> output tokens handed out so far
        self.foreign: list = []               # finished requests this core did not add
        self.ended: list[RequestUpdate] = []  # endings not handed out yet (aborted between steps)
        self.num_steps, self.step_seconds, self.step_sequences = 0, 0.0, 0   # since start (/metrics)

    def add(self, items) -> list[int]:
        """items: (request_id, token ids, text, params) as checked by the front end; a request_id
        of None takes the engine's next id. Returns the ids."""
        eng, rids = self.engine, []
        for rid, ids, text, params in items:
            rid = eng.add_checked(ids, text, params, request_id=rid)
            self.sent[rid] = 0
            rids.append(rid)
        return rids

    def take_foreign(self) -> list:
        """The finished requests of other drivers that passed through here (see the module doc)."""
        out, self.foreign = self.foreign, []
        return out

    def abort(self, request_ids) -> None:
        """Abort them now (unknown or finished ids: a no-op). Their endings are handed out with the
        next step's output; the engine keeps none of them for its next step()."""
        aborted = [rid for rid in request_ids if self.engine.abort(rid)]
        if aborted:
            self.ended += self._endings(self.engine.scheduler.take_finished())

    def has_work(self) -> bool:
        return self.engine.has_work() or bool(self.ended)

    def step(self) -> StepOutput:
        """One engine step; every request that got tokens or ended, once."""
        eng = self.engine
        t0 = time.perf_counter()
        finished = eng.step()
        self.step_seconds += time.perf_counter() - t0
        self.num_steps += 1
        sched, sent = eng.scheduler, self.sent
        updates = []
        for req in sched.admitted:
            have = sent.get(req.request_id)
            if have is None:
                continue
            out = req.output_token_ids
            n = num_known(out)
            if n > have:
                updates.append(RequestUpdate(req.request_id, out[have:n], self._logprobs(req, have, n)))
                sent[req.request_id] = n
        self.step_sequences += len(updates)
        updates += self._endings(finished)
        if self.ended:
            updates[:0], self.ended = self.ended, []
        return StepOutput(updates, self.stats())

    def _endings(self, finished) -> list[RequestUpdate]:
        """Finished requests -> their last tokens and how they ended (foreign ones set aside)."""
        updates = []
        for req in finished:
            have = self.sent.pop(req.request_id, None)
            if have is None:
                self.foreign.append(req)
                continue
            out = req.output_token_ids
            updates.append(RequestUpdate(
                req.request_id, out[have:], self._logprobs(req, have, len(out)),
                Finished(req.finish_reason, req.stop_token_id, req.error, req.num_cached_tokens,
                         req.num_preemptions)))
        return updates

    @staticmethod
    def _logprobs(req, a: int, b: int):
        return req.logprobs[a:b] if req.params.logprobs is not None else None

    def stats(self) -> dict:
        """What /metrics shows of the engine, read now (a few attributes)."""
        sched = self.engine.scheduler
        alloc = sched.allocator
        s = dict(running=len(sched.admitted), waiting=len(sched.waiting), kv_used=alloc.num_used,
                 kv_total=alloc.num_blocks, steps=self.num_steps, step_seconds=self.step_seconds,
                 step_sequences=self.step_sequences)
        for attr in ("hit_rate", "prefix_queries", "prefix_hits", "num_cached"):
            if hasattr(alloc, attr):
                s[attr] = float(getattr(alloc, attr))
        return s

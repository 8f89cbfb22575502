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

from .output_processor import Finished, StepOutput
from .interrupts import deferred


class EngineCore:
    def __init__(self, engine):
        self.engine = engine
        self.sent: dict[int, int] = {}        # request id -> output tokens handed out so far
        self.foreign: list = []               # finished requests this core did not add
        self.ended = StepOutput()             # endings not handed out yet (aborted between steps)
        self.unhanded: list = []              # finished requests taken from the engine, not handed out
        self.num_steps, self.step_seconds, self.step_sequences = 0, 0.0, 0   # since start (/metrics)
        # of those, the steps with prompt tokens in them (eager: CUDA graphs hold decode-only steps)
        self.prompt_steps, self.prompt_step_seconds = 0, 0.0
        self.last_step_s = 0.0
        self.timing = {"idle_s": 0.0, "inbox_s": 0.0, "handout_s": 0.0}   # a core process's loop
        # busy periods (idle -> work -> idle), time.monotonic(): one clock for every process of the
        # machine, so a benchmark's client can place its burst's start and end against them
        self.busy_periods, self.busy_start_t, self.busy_end_t = 0, 0.0, 0.0
        self._busy = False

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
        with deferred():
            aborted = [rid for rid in request_ids if self.engine.abort(rid)]
            if aborted:
                self.ended.extend(self._endings(self.engine.scheduler.take_finished()))

    def has_work(self) -> bool:
        return self.engine.has_work() or bool(self.ended.request_ids) or bool(self.unhanded)

    def step(self) -> StepOutput:
        """One engine step; every request that got tokens or ended, once. Interrupt-safe: the step
        and the hand-out are deferred sections (interrupts.py), and what an interrupted call had
        gathered is handed out by the next one."""
        eng = self.engine
        if not self._busy:
            self._busy, self.busy_start_t = True, time.monotonic()
            self.busy_periods += 1
        t0 = time.perf_counter()
        eng.step(into=self.unhanded)          # (its device work stays interruptible)
        self.last_step_s = time.perf_counter() - t0
        self.step_seconds += self.last_step_s
        self.num_steps += 1
        if eng.last_batch is not None and eng.last_batch.prefill:
            self.prompt_steps += 1
            self.prompt_step_seconds += self.last_step_s
        with deferred():
            out = self._hand_out()
        if not self.has_work():
            self._busy, self.busy_end_t = False, time.monotonic()
            out.stats.update(busy_end_t=self.busy_end_t)
        return out

    def _hand_out(self) -> StepOutput:
        sent, out = self.sent, self.ended
        rids, tokens = out.request_ids, out.token_ids
        for req in self.engine.scheduler.admitted:
            have = sent.get(req.request_id)
            if have is None:
                continue
            ids = req.output_token_ids           # the tokens read back (none in flight)
            n = len(ids)
            if n > have:
                rids.append(req.request_id)
                tokens.append(ids[have:n])
                if req.params.logprobs is not None:
                    out.logprobs[req.request_id] = req.logprobs[have:n]
                sent[req.request_id] = n
        self.step_sequences += len(rids)
        finished, self.unhanded = self.unhanded, []
        out.extend(self._endings(finished))
        out.stats = self.stats()
        self.ended = StepOutput()
        return out

    def _endings(self, finished) -> StepOutput:
        """Finished requests -> their last tokens and how they ended (foreign ones set aside)."""
        out = StepOutput()
        for req in finished:
            have = self.sent.pop(req.request_id, None)
            if have is None:
                self.foreign.append(req)
                continue
            ids = req.output_token_ids
            out.add(req.request_id, ids[have:], self._logprobs(req, have, len(ids)),
                    Finished(req.finish_reason, req.stop_token_id, req.error, req.num_cached_tokens,
                             req.num_preemptions, req.num_spec_proposed, req.num_spec_accepted))
        return out

    @staticmethod
    def _logprobs(req, a: int, b: int):
        return req.logprobs[a:b] if req.params.logprobs is not None else None

    def stats(self) -> dict:
        """What /metrics shows of the engine, read now (a few attributes)."""
        sched = self.engine.scheduler
        alloc = sched.allocator
        s = dict(running=len(sched.admitted), waiting=len(sched.waiting), kv_used=alloc.num_used,
                 kv_total=alloc.num_blocks, steps=self.num_steps, step_seconds=self.step_seconds,
                 prompt_steps=self.prompt_steps, prompt_step_seconds=self.prompt_step_seconds,
                 step_sequences=self.step_sequences, t=time.perf_counter(),
                 busy_periods=self.busy_periods, busy_start_t=self.busy_start_t, busy_end_t=self.busy_end_t,
                 **{f"core_{k}": v for k, v in self.timing.items()},
                 **{f"host_{k}_s": v for k, v in self.engine.timing.items() if k != "steps"})
        for attr in ("hit_rate", "prefix_queries", "prefix_hits", "num_cached"):
            if hasattr(alloc, attr):
                s[attr] = float(getattr(alloc, attr))
        return s


def run_requests(core: EngineCore, outputs, items, use_tqdm: bool = False, on_finish=None) -> list:
    """Queue checked requests (token ids, text, params), step until all finished; their
    RequestOutputs in order (what LLM.generate and a data-parallel replica run). Interrupted: its
    unfinished requests are aborted; finished requests of other callers go back to the engine.
    on_finish may drive the same core itself (a generate() or a stream inside the callback): the
    requests of this call that finish meanwhile are picked up from their states afterwards."""
    rids = core.add([(None, *item) for item in items])
    pending = {rid: outputs.add(rid, ids, text, params) for rid, (ids, text, params) in zip(rids, items)}
    done = {}
    bar = None
    if use_tqdm:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(rids), desc="requests", unit="req")

    def collect(states) -> bool:
        called = False
        for state in states:
            if state.output is not None and pending.pop(state.request_id, None) is not None:
                done[state.request_id] = state.output
                if bar:
                    bar.update(1)
                if on_finish:
                    on_finish(state.output)
                    called = True
        return called
    try:
        while pending:
            changed, stopped = outputs.process(core.step())
            core.abort(stopped)                  # their text reached a stop string
            if collect(changed) and pending:     # a callback may have stepped the core itself
                collect(list(pending.values()))
    finally:
        if pending:                        # interrupted: no orphans left running
            unfinished = [rid for rid in rids if rid not in done]
            core.abort(unfinished)
            for rid in unfinished:
                outputs.states.pop(rid, None)
        core.engine.hand_back(core.take_foreign())
        if bar:
            bar.close()
    return [done[rid] for rid in rids]


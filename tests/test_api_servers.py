"""Several front ends in front of one engine core (`serve --api-servers N`, core_mailbox.py).

The core's side first, in this process: two AsyncLLM front ends on pipes of one core process get
exactly LLM.generate's tokens, each only its own requests' outputs (one message per step per front
end); one front end's aborts free every block while the other's requests finish exactly; a front
end that vanishes without a word (its pipes closed: what SIGKILL does) has its requests aborted in
the core, the other keeps going, and the core leaves once the last front end has left."""
from __future__ import annotations

import asyncio
import time

import pytest

from pagedlab import SamplingParams
from pagedlab.async_llm import AsyncLLM
from pagedlab.core_process import CoreLink, start_core
from test_engine_core import MODEL, llm_kwargs, reference, requests  # noqa: F401  (reference: a fixture)

DEADLINE_S = 30.0


@pytest.fixture
def two_front_ends():
    """One core process with two pairs of pipes, an AsyncLLM on each (both in this process)."""
    process, ends = start_core(dict(llm_kwargs(), model=MODEL), frontends=2)
    links = [CoreLink(*e) for e in ends]
    try:
        for link in links:
            link.take_ready()
        allms = [AsyncLLM.connect([link], frontend=f, frontends=2) for f, link in enumerate(links)]
        seen = [[], []]                   # the request ids of every step message each front end got
        for f, allm in enumerate(allms):
            def on_step(k, step, f=f, inner=allm._on_step):
                seen[f].append(list(step.request_ids))
                inner(k, step)
            allm._on_step = on_step
        yield process, allms, seen
    finally:
        for link in links:
            link.stop()
        process.join(10)
        if process.is_alive():
            process.kill()


async def run_all(allm, prompts, params):
    async def one(p, sp):
        last = None
        async for d in allm.generate(p, sp, stream=False):
            last = d
        return last.output
    return await asyncio.gather(*(one(p, sp) for p, sp in zip(prompts, params)))


async def until_idle(allm, deadline_s: float = DEADLINE_S) -> dict:
    """The core's stats once nothing runs and no block is held (as this front end hears them)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        s = allm.stats()
        if s["running"] == 0 and s["waiting"] == 0 and s["kv_used"] == 0:
            return s
        await asyncio.sleep(0.05)
    raise AssertionError(f"the core still holds requests or blocks: {allm.stats()}")


def test_two_front_ends_get_generates_tokens_each_only_its_own(two_front_ends, reference):
    process, allms, seen = two_front_ends
    prompts, params = requests(16, 5, reference)
    want = reference.generate(prompts, params)

    async def main():
        halves = [run_all(allms[f], prompts[f::2], params[f::2]) for f in (0, 1)]
        a, b = await asyncio.gather(*halves)
        await until_idle(allms[1])
        return [x for pair in zip(a, b) for x in pair]
    got = asyncio.run(main())
    for o, w in zip(got, want):
        assert (o.token_ids, o.text, o.finish_reason) == (w.token_ids, w.text, w.finish_reason)
    for f in (0, 1):
        assert seen[f] and all(rid % 2 == f for rids in seen[f] for rid in rids)
        assert all(len(set(rids)) == len(rids) for rids in seen[f])     # one message per step, not per request


def test_aborts_of_one_front_end_free_its_blocks_and_spare_the_other(two_front_ends, reference):
    """Front end 0's callers leave after their first token (their 240-token requests aborted: the
    core is idle far sooner than 240 steps), and an abort it sends naming front end 1's request
    ids touches nothing: front end 1's requests finish with exactly generate()'s tokens."""
    process, allms, _ = two_front_ends
    prompts, params = requests(6, 7, reference)
    want = reference.generate(prompts, params)
    long = SamplingParams(max_tokens=240, ignore_eos=True)

    async def leave_early(p):
        async for d in allms[0].generate(p, long):
            if d.token_ids:
                return len(d.token_ids)          # leaving the loop aborts the request

    async def main():
        steps_before = allms[1].stats()["steps"]
        kept = asyncio.ensure_future(run_all(allms[1], prompts, params))
        while not any(st.token_ids for st in allms[1].outputs.states.values()):
            await asyncio.sleep(0.005)            # front end 1's requests run (ids 1, 3, 5, ...)
        allms[0].cores[0].send(("abort", list(range(1, 200, 2))))
        await asyncio.gather(*(leave_early([5 + i, 6, 7]) for i in range(4)))
        got = await kept
        s = await until_idle(allms[1])
        return got, s["steps"] - steps_before
    got, steps = asyncio.run(main())
    assert steps < 200, f"front end 0's aborted requests ran on for {steps} steps"
    for o, w in zip(got, want):
        assert (o.token_ids, o.text, o.finish_reason) == (w.token_ids, w.text, w.finish_reason)


def test_a_vanished_front_end_has_its_requests_aborted_and_the_core_goes_on(two_front_ends, reference):
    """Front end 0's pipes close without a word while its long requests run: the core aborts them
    (they end far earlier than their 240 tokens: counted in core steps), front end 1 goes on with
    exactly generate()'s tokens, and once front end 1 leaves too the core process exits."""
    process, allms, _ = two_front_ends
    prompts, params = requests(6, 11, reference)
    want = reference.generate(prompts, params)
    long = SamplingParams(max_tokens=240, ignore_eos=True)
    dead = allms[0]

    async def main():
        started = asyncio.Event()

        async def doomed(p):
            async for d in dead.generate(p, long):
                started.set()
        doomed_tasks = [asyncio.ensure_future(doomed([9 + i, 8])) for i in range(3)]
        await started.wait()
        steps_at_death = allms[1].stats()["steps"]
        link = dead.cores[0]
        asyncio.get_running_loop().remove_reader(link.fileno())
        link._sendq.put(None)
        link.close()                              # what a SIGKILL leaves the core: end-of-file
        for t in doomed_tasks:
            t.cancel()
        got = await run_all(allms[1], prompts, params)
        s = await until_idle(allms[1])
        return got, s["steps"] - steps_at_death
    got, steps = asyncio.run(main())
    assert steps < 200, f"the vanished front end's requests ran on for {steps} steps"
    for o, w in zip(got, want):
        assert (o.token_ids, o.text, o.finish_reason) == (w.token_ids, w.text, w.finish_reason)
    allms[1].shutdown()
    process.join(DEADLINE_S)
    assert process.exitcode == 0

"""AsyncLLM: concurrent streams from asyncio tasks equal generate(); a cancelled stream aborts its
request and frees its blocks while the others go on; bad input raises in the caller."""
import asyncio

import pytest

from helpers import tiny_llm
from pagedlab import SamplingParams
from pagedlab.async_llm import AsyncLLM


async def engine_idle(llm, timeout_s: float = 4.0) -> None:
    """Wait (at most timeout_s) until the engine thread has nothing left and every block is free."""
    for _ in range(int(timeout_s / 0.01)):
        if llm.engine.scheduler.allocator.num_used == 0 and not llm.engine.has_work():
            return
        await asyncio.sleep(0.01)


async def collect(allm, prompt, sp):
    deltas = [d async for d in allm.generate(prompt, sp)]
    return deltas


def test_concurrent_streams_equal_generate():
    prompts = [[5, 6, 7], [9, 10], [11, 12, 13, 14], [3]]
    sp = SamplingParams(max_new_tokens=10, ignore_eos=True)
    want = [o.token_ids for o in tiny_llm(max_num_seqs=2, num_blocks=64).generate(prompts, sp)]
    allm = AsyncLLM(tiny_llm(max_num_seqs=2, num_blocks=64))

    async def main():
        return await asyncio.gather(*(collect(allm, p, sp) for p in prompts))
    try:
        got = asyncio.run(main())
    finally:
        allm.shutdown()
    for deltas, w in zip(got, want):
        assert [t for d in deltas for t in d.token_ids] == w
        assert deltas[-1].finished and deltas[-1].output.token_ids == w
    assert not allm._thread.is_alive()


def test_cancelled_stream_is_aborted_and_others_finish():
    llm = tiny_llm(max_num_seqs=2, num_blocks=64)
    reasons = {}
    finish = llm.engine.scheduler.finish

    def spy(req, reason, error=None):
        reasons[req.request_id] = (reason, len(req.output_token_ids))
        finish(req, reason, error)
    llm.engine.scheduler.finish = spy
    allm = AsyncLLM(llm)
    long = SamplingParams(max_new_tokens=200, ignore_eos=True)
    short = SamplingParams(max_new_tokens=8, ignore_eos=True)

    async def main():
        async def first_tokens_then_cancel():
            async for d in allm.generate([5, 6, 7], long):
                if d.token_ids:
                    await asyncio.sleep(3600)          # a client that hangs: we cancel it
        task = asyncio.create_task(first_tokens_then_cancel())
        other = await collect(allm, [9, 10], short)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await engine_idle(llm)                          # the engine thread frees its blocks
        return other
    try:
        other = asyncio.run(main())
    finally:
        allm.shutdown()
    assert other[-1].finish_reason == "length" and len(other[-1].output.token_ids) == 8
    assert llm.engine.scheduler.allocator.num_used == 0 and not llm.engine.has_work()
    aborted = [n for reason, n in reasons.values() if reason == "abort"]
    assert len(aborted) == 1 and aborted[0] < 200, reasons


def test_bad_input_raises_in_the_caller():
    allm = AsyncLLM(tiny_llm(max_num_seqs=2, num_blocks=64))

    async def main():
        with pytest.raises(ValueError, match="element 1"):
            await collect(allm, [3, 4.5], SamplingParams(max_new_tokens=2))
        return await collect(allm, [3, 4], SamplingParams(max_new_tokens=2, ignore_eos=True))
    try:
        ok = asyncio.run(main())
    finally:
        allm.shutdown()
    assert len(ok[-1].output.token_ids) == 2


def test_health_follows_the_engine_thread():
    """is_alive() (what the server's /health reports) is True while the engine thread runs, False once
    it is shut down -- and a server over a stopped engine answers /health with 503."""
    from fastapi.testclient import TestClient
    from pagedlab.server.app import build_app
    allm = AsyncLLM(tiny_llm(max_num_seqs=2, num_blocks=32))
    client = TestClient(build_app(allm, "tiny"))
    assert allm.is_alive() and client.get("/health").status_code == 200
    allm.shutdown()
    assert not allm.is_alive()
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["status"] != "ok"


def test_shutdown_with_streams_running_ends_every_stream():
    """shutdown() while callers are streaming: every caller's stream ends at once (its last delta
    says "abort"), nobody is left waiting, and every block is back."""
    llm = tiny_llm(max_num_seqs=2, num_blocks=64)
    allm = AsyncLLM(llm)
    sp = SamplingParams(max_new_tokens=10**6, ignore_eos=True)

    async def main():
        started = asyncio.Event()

        async def one(p):
            last = None
            async for d in allm.generate(p, sp):
                started.set()
                last = d
            return last
        tasks = [asyncio.create_task(one(p)) for p in ([5, 6], [7, 8, 9], [10])]
        await started.wait()
        allm.shutdown()
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
    last = asyncio.run(main())
    assert all(d.finished and d.finish_reason == "abort" for d in last)
    assert llm.engine.scheduler.allocator.num_used == 0 and not llm.engine.has_work()



def test_submit_reaches_the_core_before_any_await_and_abort_frees_unread_requests():
    """submit() sends the request to its core before it returns (a server's burst is not held in
    asyncio's lockstep); a handle nobody ever iterates is stopped by abort(), and its blocks freed,
    while a request beside it finishes with exactly generate()'s tokens; abort() after the end is a no-op."""
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    want = tiny_llm(max_num_seqs=2, num_blocks=64).generate([[9, 10, 11]], sp)[0].token_ids
    llm = tiny_llm(max_num_seqs=2, num_blocks=64)
    allm = AsyncLLM(llm)
    core = allm.cores[0]

    async def main():
        hold = core._commands                       # the thread's inbox: the add is in it, or taken
        orphan = allm.submit([5, 6, 7, 8], SamplingParams(max_new_tokens=400, ignore_eos=True))
        # no await since submit(): the add is already on its way (in the inbox or in the engine)
        assert orphan.request_id in llm.engine.scheduler.requests or not hold.empty()
        kept = allm.submit(allm.check_request([9, 10, 11], sp))      # a Checked is taken as it is
        got = [d async for d in kept.deltas()]
        orphan.abort()
        kept.abort()                                  # finished: nothing happens
        await engine_idle(llm)
        return got
    try:
        got = asyncio.run(main())
        assert [t for d in got for t in d.token_ids] == want and got[-1].finished
        assert llm.engine.scheduler.allocator.num_used == 0 and not llm.engine.has_work()
        assert allm._callers == {} and allm.outputs.states == {}
    finally:
        allm.shutdown()


def test_stats_over_cores_sum_amounts_and_keep_moments():
    """Several cores' gauges: amounts (steps, seconds, blocks) are summed; the busy window's
    moments are the cores' first start and last end, not a sum of clock readings."""
    a = dict(steps=3, step_seconds=0.5, busy_periods=1, busy_start_t=100.0, busy_end_t=105.0, t=1.0)
    b = dict(steps=4, step_seconds=0.25, busy_periods=2, busy_start_t=101.0, busy_end_t=107.0, t=2.0)
    allm = AsyncLLM.__new__(AsyncLLM)
    allm.cores, allm._stats, allm._output_s, allm._loop_watch = [object(), object()], [a, b], 0.0, None
    s = allm.stats()
    assert (s["steps"], s["step_seconds"], s["busy_periods"]) == (7, 0.75, 3)
    assert (s["busy_start_t"], s["busy_end_t"]) == (100.0, 107.0) and "t" not in s

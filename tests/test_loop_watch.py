"""loop_watch.LoopWatch: how long an asyncio loop stood still and how long the collector paused it --
in a loop of our own (blocked on purpose, collections forced) and in the server's front end, where
/metrics shows it (pagedlab_frontend_stall_*, pagedlab_frontend_gc*)."""
import asyncio
import gc
import re
import time

import httpx

from pagedlab.loop_watch import LoopWatch


def test_a_blocked_loop_and_forced_collections_are_seen_and_nothing_is_left_behind():
    callbacks = len(gc.callbacks)

    async def main():
        w = LoopWatch(every_s=0.002).start()
        await asyncio.sleep(0.03)
        time.sleep(0.08)                     # the loop stands still
        await asyncio.sleep(0.03)
        time.sleep(0.01)                     # a short stall: not a long one
        await asyncio.sleep(0.03)
        gc.collect()
        gc.collect()
        await asyncio.sleep(0.01)
        return w.stop()
    got = asyncio.run(main())
    assert 0.075 <= got["longest_stall_s"] < 1.0 and got["long_stalls"] >= 1, got
    assert got["long_stall_s"] >= 0.075 and got["stall_s"] >= got["long_stall_s"] + 0.005, got
    assert got["gcs"] >= 2 and got["gc_s"] >= got["longest_gc_s"] > 0, got
    assert len(gc.callbacks) == callbacks          # stop() took its callback back


def test_an_idle_loop_barely_stalls():
    """0.3 s of an idle loop: its waker's own sleeps are not lateness (a watch that counted them
    would say ~0.3 s). A busy machine may take the CPU away for a moment -- a real stall, and
    reported -- so the check is on the total, not on zero long stalls."""
    async def main():
        w = LoopWatch(every_s=0.005).start()
        t = time.perf_counter()
        await asyncio.sleep(0.3)
        return w.stop(), time.perf_counter() - t
    got, elapsed = asyncio.run(main())
    assert got["stall_s"] < elapsed / 3 and got["stall_s"] >= got["long_stall_s"], (got, elapsed)


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def test_the_front_end_reports_its_own_stalls_in_metrics():
    """A callback that blocks the front end's loop for 0.2 s: /metrics counts one more stall of
    >= 50 ms and at least 0.19 s more of them; the server answers on."""
    from pagedlab.server import serve
    from test_engine_core import MODEL, llm_kwargs
    callbacks = list(gc.callbacks)
    s = serve(MODEL, model_name="tiny", port=0, **llm_kwargs())
    try:
        r = httpx.post(s.url + "/v1/completions", timeout=60,
                       json=dict(model="tiny", prompt=[5, 6], max_tokens=3, ignore_eos=True))
        assert r.status_code == 200
        n0 = metric(s.url, "pagedlab_frontend_long_stalls")
        t0 = metric(s.url, "pagedlab_frontend_long_stall_seconds")
        s.async_llm._loop.call_soon_threadsafe(time.sleep, 0.2)
        time.sleep(0.5)
        assert metric(s.url, "pagedlab_frontend_long_stalls") >= n0 + 1
        assert metric(s.url, "pagedlab_frontend_long_stall_seconds") >= t0 + 0.19
        assert metric(s.url, "pagedlab_frontend_longest_stall_seconds") >= 0.19
        assert metric(s.url, "pagedlab_frontend_gcs") >= 0
        r = httpx.post(s.url + "/v1/completions", timeout=60,
                       json=dict(model="tiny", prompt=[5, 6], max_tokens=3, ignore_eos=True))
        assert r.status_code == 200
    finally:
        s.stop()
    assert gc.callbacks == callbacks          # the stopped server's watch took its callback back

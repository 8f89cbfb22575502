"""Liveness of the engine core process: a core that is alive but does not answer (SIGSTOP here; a
hung GPU kernel in life) is reported, not just a dead one. /health turns 503 within the threshold
(+ a few s) with a one-line reason naming the core and its silence, /metrics shows the silence, and
after SIGCONT /health is ok again by itself and the open streams finish with exactly the tokens an
unpaused run gives. An idle core raises no alarm over several thresholds (it answers every 0.25 s,
even when messages wake it without work). Past the give-up threshold the stopped core's streams end
with an error, new requests get 503, and once it answers again its blocks are all free and it
serves exactly; a stall of the front end's own loop is not counted against the core. The CLI server
with two front ends takes the threshold from the environment.
(The kill-the-core tests are in test_engine_core.py and test_api_servers.py.)"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from pagedlab import SamplingParams
from pagedlab.server import serve
from test_engine_core import (MODEL, alive, free_port, ids_of, llm_kwargs, reference, start_cli_server,  # noqa: F401
                              wait_blocks_free)

SILENT_S = 2.0              # the threshold under test (the default is 30 s)
GRACE_S = 4.0               # + the watcher's second, a loaded 2-core machine


@pytest.fixture(scope="module")
def server():
    s = serve(MODEL, model_name="tiny", port=0, silent_s=SILENT_S, give_up_s=0, **llm_kwargs())
    pid = s.async_llm.core_status()[0]["pid"]
    try:
        yield s, pid
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGCONT)          # (a failed test must not leave it stopped)
        s.stop()


def health(url: str) -> httpx.Response:
    return httpx.get(url + "/health", timeout=10)


def silent_gauge(url: str, core: int = 0) -> float:
    m = httpx.get(url + "/metrics", timeout=10).text
    return float(re.search(rf'^pagedlab_core_silent_seconds{{core="{core}"}} (\S+)', m, re.M).group(1))


def wait_status(url: str, code: int, deadline_s: float) -> tuple[httpx.Response, float]:
    t0 = time.monotonic()
    while True:
        r = health(url)
        if r.status_code == code:
            return r, time.monotonic() - t0
        assert time.monotonic() - t0 < deadline_s, f"/health not {code} after {deadline_s} s: {r.text}"
        time.sleep(0.1)


PROMPTS = [[5, 6, 7], [9, 10], [11, 12, 13, 14]]
PARAMS = [SamplingParams(max_tokens=200, ignore_eos=True),                        # greedy
          SamplingParams(max_tokens=150, ignore_eos=True),
          SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.8, top_k=50, seed=7)]   # seeded


def body(prompt, sp: SamplingParams) -> dict:
    b = dict(model="tiny", prompt=prompt, max_tokens=sp.max_new_tokens, ignore_eos=True, stream=True,
             temperature=sp.temperature)
    if sp.seed is not None:
        b.update(seed=sp.seed, top_k=sp.top_k)
    return b


async def stream(c: httpx.AsyncClient, prompt, sp, on_first=None) -> tuple[str, list[str]]:
    """One streamed completion: (its text, its data: lines); on_first() after the first event."""
    text, events = "", []
    async with c.stream("POST", "/v1/completions", json=body(prompt, sp)) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            events.append(line)
            if len(events) == 1 and on_first is not None:
                on_first()
            if line != "data: [DONE]" and '"choices"' in line:
                text += json.loads(line[5:])["choices"][0]["text"]
    return text, events


def test_a_stopped_core_turns_health_503_then_recovers_and_its_streams_finish_exactly(server, reference):
    s, pid = server
    want = reference.generate(PROMPTS, PARAMS)
    seen = {}

    async def main():
        stopped = asyncio.Event()

        def stop_core():
            if not stopped.is_set():
                os.kill(pid, signal.SIGSTOP)
                seen["stopped_t"] = time.monotonic()
                stopped.set()

        async def watch_and_continue():
            await stopped.wait()
            r, after = await asyncio.to_thread(wait_status, s.url, 503, SILENT_S + GRACE_S)
            seen["health"], seen["after_s"] = r.json(), after
            seen["gauge"] = await asyncio.to_thread(silent_gauge, s.url)
            seen["open_at_continue"] = len(s.async_llm._callers)
            os.kill(pid, signal.SIGCONT)
            r, back = await asyncio.to_thread(wait_status, s.url, 200, GRACE_S)
            seen["back"], seen["back_s"] = r.json(), back

        async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
            return await asyncio.gather(*(stream(c, p, sp, stop_core if i == 0 else None)
                                          for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS))), watch_and_continue())
    *got, _ = asyncio.run(main())
    h = seen["health"]
    assert h["status"] == "engine core not answering" and "\n" not in h["reason"]
    assert f"engine core 0 (pid {pid}) has not answered for" in h["reason"], h["reason"]
    assert float(re.search(r"for ([\d.]+) s", h["reason"]).group(1)) >= SILENT_S   # (one decimal)
    assert h["engine_cores"][0]["alive"] and not h["engine_cores"][0]["answering"]
    assert seen["after_s"] < SILENT_S + GRACE_S and seen["gauge"] > SILENT_S
    assert seen["open_at_continue"] > 0, "every stream finished before the core was stopped: nothing tested"
    assert seen["back"]["status"] == "ok" and seen["back"]["engine_cores"][0]["answering"]
    for (text, events), w in zip(got, want):
        assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events)
        assert ids_of(text) == w.token_ids          # exactly an unpaused run's tokens
    wait_blocks_free(s.url)


def test_an_idle_core_raises_no_alarm_over_several_thresholds(server):
    """No request for 4 thresholds (after one that finished): /health answers 200 every time and the
    silence never nears the threshold (an idle core answers every 0.25 s)."""
    s, _ = server
    r = httpx.post(s.url + "/v1/completions", timeout=60,
                   json=dict(model="tiny", prompt=[5, 6], max_tokens=4, ignore_eos=True))
    assert r.status_code == 200
    end, worst = time.monotonic() + 4 * SILENT_S, 0.0
    while time.monotonic() < end:
        h = health(s.url)
        assert h.status_code == 200, h.text
        worst = max(worst, h.json()["engine_cores"][0]["silent_s"], silent_gauge(s.url))
        time.sleep(0.2)
    assert worst < SILENT_S / 2, worst


def test_past_give_up_a_stopped_cores_streams_end_and_its_blocks_come_back(server, reference):
    """give_up_s: the stopped core's open streams end with an error event, a new request is refused
    with 503 + Retry-After (not queued for ever), /health names the core; after SIGCONT /health is
    ok, the aborted requests' blocks are all free, and a new request gets exactly its tokens."""
    s, pid = server
    give_up = 3.0
    s.async_llm.give_up_s = give_up
    try:
        async def main():
            stopped = asyncio.Event()

            def stop_core():
                if not stopped.is_set():
                    os.kill(pid, signal.SIGSTOP)
                    stopped.set()
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
                t0 = time.monotonic()
                got = await asyncio.gather(*(stream(c, p, sp, stop_core if i == 0 else None)
                                             for i, (p, sp) in enumerate(zip(PROMPTS[:2], PARAMS[:2]))))
                return got, time.monotonic() - t0
        got, took = asyncio.run(main())
        assert took < give_up + GRACE_S + 2, took
        ended = [events for _, events in got if any('"error"' in e for e in events)]
        assert ended, "no stream was open when the core stopped"
        for events in ended:
            assert "has not answered for" in events[-2] and events[-1] == "data: [DONE]"
        r = httpx.post(s.url + "/v1/completions", timeout=30,
                       json=dict(model="tiny", prompt=[5, 6], max_tokens=4, ignore_eos=True))
        assert r.status_code == 503 and "Retry-After" in r.headers
        assert "engine core 0 has not answered" in r.json()["error"]["message"]
        assert health(s.url).status_code == 503
    finally:
        os.kill(pid, signal.SIGCONT)
        s.async_llm.give_up_s = 0
    wait_status(s.url, 200, GRACE_S)
    wait_blocks_free(s.url)
    want = reference.generate(PROMPTS[2:], PARAMS[2:])[0]

    async def again():
        async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
            return await stream(c, PROMPTS[2], PARAMS[2])
    text, events = asyncio.run(again())
    assert ids_of(text) == want.token_ids and events[-1] == "data: [DONE]"


def test_a_stall_of_the_front_end_itself_is_not_the_cores(server, reference, monkeypatch):
    """The front end's loop blocked for 4 s (what Ctrl-Z of the whole server does to it) while the
    core is stopped too, both going on together: the core is not given up on (give_up_s 2 s) -- the
    watcher finds itself late and gives the core that time back -- and its stream finishes exactly."""
    import pagedlab.async_llm as async_llm
    monkeypatch.setattr(async_llm, "FRONT_END_STALL_S", 1.0)
    s, pid = server
    s.async_llm.give_up_s = 2.0
    loop = s.async_llm._loop

    def both_stopped():             # (on the server's loop: blocks it)
        time.sleep(4.0)
        os.kill(pid, signal.SIGCONT)
    try:
        def stop_both():
            os.kill(pid, signal.SIGSTOP)
            loop.call_soon_threadsafe(both_stopped)

        async def main():
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
                return await stream(c, PROMPTS[0], PARAMS[0], stop_both)
        text, events = asyncio.run(main())
    finally:
        os.kill(pid, signal.SIGCONT)
        s.async_llm.give_up_s = 0
    assert not any('"error"' in e for e in events), events[-2:]
    assert ids_of(text) == reference.generate([PROMPTS[0]], PARAMS[0])[0].token_ids


def test_an_idle_core_woken_by_messages_without_work_still_answers():
    """Aborts of unknown requests every 50 ms wake an idle core without giving it work (its wait
    never times out): it still sends its stats every 0.25 s (Mailbox.beat), so its front end does
    not take it for silent."""
    import multiprocessing as mp

    from pagedlab.core_mailbox import Mailbox
    from pagedlab.core_process import run_core

    class IdleCore:
        timing = {"idle_s": 0.0, "inbox_s": 0.0, "handout_s": 0.0}
        sent: dict = {}
        last_step_s = 0.0

        def has_work(self):
            return False

        def abort(self, ids):
            pass

        def add(self, items):
            raise AssertionError("no adds here")

        def stats(self):
            return {"t": time.perf_counter()}

    inbox_r, inbox_w = mp.Pipe(duplex=False)
    outbox_r, outbox_w = mp.Pipe(duplex=False)
    mailbox = Mailbox([inbox_r], [outbox_w], stats_every_s=0.25)
    t = threading.Thread(target=run_core, args=(IdleCore(), mailbox), daemon=True)
    t.start()
    heard = []
    try:
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            inbox_w.send(("abort", [10_000]))
            while outbox_r.poll(0):
                outbox_r.recv()
                heard.append(time.monotonic())
            time.sleep(0.05)
    finally:
        inbox_w.send(("stop",))
        t.join(10)
        mailbox.close()
    gaps = [b - a for a, b in zip(heard, heard[1:])]
    assert len(heard) >= 4 and max(gaps) < 1.0, (len(heard), gaps)


@pytest.mark.parametrize("value", ["abc", "-1", "0", "nan"])
def test_a_bad_threshold_is_named(value, monkeypatch):
    from pagedlab.async_llm import liveness
    monkeypatch.setenv("PAGEDLAB_CORE_SILENT_S", value)
    with pytest.raises(ValueError, match="PAGEDLAB_CORE_SILENT_S"):
        liveness(None, None)
    monkeypatch.delenv("PAGEDLAB_CORE_SILENT_S")
    assert liveness(None, 0) == (30.0, 0.0)
    with pytest.raises(ValueError, match="silent_s"):
        liveness(-2, None)


@pytest.mark.parametrize("given", ["env", "flag"])
def test_the_cli_server_with_two_front_ends_reports_a_stopped_core(given, monkeypatch):
    """`python -m pagedlab serve --api-servers 2` with PAGEDLAB_CORE_SILENT_S=2 or --core-silent-s 2:
    the core stopped while idle turns both front ends' /health to 503 naming it; SIGCONT: both ok again."""
    flags = ()
    if given == "env":
        monkeypatch.setenv("PAGEDLAB_CORE_SILENT_S", str(SILENT_S))
    else:
        monkeypatch.delenv("PAGEDLAB_CORE_SILENT_S", raising=False)
        flags = ("--core-silent-s", str(SILENT_S))
    port = free_port()
    proc, cores = start_cli_server(port, "--api-servers", "2", *flags)
    url = f"http://127.0.0.1:{port}"

    def every_front_end(code: int, deadline_s: float) -> dict[int, dict]:
        got, end = {}, time.monotonic() + deadline_s
        while len(got) < 2:
            assert time.monotonic() < end, f"front ends {sorted(got)} of 2 answered {code} in {deadline_s} s"
            r = health(url)
            if r.status_code == code:
                got[r.json()["frontend"]["index"]] = r.json()
            time.sleep(0.05)
        return got
    try:
        every_front_end(200, 30)
        os.kill(cores[0], signal.SIGSTOP)
        for h in every_front_end(503, SILENT_S + GRACE_S).values():
            assert f"engine core 0 (pid {cores[0]}) has not answered for" in h["reason"], h
        os.kill(cores[0], signal.SIGCONT)
        every_front_end(200, GRACE_S)
        r = httpx.post(url + "/v1/completions", timeout=60,
                       json=dict(model=MODEL, prompt=[5, 6, 7], max_tokens=4, ignore_eos=True))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert proc.poll() is None
    finally:
        for p in cores:
            if alive(p):
                os.kill(p, signal.SIGCONT)
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except Exception:      # noqa: BLE001
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("flag,value,said", [("--core-silent-s", "-1", "--core-silent-s must be a number of seconds > 0"),
                                             ("--core-give-up-s", "nan", "--core-give-up-s must be a number of seconds >= 0")])
def test_a_bad_threshold_flag_is_one_line_naming_it(flag, value, said):
    r = subprocess.run([sys.executable, "-m", "pagedlab", "serve", "--model", MODEL, "--device", "cpu", flag, value],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and said in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_a_stream_on_a_silent_core_gets_keep_alive_comments_then_finishes_exactly(server, reference):
    """keepalive_s 1 s: while the core is stopped (6 s) each open stream gets SSE comments
    `: keep-alive` (at least two), none while it flows, and after SIGCONT it finishes with exactly an
    unpaused run's tokens; the comment is not a data event (an SSE client skips it)."""
    s, pid = server
    want = reference.generate(PROMPTS[:1], PARAMS[:1])[0]
    s.async_llm.keepalive_s = 1.0
    lines, marks = [], {}

    async def main():
        async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
            async with c.stream("POST", "/v1/completions", json=body(PROMPTS[0], PARAMS[0])) as r:
                async for line in r.aiter_lines():
                    lines.append(line)
                    if line.startswith("data:") and "stop_i" not in marks:
                        os.kill(pid, signal.SIGSTOP)
                        marks["stop_i"] = len(lines)
                        # the stream's lines wait in the socket. 6 s: the watcher looks once a
                        # second, so comments come 1-2 s apart, after the tokens already on their
                        # way (3.5 s gave one comment once on CI's busy 2 cores)
                        await asyncio.sleep(6.0)
                        os.kill(pid, signal.SIGCONT)
    try:
        asyncio.run(main())
    finally:
        os.kill(pid, signal.SIGCONT)
        s.async_llm.keepalive_s = 15.0
    comments = [i for i, line in enumerate(lines) if line.startswith(":")]
    assert len(comments) >= 2, lines[:20]
    assert all(lines[i] == ": keep-alive" for i in comments)
    assert all(i >= marks["stop_i"] for i in comments), "a keep-alive while tokens flowed"
    data = [line for line in lines if line.startswith("data:")]
    text = "".join(json.loads(d[5:])["choices"][0]["text"] for d in data[:-1] if '"choices"' in d)
    assert data[-1] == "data: [DONE]" and ids_of(text) == want.token_ids
    wait_blocks_free(s.url)


def test_a_bad_keepalive_setting_is_one_line_naming_it():
    env = dict(os.environ, PAGEDLAB_SSE_KEEPALIVE_S="soon")
    r = subprocess.run([sys.executable, "-m", "pagedlab", "serve", "--model", MODEL, "--device", "cpu"],
                       capture_output=True, text=True, timeout=120, env=env)
    said = "error: PAGEDLAB_SSE_KEEPALIVE_S must be a number of seconds, got 'soon'"
    assert r.returncode != 0 and said in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]

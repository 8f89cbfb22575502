"""Several front ends in front of one engine core (`serve --api-servers N`: core_mailbox.py,
server/frontends.py).

The core's side first, in this process: two AsyncLLM front ends on pipes of one core process get
exactly LLM.generate's tokens, each only its own requests' outputs (one message per step per front
end); one front end's aborts free every block while the other's requests finish exactly; a front
end that vanishes without a word (its pipes closed: what SIGKILL does) has its requests aborted in
the core, the other keeps going, and the core leaves once the last front end has left.

Then the server, `serve(..., api_servers=2)`: two front-end processes on one port. The official
client's concurrent mixed requests get generate()'s text and both front ends served some; clients
pinned to one front end (one keep-alive connection each, /health says which) leave early and free
every block while the other front end's requests finish exactly; SIGKILL of a front end with
streams open: the other serves on and the core frees the dead one's blocks. The CLI: SIGINT,
SIGTERM or SIGKILL of the parent leaves no process; SIGKILL of the core ends every open stream of
every front end with an error event within 10 s and the parent exits with status 1."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import time

import httpx
import pytest

from pagedlab import SamplingParams
from pagedlab.async_llm import AsyncLLM
from pagedlab.core_process import CoreLink, start_core
from pagedlab.server import serve
from test_engine_core import (MODEL, alive, body, free_port, llm_kwargs, reference, requests,  # noqa: F401
                              served_like_generate, start_cli_server, wait_gone)

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
    exact_and_cut_short(got, want, steps, "front end 0's aborted requests")


def exact_and_cut_short(got, want, steps: int, whose: str) -> None:
    """The surviving front end's outputs are generate()'s, and the other's requests stopped early
    (their 240 tokens would take more than 200 core steps)."""
    assert steps < 200, f"{whose} ran on for {steps} steps"
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
    exact_and_cut_short(got, want, steps, "the vanished front end's requests")
    allms[1].shutdown()
    process.join(DEADLINE_S)
    assert process.exitcode == 0


# -- the server: two front-end processes on one port -----------------------------------------------

@pytest.fixture(scope="module")
def fronts():
    s = serve(MODEL, model_name="tiny", port=0, api_servers=2, **llm_kwargs())
    yield s
    s.stop()
    assert not any(alive(p) for p in s.frontend_pids + s.core_pids)


def scrape_each(url: str, path: str = "/metrics", n: int = 2) -> dict[int, str]:
    """`path` from every front end: one fresh connection per GET (the kernel picks the front end),
    until each of the n has answered; {front end index: text}."""
    got = {}
    for _ in range(200):
        r = httpx.get(url + path, timeout=10)
        got[int(re.search(r'"?index"?[=:] ?"?(\d+)', r.text).group(1))] = r.text
        if len(got) == n:
            return got
    raise AssertionError(f"only front ends {sorted(got)} answered {path}")


def metric(text: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)", text, re.M).group(1))


def wait_idle(url: str, deadline_s: float = DEADLINE_S) -> float:
    """Until the core runs nothing and holds no block (as a front end's /metrics says): its step count."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        m = httpx.get(url + "/metrics", timeout=10).text
        if metric(m, "pagedlab_kv_blocks_used") == 0 and metric(m, "pagedlab_requests_running") == 0:
            return metric(m, "pagedlab_engine_steps")
        time.sleep(0.05)
    raise AssertionError(f"blocks still in use after {deadline_s} s")


async def pinned(url: str, want: dict[int, int]) -> dict[int, list[httpx.AsyncClient]]:
    """want[f] clients on front end f: each holds one keep-alive connection, which /health says
    the kernel gave to front end f."""
    got: dict[int, list] = {f: [] for f in want}
    for _ in range(400):
        if all(len(got[f]) >= n for f, n in want.items()):
            return got
        c = httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=1))
        f = (await c.get("/health")).json()["frontend"]["index"]
        if len(got.get(f, want)) < want.get(f, 0):
            got[f].append(c)
        else:
            await c.aclose()
    raise AssertionError(f"could not pin clients to front ends {want}")


async def complete(c: httpx.AsyncClient, prompt, sp: SamplingParams, stream: bool) -> tuple[str, str]:
    """One /v1/completions request: (text, finish_reason)."""
    b = dict(model="tiny", prompt=prompt, stream=stream, **body(sp))
    if not stream:
        r = (await c.post("/v1/completions", json=b)).json()
        return r["choices"][0]["text"], r["choices"][0]["finish_reason"]
    text, reason = "", None
    async with c.stream("POST", "/v1/completions", json=b) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                ch = json.loads(line[6:])["choices"][0]
                text += ch["text"]
                reason = ch["finish_reason"] or reason
    return text, reason


async def hang_up_after_first_chunk(c: httpx.AsyncClient, i: int, kill=None) -> None:
    async with c.stream("POST", "/v1/completions", json=dict(
            model="tiny", prompt=[5 + i, 6, 7], max_tokens=240, ignore_eos=True, stream=True)) as r:
        async for line in r.aiter_lines():
            if line.startswith("data:") and "<" in line:
                if kill is not None:
                    kill()
                return


def test_two_front_ends_serve_generates_text_and_both_serve(fronts, reference):
    served_like_generate(fronts.url, 24, 21, reference)       # the official client, mixed requests
    wait_idle(fronts.url)
    end = time.monotonic() + 10
    while True:                         # the core's gauges, the same on both once it is idle
        each = scrape_each(fronts.url)
        if all(metric(m, "pagedlab_kv_blocks_used") == 0 for m in each.values()) or time.monotonic() > end:
            break
    done = {f: sum(float(v) for v in re.findall(r'^pagedlab_requests_finished_total\{finish_reason="(?:stop|length)"\} (\S+)',
                                                 m, re.M)) for f, m in each.items()}
    assert sum(done.values()) == 24 and all(done.values()), done    # each served some
    for name in ("pagedlab_kv_blocks_total", "pagedlab_kv_blocks_used"):        # the core's gauges, on both
        assert metric(each[0], name) == metric(each[1], name)
    pids = {f: re.search(r'pid="(\d+)"', m).group(1) for f, m in each.items()}
    assert sorted(int(p) for p in pids.values()) == sorted(fronts.frontend_pids)


def one_front_end_leaves(url: str, reference, seed: int, kill_pid: int | None = None) -> None:
    """Three clients on front end 0 hang up after their first chunk of a 240-token stream (the
    first, with kill_pid, SIGKILLs that process first), while six on front end 1 send mixed requests,
    streamed and not: those get exactly generate()'s text, and the core is idle again long before
    240 steps (front end 0's requests were aborted, not run out)."""
    prompts, params = requests(6, seed, reference)
    want = reference.generate(prompts, params)

    async def main():
        clients = await pinned(url, {0: 3, 1: len(prompts)})
        kill = (lambda: os.kill(kill_pid, signal.SIGKILL)) if kill_pid else None
        try:
            leave = [hang_up_after_first_chunk(c, i, kill if i == 0 else None) for i, c in enumerate(clients[0])]
            stay = [complete(c, p, sp, stream=i % 2 == 0)
                    for i, (c, p, sp) in enumerate(zip(clients[1], prompts, params))]
            return await asyncio.gather(*stay, *leave, return_exceptions=kill_pid is not None)
        finally:
            for c in clients[0] + clients[1]:
                await c.aclose()
    steps_before = wait_idle(url)
    got = asyncio.run(main())[:len(prompts)]
    for (text, reason), w in zip(got, want):
        assert text == w.text and reason == w.finish_reason
    if kill_pid:
        assert wait_gone([kill_pid])
    assert wait_idle(url) - steps_before < 200


def test_clients_leaving_one_front_end_free_every_block_the_other_finishes(fronts, reference):
    one_front_end_leaves(fronts.url, reference, 23)


def test_a_killed_front_end_leaves_the_other_serving_and_its_blocks_free(fronts, reference):
    """SIGKILL of front end 0 while its streams are open: front end 1's requests finish exactly, the
    core aborts front end 0's, and every new connection is served by front end 1. (Last of this
    module's server tests: it leaves one front end.)"""
    victim = int(re.search(r'pid="(\d+)"', scrape_each(fronts.url)[0]).group(1))
    one_front_end_leaves(fronts.url, reference, 29, kill_pid=victim)
    for _ in range(10):
        h = httpx.get(fronts.url + "/health", timeout=10).json()
        assert h["status"] == "ok" and h["frontend"]["index"] == 1
    end = time.monotonic() + 5
    while fronts.admitted[0] and time.monotonic() < end:     # the parent clears the dead one's admissions
        time.sleep(0.05)
    assert list(fronts.admitted) == [0, 0]


def test_api_servers_serve_a_model_name_only(reference):
    with pytest.raises(ValueError, match="model name"):
        serve(reference, port=0, api_servers=2)         # an LLM of this process has one front end: this one


def test_the_front_ends_admit_against_one_bound():
    """AdmissionGate with a shared array (what each front end gets): slots + max_waiting streams for
    the server, whichever front end admits them."""
    import multiprocessing

    from pagedlab.server.admission import AdmissionGate
    from pagedlab.server.protocol import OpenAIError
    shared = multiprocessing.get_context("spawn").RawArray("q", 2)
    a, b = AdmissionGate(4, 2, shared, 0), AdmissionGate(4, 2, shared, 1)
    tickets = [a.admit() for _ in range(4)] + [b.admit(2)]
    for gate in (a, b):
        with pytest.raises(OpenAIError) as e:
            gate.admit()
        assert e.value.status == 503 and gate.waiting == 2
    tickets[0].release()
    tickets.append(b.admit())
    assert list(shared) == [3, 3] and a.total() == b.total() == 6


def test_two_front_ends_in_front_of_two_data_parallel_cores(reference):
    """--api-servers 2 --data-parallel-size 2: every front end talks to both cores; greedy and
    seeded requests give one engine's text, and a scrape counts both cores' blocks."""
    s = serve(MODEL, model_name="tiny", port=0, api_servers=2, data_parallel_size=2, **llm_kwargs())
    try:
        assert len(s.core_pids) == 2
        served_like_generate(s.url, 12, 31, reference)
        for m in scrape_each(s.url).values():
            assert metric(m, "pagedlab_kv_blocks_total") == 2 * llm_kwargs()["num_blocks"]
    finally:
        s.stop()
    assert not any(alive(p) for p in s.frontend_pids + s.core_pids)


# -- the CLI: signals ------------------------------------------------------------------------------

@contextlib.contextmanager
def cli_with_two_front_ends():
    """`python -m pagedlab serve --api-servers 2` in a subprocess: (process, url, core pids, front-end
    pids); whatever is still running at the end is killed."""
    port = free_port()
    proc, cores = start_cli_server(port, "--api-servers", "2", "--slots", "4")
    fronts = []
    try:
        url = f"http://127.0.0.1:{port}"
        fronts = [json.loads(h)["frontend"]["pid"] for h in scrape_each(url, "/health").values()]
        assert len(set(fronts + cores)) == 3
        yield proc, url, cores, fronts
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in cores + fronts:
            if alive(p):
                os.kill(p, signal.SIGKILL)


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM", "SIGKILL"])
def test_a_stopped_or_killed_parent_leaves_no_process(how):
    with cli_with_two_front_ends() as (proc, url, cores, fronts):
        r = httpx.post(url + "/v1/completions", timeout=60,
                       json=dict(model=MODEL, prompt=[5, 6, 7], max_tokens=4, ignore_eos=True))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        os.kill(proc.pid, getattr(signal, how))
        proc.wait(30)
        assert wait_gone(cores + fronts), f"a process was left running after {how} of the parent"
        if how != "SIGKILL":        # a clean stop: 130 after Ctrl-C (the shell's convention), else 0
            assert proc.returncode == (130 if how == "SIGINT" else 0), proc.stdout.read()


def test_a_killed_core_errors_every_stream_of_every_front_end_and_stops_the_cli():
    async def streams_while_the_core_dies(url, core):
        clients = await pinned(url, {0: 2, 1: 2})
        started = asyncio.Event()
        n = [0]

        async def one(c, i):
            events = []
            async with c.stream("POST", "/v1/completions", json=dict(
                    model=MODEL, prompt=[5 + i, 6], max_tokens=240, ignore_eos=True, stream=True)) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        events.append(line)
                        if len(events) == 1:
                            n[0] += 1
                            if n[0] == 4:
                                started.set()
            return events

        async def kill():
            await started.wait()
            os.kill(core, signal.SIGKILL)
            return time.monotonic()
        try:
            every = [one(c, i) for i, c in enumerate(clients[0] + clients[1])]
            *results, killed = await asyncio.gather(*every, kill())
            return results, time.monotonic() - killed
        finally:
            for c in clients[0] + clients[1]:
                await c.aclose()
    with cli_with_two_front_ends() as (proc, url, cores, fronts):
        results, after_s = asyncio.run(streams_while_the_core_dies(url, cores[0]))
        assert after_s < 10.0
        ends = [(len(ev), any('"error"' in e for e in ev), ev[-1][:60]) for ev in results]
        assert all(err and last == "data: [DONE]" for _, err, last in ends), ends
        proc.wait(30)
        out = proc.stdout.read()
        assert proc.returncode == 1 and "engine core 0 died" in out, out
        assert wait_gone(fronts)

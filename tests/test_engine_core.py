"""The engine core in a process of its own behind the HTTP server: the served tokens are exactly
LLM.generate's (mixed sampling parameters, concurrent clients, streamed and whole, one core and two
data-parallel cores); a client that leaves frees its blocks; a core that is SIGKILLed ends every open
stream with an error within seconds and /health says so; a server that is SIGKILLed or stopped leaves
no core process behind."""
from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch

from helpers import mixed_params
from pagedlab import LLM, SamplingParams
from pagedlab.engine_core import EngineCore
from pagedlab.output_processor import OutputProcessor
from pagedlab.server import serve
from pagedlab.tokenizer import ByteTokenizer

MODEL = "random:tiny"
SLOTS, NUM_BLOCKS = 4, 128
DEADLINE_S = 60.0


class IdTokenizer(ByteTokenizer):
    """Text in as bytes; every token out as its own id in brackets: decode([5, 17]) == "<5><17>"
    (so a served text gives back its exact token ids). Picklable: it travels to the core process."""

    def decode(self, ids, skip_special: bool = False) -> str:
        return "".join(f"<{int(i)}>" for i in ids)


def ids_of(text: str) -> list[int]:
    assert re.fullmatch(r"(<\d+>)*", text), text
    return [int(t) for t in re.findall(r"<(\d+)>", text)]


def llm_kwargs():
    from pagedlab import tiny_config
    c = tiny_config()
    return dict(device="cpu", dtype="float32", max_num_seqs=SLOTS, num_blocks=NUM_BLOCKS,
                show_progress=False, tokenizer=IdTokenizer(c.vocab_size, c.bos_token_id, c.eos_token_ids))


@pytest.fixture(scope="module")
def reference():
    return LLM(MODEL, **llm_kwargs())


@pytest.fixture(scope="module")
def server():
    s = serve(MODEL, model_name="tiny", port=0, **llm_kwargs())
    yield s
    pids = [c["pid"] for c in s.async_llm.core_status()]
    s.stop()
    assert not any(alive(p) for p in pids)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:                          # a zombie (exited, not reaped yet) is gone for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def requests(n: int, seed: int, reference):
    """n random prompts with mixed sampling parameters (greedy, stop strings, logprobs, penalties,
    seeded sampling), as token ids."""
    rng, rnd = torch.Generator().manual_seed(seed), random.Random(seed)
    prompts = [torch.randint(3, 500, (int(torch.randint(2, 30, (1,), generator=rng)),), generator=rng).tolist()
               for _ in range(n)]
    free = reference.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    return prompts, mixed_params(free, rnd)


def body(params: SamplingParams) -> dict:
    b = dict(max_tokens=params.max_new_tokens, temperature=params.temperature, ignore_eos=params.ignore_eos)
    if params.stop:
        b["stop"] = list(params.stop)
    if params.seed is not None:
        b.update(seed=params.seed, top_k=params.top_k, min_p=params.min_p)
    if params.presence_penalty or params.frequency_penalty:
        b.update(presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty)
    if params.logprobs is not None:
        b["logprobs"] = params.logprobs
    return b


async def complete_all(url: str, prompts, params, stream_every: int = 2):
    """Every request at once through the official client; every other one streamed."""
    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

    async def one(i, p, sp):
        kw = dict(model="tiny", prompt=p, **body(sp))
        extra = {k: kw.pop(k) for k in ("ignore_eos", "top_k", "min_p") if k in kw}
        if i % stream_every:
            text, reason = "", None
            async for ch in await c.completions.create(stream=True, extra_body=extra, **kw):
                text += ch.choices[0].text
                reason = ch.choices[0].finish_reason or reason
            return text, reason
        r = await c.completions.create(extra_body=extra, **kw)
        return r.choices[0].text, r.choices[0].finish_reason
    try:
        return await asyncio.gather(*(one(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))))
    finally:
        await c.close()


def served_like_generate(url: str, n: int, seed: int, reference) -> None:
    """n concurrent mixed requests (complete_all) get exactly generate()'s text and finish reasons
    (ids in brackets: the text is the tokens)."""
    prompts, params = requests(n, seed, reference)
    want = reference.generate(prompts, params)
    got = asyncio.run(complete_all(url, prompts, params))
    for (text, reason), w in zip(got, want):
        assert text == w.text and reason == w.finish_reason


def wait_blocks_free(url: str, deadline_s: float = DEADLINE_S) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        m = httpx.get(url + "/metrics").text
        used = float(re.search(r"^pagedlab_kv_blocks_used (\S+)", m, re.M).group(1))
        running = float(re.search(r"^pagedlab_requests_running (\S+)", m, re.M).group(1))
        if used == 0 and running == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"blocks still in use after {deadline_s} s")


# -- the core, in this process -------------------------------------------------------------------

def test_engine_core_hands_out_every_token_and_ending_once(reference):
    """EngineCore + OutputProcessor (what LLM.generate runs) on a stream of requests added between
    steps, some aborted: every request ends exactly once, with generate()'s tokens."""
    prompts, params = requests(10, 3, reference)
    want = reference.generate(prompts, params)
    core, proc = EngineCore(reference.engine), OutputProcessor(reference.tokenizer)
    ended, pending = {}, list(enumerate(zip(prompts, params)))
    rnd = random.Random(0)
    aborted = set()
    while pending or core.has_work():
        for _ in range(rnd.randint(0, 3)):
            if pending:
                i, (p, sp) = pending.pop(0)
                [rid] = core.add([(1000 + i, p, None, sp)])
                proc.add(rid, p, None, sp)
        if rnd.random() < 0.1 and proc.states:
            rid = rnd.choice(list(proc.states))
            core.abort([rid])
            aborted.add(rid)
        changed, stopped = proc.process(core.step())
        core.abort(stopped)
        for s in changed:
            if s.output is not None:
                assert s.request_id not in ended
                ended[s.request_id] = s.output
    assert len(ended) == len(prompts) and reference.engine.scheduler.allocator.num_used == 0
    for i, w in enumerate(want):
        o = ended[1000 + i]
        if 1000 + i in aborted and o.finish_reason == "abort":
            assert o.token_ids == w.token_ids[:len(o.token_ids)]
        else:
            assert (o.token_ids, o.text, o.finish_reason) == (w.token_ids, w.text, w.finish_reason)


# -- the server on a core process ----------------------------------------------------------------

def test_served_tokens_equal_generate_under_concurrency(server, reference):
    served_like_generate(server.url, 16, 1, reference)
    wait_blocks_free(server.url)
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["engine_cores"][0]["pid"] != os.getpid()


def test_clients_that_leave_free_every_block(server, reference):
    """Streams cancelled mid-way (their connections closed) are aborted in the core: every block
    comes back, and a request sent afterwards still gets generate()'s tokens."""
    async def leave_early(n):
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            async def one(i):
                req = c.build_request("POST", "/v1/completions", json=dict(
                    model="tiny", prompt=[5 + i, 6, 7], max_tokens=500, ignore_eos=True, stream=True))
                r = await c.send(req, stream=True)
                async for line in r.aiter_lines():
                    if line.startswith("data:") and "<" in line:
                        break            # one chunk of text, then hang up
                await r.aclose()
            await asyncio.gather(*(one(i) for i in range(n)))
    asyncio.run(leave_early(8))
    wait_blocks_free(server.url)
    p = [9, 8, 7, 6]
    want = reference.generate(p, SamplingParams(max_tokens=12, ignore_eos=True))[0]
    got = asyncio.run(complete_all(server.url, [p], [SamplingParams(max_tokens=12, ignore_eos=True)]))
    assert ids_of(got[0][0]) == want.token_ids


def test_data_parallel_serving_gives_one_engines_outputs(reference):
    """Two engine cores behind one server: seeded and greedy requests give one engine's tokens, and
    /metrics counts both cores' blocks. Then one core is SIGKILLed with streams open: each of its
    streams gets an error event within 10 s, /health turns 503, the server does not hang."""
    s = serve(MODEL, model_name="tiny", port=0, data_parallel_size=2, **llm_kwargs())
    try:
        cores = s.async_llm.core_status()
        assert len(cores) == 2 and len({c["pid"] for c in cores}) == 2
        served_like_generate(s.url, 12, 2, reference)
        m = httpx.get(s.url + "/metrics").text
        assert float(re.search(r"^pagedlab_kv_blocks_total (\S+)", m, re.M).group(1)) == 2 * NUM_BLOCKS

        async def streams_while_a_core_dies():
            async with httpx.AsyncClient(base_url=s.url, timeout=30) as c:
                async def one(i):
                    events = []
                    async with c.stream("POST", "/v1/completions", json=dict(
                            model="tiny", prompt=[5 + i, 6], max_tokens=100000 // 1000, ignore_eos=True,
                            stream=True, temperature=0)) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data:"):
                                events.append(line)
                                if len(events) == 2 and i == 0:
                                    os.kill(cores[1]["pid"], signal.SIGKILL)
                    return events
                return await asyncio.gather(*(one(i) for i in range(6)))
        t0 = time.monotonic()
        results = asyncio.run(streams_while_a_core_dies())
        assert time.monotonic() - t0 < 10.0
        errors = [ev for ev in results if any('"error"' in e for e in ev)]
        assert errors, "no stream saw the core die"
        assert all(ev[-1] == "data: [DONE]" for ev in results)
        h = httpx.get(s.url + "/health")
        assert h.status_code == 503 and not h.json()["engine_cores"][1]["alive"]
    finally:
        s.stop()
    assert not any(alive(c["pid"]) for c in cores)


# -- the CLI server: signals ---------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_cli_server(port: int, *more: str):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "pagedlab", "serve", "--model", MODEL, "--device", "cpu",
                             "--port", str(port), "--slots", "2", "--log-level", "warning", *more],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    end = time.monotonic() + 120
    while time.monotonic() < end:
        try:
            h = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
            if h.status_code == 200:
                return proc, [c["pid"] for c in h.json()["engine_cores"]]
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise AssertionError(proc.stdout.read())
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("the CLI server did not start in 120 s")


def wait_gone(pids, deadline_s: float = 15.0) -> bool:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM", "SIGKILL"])
def test_a_stopped_or_killed_server_leaves_no_core(how):
    port = free_port()
    proc, cores = start_cli_server(port)
    try:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json=dict(model=MODEL, prompt=[5, 6, 7], max_tokens=4, ignore_eos=True))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        os.kill(proc.pid, getattr(signal, how))
        proc.wait(30)
        assert wait_gone(cores), f"engine core left running after {how} of the server"
        if how != "SIGKILL":        # a clean stop: 130 after Ctrl-C (the shell's convention), else 0
            assert proc.returncode == (130 if how == "SIGINT" else 0), proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in cores:
            if alive(p):
                os.kill(p, signal.SIGKILL)


def test_a_killed_core_stops_the_cli_server():
    """SIGKILL of the engine core: the CLI server notices, exits with status 1 (a supervisor restarts
    it) and says why."""
    port = free_port()
    proc, cores = start_cli_server(port)
    try:
        os.kill(cores[0], signal.SIGKILL)
        proc.wait(30)
        out = proc.stdout.read()
        assert proc.returncode == 1 and "engine core 0 died" in out, out
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("env", ["", "0"])
def test_freeze_heap_hides_the_startup_heap_from_the_collector(env):
    """core_process.freeze_heap (the CLI server and each engine core call it once built): what is
    alive moves to the permanent generation and the young generation grows to 50,000 objects, so a
    collection during serving never re-walks torch and the model; PAGEDLAB_GC_FREEZE=0 leaves the
    collector as it was. Garbage made later is still collected."""
    code = ("import gc, weakref\n"
            "from pagedlab.core_process import freeze_heap\n"
            "keep = [[i] for i in range(1000)]\n"
            "t0 = gc.get_threshold()\n"
            "freeze_heap()\n"
            "class C: pass\n"
            "a = C(); a.me = a; dead = weakref.ref(a); del a\n"
            "gc.collect()\n"
            "print(gc.get_freeze_count(), t0[0], gc.get_threshold()[0], dead() is None)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PAGEDLAB_GC_FREEZE": env}, check=True).stdout.split()
    frozen, before, after, collected = int(out[0]), int(out[1]), int(out[2]), out[3]
    assert collected == "True"
    if env == "0":
        assert frozen == 0 and after == before
    else:
        assert frozen > 1000 and after == max(before, 50_000)

"""The OpenAI-compatible server (pagedlab.server), over real HTTP on 127.0.0.1.

The load tests use the tiny random model with a tokenizer whose text shows every token id
("<5><17>"), so a client's text tells exactly which tokens it got; SmolLM2 (slow) only where real
text matters. Every test leaves the shared server as it found it: no request running, no block used.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
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
from prometheus_client.parser import text_string_to_metric_families

from helpers import tiny_llm
from pagedlab import SamplingParams, tiny_config
from pagedlab.server import serve
from pagedlab.tokenizer import ByteTokenizer

MODEL = "tiny-ids"
SLOTS = 4
NUM_BLOCKS = 96
DEADLINE_S = 30.0


class IdTokenizer(ByteTokenizer):
    """Text in as bytes; every token out as its own id in brackets: decode([5, 17]) == "<5><17>"."""

    def decode(self, ids, skip_special: bool = False) -> str:
        return "".join(f"<{int(i)}>" for i in ids)


def ids_of(text: str) -> list[int]:
    assert re.fullmatch(r"(<\d+>)*", text), text
    return [int(t) for t in re.findall(r"<(\d+)>", text)]


def id_llm(**kw):
    c = tiny_config()
    kw.setdefault("max_num_seqs", SLOTS)
    kw.setdefault("num_blocks", NUM_BLOCKS)
    return tiny_llm(tokenizer=IdTokenizer(c.vocab_size, c.bos_token_id, c.eos_token_ids), dtype="float32", **kw)


@pytest.fixture(scope="module")
def server():
    s = serve(id_llm(), model_name=MODEL, port=0, max_waiting=64)
    yield s
    s.stop()
    assert not s.thread.is_alive()


@pytest.fixture(scope="module")
def reference():
    """The same weights in a plain LLM: what greedy generate gives."""
    return id_llm()


def engine_of(server):
    return server.async_llm.engine


def wait_idle(server, deadline_s: float = DEADLINE_S):
    """Poll until the engine has no request and no block in use (fail after the deadline)."""
    eng = engine_of(server)
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if eng.scheduler.allocator.num_used == 0 and not eng.has_work():
            return
        time.sleep(0.02)
    raise AssertionError(f"blocks still used after {deadline_s} s: {eng.scheduler.allocator.num_used}")


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def metrics(server) -> dict:
    """{(sample name, labels as a sorted tuple): value} from /metrics, through prometheus' parser."""
    text = httpx.get(server.url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def moved(before: dict, after: dict, name: str, labels=()) -> float:
    return after[(name, labels)] - before.get((name, labels), 0)


def random_prompts(rng, n, lo=1, hi=40):
    return [torch.randint(3, 500, (int(torch.randint(lo, hi, (1,), generator=rng)),), generator=rng).tolist()
            for _ in range(n)]


# -- the official client, streamed and whole -------------------------------------------------------

def test_openai_client_stream_joins_to_whole(server, reference):
    c = client(server)
    rng = torch.Generator().manual_seed(1)
    prompt = random_prompts(rng, 1, 5, 30)[0]
    want = reference.generate(prompt, SamplingParams(max_tokens=11, ignore_eos=True))[0]

    whole = c.completions.create(model=MODEL, prompt=prompt, max_tokens=11, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert whole.object == "text_completion" and len(whole.choices) == 1
    assert ids_of(whole.choices[0].text) == want.token_ids
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len(prompt) and whole.usage.completion_tokens == 11

    chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=11, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 11
    assert all(ch.usage is None for ch in chunks[:-1])

    # pagedlab's own stream option: the usage chunk also says when the request reached the front end
    # and when its first token came back -- on this machine's monotonic clock (time.perf_counter)
    before = time.perf_counter()
    chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=11, temperature=0, stream=True,
                                       stream_options={"pagedlab_timing": True}, extra_body={"ignore_eos": True}))
    after = time.perf_counter()
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 11
    [moments] = chunks[-1].model_extra["pagedlab_timing"]
    assert before < moments["arrival"] < moments["first_token"] < after, (before, moments, after)

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"},
                {"role": "assistant", "content": "hi"},
                {"role": "user", "content": [{"type": "text", "text": "and "}, {"type": "text", "text": "now?"}]}]
    conv = [dict(m, content=m["content"] if isinstance(m["content"], str) else "and now?") for m in messages]
    chat_ids = reference.tokenizer.chat(conv)
    want = reference.generate(chat_ids, SamplingParams(max_tokens=9, ignore_eos=True))[0]
    whole = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=9, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert ids_of(whole.choices[0].message.content) == want.token_ids
    assert whole.usage.prompt_tokens == len(chat_ids)
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=9, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length" and not chunks[-1].choices[0].delta.content
    assert len({ch.id for ch in chunks}) == 1
    wait_idle(server)


def test_tokens_whose_text_is_held_back_still_make_events(server, reference):
    """A stop string 256 characters long (the longest allowed) holds back all the text of 30 tokens
    (each token's text here, "<id>", is 4-6 characters): every token still makes a chunk, text ""
    (as vLLM sends such tokens),
    and the last token's chunk lets the held text go. However the stream coalesces steps (a busy
    machine joins several tokens into one chunk), the chunks before that one carry no text and there
    is at least one of them: before the change the server sent nothing until the last token."""
    c = client(server)
    rng = torch.Generator().manual_seed(3)
    prompt = random_prompts(rng, 1, 5, 30)[0]
    want = reference.generate(prompt, SamplingParams(max_tokens=30, ignore_eos=True))[0]
    chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stream=True,
                                       stop=["#" * 256], extra_body={"ignore_eos": True}))
    texts = [ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].finish_reason is None]
    assert len(texts) >= 2 and set(texts[:-1]) == {""} and texts[-1], texts
    assert ids_of("".join(ch.choices[0].text for ch in chunks if ch.choices)) == want.token_ids


def test_raw_sse_format(server):
    """The bytes on the wire: `data: {json}` events separated by blank lines, then `data: [DONE]`."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
            "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=DEADLINE_S) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    objs = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert objs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert objs[-1]["choices"][0]["delta"] == {} and objs[-1]["choices"][0]["finish_reason"] == "length"
    assert len(ids_of("".join(o["choices"][0]["delta"].get("content", "") for o in objs))) == 3


# -- many clients at once ------------------------------------------------------------------------

def test_50_concurrent_streams_get_exactly_their_tokens(server, reference):
    rng = torch.Generator().manual_seed(50)
    prompts = random_prompts(rng, 50)
    max_tokens = torch.randint(1, 14, (50,), generator=rng).tolist()
    ignore = [bool(b) for b in torch.randint(0, 2, (50,), generator=rng)]
    want = reference.generate(prompts, [SamplingParams(max_tokens=m, ignore_eos=i)
                                        for m, i in zip(max_tokens, ignore)])

    async def one(c, p, m, i):
        stream = await c.completions.create(model=MODEL, prompt=p, max_tokens=m, temperature=0, stream=True,
                                            extra_body={"ignore_eos": i})
        text, reasons = "", []
        async for ch in stream:
            text += ch.choices[0].text
            reasons.append(ch.choices[0].finish_reason)
        return text, reasons

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                      http_client=openai.DefaultAsyncHttpxClient(
                                          limits=httpx.Limits(max_connections=100))) as c:
            return await asyncio.gather(*(one(c, *a) for a in zip(prompts, max_tokens, ignore)))
    got = asyncio.run(main())
    for (text, reasons), w in zip(got, want):
        assert ids_of(text) == w.token_ids
        assert reasons[-1] == w.finish_reason and all(r is None for r in reasons[:-1])
    wait_idle(server)


# -- clients that go away ------------------------------------------------------------------------

def test_aborted_stream_frees_its_blocks(server, monkeypatch):
    # every step takes at least 10 ms here, so 200 tokens (2 s) surely outlast the client's 0.3 s
    # read timeout below, however fast the machine (a race otherwise: an idle CPU can finish first)
    runner = engine_of(server).runner
    run = runner.run
    monkeypatch.setattr(runner, "run", lambda batch: (time.sleep(0.01), run(batch))[1])
    before = metrics(server)
    body = {"model": MODEL, "prompt": list(range(3, 40)), "max_tokens": 200, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=DEADLINE_S) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]          # a few events, then the client hangs up
    assert got[0].startswith("data: ")
    wait_idle(server)
    after = metrics(server)
    key = ("pagedlab_requests_finished_total", (("finish_reason", "abort"),))
    assert after[key] == before[key] + 1
    assert moved(before, after, "pagedlab_generation_tokens_total") < 200     # it stopped early
    # a non-streaming request whose client gives up (a read timeout) is aborted too
    body = dict(body, stream=False)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(DEADLINE_S, read=0.3))
    wait_idle(server)
    later = metrics(server)
    assert later[key] == after[key] + 1
    assert moved(after, later, "pagedlab_generation_tokens_total") < 200
    length = ("pagedlab_requests_finished_total", (("finish_reason", "length"),))
    assert later[length] == before[length]              # neither ran to its end


CLIENT_SCRIPT = """
import sys, httpx
body = {"model": sys.argv[2], "prompt": list(range(3, 30)), "max_tokens": int(sys.argv[3]), "temperature": 0,
        "stream": True, "ignore_eos": True}
with httpx.stream("POST", sys.argv[1] + "/v1/completions", json=body, timeout=60) as r:
    lines = r.iter_lines()    # held: a line iterator dropped after `break` is closed at once, and
    for line in lines:        # closing it closes the connection -- the client would have left
        if line.startswith("data: {"):      # (the server then aborts the request: this test's
            print(line, flush=True)         # flake of sessions 16-20, the abort winning the race)
            break                           # the first event: a token (or an error, said as it is)
    import time
    time.sleep(600)
"""
ENDLESS_TOKENS = 100_000      # minutes of decoding: a request that cannot finish while a test looks at it


def wait_for(condition, what: str, deadline_s: float = DEADLINE_S, state=None):
    """Poll condition until true; fail after the deadline, saying what state() says then."""
    end = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"not true after {deadline_s} s: {what}" + (f" ({state()})" if state else ""))
        time.sleep(0.01)


def test_server_survives_a_killed_client():
    """A client SIGKILLed mid-stream: its request is aborted (not run to its end), its blocks are
    freed, and the server serves the next request. The request asks for ENDLESS_TOKENS, so it is
    certainly still running when the client dies, however busy the machine is."""
    c = tiny_config(max_position_embeddings=ENDLESS_TOKENS + 64)
    llm = tiny_llm(config=c, tokenizer=IdTokenizer(c.vocab_size, c.bos_token_id, c.eos_token_ids), dtype="float32",
                   max_num_seqs=2, num_blocks=(ENDLESS_TOKENS + 64) // 16 + 8)
    server = serve(llm, model_name=MODEL, port=0)
    try:
        before = metrics(server)
        proc = subprocess.Popen([sys.executable, "-c", CLIENT_SCRIPT, server.url, MODEL, str(ENDLESS_TOKENS)],
                                stdout=subprocess.PIPE, text=True)
        try:
            first = proc.stdout.readline().strip()
            assert first.startswith("data: {") and '"choices"' in first and '"error"' not in first, first
            eng = engine_of(server)
            wait_for(lambda: eng.scheduler.allocator.num_used > 0, "the request holds KV blocks",
                     state=lambda: f"has_work={eng.has_work()} admitted={len(eng.scheduler.admitted)} "
                                   f"waiting={len(eng.scheduler.waiting)} first event {first!r}")
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(DEADLINE_S)
        finally:
            if proc.poll() is None:
                proc.kill()
        wait_idle(server)
        after = metrics(server)
        abort = ("pagedlab_requests_finished_total", (("finish_reason", "abort"),))
        assert after[abort] == before.get(abort, 0) + 1
        assert moved(before, after, "pagedlab_generation_tokens_total") < ENDLESS_TOKENS
        r = client(server).completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, temperature=0,
                                              extra_body={"ignore_eos": True})
        assert len(ids_of(r.choices[0].text)) == 4
        assert httpx.get(server.url + "/health").json()["status"] == "ok"
    finally:
        server.stop()


# -- bad requests --------------------------------------------------------------------------------

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": MODEL, "prompt": "hi"}
BAD = [   # (endpoint, body, the field the error must name, code)
    ("chat", b'{"model": "tiny-ids", "messages": [', None, None),
    ("completions", b"\xff\xfe not json", None, None),
    ("chat", b"[1, 2]", None, None),
    ("chat", CHAT | {"max_tokens": "ten"}, "max_tokens", None),
    ("completions", COMPLETION | {"max_tokens": 0}, "max_tokens", None),
    ("chat", CHAT | {"max_completion_tokens": -3}, "max_completion_tokens", None),
    ("chat", CHAT | {"temperature": -1}, "temperature", None),
    ("completions", COMPLETION | {"temperature": "hot"}, "temperature", None),
    ("chat", CHAT | {"top_p": 1.5}, "top_p", None),
    ("chat", CHAT | {"seed": -1}, "seed", None),
    ("chat", CHAT | {"stream": "yes"}, "stream", None),
    ("chat", CHAT | {"stop": 7}, "stop", None),
    ("chat", CHAT | {"n": 0}, "n", None),
    ("chat", CHAT | {"messages": 5}, "messages", None),
    ("chat", CHAT | {"messages": []}, "messages", None),
    ("chat", CHAT | {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", None),
    ("chat", CHAT | {"messages": [{"role": "user", "content": 5}]}, "messages[0].content", None),
    ("chat", CHAT | {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content", None),
    ("chat", {"messages": CHAT["messages"]}, "model", None),
    ("chat", CHAT | {"model": "gpt-4"}, "model", "model_not_found"),
    ("completions", COMPLETION | {"model": "nope"}, "model", "model_not_found"),
    ("chat", CHAT | {"temprature": 0.5}, "temprature", None),
    ("completions", COMPLETION | {"prompt": 5}, "prompt", None),
    ("completions", COMPLETION | {"prompt": [1, "a"]}, "prompt", None),
    ("completions", COMPLETION | {"prompt": [3, 600]}, "prompt", None),          # outside the vocabulary
    ("completions", COMPLETION | {"prompt": list(range(3, 300))}, "prompt", None),  # too long
    ("completions", COMPLETION | {"prompt": "   "}, "prompt", None),
    ("completions", COMPLETION | {"echo": True}, "echo", None),
    ("completions", COMPLETION | {"stream_options": {"include_usage": True}}, "stream_options", None),
    ("completions", COMPLETION | {"stream": True, "stream_options": {"pagedlab_timing": "yes"}}, "stream_options", None),
    ("completions", COMPLETION | {"stream": True, "stream_options": {"timing": True}}, "stream_options", None),
    ("chat", CHAT | {"top_logprobs": 3}, "top_logprobs", None),
]


@pytest.mark.parametrize("endpoint,body,param,code", BAD)
def test_bad_request_is_400_naming_the_field(server, endpoint, body, param, code):
    url = server.url + ("/v1/chat/completions" if endpoint == "chat" else "/v1/completions")
    r = httpx.post(url, content=body, headers={"Content-Type": "application/json"}) if isinstance(body, bytes) \
        else httpx.post(url, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and err["code"] == code and err["message"]
    if param:
        assert param.split("[")[0].split(".")[0] in err["message"] or param == "model"


def test_random_junk_never_500(server):
    """Random JSON values in every field: a 400 or a 200, never a 500, and the server goes on."""
    rng = torch.Generator().manual_seed(7)
    junk = [None, True, -1, 0, 2**70, 1e308, -0.5, "", "x" * 50, [], [1, "a"], {"a": 1}, [[1]], float("nan")]
    fields = ["max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "messages", "model",
              "stream", "stream_options", "presence_penalty", "logprobs", "top_logprobs", "ignore_eos"]
    for _ in range(60):
        body = dict(CHAT, max_tokens=2)
        for _ in range(int(torch.randint(1, 4, (1,), generator=rng))):
            f = fields[int(torch.randint(len(fields), (1,), generator=rng))]
            body[f] = junk[int(torch.randint(len(junk), (1,), generator=rng))]
        text = json.dumps(body, allow_nan=True)        # NaN: not JSON, a client bug the server must survive
        r = httpx.post(server.url + "/v1/chat/completions", content=text,
                       headers={"Content-Type": "application/json"}, timeout=DEADLINE_S)
        assert r.status_code in (200, 400), (body, r.status_code, r.text)
        if r.status_code == 400:
            assert r.json()["error"]["type"] == "invalid_request_error"
    wait_idle(server)
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_bug_in_a_generation_route_is_that_requests_500(server, reference, monkeypatch, caplog):
    """An unexpected exception inside /v1/completions or /v1/chat/completions (ServingApp's direct
    path, FastAPI's layers skipped): a 500 in OpenAI's shape, the traceback logged, and a stream
    running meanwhile still gets exactly its tokens."""
    prompt = [9, 8, 7, 6]
    want = reference.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids
    with httpx.stream("POST", server.url + "/v1/completions", timeout=DEADLINE_S,
                      json=dict(model=MODEL, prompt=prompt, max_tokens=24, stream=True, ignore_eos=True,
                                temperature=0)) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))     # running now
        check = server.async_llm.check_request

        def broken(*a, **k):
            raise RuntimeError("a bug")
        monkeypatch.setattr(server.async_llm, "check_request", broken)
        for path, body in (("/v1/completions", dict(model=MODEL, prompt=[5, 6], max_tokens=2)),
                           ("/v1/chat/completions", dict(CHAT, max_tokens=2))):
            with caplog.at_level("ERROR", logger="uvicorn.error"):
                bad = httpx.post(server.url + path, json=body, timeout=DEADLINE_S)
            assert bad.status_code == 500 and bad.json()["error"]["type"] == "server_error", bad.text
            assert "RuntimeError: a bug" in bad.json()["error"]["message"]
            assert any(rec.exc_info and "a bug" in str(rec.exc_info[1]) for rec in caplog.records)
            caplog.clear()
        monkeypatch.setattr(server.async_llm, "check_request", check)
        rest = [first] + [line for line in lines if line.startswith("data: ")]
    text = "".join(json.loads(x[6:])["choices"][0]["text"] for x in rest if x != "data: [DONE]" and
                   json.loads(x[6:])["choices"])
    assert ids_of(text) == want
    wait_idle(server)


def test_a_body_past_the_limit_is_413_and_never_held_whole(server, monkeypatch):
    """A request body past protocol.MAX_BODY_BYTES: 413 in OpenAI's shape -- at once when its
    Content-Length says so, and mid-upload when it comes in chunks without one -- on every route
    that reads a body; the server goes on (a stream running meanwhile is not disturbed)."""
    from pagedlab.server import protocol
    monkeypatch.setattr(protocol, "MAX_BODY_BYTES", 4096)
    with httpx.stream("POST", server.url + "/v1/completions", timeout=DEADLINE_S,
                      json=dict(model=MODEL, prompt=[9, 8, 7], max_tokens=40, stream=True, ignore_eos=True)) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))      # running now
        big = json.dumps(dict(model=MODEL, prompt=[5] * 3000, max_tokens=2))     # ~9 kB
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
            r1 = httpx.post(server.url + path, content=big, headers={"Content-Type": "application/json"},
                            timeout=DEADLINE_S)
            assert r1.status_code == 413 and "4,096" in r1.json()["error"]["message"], (path, r1.text)

            def chunks():                      # no Content-Length: chunked transfer, 1 kB at a time
                for i in range(0, len(big), 1024):
                    yield big[i:i + 1024].encode()
            r2 = httpx.post(server.url + path, content=chunks(), headers={"Content-Type": "application/json"},
                            timeout=DEADLINE_S)
            assert r2.status_code == 413 and r2.json()["error"]["type"] == "invalid_request_error", (path, r2.text)
        done = [first] + [line for line in lines if line.startswith("data: ")]
    assert done[-1] == "data: [DONE]"
    assert len(ids_of("".join(c["text"] for x in done[:-1] for c in json.loads(x[6:])["choices"]))) == 40
    ok = httpx.post(server.url + "/v1/completions", json=dict(model=MODEL, prompt=[5] * 50, max_tokens=2),
                    timeout=DEADLINE_S)
    assert ok.status_code == 200, ok.text
    wait_idle(server)


def test_a_client_gone_mid_body_is_no_error(server, caplog):
    """A client that closes its connection halfway through sending a body: nothing to answer,
    nothing logged as an error, nothing queued; the server goes on."""
    host, port = server.url.removeprefix("http://").split(":")
    with caplog.at_level("ERROR", logger="uvicorn.error"):
        for path in ("/v1/completions", "/v1/chat/completions"):
            with socket.create_connection((host, int(port)), timeout=DEADLINE_S) as sock:
                sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             f"Content-Length: 5000\r\n\r\n{{\"model\": \"{MODEL}\", \"prompt\": [".encode())
                time.sleep(0.05)
        time.sleep(0.3)
    assert not [r for r in caplog.records if r.levelname == "ERROR"], [r.getMessage() for r in caplog.records]
    ok = httpx.post(server.url + "/v1/completions", json=dict(model=MODEL, prompt=[5, 6], max_tokens=2),
                    timeout=DEADLINE_S)
    assert ok.status_code == 200, ok.text
    wait_idle(server)


# -- a full queue --------------------------------------------------------------------------------

def test_full_queue_gets_503_with_retry_after():
    s = serve(id_llm(max_num_seqs=1), model_name=MODEL, port=0, max_waiting=1)
    try:
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 200, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with httpx.Client(base_url=s.url, timeout=DEADLINE_S) as c:
            with c.stream("POST", "/v1/completions", json=body) as running, \
                    c.stream("POST", "/v1/completions", json=body) as waiting:
                assert running.status_code == waiting.status_code == 200
                r = c.post("/v1/chat/completions", json=CHAT)
                assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and "waiting" in err["message"]
                rejected = metrics(s)[("pagedlab_requests_rejected_total", ())]
                assert rejected == 1
            wait_idle(s)
            ok = c.post("/v1/completions", json=dict(body, stream=False, max_tokens=2))
            assert ok.status_code == 200 and len(ids_of(ok.json()["choices"][0]["text"])) == 2
            # n streams count n: more than slots + max_waiting can never be served
            r = c.post("/v1/completions", json=dict(body, stream=False, n=3))
            assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    finally:
        s.stop()


# -- one request's engine error is its own -------------------------------------------------------

def test_engine_error_fails_that_request_only():
    llm = id_llm()
    run = llm.engine.runner.run
    poison = 499

    def failing_run(batch):
        if any(poison in r.prompt_token_ids for r in batch.prefill + batch.decode):
            raise RuntimeError("poisoned")
        return run(batch)
    llm.engine.runner.run = failing_run
    reference = id_llm().generate([[5, 6, 7, 8]], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    s = serve(llm, model_name=MODEL, port=0)
    try:
        async def main():
            async with httpx.AsyncClient(base_url=s.url, timeout=DEADLINE_S) as c:
                good = c.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 12,
                                                       "temperature": 0, "ignore_eos": True})
                bad = c.post("/v1/completions", json={"model": MODEL, "prompt": [5, poison], "max_tokens": 12,
                                                      "temperature": 0})
                streamed = c.post("/v1/completions", json={"model": MODEL, "prompt": [poison, 9], "stream": True,
                                                           "max_tokens": 12, "temperature": 0})
                return await asyncio.gather(good, bad, streamed)
        good, bad, streamed = asyncio.run(main())
        assert good.status_code == 200 and ids_of(good.json()["choices"][0]["text"]) == reference.token_ids
        assert bad.status_code == 500 and bad.json()["error"]["type"] == "server_error"
        assert "poisoned" in bad.json()["error"]["message"]
        events = [e for e in streamed.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]" and "poisoned" in json.loads(events[-2][6:])["error"]["message"]
        assert metrics(s)[("pagedlab_requests_finished_total", (("finish_reason", "error"),))] == 2
        wait_idle(s)
    finally:
        s.stop()


# -- metrics -------------------------------------------------------------------------------------

def test_metrics_parse_and_move(server):
    before = metrics(server)
    eng = engine_of(server)
    assert before[("pagedlab_kv_blocks_total", ())] == eng.scheduler.allocator.num_blocks
    for name in ("pagedlab_requests_running", "pagedlab_requests_waiting", "pagedlab_kv_blocks_used"):
        assert before[(name, ())] == 0
    m = int(torch.randint(2, 9, (1,)))
    r = client(server).completions.create(model=MODEL, prompt=[4, 5, 6, 7, 8], max_tokens=m, temperature=0,
                                          extra_body={"ignore_eos": True})
    after = metrics(server)
    assert moved(before, after, "pagedlab_generation_tokens_total") == r.usage.completion_tokens == m
    assert moved(before, after, "pagedlab_prompt_tokens_total") == 5
    assert moved(before, after, "pagedlab_requests_finished_total", (("finish_reason", "length"),)) == 1
    assert moved(before, after, "pagedlab_time_to_first_token_seconds_count") == 1
    assert moved(before, after, "pagedlab_inter_token_latency_seconds_count") == m - 1
    assert moved(before, after, "pagedlab_time_to_first_token_seconds_sum") > 0
    # the front end's own CPU (what `bench serve` divides by the requests): this process's, moving
    cpu = moved(before, after, "pagedlab_frontend_cpu_seconds")
    assert 0 < cpu and after[("pagedlab_frontend_cpu_seconds", ())] <= time.process_time()


def test_many_histogram_equals_prometheus_histogram():
    """metrics.ManyHistogram (a request's gaps added in one call) exposes what prometheus_client's
    Histogram does for the same values, one observe each: values on a bound, above every bound, none."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest
    from pagedlab.server.metrics import ITL_BUCKETS, ManyHistogram
    one, many = CollectorRegistry(), CollectorRegistry()
    h = Histogram("gap_seconds", "gaps", buckets=ITL_BUCKETS, registry=one)
    m = ManyHistogram("gap_seconds", "gaps", ITL_BUCKETS, many)
    rnd = __import__("random").Random(int(torch.randint(0, 10**6, (1,))))
    for _ in range(40):
        vals = [rnd.choice([rnd.expovariate(40), rnd.choice(ITL_BUCKETS), 9.0, 0.0])
                for _ in range(rnd.randint(0, 25))]
        for v in vals:
            h.observe(v)
        m.observe_many(vals)
    got = {(s.name, tuple(s.labels.items())): s.value for f in text_string_to_metric_families(
        generate_latest(many).decode()) for s in f.samples}
    want = {(s.name, tuple(s.labels.items())): s.value for f in text_string_to_metric_families(
        generate_latest(one).decode()) for s in f.samples if not s.name.endswith("_created")}
    assert got.keys() == want.keys() and got[("gap_seconds_count", ())] > 0
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-12), k


def test_prefix_cache_hits_show_in_usage_and_metrics():
    s = serve(id_llm(prefix_caching=True), model_name=MODEL, port=0)
    try:
        rng = torch.Generator().manual_seed(14)
        prompt = random_prompts(rng, 1, 70, 90)[0]          # several full 16-token blocks
        c = client(s)
        kw = dict(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
        first, second = c.completions.create(**kw), c.completions.create(**kw)
        assert first.choices[0].text == second.choices[0].text
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert 0 < cached < len(prompt) and cached % 16 == 0
        m = metrics(s)
        assert m[("pagedlab_prefix_cache_hit_tokens_total", ())] == cached
        assert m[("pagedlab_prompt_tokens_total", ())] == 2 * len(prompt)
        assert m[("pagedlab_prefix_cache_hit_rate", ())] == pytest.approx(cached / (2 * len(prompt)))
        wait_idle(s)
    finally:
        s.stop()


# -- fields that arrived with SamplingParams' growth (n, stop, logprobs) ----------------------------

def needs_field(name):
    have = {f.name for f in dataclasses.fields(SamplingParams)}
    return pytest.mark.skipif(name not in have, reason=f"SamplingParams has no field {name!r} yet")


@needs_field("n")
def test_n_samples_are_seeded_streams(server):
    c = client(server)
    kw = dict(model=MODEL, prompt=[9, 10, 11], max_tokens=8, temperature=1.0, seed=1234,
              extra_body={"ignore_eos": True})
    many = c.completions.create(n=3, **kw)
    assert [ch.index for ch in many.choices] == [0, 1, 2]
    assert many.usage.completion_tokens == 24 and many.usage.prompt_tokens == 3
    for i, ch in enumerate(many.choices):       # sample i is the single request with seed + i
        one = c.completions.create(**(kw | {"seed": 1234 + i}))
        assert ch.text == one.choices[0].text
    streamed = c.completions.create(n=3, stream=True, **kw)
    texts = ["", "", ""]
    for chunk in streamed:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [ch.text for ch in many.choices]
    wait_idle(server)


@needs_field("stop")
def test_stop_string_ends_the_text_before_it(server, reference):
    prompt = [12, 13, 14, 15]
    full = reference.generate(prompt, SamplingParams(max_tokens=10, ignore_eos=True))[0]
    stop = f"<{full.token_ids[4]}>"
    want = full.text[:full.text.index(stop)]
    c = client(server)
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stop=[stop],
                             extra_body={"ignore_eos": True})
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stop=stop,
                                       stream=True, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"
    wait_idle(server)


@needs_field("logprobs")
def test_logprobs_in_both_shapes(server):
    c = client(server)
    r = c.completions.create(model=MODEL, prompt=[20, 21, 22], max_tokens=6, temperature=0, logprobs=3,
                             extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.token_logprobs) == 6
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and len(top) == 3
        assert max(top.values()) >= chosen - 1e-4           # greedy: the chosen token is the likeliest
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hey"}], max_tokens=5,
                                     temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    wait_idle(server)


# -- the command line ------------------------------------------------------------------------------

@pytest.mark.parametrize("args,flag", [
    (["--port", "70000"], "--port"), (["--max-waiting", "-1"], "--max-waiting"), (["--slots", "0"], "--slots"),
    (["--device", "gpu"], "--device"), (["--dtype", "fp8"], "--dtype"), (["--model", " "], "--model"),
    (["--host", ""], "--host"), (["--api-servers", "0"], "--api-servers"),
])
def test_serve_flags_checked_before_loading(args, flag, monkeypatch, capsys):
    import pagedlab.__main__ as cli
    import pagedlab.llm

    def boom(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")
    monkeypatch.setattr(pagedlab.llm, "LLM", boom)
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--port", "0"] + args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and flag in err


def test_serve_port_in_use_is_one_line(monkeypatch, capsys):
    import pagedlab.__main__ as cli
    import pagedlab.llm
    monkeypatch.setattr(pagedlab.llm, "LLM", lambda *a, **k: pytest.fail("loaded"))
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as e:
            cli.main(["serve", "--port", str(port)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and f"--port {port}" in err


# -- real text (SmolLM2) ---------------------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_chat_over_http(smollm2_llm):
    messages = [{"role": "system", "content": "You answer in one short sentence."},
                {"role": "user", "content": "What is the capital of France?"}]
    ids = smollm2_llm.tokenizer.chat(messages)
    want = smollm2_llm.generate(ids, SamplingParams(max_tokens=24))[0]
    from pagedlab import LLM
    llm = LLM(checkpoint=smollm2_llm.checkpoint, device="cpu", max_num_seqs=2, max_model_len=512,
              show_progress=False)
    s = serve(llm, model_name="smollm2", port=0)
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        whole = c.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0)
        assert whole.choices[0].message.content == want.text and "Paris" in want.text
        assert whole.choices[0].finish_reason == want.finish_reason
        assert whole.usage.prompt_tokens == len(ids)
        streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=24, temperature=0, stream=True))
        assert streamed == want.text
    finally:
        s.stop()


def test_a_tensor_parallel_engine_behind_the_server(reference):
    """serve(LLM(tensor_parallel_size=2)): concurrent HTTP completions give generate()'s tokens, and
    stopping the server and closing the LLM leaves no process behind."""
    import multiprocessing
    from concurrent.futures import ThreadPoolExecutor
    prompts = [[5, 6, 7], [9] * 20, [3, 4, 5, 6, 7, 8, 9, 10, 11]]
    want = [o.token_ids for o in reference.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))]
    llm = id_llm(tensor_parallel_size=2)
    s = serve(llm, model_name=MODEL, port=0)
    try:
        def one(p):
            body = dict(model=MODEL, prompt=p, max_tokens=12, temperature=0, ignore_eos=True)
            r = httpx.post(s.url + "/v1/completions", json=body, timeout=DEADLINE_S)
            assert r.status_code == 200, r.text
            return ids_of(r.json()["choices"][0]["text"])
        with ThreadPoolExecutor(3) as pool:
            assert list(pool.map(one, prompts)) == want
    finally:
        s.stop()
        llm.close()
    assert not multiprocessing.active_children()


def test_text_events_from_the_template_equal_whole_chunks():
    """responses.Envelope.text_event (the streamed text event, from a per-request template) gives
    the very characters sse(chunk(...)) gives: both APIs, with and without usage, any index, texts
    with quotes, escapes, newlines, non-ASCII and astral characters, empty; odd model names."""
    import random
    from pagedlab.server.responses import Envelope, chunk, sse
    rnd = random.Random(int(torch.randint(0, 10**6, (1,))))
    alphabet = ['"', "\\", "\n", "\t", "\x00", "\x7f", "é", "ß", "中", "😀", "\u2028", "a", " ", "{", "}"]
    for kind in ("chat", "completion"):
        for model in ("smollm2", 'a"b\\c', "módèl", "\x00"):
            env = Envelope(kind, model)
            for _ in range(50):
                text = "".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 8)))
                index, usage = rnd.randrange(0, 130), rnd.random() < 0.5
                assert env.text_event(index, text, usage) == sse(chunk(env, index, text, include_usage=usage))


def test_a_request_after_the_engine_died_gets_503_naming_it():
    """Once the engine is gone (its thread died), a new request is 503 "the engine core stopped:
    ..." -- the server is unavailable, the request is not at fault (it was a 500)."""
    s = serve(id_llm(), model_name=MODEL, port=0)
    try:
        core = s.async_llm.cores[0].core

        def broken():
            raise SystemError("injected: the engine is gone")
        core.step = broken
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3}
        with httpx.Client(base_url=s.url, timeout=DEADLINE_S) as c:
            first = c.post("/v1/completions", json=body)          # the request the engine died under
            assert first.status_code >= 500, first.text
            end = time.monotonic() + DEADLINE_S
            while c.get("/health").status_code != 503:
                assert time.monotonic() < end, "/health still ok"
                time.sleep(0.05)
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert "the engine core stopped" in err["message"] and "injected" in err["message"], err
    finally:
        s.stop()

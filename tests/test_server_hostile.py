"""Hostile input at the server's doors, found by a robustness sweep (malformed bodies, wrong types,
huge numbers, odd headers, clients that vanish) with greedy streams running meanwhile.

Each case here was once a 500 or a 400 naming the wrong field. Every test keeps a greedy stream in
flight while the bad requests come, and checks that the stream still gets exactly generate()'s
tokens, that the server answers /health, and that no KV block stays used.
(The broad "never a 500" sweeps and the first bad-request table: test_server.py.)
"""
from __future__ import annotations

import contextlib
import json
import socket
import sys
import time

import httpx
import pytest

from pagedlab import SamplingParams
from pagedlab.server import serve
from test_server import DEADLINE_S, MODEL, id_llm, ids_of, wait_idle

DIGITS = sys.get_int_max_str_digits()       # 4300 by default: int() of a longer literal raises ValueError
STREAM_PROMPT, STREAM_TOKENS = [9, 8, 7, 6, 5], 200


@pytest.fixture(scope="module")
def server():
    s = serve(id_llm(), model_name=MODEL, port=0, max_waiting=64)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def want():
    """What a plain generate() gives for the stream kept running during each test."""
    return id_llm().generate(STREAM_PROMPT, SamplingParams(max_tokens=STREAM_TOKENS, ignore_eos=True))[0].token_ids


@contextlib.contextmanager
def a_stream_running(server, want, monkeypatch):
    """A greedy stream in flight for the whole block (each step slowed to >= 5 ms, so it cannot end
    before the block does); afterwards it must have got exactly `want`, the server must be healthy
    and every KV block free."""
    runner = server.async_llm.engine.runner
    run = runner.run
    monkeypatch.setattr(runner, "run", lambda batch: (time.sleep(0.005), run(batch))[1])
    body = dict(model=MODEL, prompt=STREAM_PROMPT, max_tokens=STREAM_TOKENS, temperature=0, ignore_eos=True,
                stream=True)
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=DEADLINE_S) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        events = [next(line for line in lines if line.startswith("data: "))]     # running now
        yield
        assert server.async_llm.engine.has_work(), "the stream ended before the block did: nothing was tested"
        events += [line for line in lines if line.startswith("data: ")]
    monkeypatch.setattr(runner, "run", run)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c], chunks
    assert ids_of("".join(ch["text"] for c in chunks for ch in c["choices"])) == want
    assert httpx.get(server.url + "/health", timeout=DEADLINE_S).json()["status"] == "ok"
    wait_idle(server)


def post_raw(server, path: str, raw: bytes) -> httpx.Response:
    return httpx.post(server.url + path, content=raw, headers={"Content-Type": "application/json"},
                      timeout=DEADLINE_S)


def assert_400(r: httpx.Response, param, *words):
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error", err
    assert err["param"] == param, err
    for w in words:
        assert w in err["message"], err


# -- integer literals past Python's int-from-text limit --------------------------------------------

HUGE = "9" * (DIGITS + 700)
BODIES = [   # (path, body text holding an integer literal of more than DIGITS digits)
    ("/v1/completions", f'{{"model": "{MODEL}", "prompt": [5, 6], "max_tokens": {HUGE}}}'),
    ("/v1/completions", f'{{"model": "{MODEL}", "prompt": [5, {HUGE}], "max_tokens": 2}}'),
    ("/v1/chat/completions", f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hi"}}], '
                             f'"temperature": -{HUGE}}}'),
    ("/v1/chat/completions", f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hi"}}], '
                             f'"stop_token_ids": [3, {"1" + "0" * DIGITS}]}}'),
    ("/detokenize", f'{{"tokens": [{HUGE}]}}'),
    ("/tokenize", f'{{"prompt": "hi", "x": {HUGE}}}'),
]


def test_an_integer_past_the_digit_limit_is_a_400(server, want, monkeypatch):
    """JSON has no limit on an integer's length, but Python's json refuses to turn more than 4300
    digits into an int, with a ValueError that is not a JSONDecodeError: that was a 500 at every
    door that reads a body. Now a 400 saying so, and nothing else is disturbed."""
    with a_stream_running(server, want, monkeypatch):
        for path, text in BODIES:
            assert_400(post_raw(server, path, text.encode()), None, f"more than {DIGITS:,} digits")


# -- Content-Length ----------------------------------------------------------------------------------

def raw_request(server, head: bytes, body: bytes) -> tuple[bytes, bytes]:
    """Send a hand-written request; the status line and the body of the answer."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=DEADLINE_S) as sock:
        sock.sendall(head + body)
        got = b""
        while b"\r\n\r\n" not in got or len(got.split(b"\r\n\r\n", 1)[1]) < _length(got):
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += chunk
    status, _, rest = got.partition(b"\r\n")
    return status, rest.split(b"\r\n\r\n", 1)[1]


def _length(got: bytes) -> int:
    for line in got.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 1 << 30


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])
def test_a_content_length_with_thousands_of_leading_zeros(server, want, monkeypatch, path):
    """A Content-Length of 5,000 digits, nearly all leading zeros: the HTTP parser takes it (the
    value is small), and the server's own body-size check did int() on the text -- a ValueError past
    4300 digits, a 500. Now such a body is read as its value says; one whose value is past the
    limit is a 413."""
    body = json.dumps({"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
                      if path == "/v1/completions" else {"prompt": "hi"}).encode()
    with a_stream_running(server, want, monkeypatch):
        head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {'0' * 5000}{len(body)}\r\nConnection: close\r\n\r\n").encode()
        status, answer = raw_request(server, head, body)
        assert status == b"HTTP/1.1 200 OK", (status, answer)
        answer = json.loads(answer)
        if path == "/v1/completions":
            assert len(ids_of(answer["choices"][0]["text"])) == 2
        else:
            assert answer["tokens"] == [1, ord("h"), ord("i")]          # BOS, then the bytes
        head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {'0' * 5000}{10**12}\r\nConnection: close\r\n\r\n").encode()
        status, answer = raw_request(server, head, body)
        assert status.startswith(b"HTTP/1.1 413"), (status, answer)
        assert "1,000,000,000,000 bytes" in json.loads(answer)["error"]["message"]


# -- errors that named the wrong field ---------------------------------------------------------------

def test_stop_token_ids_outside_the_vocabulary_name_that_field(server, want, monkeypatch):
    """stop_token_ids past the vocabulary were refused by the engine's check, which the server
    reported as a problem of the prompt (param "prompt", "prompt: stop_token_ids ...")."""
    vocab = server.async_llm.vocab_size
    with a_stream_running(server, want, monkeypatch):
        r = httpx.post(server.url + "/v1/completions", timeout=DEADLINE_S,
                       json=dict(model=MODEL, prompt=[5, 6], max_tokens=2, stop_token_ids=[3, vocab, vocab + 7]))
        assert_400(r, "stop_token_ids", f"[{vocab}, {vocab + 7}]", "vocabulary")
        assert not r.json()["error"]["message"].startswith("prompt")
        r = httpx.post(server.url + "/v1/chat/completions", timeout=DEADLINE_S,
                       json=dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                 stop_token_ids=[2**40]))
        assert_400(r, "stop_token_ids", str(2**40))
        ok = httpx.post(server.url + "/v1/completions", timeout=DEADLINE_S,       # in the vocabulary: fine
                        json=dict(model=MODEL, prompt=[5, 6], max_tokens=2, stop_token_ids=[vocab - 1]))
        assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("name", [5, True, ["bob"], {"a": 1}])
def test_a_message_name_must_be_a_string(server, name):
    """messages[i].name of another JSON type was taken silently (every other field is type-checked)."""
    r = httpx.post(server.url + "/v1/chat/completions", timeout=DEADLINE_S,
                   json=dict(model=MODEL, messages=[{"role": "user", "content": "hi", "name": name}], max_tokens=2))
    assert_400(r, "messages[0].name", "must be a string")
    for fine in ("bob", None):
        r = httpx.post(server.url + "/v1/chat/completions", timeout=DEADLINE_S,
                       json=dict(model=MODEL, messages=[{"role": "user", "content": "hi", "name": fine}],
                                 max_tokens=2))
        assert r.status_code == 200, r.text
    wait_idle(server)

"""The benchmark's own HTTP client (pagedlab/bench/raw_http.py, `bench serve --client raw`): bodies
by Content-Length, chunked and until-close, lines split across chunks, connections reused only when
a response was read to its end, broken answers as errors (a Result, not a crash) -- against canned
servers. The whole benchmark through it against a real server: tests/test_bench_serve.py."""
from __future__ import annotations

import asyncio
import json

import pytest

from pagedlab.bench import serve as bench
from pagedlab.bench.raw_http import RawHTTP

def canned(answers, close_after: bool = False):
    """Run `body(url, stats)` against a server that reads one request at a time per connection
    and writes the next canned answer (bytes, or a list of pieces written with pauses between);
    close_after: it then closes the connection."""
    async def run(body):
        stats = {"connections": 0, "requests": []}
        queue = list(answers)

        async def handle(reader, writer):
            stats["connections"] += 1
            try:
                while queue:
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                                   if line.lower().startswith(b"content-length:")), 0)
                    stats["requests"].append(head + await reader.readexactly(length))
                    answer = queue.pop(0)
                    for piece in answer if isinstance(answer, list) else [answer]:
                        writer.write(piece)
                        await writer.drain()
                        await asyncio.sleep(0.01)
                    if close_after or b"Connection: close" in (answer if isinstance(answer, bytes) else b"".join(answer)):
                        break
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            writer.close()
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        try:
            return await body(url, stats)
        finally:
            server.close()
    return run


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def test_one_write_per_request_and_a_kept_connection_reused():
    body = b'{"a": 1}'
    answers = [b"HTTP/1.1 200 OK\r\ncontent-length: 8\r\n\r\n" + body,
               b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"]

    async def body_(url, stats):
        async with RawHTTP(url + "/base/") as client:
            async with client.request("POST", "/v1/x", b'{"q": 2}') as r:
                got1 = (r.status, await r.read())
            async with client.request("GET", "/health") as r:
                got2 = (r.status, await r.read())
            return got1, got2, stats
    got1, got2, stats = asyncio.run(canned(answers)(body_))
    assert got1 == (200, body) and got2 == (200, b"ok")
    assert stats["connections"] == 1                       # read to its end: the connection was kept
    first, second = stats["requests"]
    assert first.startswith(b"POST /base/v1/x HTTP/1.1\r\n") and first.endswith(b'\r\n\r\n{"q": 2}')
    assert b"content-length: 8" in first.lower() and b"content-type: application/json" in first.lower()
    assert second.startswith(b"GET /base/health HTTP/1.1\r\n") and b"content-length" not in second.lower()


def test_chunked_lines_split_anywhere():
    events = b'data: {"t": "a"}\n\ndata: {"t": "\xc3\xa9"}\r\n\r\ndata: [DONE]\n\n'
    cuts = [0, 3, 9, 17, 18, 30, 31, len(events)]         # a line, and a UTF-8 character, cut in two
    pieces = [events[a:b] for a, b in zip(cuts, cuts[1:])]
    whole = SSE_HEAD + chunked(*pieces)
    cuts2 = [0, 20, len(SSE_HEAD) + 2, len(SSE_HEAD) + 11, len(whole) - 3, len(whole)]
    in_pieces = [[whole[a:b] for a, b in zip(cuts2, cuts2[1:])]]   # written with pauses between

    async def body_(url, stats):
        async with RawHTTP(url) as client:
            async with client.request("POST", "/s", b"{}") as r:
                return [line async for line in r.lines()], client.idle
    lines, idle = asyncio.run(canned([whole])(body_))
    assert lines == ['data: {"t": "a"}', "", 'data: {"t": "é"}', "", "data: [DONE]", ""]
    assert len(idle) == 1                                  # the terminating chunk was read: reusable
    lines2, _ = asyncio.run(canned(in_pieces)(body_))      # the same bytes, arriving in pieces
    assert lines2 == lines


def test_connection_close_and_until_close_bodies_are_not_reused():
    answers = [b"HTTP/1.1 200 OK\r\nConnection: close\r\ncontent-length: 1\r\n\r\nx",
               b"HTTP/1.0 200 OK\r\n\r\nuntil close"]

    async def body_(url, stats):
        out = []
        async with RawHTTP(url) as client:
            for _ in range(2):
                async with client.request("GET", "/") as r:
                    out.append(await r.read())
            return out, len(client.idle), stats["connections"]
    out, idle, conns = asyncio.run(canned(answers)(body_))
    assert out == [b"x", b"until close"] and idle == 0 and conns == 2


@pytest.mark.parametrize("pause_s", [0.0, 0.05])
def test_a_kept_connection_the_server_closed_is_replaced(pause_s):
    """A server that closes a kept-alive connection after its answer (as uvicorn does after 5 idle
    seconds): the next request that takes it from the pool goes out again on a new connection --
    whether the close was seen while it sat idle (pause) or only as the request was written."""
    ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"
    answers = [ok + b"a1", ok + b"b2", ok + b"c3"]

    async def body_(url, stats):
        out = []
        async with RawHTTP(url, timeout_s=10.0) as client:
            for _ in range(3):
                async with client.request("POST", "/v1/x", b"{}") as r:
                    out.append(await r.read())
                await asyncio.sleep(pause_s)
            return out, stats
    out, stats = asyncio.run(canned(answers, close_after=True)(body_))
    assert out == [b"a1", b"b2", b"c3"]
    assert stats["connections"] == 3 and len(stats["requests"]) == 3   # each request reached it once


def test_a_fresh_connection_closed_at_once_is_an_error_not_a_retry():
    async def body_(url, stats):
        client = RawHTTP(url, timeout_s=10.0)
        r = await bench.send_raw(client, url, "m", bench.Job(prompt=[1], input_len=1, output_len=2), True)
        return r, stats
    r, stats = asyncio.run(canned([b""], close_after=True)(body_))
    assert not r.ok and "status line" in r.error and stats["connections"] == 1


@pytest.mark.parametrize("answer,error", [
    (SSE_HEAD + b"10\r\ndata: {\"choi", "closed inside"),                 # cut inside a chunk
    (b"HTTP/1.1 200 OK\r\ncontent-length: 50\r\n\r\nshort", "Content-Length"),
    (b"SMTP ready\r\n\r\n", "status line"),
    (b"HTTP/1.1 200 OK\r\nx: y\r\n", "headers"),
])
def test_a_broken_answer_is_an_error_result(answer, error):
    async def body_(url, stats):
        client = RawHTTP(url, timeout_s=10.0)
        job = bench.Job(prompt=[1, 2], input_len=2, output_len=3)
        r = await bench.send_raw(client, url, "m", job, True)
        return r, client.idle
    r, idle = asyncio.run(canned([answer], close_after=True)(body_))
    assert not r.ok and error in r.error and idle == []


def test_an_http_error_keeps_its_message():
    msg = json.dumps({"error": {"message": "prompt: too long"}}).encode()
    answer = b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%s" % (len(msg), msg)

    async def body_(url, stats):
        client = RawHTTP(url, timeout_s=10.0)
        return await bench.send_raw(client, url, "m", bench.Job(prompt="p", input_len=1, output_len=2), False)
    r = asyncio.run(canned([answer])(body_))
    assert not r.ok and r.error.startswith("HTTP 400") and "too long" in r.error


@pytest.mark.parametrize("url", ["https://127.0.0.1:8000", "unix:///tmp/s", "127.0.0.1:8000"])
def test_only_plain_http(url):
    with pytest.raises(ValueError, match="plain http"):
        RawHTTP(url)

"""The benchmark's own HTTP/1.1 client (`bench serve --client raw`): one write per request.

Why: a burst's requests should leave as a burst, the way hundreds of separate users' requests do.
aiohttp and httpx spend ~0.1-0.3 ms of Python on a request before its first byte goes out, and a
client process's event loop runs every request's first step before any of them connects or writes:
with 128 requests per client process, the server's log showed the first request's bytes arriving
20-75 ms after the burst's start (connections opened, then nothing read until every connection
was made; docs/serving.md, session 21), while 512 plain sockets that connect and send at once
reached the engine in ~7 ms -- and every request's time to first token carries the difference.

Here a request is a connection (a kept-alive one from the pool, else a new one), ONE write of its
headers and body, then the response read as it arrives: the status line, the headers, a body by
Content-Length, chunked transfer encoding (what servers stream server-sent events with) or until
the server closes. Plain http:// only; a connection whose response was read to its end goes back
to the pool, and a pooled one the server has closed since (its keep-alive timeout) is replaced. That is all a benchmark of an OpenAI-compatible server needs.
"""
from __future__ import annotations

import asyncio
import socket
from urllib.parse import urlsplit

MAX_LINE = 1 << 20            # the longest status, header or chunk-size line read (and SSE line)


class HTTPError(Exception):
    """The server's answer was not HTTP/1.x as this client reads it."""


class RawHTTP:
    """A pool of HTTP/1.1 connections to one server (url: http://host:port[/base]); timeout_s: what
    a whole request may take (send_raw's limit)."""

    def __init__(self, url: str, timeout_s: float = 600.0):
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"the raw client speaks plain http://host:port only, got {url!r} "
                             "(--client aiohttp or httpx for anything else)")
        self.host, self.port = parts.hostname, parts.port or 80
        self.base = parts.path.rstrip("/")
        self.authority = f"{self.host}:{self.port}"
        self.timeout_s = timeout_s
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def connect(self):
        reader, writer = await asyncio.open_connection(self.host, self.port, limit=MAX_LINE)
        sock = writer.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return reader, writer

    async def preconnect(self, n: int) -> None:
        """Open n connections now and keep them for later requests."""
        self.idle.extend(await asyncio.gather(*(self.connect() for _ in range(n))))

    def request(self, method: str, path: str, body: bytes = b"", content_type: str = "application/json") -> "Response":
        """`async with client.request("POST", "/v1/completions", data) as resp:` -- resp.status,
        resp.headers, then resp.read() or `async for line in resp.lines()`."""
        head = (f"{method} {self.base}{path} HTTP/1.1\r\nHost: {self.authority}\r\nAccept: */*\r\n"
                + (f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n" if body or method == "POST" else "")
                + "\r\n").encode("latin-1")
        return Response(self, head + body)

    async def close(self) -> None:
        idle, self.idle = self.idle, []
        for _, writer in idle:
            writer.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()


class Response:
    def __init__(self, client: RawHTTP, message: bytes):
        self.client, self.message = client, message
        self.status, self.headers = 0, {}
        self.done, self.keep, self.conn = False, True, None

    async def __aenter__(self) -> "Response":
        pool = self.client.idle
        while True:
            reused = bool(pool)
            self.conn = reader, writer = pool.pop() if reused else await self.client.connect()
            if reused and reader.at_eof():               # the server closed it while it sat idle
                writer.close()
                continue
            try:
                writer.write(self.message)               # the whole request in one write
                line = await reader.readline()
            except ConnectionError:
                if not reused:
                    raise
                line = b""
            if line or not reused:
                break
            # a kept connection that the server closed as we wrote (its keep-alive timeout: uvicorn's
            # is 5 s, and a Poisson run leaves pooled connections idle longer): nothing came back,
            # so the request goes again on the next one -- what urllib3 and aiohttp do
            writer.close()
        parts = line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise HTTPError(f"not an HTTP/1.x status line: {line[:80]!r}")
        self.status = int(parts[1])
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b"\n"):
                break
            if not line:
                raise HTTPError("the connection closed inside the response's headers")
            name, _, value = line.decode("latin-1").partition(":")
            self.headers[name.strip().lower()] = value.strip()
        if parts[0] == b"HTTP/1.0" or self.headers.get("connection", "").lower() == "close":
            self.keep = False
        return self

    async def chunks(self):
        """The body's bytes as they arrive."""
        reader = self.conn[0]
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size_line = await reader.readline()
                if not size_line:
                    raise HTTPError("the connection closed inside a chunked body")
                size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                        pass                             # trailers
                    break
                try:
                    data = await reader.readexactly(size + 2)
                except asyncio.IncompleteReadError:
                    raise HTTPError("the connection closed inside a chunk of the body") from None
                yield data[:-2]
        elif "content-length" in self.headers:
            left = int(self.headers["content-length"])
            while left > 0:
                data = await reader.read(min(left, 1 << 16))
                if not data:
                    raise HTTPError("the connection closed before Content-Length bytes")
                left -= len(data)
                yield data
        else:                                            # the body ends when the server closes
            self.keep = False
            while data := await reader.read(1 << 16):
                yield data
        self.done = True

    async def read(self) -> bytes:
        return b"".join([c async for c in self.chunks()])

    async def lines(self):
        """The body's lines (str, without their end), each as soon as it is complete."""
        rest = b""
        async for chunk in self.chunks():
            rest += chunk
            *complete, rest = rest.split(b"\n")
            for line in complete:
                yield line.rstrip(b"\r").decode("utf-8", "replace")
        if rest:
            yield rest.decode("utf-8", "replace")

    async def __aexit__(self, *exc):
        reader, writer = self.conn
        if self.done and self.keep and exc[0] is None:
            self.client.idle.append(self.conn)          # read to its end: reusable
        else:
            writer.close()

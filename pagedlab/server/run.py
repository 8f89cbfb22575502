"""Starting and stopping the server: in the foreground (the CLI) or on a background thread (tests,
notebooks).

    server = serve(LLM("random:tiny"), port=0)      # 0: any free port; returns once it accepts
    print(server.url)                               # http://127.0.0.1:54321
    ...                                             # talk to it with curl, openai, httpx
    server.stop()                                   # stop accepting, finish, stop the engine

uvicorn runs the ASGI app (build_app) on its own asyncio loop; AsyncLLM runs the engine on its own
thread. Stopping is the reverse: uvicorn closes its connections (open streams are cancelled, so
their requests are aborted), then the engine thread is stopped.
"""
from __future__ import annotations

import threading
import time

import uvicorn

from ..async_llm import AsyncLLM
from .app import DEFAULT_MAX_WAITING, build_app

START_TIMEOUT_S = 60.0


class RunningServer:
    """A server on a background thread: .url, .app, .async_llm, .stop()."""

    def __init__(self, server: uvicorn.Server, thread: threading.Thread, async_llm: AsyncLLM, app, host: str):
        self.server, self.thread, self.async_llm, self.app = server, thread, async_llm, app
        sock = server.servers[0].sockets[0]
        self.host, self.port = host, sock.getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.async_llm.shutdown(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def make_server(llm, model_name: str, host: str, port: int, max_waiting: int, log_level: str):
    async_llm = AsyncLLM(llm)
    app = build_app(async_llm, model_name, max_waiting=max_waiting)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    return uvicorn.Server(config), async_llm, app


def serve(llm, model_name: str | None = None, host: str = "127.0.0.1", port: int = 8000,
          max_waiting: int = DEFAULT_MAX_WAITING, background: bool = True,
          log_level: str = "warning") -> RunningServer | None:
    """Serve an LLM over OpenAI's API. background=True: start on a thread and return a RunningServer
    once it accepts connections (port=0 picks a free port). background=False: run here until
    Ctrl-C, then stop the engine."""
    name = model_name or llm.checkpoint.source
    server, async_llm, app = make_server(llm, name, host, port, max_waiting, log_level)
    if not background:
        try:
            server.run()
        finally:
            async_llm.shutdown()
        return None
    thread = threading.Thread(target=server.run, name="pagedlab-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            async_llm.shutdown()
            raise RuntimeError(f"the server did not start on {host}:{port} (port in use?)")
        time.sleep(0.01)
    return RunningServer(server, thread, async_llm, app, host)

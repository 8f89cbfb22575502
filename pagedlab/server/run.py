"""Starting and stopping the server: in the foreground (the CLI) or on a background thread (tests,
notebooks).

    server = serve("smollm2", port=0)               # the engine core in a process of its own
    server = serve(LLM("random:tiny"), port=0)      # or an LLM of this process (its core on a thread)
    print(server.url)                               # http://127.0.0.1:54321  (port 0: any free port)
    ...                                             # talk to it with curl, openai, httpx
    server.stop()                                   # stop accepting, finish, stop the engine

uvicorn runs the ASGI app (build_app) on its own asyncio loop; AsyncLLM's engine cores run in
processes of their own (a model name; data_parallel_size=N: N of them) or on a thread (an LLM).
Stopping is the reverse: uvicorn closes its connections (open streams are cancelled, so their
requests are aborted), then the engine cores are stopped. A core that dies stops a foreground
server (the CLI exits with status 1: a supervisor restarts it); a background one reports it at
/health and ends every open stream with an error. A core alive but silent (stopped, or stuck in a
step) is reported at /health (503) after 30 s and its streams ended after 300 s, the server serving
on (async_llm.py's doc: liveness; PAGEDLAB_CORE_SILENT_S, PAGEDLAB_CORE_GIVE_UP_S).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

import uvicorn

from ..async_llm import AsyncLLM, liveness
from ..core_process import freeze_heap
from .app import DEFAULT_MAX_WAITING, build_app, uvicorn_config
from .frontends import FrontEnds
from .graceful import Server  # noqa: F401 (run.Server: its home is graceful.py, shared with frontends.py)

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


def make_async_llm(llm, data_parallel_size: int = 1, silent_s: float | None = None,
                   give_up_s: float | None = None, **llm_kwargs) -> AsyncLLM:
    """An AsyncLLM for `llm`: an AsyncLLM as it is, an LLM of this process on a thread, a model name
    or path as engine core processes (data_parallel_size of them, each LLM(llm, **llm_kwargs)).
    silent_s, give_up_s: its liveness thresholds (AsyncLLM; None: the environment's or the default)."""
    if isinstance(llm, AsyncLLM):
        if silent_s is not None or give_up_s is not None:
            given = liveness(silent_s, give_up_s)
            llm.silent_s = given[0] if silent_s is not None else llm.silent_s
            llm.give_up_s = given[1] if give_up_s is not None else llm.give_up_s
        return llm
    if isinstance(llm, (str, os.PathLike)):
        return AsyncLLM.from_model(str(llm), data_parallel_size=data_parallel_size, silent_s=silent_s,
                                   give_up_s=give_up_s, **llm_kwargs)
    if data_parallel_size != 1 or llm_kwargs:
        raise ValueError("data_parallel_size= and LLM arguments go with a model name: serve(\"smollm2\", "
                         "data_parallel_size=2, ...); an LLM object is served as it is")
    return AsyncLLM(llm, silent_s=silent_s, give_up_s=give_up_s)


def default_name(llm) -> str:
    if isinstance(llm, (str, os.PathLike)):
        return str(llm)
    if isinstance(llm, AsyncLLM):
        return llm.model_name
    return getattr(llm, "model_name", None) or llm.checkpoint.source     # as the user named it: "smollm2"


def _exit_on_sigterm(signum, frame):
    raise SystemExit(0)


def make_server(async_llm, model_name: str, host: str, port: int, max_waiting: int, log_level: str):
    app = build_app(async_llm, model_name, max_waiting=max_waiting)
    return Server(uvicorn_config(app, log_level, host=host, port=port), async_llm), app


def serve(llm, model_name: str | None = None, host: str = "127.0.0.1", port: int = 8000,
          max_waiting: int = DEFAULT_MAX_WAITING, background: bool = True,
          log_level: str = "warning", data_parallel_size: int = 1, on_ready=None, api_servers: int = 1,
          silent_s: float | None = None, give_up_s: float | None = None,
          **llm_kwargs) -> RunningServer | FrontEnds | None:
    """Serve over OpenAI's API: `llm` is a model name or path (engine cores in processes of their
    own, built with **llm_kwargs; data_parallel_size=N: N cores behind one server), an LLM of this
    process, or an AsyncLLM. background=True: start on a thread and return a RunningServer once it
    accepts connections (port=0 picks a free port). background=False: run here until Ctrl-C or
    SIGTERM, then stop the engine; returns None, or raises SystemExit(1) if an engine core died.
    api_servers=N > 1 (a model name only): N front-end processes on the port, each in front of
    every core (frontends.py); background=True returns their FrontEnds (.url, .stop()).
    silent_s, give_up_s: when a core that does not answer is reported at /health (503), and when its
    streams are ended (None: PAGEDLAB_CORE_SILENT_S / PAGEDLAB_CORE_GIVE_UP_S, else 30 s and 300 s;
    async_llm.py's doc: liveness)."""
    name = model_name or default_name(llm)
    if api_servers != 1:
        return serve_frontends(llm, name, host, port, max_waiting, background, log_level, data_parallel_size,
                               on_ready, api_servers, silent_s=silent_s, give_up_s=give_up_s, **llm_kwargs)
    async_llm = make_async_llm(llm, data_parallel_size, silent_s=silent_s, give_up_s=give_up_s, **llm_kwargs)
    died = []
    try:            # from here on, whatever stops us (Ctrl-C included) stops the engine cores too
        server, app = make_server(async_llm, name, host, port, max_waiting, log_level)

        def on_core_death(k, why):
            died.append(why)
            print(f"pagedlab: engine core {k} died ({why}); stopping the server", file=sys.stderr, flush=True)
            if not background:
                server.should_exit = True
        async_llm.on_core_death = on_core_death
        if on_ready is not None:
            on_ready(async_llm)
    except BaseException:
        async_llm.shutdown()
        raise
    if not background:
        # uvicorn stops gracefully on SIGINT / SIGTERM, then raises the signal again for us: SIGTERM
        # becomes a normal exit (engine cores stopped below), not a kill
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:        # (a Ctrl-C during freeze_heap, right after "serving ...", left the core running
            freeze_heap()      # and the exit waiting for it for ever: multiprocessing joins it)
            server.run()       # (freeze_heap: the process is the server's alone; a caller's thread
        finally:               # keeps its GC as it is)
            signal.signal(signal.SIGTERM, previous)
            async_llm.shutdown()
        if died:
            raise SystemExit(1)
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


def serve_frontends(llm, name: str, host: str, port: int, max_waiting: int, background: bool, log_level: str,
                    data_parallel_size: int, on_ready, api_servers: int, silent_s: float | None = None,
                    give_up_s: float | None = None, **llm_kwargs) -> FrontEnds | None:
    """serve(..., api_servers=N > 1): the front ends in processes of their own, this process their parent."""
    if not isinstance(api_servers, int) or api_servers < 1:
        raise ValueError(f"api_servers must be an integer >= 1, got {api_servers!r}")
    thresholds = liveness(silent_s, give_up_s)     # (a bad one is said here, not in each front end)
    if not isinstance(llm, (str, os.PathLike)):
        raise ValueError("api_servers > 1 serves a model name or path: each front end is a process of its "
                         "own, in front of engine core processes (an LLM or AsyncLLM of this process "
                         "has one front end: this one)")
    previous = None if background else signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        fronts = FrontEnds(str(llm), name, host, port, max_waiting, log_level, api_servers,
                           data_parallel_size, liveness_s=thresholds, **llm_kwargs).wait_ready()
        if on_ready is not None:
            on_ready(fronts)
        if background:
            return fronts
        try:
            status = fronts.run()
        finally:
            fronts.stop()
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if status:
        raise SystemExit(status)
    return None

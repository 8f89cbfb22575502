"""Several HTTP front ends on one port, in front of the same engine core(s): `serve --api-servers N`
(vLLM's --api-server-count).

    parent (this module's FrontEnds: starts, watches, stops; serves nothing)
      |-- engine core 0 .. D-1     one process each (data parallelism: D), N pairs of pipes each
      |-- front end 0 .. N-1       one process each: uvicorn + FastAPI + AsyncLLM.connect(...),
                                   a socket on the shared port, a pipe to every core, a lifeline

One front end (HTTP parsing, JSON, tokenizing, detokenizing, SSE) is one Python thread: in a burst
its requests pass accept, parse, route and check in lockstep on its one event loop, and the first
reaches the core only once many have been parsed (docs/serving.md, session 15). N front ends
share that work on N CPUs. Each front end numbers its requests f, f + N, ... and each core hands a
step's output to the front ends that own its requests, one message each (core_mailbox.py).

The port: N listening sockets, one per front end, all bound to it with SO_REUSEPORT, made here
(so port 0 is resolved once) and handed to the front ends. Not one shared socket: with one socket
every front end's loop is woken by each connection and the first to run accepts every connection
queued (asyncio and libuv accept until the queue is empty), so a burst lands on one front end --
the very lockstep this is meant to split. With SO_REUSEPORT the kernel spreads connections over
the sockets by a hash of their addresses; a front end that dies takes its socket with it and new
connections go to the others. (Linux; macOS has SO_REUSEPORT without the spreading.)

Lifetime: the parent tells a front end to stop through its lifeline (a pipe), and a front end stops
when the lifeline reaches end-of-file, i.e. when the parent is gone, even SIGKILLed. Front ends
ignore Ctrl-C (it reaches the whole process group: the parent handles it) and stop gracefully on
SIGTERM. A core leaves once every front end has left (core_mailbox.py). A front end that dies has
its requests aborted in the cores; the others serve on. A core that dies: every front end ends its
open streams with an error event and answers /health with 503; the parent in the foreground (the
CLI) then stops everything and exits with status 1, like the one-front-end server.
"""
from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from multiprocessing.connection import wait

from ..async_llm import AsyncLLM, core_specs
from ..core_process import READY_TIMEOUT_S, CoreLink, freeze_heap, join_or_kill, sigint_ignored, start_core
from .app import build_app, uvicorn_config
from .graceful import Server

STOP_TIMEOUT_S = 15.0           # a front end's graceful stop (uvicorn's 5 s) and its engine links


def listening_sockets(host: str, port: int, n: int, backlog: int = 2048) -> list[socket.socket]:
    """n sockets listening on one port (port 0: a free one, the same for all), SO_REUSEPORT."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise ValueError("api_servers > 1 needs SO_REUSEPORT (Linux): serve with one front end here")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    socks = []
    try:
        for _ in range(n):
            sock = socket.socket(family, socket.SOCK_STREAM)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            port = sock.getsockname()[1]
            sock.listen(backlog)
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


# -- the front end's process ---------------------------------------------------------------------

class FrontEndServer(Server):
    """graceful.Server (as run.py's: open requests end with an answer when it stops) without
    uvicorn's own signal handlers: a front end's stop comes from its parent."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def frontend_main(index: int, count: int, ends, sock, lifeline, model_name: str, max_waiting: int,
                  admitted, log_level: str, liveness_s: tuple | None = None) -> None:
    """Front end `index` of `count`: wait for every core, then serve HTTP on `sock` until the parent
    says stop (or is gone). Tells the parent ("ready", pid) once it accepts, ("failed", why) if a
    core did not start. liveness_s: (silent_s, give_up_s) for its AsyncLLM (None: the environment's)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)       # Ctrl-C reaches the whole group: the parent decides
    links = [CoreLink(inbox, outbox, name=f"pagedlab-core{k}") for k, (inbox, outbox) in enumerate(ends)]
    try:
        for link in links:
            if lifeline in wait([link.outbox, lifeline]):
                return                                  # stopped (or the parent is gone) while loading
            link.take_ready()
    except RuntimeError as e:           # CoreStartError (the core's own exception in it) or a core gone
        try:
            lifeline.send(("failed", e))   # itself: the parent raises it (the CLI: one line)
        except Exception:                  # noqa: BLE001 -- did not pickle: its words
            lifeline.send(("failed", str(e)))
        return
    silent_s, give_up_s = liveness_s or (None, None)
    allm = AsyncLLM.connect(links, index, count, silent_s=silent_s, give_up_s=give_up_s)
    allm.on_core_death = lambda k, why: print(f"pagedlab: front end {index}: engine core {k} died ({why})",
                                              file=sys.stderr, flush=True)
    app = build_app(allm, model_name, max_waiting=max_waiting, admitted=admitted)
    config = uvicorn_config(app, log_level)                # as run.make_server
    server = FrontEndServer(config, allm)
    freeze_heap()

    def stop():
        server.should_exit = True

    def on_lifeline():
        try:
            lifeline.recv()              # ("stop",): the only thing the parent says
        except (EOFError, OSError):
            pass                         # the parent is gone
        asyncio.get_running_loop().remove_reader(lifeline.fileno())
        stop()

    async def main():
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop)
        loop.add_reader(lifeline.fileno(), on_lifeline)
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)
        if server.started:
            lifeline.send(("ready", os.getpid()))
        await serving
    try:
        factory = config.get_loop_factory() if hasattr(config, "get_loop_factory") else None
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(main())
    finally:
        allm.shutdown()


# -- the parent ----------------------------------------------------------------------------------

class FrontEnds:
    """Engine cores and N front-end processes on one port: start them, wait for them, watch them,
    stop them. .url, .port, .frontend_pids, .core_pids; .async_llm is None (it lives in each front end)."""

    async_llm = None

    def __init__(self, model: str, model_name: str, host: str, port: int, max_waiting: int, log_level: str,
                 api_servers: int, data_parallel_size: int = 1, liveness_s: tuple | None = None, **llm_kwargs):
        socks = listening_sockets(host, port, api_servers)
        self.host, self.port = host, socks[0].getsockname()[1]
        self.cores: list = []                 # engine core processes
        self.frontends: list = []             # (process, lifeline)
        ctx = multiprocessing.get_context("spawn")
        # each front end's admitted streams, in shared memory: each admits against their sum
        # (admission.py), so --max-waiting bounds the server, not each front end
        self.admitted = ctx.RawArray("q", api_servers)
        self._stopping, self._over, self.status = False, threading.Event(), None
        core_ends: list = []

        def release():       # the front ends hold their pipes and sockets alone: their exit closes them
            for sock in socks:
                sock.close()
            for ends in core_ends:
                for inbox, outbox in ends:
                    inbox.close()
                    outbox.close()
        try:
            for kwargs, env, name in core_specs(model, data_parallel_size, llm_kwargs):
                process, ends = start_core(kwargs, env, name, frontends=api_servers)
                self.cores.append(process)
                core_ends.append(ends)
            for f in range(api_servers):
                mine, theirs = ctx.Pipe()
                process = ctx.Process(target=frontend_main, name=f"pagedlab-api{f}", daemon=True,
                                      args=(f, api_servers, [ends[f] for ends in core_ends], socks[f], theirs,
                                            model_name, max_waiting, self.admitted, log_level, liveness_s))
                with sigint_ignored():          # (a Ctrl-C while it imports: the parent's alone)
                    process.start()
                theirs.close()
                self.frontends.append((process, mine))
        except BaseException:
            release()
            self.stop()
            raise
        release()
        self.frontend_pids = [p.pid for p, _ in self.frontends]
        self.core_pids = [p.pid for p in self.cores]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> "FrontEnds":
        """Until every front end accepts connections; everything stopped if one cannot, and raised:
        the CoreStartError of a core that did not start (its .error the core's own exception), else
        RuntimeError."""
        waiting = {lifeline: (f, process) for f, (process, lifeline) in enumerate(self.frontends)}
        deadline = time.monotonic() + timeout
        try:
            while waiting:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"the front ends were not ready after {timeout:.0f} s")
                sentinels = {process.sentinel: lifeline for lifeline, (_f, process) in waiting.items()}
                for ready in wait([*waiting, *sentinels], left):
                    lifeline = sentinels.get(ready, ready)
                    if lifeline not in waiting:
                        continue
                    f, process = waiting[lifeline]
                    try:
                        kind, what = lifeline.recv() if lifeline.poll() else ("exited", process.exitcode)
                    except (EOFError, OSError):
                        kind, what = "exited", process.exitcode
                    if kind == "failed":     # a CoreStartError as the core raised it, or words
                        raise what if isinstance(what, BaseException) else RuntimeError(what)
                    if kind != "ready":
                        raise RuntimeError(f"front end {f} exited (code {process.exitcode}) before it was ready")
                    waiting.pop(lifeline, None)
        except BaseException:
            self.stop()
            raise
        threading.Thread(target=self._watch, name="pagedlab-frontends-watch", daemon=True).start()
        return self

    def run(self) -> int:
        """Until an engine core dies or every front end has (then 1). Ctrl-C and SIGTERM are the
        caller's (KeyboardInterrupt, SystemExit); stop() follows in every case."""
        while not self._over.wait(0.5):
            pass
        return self.status

    def _watch(self) -> None:
        """A thread, from ready to stop: a front end that dies has its admitted count cleared (its
        streams died with it) and is reported; a core that dies, or the last front end, ends run()."""
        live = dict(enumerate(self.frontends))
        while not self._stopping:
            cores = {p.sentinel: k for k, p in enumerate(self.cores)}
            fronts = {p.sentinel: f for f, (p, _) in live.items()}
            for ready in wait([*cores, *fronts], 0.5):
                if self._stopping:
                    return
                if ready in cores:
                    k = cores[ready]
                    print(f"pagedlab: engine core {k} died (exit code {self.cores[k].exitcode}); stopping "
                          "the server", file=sys.stderr, flush=True)
                    self.status = 1
                    self._over.set()
                    return
                f = fronts[ready]
                process, _ = live.pop(f)
                self.admitted[f] = 0
                print(f"pagedlab: front end {f} (pid {process.pid}) died (exit code {process.exitcode}); "
                      f"{len(live)} left", file=sys.stderr, flush=True)
                if not live:
                    self.status = 1
                    self._over.set()
                    return

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Every front end stops (gracefully: open streams end), then every core (they leave once
        their front ends have); whatever does not within `timeout` is killed."""
        self._stopping = True
        for _, lifeline in self.frontends:
            try:
                lifeline.send(("stop",))
            except OSError:
                pass
        for process, lifeline in self.frontends:
            join_or_kill(process, timeout)
            lifeline.close()
        for process in self.cores:
            join_or_kill(process, timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


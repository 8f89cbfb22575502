"""The engine core in a process of its own: nothing else on its interpreter.

    front end (AsyncLLM, the HTTP server)                 core process
      tokenize, check, number requests   --- add ---->    engine.add_checked
      a client left / a stop string      --- abort -->    engine.abort
                                                          loop: schedule -> run -> accept
      detokenize, stop strings, SSE      <--- step ---    one StepOutput per step

Why a process: in one process the engine's loop and the server's asyncio loop (HTTP parsing, JSON,
server-sent events, detokenizing) take turns on one GIL, and the GPU waits while Python writes
HTTP. Here the core does only schedule -> run -> accept and hands out one message per step, whatever
the batch size; the front end does everything else.

What crosses: Python objects pickled through two one-way pipes (multiprocessing.Pipe), one message
per step each way at most. No new dependency, and a step's message (a few hundred token ids and
request ids) pickles in tens of microseconds, small beside a GPU step (docs/serving.md has the
numbers). Both sides write without blocking (core_mailbox.Outbox: at once when the pipe has room,
the rest through a writer thread), so a long message never blocks the core's loop or the event loop.

Several front ends (`serve --api-servers N`): one pair of pipes per front end, every one to the same
core; the core's side of them is core_mailbox.Mailbox (who owns which request, who gets which part
of a step's output, front ends that leave).

Lifetime: the core ignores Ctrl-C (the front end decides: it sends "stop"), and leaves on its own
when its front ends are gone (each inbox reaches end-of-file), so neither a SIGKILLed server nor a
crashed one leaves an orphan. A core that dies is seen by the front end at once: its outbox reaches
end-of-file.
"""
from __future__ import annotations

import atexit
import gc
import multiprocessing
import multiprocessing.util         # (its exit hook registered before _end_cores: run after it)
import os
import signal
import time
import traceback
import weakref
from dataclasses import dataclass, field

from .core_mailbox import outbox as make_outbox, pipe_ready
from .interrupts import sigint_ignored  # noqa: F401 (here too: the servers start children under it)

READY_TIMEOUT_S = 1800.0      # loading a model (and compiling kernels) before the core answers
IDLE_SLICE_S = 0.25           # an idle core sends its stats this often (idle time in /metrics)


@dataclass
class CoreInfo:
    """What a core tells its front end once its engine is built."""
    tokenizer: object
    max_model_len: int
    max_num_seqs: int
    vocab_size: int
    pool_hint: str
    stop_sources: dict
    model_name: str
    seed: int
    pid: int
    stats: dict = field(default_factory=dict)


def core_info(llm, core) -> CoreInfo:
    eng = llm.engine
    return CoreInfo(llm.tokenizer, eng.max_model_len, eng.config.max_num_seqs, llm.config.vocab_size,
                    eng.pool_hint(), dict(eng.stop_token_ids),
                    getattr(llm, "model_name", None) or getattr(llm.checkpoint, "source", "?"),
                    eng.config.seed, os.getpid(), core.stats())


def freeze_heap() -> None:
    """Move everything alive now (torch, the model's Python objects, the tokenizer, the app: all
    that lives as long as the process) out of the garbage collector's sight, and let it run less
    often (a young generation of 50,000 objects, not 700). The front end's one thread allocates a
    few objects per token; with the defaults the collector ran ~190 times during a 512-request
    burst and took 25 % of the front end's CPU, mostly re-walking the startup heap (0.48 of 1.9 s;
    frozen: 0.03 of 1.2 s; 2-core CPU, random:tiny core, 2026-12-02). The engine core process does
    the same once it is built (a full collection there would stall a step), as vLLM's API server
    and engine core do. Cycles made later are still collected. PAGEDLAB_GC_FREEZE=0: leave it."""
    if os.environ.get("PAGEDLAB_GC_FREEZE", "1") == "0":
        return
    gc.collect()
    gc.freeze()
    # at exit, hand the frozen heap back: objects left frozen are never freed at shutdown, and
    # triton's bindings (nanobind) then print ~30 lines of "leaked ..." per process on every stop
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)
    g0, g1, g2 = gc.get_threshold()
    gc.set_threshold(max(g0, 50_000), g1, g2)


def core_main(inboxes, outboxes, llm_kwargs: dict, env: dict) -> None:
    """The core process: build the LLM, then loop. One inbox and one outbox per front end
    (core_mailbox.py). Messages in: ("add", items), ("abort", ids), ("stop",) (the sender leaves).
    Out: ("ready", CoreInfo) | ("failed", (traceback, exception)) once, then ("step", StepOutput) per step with
    the sender's requests in it (("stats", dict) now and then otherwise), and ("died", traceback)
    if the engine fails."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # Ctrl-C is the front end's to handle
    os.environ.update(env)
    from .core_mailbox import Mailbox
    mailbox = Mailbox(inboxes, outboxes, stats_every_s=IDLE_SLICE_S)
    try:
        from .engine_core import EngineCore
        from .llm import LLM
        llm = LLM(**llm_kwargs)
        core = EngineCore(llm.engine)
        mailbox.tell_all(("ready", core_info(llm, core)))
        freeze_heap()
    except BaseException as e:      # noqa: BLE001 -- told to the front ends, which raise it
        mailbox.tell_all(("failed", (traceback.format_exc(), portable(e))))
        mailbox.close()
        return
    try:
        run_core(core, mailbox)
    except BaseException:           # noqa: BLE001
        mailbox.tell_all(("died", traceback.format_exc()))
    finally:
        mailbox.close()
        llm.close()


class CoreStartError(RuntimeError):
    """The engine core could not build its LLM. .error: the exception it raised there (None when
    it did not survive pickling), so a caller can tell a bad model name (ModelNotFound, ValueError,
    ...) from a bug; .core_traceback: the core's traceback (also in the message)."""

    def __init__(self, core_traceback: str, error: BaseException | None = None):
        super().__init__(f"the engine core failed to start:\n{core_traceback}")
        self.core_traceback, self.error = core_traceback, error

    def __reduce__(self):               # (crosses pipes: serve --api-servers' front ends)
        return type(self), (self.core_traceback, self.error)


def portable(e: BaseException) -> BaseException | None:
    """`e` if it pickles and unpickles as itself (it crosses a pipe), else None."""
    import pickle
    try:
        pickle.loads(pickle.dumps(e))
        e.__traceback__ = None                # (the text travels beside it)
        return e
    except Exception:                      # noqa: BLE001
        return None


def run_core(core, mailbox) -> None:
    """schedule -> run -> accept, with the front ends' messages read between steps (blocking only
    when idle), until every front end has left. Step outputs leave through the mailbox's outboxes
    (written at once when the pipe has room, else by a writer thread): a front end that reads late
    never holds up a step (its messages queue here and it takes them all at once). Where the core's
    time goes (idle, inbox, steps, handing out) is counted in core.timing, sent with every step's
    stats (/metrics).

    Liveness (what the front ends' /health reads): every front end hears from this loop at least
    every IDLE_SLICE_S while it turns -- a step's output or its stats after each step (hand_out),
    the stats every slice it waits idle, and after messages that made no work (Mailbox.beat) -- so
    a long silence means a core stopped or stuck in one step, with no ping needed. What it adds to a
    step: nothing (the stats go out with hand_out as before); to an idle wake: a clock read."""
    timing = core.timing
    clock = time.perf_counter
    while mailbox.open:
        t0 = clock()
        while not core.has_work() and not mailbox.wait(IDLE_SLICE_S):
            timing["idle_s"] += clock() - t0      # sleep until a message (or end-of-file) arrives,
            t0 = clock()                          # counted slice by slice, and told (/metrics)
            mailbox.tell_all(("stats", core.stats()))
        t1 = clock()
        mailbox.take(core)                        # adds, aborts, front ends that left
        t2 = clock()
        timing["idle_s"] += t1 - t0
        timing["inbox_s"] += t2 - t1
        if core.has_work() and mailbox.open:
            mailbox.hand_out(core.step())
            if not core.has_work():               # idle now: every front end's gauges say so at once
                mailbox.tell_all(("stats", core.stats()))
            timing["handout_s"] += clock() - t2 - core.last_step_s
        else:                                     # woken by messages that made no work: still heard
            mailbox.beat(core.stats)              # every IDLE_SLICE_S (the front ends' liveness)


_started: "weakref.WeakSet" = weakref.WeakSet()      # the core processes this process started


@atexit.register
def _end_cores() -> None:
    """At exit, end the core processes still running (registered after multiprocessing's own exit
    hook, so run before it: that one joins every non-daemon child, and a core whose front end never
    said "stop" -- a Ctrl-C landed between its start and the code that would stop it -- waits on its
    open pipes for ever, and so did the exit)."""
    for process in list(_started):
        join_or_kill(process, 0)


def join_or_kill(process, timeout: float) -> None:
    """Wait up to `timeout` s for a child process to end, then terminate it, then kill it."""
    process.join(timeout)
    if process.is_alive():
        process.terminate()
        process.join(5)
    if process.is_alive():
        process.kill()
        process.join(5)


def start_core(llm_kwargs: dict, env: dict | None = None, name: str = "pagedlab-core", frontends: int = 1):
    """Start a core process with a pair of pipes per front end; returns (the process, [(inbox to
    write, outbox to read)] per front end). The core holds the other ends alone: a front end that
    is gone is its inbox's end-of-file, a core that is gone its outbox's."""
    ctx = multiprocessing.get_context("spawn")
    core_in, core_out, ends = [], [], []
    for _ in range(frontends):
        inbox_r, inbox_w = ctx.Pipe(duplex=False)         # front end -> core
        outbox_r, outbox_w = ctx.Pipe(duplex=False)       # core -> front end
        core_in.append(inbox_r)
        core_out.append(outbox_w)
        ends.append((inbox_w, outbox_r))
    process = ctx.Process(target=core_main, args=(core_in, core_out, llm_kwargs, env or {}),
                          name=name, daemon=False)       # a core may start its own workers (TP)
    with sigint_ignored():
        process.start()
    _started.add(process)
    for conn in core_in + core_out:       # only the core holds these ends: its exit is our end-of-file
        conn.close()
    return process, ends


class CoreLink:
    """A front end's end of one core's pipes, whichever process started the core: send to it
    (through a writer thread, so a long message never blocks the caller), read from it, know when
    it is gone (its outbox reaches end-of-file)."""

    def __init__(self, inbox, outbox, name: str = "pagedlab-core"):
        self.outbox = outbox
        self.info: CoreInfo | None = None
        self.dead: str | None = None     # why the core is gone, once it is
        self.heard_t = time.monotonic()  # when a message last came from it (AsyncLLM's liveness)
        # adds and aborts: written at once by the caller's thread (the event loop) when the pipe has
        # room, the rest by a writer thread (core_mailbox.Outbox), so the loop never waits on a pipe
        self._sendq = make_outbox(inbox, f"{name}-writer")
        self._ready = pipe_ready(outbox)          # "is a message waiting?", before every recv

    def take_ready(self) -> CoreInfo:
        """The core's first message (wait until there is one): its CoreInfo, or RuntimeError."""
        try:
            kind, what = self.outbox.recv()
            self.heard_t = time.monotonic()
        except (EOFError, OSError):
            raise RuntimeError(
                "the engine core process exited before it was ready. It is started with 'spawn', which "
                "imports your __main__ module again: run from a file whose serving code is under "
                "`if __name__ == \"__main__\":` (not from stdin), or serve an LLM of this process "
                "with serve(llm) (its core on a thread)") from None
        if kind == "failed":
            text, error = what if isinstance(what, tuple) else (what, None)
            raise CoreStartError(text, error)
        self.info = what
        return what

    def send(self, msg) -> None:
        """Send a message to the core (never blocks the caller: what the pipe cannot take now is
        left to the writer thread; a core that is gone drops it, and its outbox says why)."""
        self._sendq.put(msg)

    def fileno(self) -> int:
        return self.outbox.fileno()

    def messages(self):
        """Every message waiting from the core, without blocking. End-of-file: ("died", why).
        Each one sets heard_t (a clock read per message)."""
        while True:
            try:
                if not self._ready():
                    return
                msg = self.outbox.recv()
                self.heard_t = time.monotonic()
                yield msg
            except (EOFError, OSError):
                yield ("died", self._gone())
                return

    def _gone(self) -> str:
        return "the engine core process ended"

    def is_alive(self) -> bool:
        return self.dead is None

    def stop(self, timeout: float = 10.0) -> None:
        """Leave: the core aborts this front end's requests (and stops once every front end left)."""
        self.send(("stop",))
        self._sendq.put(None)
        self._sendq.join(timeout)
        self.close()

    def close(self) -> None:
        self._sendq.close()                  # the inbox (its outbox owns it), then the outbox
        try:
            self.outbox.close()
        except OSError:
            pass


class CoreProcess(CoreLink):
    """A core process this process started, and its only front end: start it, send to it, read
    from it, stop it. (Several front ends: start_core, and a CoreLink in each.)"""

    def __init__(self, llm_kwargs: dict, env: dict | None = None, name: str = "pagedlab-core"):
        self.process, [(inbox, outbox)] = start_core(llm_kwargs, env, name)
        super().__init__(inbox, outbox, name)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> CoreInfo:
        deadline = time.monotonic() + timeout
        while not self.outbox.poll(0.2):
            if not self.process.is_alive() and not self.outbox.poll(0):
                raise RuntimeError(f"the engine core process exited (code {self.process.exitcode}) before "
                                   "it was ready. It is started with 'spawn', which imports your __main__ "
                                   "module again: run from a file whose serving code is under `if __name__ "
                                   "== \"__main__\":` (not from stdin), or serve an LLM of this process "
                                   "with serve(llm) (its core on a thread)")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"the engine core was not ready after {timeout:.0f} s")
        try:
            return self.take_ready()
        except RuntimeError:
            self.process.join(10)
            raise

    def _gone(self) -> str:
        self.process.join(1.0)
        return f"the engine core process ended (exit code {self.process.exitcode})"

    def is_alive(self) -> bool:
        return self.dead is None and self.process.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the core to abort everything and leave; end it if it does not within `timeout`."""
        if self.process.is_alive():
            self.send(("stop",))
        self._sendq.put(None)
        self._sendq.join(timeout)
        self.process.join(timeout)
        self.kill()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self.close()

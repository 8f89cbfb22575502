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
numbers). The front end sends through a writer thread, so a long message never blocks its event loop.

Lifetime: the core ignores Ctrl-C (the front end decides: it sends "stop"), and leaves on its own
when the front end is gone (its inbox reaches end-of-file), so neither a SIGKILLed server nor a
crashed one leaves an orphan. A core that dies is seen by the front end at once: its outbox reaches
end-of-file.
"""
from __future__ import annotations

import gc
import multiprocessing
import os
import queue
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field

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
    g0, g1, g2 = gc.get_threshold()
    gc.set_threshold(max(g0, 50_000), g1, g2)


def core_main(inbox, outbox, llm_kwargs: dict, env: dict) -> None:
    """The core process: build the LLM, then loop. Messages in: ("add", items), ("abort", ids),
    ("stop",). Out: ("ready", CoreInfo) | ("failed", traceback) once, then ("step", StepOutput) per
    step (("stats", dict) now and then while idle), and ("died", traceback) if the engine fails."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # Ctrl-C is the front end's to handle
    os.environ.update(env)
    try:
        from .engine_core import EngineCore
        from .llm import LLM
        llm = LLM(**llm_kwargs)
        core = EngineCore(llm.engine)
        outbox.send(("ready", core_info(llm, core)))
        freeze_heap()
    except BaseException:           # noqa: BLE001 -- told to the front end, which raises it
        outbox.send(("failed", traceback.format_exc()))
        return
    try:
        run_core(core, inbox, outbox)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass                        # the front end is gone: leave
    except BaseException:           # noqa: BLE001
        try:
            outbox.send(("died", traceback.format_exc()))
        except OSError:
            pass
    finally:
        llm.close()


def run_core(core, inbox, outbox) -> None:
    """schedule -> run -> accept, with the inbox read between steps (blocking only when idle). Step
    outputs leave through a writer thread: a front end that reads late never holds up a step (its
    messages queue here and it takes them all at once). Where the core's time goes (idle, inbox,
    steps, handing out) is counted in core.timing, sent with every step's stats (/metrics)."""
    sendq: queue.SimpleQueue = queue.SimpleQueue()
    writer = threading.Thread(target=_write_outbox, args=(sendq, outbox), name="core-writer", daemon=True)
    writer.start()
    timing = core.timing
    clock = time.perf_counter
    try:
        while True:
            t0 = clock()
            while not core.has_work() and not inbox.poll(IDLE_SLICE_S):
                timing["idle_s"] += clock() - t0      # sleep until a message (or end-of-file) arrives,
                t0 = clock()                          # counted slice by slice, and told (/metrics)
                sendq.put(("stats", core.stats()))
            t1 = clock()
            while inbox.poll():
                msg = inbox.recv()               # EOFError: the front end is gone
                if msg[0] == "add":
                    core.add(msg[1])
                elif msg[0] == "abort":
                    core.abort(msg[1])
                elif msg[0] == "stop":
                    core.abort(list(core.sent))
                    if core.has_work():
                        sendq.put(("step", core.step()))
                    return
            t2 = clock()
            timing["idle_s"] += t1 - t0
            timing["inbox_s"] += t2 - t1
            if core.has_work():
                step = core.step()
                if step.request_ids:
                    sendq.put(("step", step))
                timing["handout_s"] += clock() - t2 - core.last_step_s
    finally:
        sendq.put(None)
        writer.join(10.0)


def _write_outbox(sendq, outbox) -> None:
    while True:
        msg = sendq.get()
        if msg is None:
            return
        try:
            outbox.send(msg)
        except OSError:                       # the front end is gone: the main loop sees EOF
            return


class CoreProcess:
    """The front end's handle on one core process: start it, send to it, read from it, stop it."""

    def __init__(self, llm_kwargs: dict, env: dict | None = None, name: str = "pagedlab-core"):
        ctx = multiprocessing.get_context("spawn")
        inbox_r, self._inbox = ctx.Pipe(duplex=False)        # front end -> core
        self.outbox, outbox_w = ctx.Pipe(duplex=False)       # core -> front end
        self.process = ctx.Process(target=core_main, args=(inbox_r, outbox_w, llm_kwargs, env or {}),
                                   name=name, daemon=False)   # a core may start its own workers (TP)
        self.process.start()
        inbox_r.close()              # only the core holds these ends: its exit is our end-of-file
        outbox_w.close()
        self.info: CoreInfo | None = None
        self.dead: str | None = None     # why the core is gone, once it is
        self._sendq: queue.SimpleQueue = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write, name=f"{name}-writer", daemon=True)
        self._writer.start()

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
            kind, what = self.outbox.recv()
        except EOFError:
            raise RuntimeError(
                "the engine core process exited before it was ready. It is started with 'spawn', which "
                "imports your __main__ module again: run from a file whose serving code is under "
                "`if __name__ == \"__main__\":` (not from stdin), or serve an LLM of this process "
                "with serve(llm) (its core on a thread)") from None
        if kind == "failed":
            self.process.join(10)
            raise RuntimeError(f"the engine core failed to start:\n{what}")
        self.info = what
        return what

    def send(self, msg) -> None:
        """Queue a message for the core (the writer thread sends it: never blocks the caller)."""
        self._sendq.put(msg)

    def _write(self) -> None:
        while True:
            msg = self._sendq.get()
            if msg is None:
                return
            try:
                self._inbox.send(msg)
            except OSError:                  # the core is gone; the reader side reports it
                return

    def fileno(self) -> int:
        return self.outbox.fileno()

    def messages(self):
        """Every message waiting from the core, without blocking. End-of-file: ("died", why)."""
        while True:
            try:
                if not self.outbox.poll():
                    return
                yield self.outbox.recv()
            except (EOFError, OSError):
                self.process.join(1.0)
                yield ("died", f"the engine core process ended (exit code {self.process.exitcode})")
                return

    def is_alive(self) -> bool:
        return self.dead is None and self.process.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the core to abort everything and leave; end it if it does not within `timeout`."""
        if self.process.is_alive():
            self.send(("stop",))
        self._sendq.put(None)
        self._writer.join(timeout)
        self.process.join(timeout)
        self.kill()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        for conn in (self._inbox, self.outbox):
            try:
                conn.close()
            except OSError:
                pass

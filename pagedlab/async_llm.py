"""An asyncio front for the engine: many callers stream at once, one thread steps the engine.

    llm = AsyncLLM(LLM("smollm2"))
    async for delta in llm.generate("Hi!", SamplingParams(max_tokens=32), chat=True):
        print(delta.text, end="")

The engine is plain, single-threaded code. AsyncLLM gives it one thread of its own that loops:
take new requests and aborts from a queue -> engine.step() -> hand each request's new tokens to its
caller's asyncio queue. Callers never touch the engine. Leaving an `async for` early (break,
cancellation, a client that went away) aborts the request and frees its blocks at the next step.
"""
from __future__ import annotations

import asyncio
import queue
import threading

from .streaming import RequestStream

IDLE_WAIT_S = 0.05        # how long the engine thread sleeps on an empty queue when it has no work


class _Caller:
    """One request's caller: its asyncio loop and queue, and how far it has been streamed."""

    def __init__(self, loop):
        self.loop, self.queue, self.stream = loop, asyncio.Queue(), None

    def put(self, item):
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncLLM:
    def __init__(self, llm):
        if getattr(llm, "data_parallel_size", 1) > 1:
            raise ValueError("AsyncLLM drives one engine: with data_parallel_size > 1 use LLM.generate, "
                             "or one server per GPU behind a load balancer")
        self.llm, self.engine = llm, llm.engine
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[int, _Caller] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pagedlab-engine", daemon=True)
        self._thread.start()

    # -- the caller's side (any asyncio task) -----------------------------------------
    async def generate(self, prompt, params=None, chat: bool = False):
        """Yield StreamDelta's for one prompt; the last has finished=True and the RequestOutput.
        Bad input raises here, before anything is queued."""
        if self._stop.is_set():
            raise RuntimeError("AsyncLLM was shut down")
        checked = self.engine.check_request(prompt, params, chat=chat)     # read-only: safe here
        caller = _Caller(asyncio.get_running_loop())
        self._commands.put(("add", checked, caller))
        done = False
        try:
            while not done:
                item = await caller.queue.get()
                if isinstance(item, BaseException):
                    raise item
                done = item.finished
                yield item
        finally:
            if not done:
                self._commands.put(("abort", caller, None))

    def is_alive(self) -> bool:
        """Is the engine thread running (not shut down, not stopped by an engine failure)?"""
        return self._thread.is_alive() and not self._stop.is_set()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (unfinished requests are aborted)."""
        self._stop.set()
        self._commands.put(("wake", None, None))
        self._thread.join(timeout)

    # -- the engine thread ------------------------------------------------------------
    def _loop(self) -> None:
        eng = self.engine
        try:
            while not self._stop.is_set():
                self._take_commands(block=not eng.has_work())
                if eng.has_work():
                    eng.step()
                    self._send()
        except BaseException as e:          # the engine itself failed: every stream learns it
            for s in self._streams.values():
                s.put(RuntimeError(f"the engine stopped: {type(e).__name__}: {e}"))
            self._streams.clear()
            self._stop.set()
            return
        for rid in list(self._streams):
            eng.abort(rid)
        while eng.has_work():
            eng.step()

    def _take_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            what, a, b = cmd
            if what == "add":
                rid = self.engine.add_checked(*a)
                b.stream = RequestStream(self.engine.scheduler.requests[rid], self.llm.tokenizer, self.llm.output)
                self._streams[rid] = b
            elif what == "abort" and a.stream is not None and a.stream.req.request_id in self._streams:
                self.engine.abort(a.stream.req.request_id)
                del self._streams[a.stream.req.request_id]
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _send(self) -> None:
        """Each caller's new tokens and text; finished requests close their stream."""
        for rid, caller in list(self._streams.items()):
            delta = caller.stream.delta()
            if delta is None:
                continue
            if delta.finished:
                del self._streams[rid]
            caller.put(delta)

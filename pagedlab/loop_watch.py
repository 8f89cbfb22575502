"""How long an asyncio event loop stood still, and how long Python's garbage collector paused it.

A task that asks to wake every `every_s` measures how late it woke: that lateness is how long any
ready callback of the loop waited -- a long callback, a burst of them, a collection, the process
not getting a CPU. And `gc.callbacks` time each collection. The server's front end runs one for its
whole life (AsyncLLM.watch; /metrics: pagedlab_frontend_stall_* and pagedlab_frontend_gc_*); `bench
serve`'s client processes run one per burst (a client that stalls reads its streams late and
reports that lateness as the server's). Everything is a running total or a maximum: nothing grows.
"""
from __future__ import annotations

import asyncio
import gc
import time

LONG_S = 0.05          # a stall or a collection this long is counted apart: it shows in a TTFT's tail


class LoopWatch:
    def __init__(self, every_s: float = 0.005):
        self.every_s = every_s
        self.stall_s = self.longest_stall_s = self.long_stall_s = 0.0
        self.long_stalls = 0
        self.gc_s = self.longest_gc_s = self.long_gc_s = 0.0
        self.gcs = self.long_gcs = 0
        self._gc_t = None
        self._task = None

    def _on_gc(self, phase, info) -> None:
        if phase == "start":
            self._gc_t = time.perf_counter()
        elif self._gc_t is not None:
            d, self._gc_t = time.perf_counter() - self._gc_t, None
            self.gc_s += d
            self.gcs += 1
            self.longest_gc_s = max(self.longest_gc_s, d)
            if d >= LONG_S:
                self.long_gcs += 1
                self.long_gc_s += d

    async def _watch(self) -> None:
        every = self.every_s
        while True:
            t = time.perf_counter()
            await asyncio.sleep(every)
            late = max(0.0, time.perf_counter() - t - every)
            self.stall_s += late
            if late > self.longest_stall_s:
                self.longest_stall_s = late
            if late >= LONG_S:
                self.long_stalls += 1
                self.long_stall_s += late

    def start(self) -> "LoopWatch":
        """Watch the running loop (and every collection of this process) from now on, until stop()
        (again after a stop: the totals go on adding up)."""
        if self._task is None:
            gc.callbacks.append(self._on_gc)
            self._task = asyncio.get_running_loop().create_task(self._watch())
        return self

    def stop(self) -> dict:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        return self.totals()

    def totals(self) -> dict:
        """Seconds and counts so far: stall_s (all lateness), long_stalls / long_stall_s (those >=
        LONG_S), longest_stall_s; the same for the collector (gc_s, gcs, long_gcs, long_gc_s,
        longest_gc_s)."""
        return {"stall_s": self.stall_s, "long_stalls": self.long_stalls, "long_stall_s": self.long_stall_s,
                "longest_stall_s": self.longest_stall_s, "gc_s": self.gc_s, "gcs": self.gcs,
                "long_gcs": self.long_gcs, "long_gc_s": self.long_gc_s, "longest_gc_s": self.longest_gc_s}

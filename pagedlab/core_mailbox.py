"""The engine core's mailbox: its pipes to one or several front ends (`serve --api-servers N`).

    front end 0 --add/abort/stop-->  inbox 0  \\                      / outbox 0 --step--> front end 0
    front end 1 --add/abort/stop-->  inbox 1  --> core: take all, step --> outbox 1 --step--> front end 1
    ...                                        /  split by owner       \\ ...

Who owns a request: its id says. Front end f of N numbers its requests f, f + N, f + 2N, ... (the
engine and its scheduler see plain ints, unique across front ends), so the owner of request `rid`
is rid % N: no table to keep, nothing to forget.

What the core sends: after each step, ONE message to each front end that has requests in that step
(its requests' columns of the StepOutput, with the core's stats), never one per request; a front end
with nothing in the step gets the stats alone, at most every `stats_every_s` (so every front end's
/metrics shows the same engine gauges, a fraction of a second old at most).

Liveness: every front end hears from a core whose loop turns at least every `stats_every_s`
(0.25 s) or every step, whichever is longer -- its share of a step or the stats (hand_out), the
stats every slice an idle core waits (run_core), and after an idle core took messages that made no
work (beat). So the front end needs no ping: a core silent for much longer is stopped (SIGSTOP) or stuck in one step (a hung
kernel, or a legitimately long compile); AsyncLLM measures that silence (/health, /metrics).

How a message leaves (Outbox): the core's own thread pickles it and writes it into the pipe at once,
without blocking (the pipe is non-blocking on the core's side; the front end reads it with a plain
Connection.recv). Only what the pipe cannot take now -- a front end that reads late -- is left to
that front end's writer thread, which waits for room; until it has written everything, later
messages queue behind it, so the order holds. So a front end that reads late holds up neither the
step nor the other front ends, and in the common case no second thread wakes per step: a thread
that wakes every step to pickle and send takes the GIL from the loop that launches the GPU's work
(the engine lost 8 % offline beside one, docs/serving.md session 15). PAGEDLAB_CORE_DIRECT_SEND=0:
every message through the writer thread, as before session 20.

A front end that leaves -- it says "stop", or its inbox reaches end-of-file because it was killed --
has its requests aborted (their blocks are free at once) and is written to no more; an abort from a
front end touches only its own requests. The core leaves once every front end has left.
"""
from __future__ import annotations

import collections
import itertools
import os
import queue
import select
import struct
import threading
import time
from multiprocessing.reduction import ForkingPickler

from .output_processor import StepOutput


def request_ids(frontend: int, frontends: int):
    """The ids front end `frontend` of `frontends` gives its requests, in turn: frontend,
    frontend + frontends, frontend + 2 frontends, ... (AsyncLLM.submit draws from it)."""
    return itertools.count(frontend, frontends)


def owner(request_id: int, frontends: int) -> int:
    """The front end that numbered request `request_id` (the inverse of request_ids)."""
    return request_id % frontends


def pipe_ready(conn):
    """A function telling, without blocking, whether `conn` (a multiprocessing Connection) has a
    message waiting (or its end-of-file): one poll object for the pipe's whole life.
    Connection.poll() builds and tears down a selector each time -- asked before every recv, that
    was ~10 % of a front end's CPU under a burst (py-spy, docs/serving.md session 17). Where
    select.poll is missing (Windows' pipes): Connection.poll itself."""
    if not hasattr(select, "poll"):
        return conn.poll
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN)
    return lambda: bool(poller.poll(0))


class Mailbox:
    def __init__(self, inboxes, outboxes, stats_every_s: float = 0.25):
        assert len(inboxes) == len(outboxes) >= 1
        self.n = len(inboxes)
        self.inboxes = list(inboxes)
        self._ready = [pipe_ready(c) for c in self.inboxes]
        self.live = list(range(self.n))               # the front ends that have not left
        self.stats_every_s = stats_every_s
        self._last_sent = [0.0] * self.n
        self._queues = [outbox(out, f"core-writer{f}") for f, out in enumerate(outboxes)]

    @property
    def open(self) -> bool:
        """Is any front end left?"""
        return bool(self.live)

    def owner(self, request_id: int) -> int:
        return owner(request_id, self.n)

    # -- in ------------------------------------------------------------------------------------
    def wait(self, timeout: float) -> bool:
        """Block until a front end has sent something (or left), at most `timeout` s."""
        if not self.live:
            return True
        if self.n == 1:
            return self.inboxes[0].poll(timeout)
        from multiprocessing.connection import wait
        return bool(wait([self.inboxes[f] for f in self.live], timeout))

    def take(self, core) -> None:
        """Apply every message waiting, front end by front end: adds, aborts (of the sender's own
        requests), and front ends that left (their requests aborted)."""
        for f in list(self.live):
            inbox = self.inboxes[f]
            try:
                while self._ready[f]():
                    msg = inbox.recv()
                    if msg[0] == "add":
                        core.add(msg[1])
                    elif msg[0] == "abort":
                        core.abort(msg[1] if self.n == 1 else [r for r in msg[1] if owner(r, self.n) == f])
                    elif msg[0] == "stop":
                        self.leave(core, f)
                        break
            except (EOFError, OSError):                # killed, or gone without a word
                self.leave(core, f)

    def leave(self, core, f: int) -> None:
        """Front end f is gone: abort its requests, write to it no more."""
        if f not in self.live:
            return
        self.live.remove(f)
        core.abort([r for r in core.sent if owner(r, self.n) == f])
        self._queues[f].put(None)
        try:
            self.inboxes[f].close()
        except OSError:
            pass

    # -- out -----------------------------------------------------------------------------------
    def tell_all(self, msg) -> None:
        """The same message to every front end left (ready, failed, died, an idle core's stats)."""
        now = time.perf_counter()
        for f in self.live:
            self._queues[f].put(msg)
            self._last_sent[f] = now

    def beat(self, stats) -> None:
        """An idle core's heartbeat when messages, not its wait's timeout, woke it: the stats (`stats`:
        a function, called only then) to each front end not written to for `stats_every_s`. Without
        it a front end sending messages that make no work (aborts of requests that ended) faster than
        that would keep an idle core silent. Costs a clock read and a comparison per front end."""
        now = time.perf_counter()
        due = [f for f in self.live if now - self._last_sent[f] >= self.stats_every_s]
        if due:
            msg = ("stats", stats())
            for f in due:
                self._queues[f].put(msg)
                self._last_sent[f] = now

    def hand_out(self, step: StepOutput) -> None:
        """One step's output: each front end its own requests' share, one message each."""
        now = time.perf_counter()
        if self.n == 1:
            parts = {0: step} if step.request_ids else {}
        else:
            parts = split(step, self.n)
        for f in self.live:
            part = parts.get(f)
            if part is not None:
                self._queues[f].put(("step", part))
            elif now - self._last_sent[f] >= self.stats_every_s:
                self._queues[f].put(("stats", step.stats))
            else:
                continue
            self._last_sent[f] = now

    def close(self, timeout: float = 10.0) -> None:
        """Send what is queued, then stop the writers."""
        for f in self.live:
            self._queues[f].put(None)
        self.live = []
        for q in self._queues:
            q.join(timeout)


def split(step: StepOutput, n: int) -> dict[int, StepOutput]:
    """A step's columns by owner (request id % n): {front end: its StepOutput}, each with the stats."""
    parts: dict[int, StepOutput] = {}

    def part(rid):
        f = owner(rid, n)
        p = parts.get(f)
        if p is None:
            p = parts[f] = StepOutput(stats=step.stats)
        return p
    for rid, ids in zip(step.request_ids, step.token_ids):
        p = part(rid)
        p.request_ids.append(rid)
        p.token_ids.append(ids)
    for rid, lp in step.logprobs.items():
        part(rid).logprobs[rid] = lp
    for rid, fin in step.finished.items():
        part(rid).finished[rid] = fin
    return parts


def frame(msg) -> bytes:
    """A message as multiprocessing.Connection.send writes it (a 4-byte big-endian length, or -1 and
    an 8-byte one past 2 GiB, then the pickle), so the front end reads it with Connection.recv."""
    body = ForkingPickler.dumps(msg)
    n = len(body)
    head = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)
    return head + body


def outbox(conn, name: str):
    """The sending end of a pipe as an Outbox (written at once when there is room), or a
    ThreadOutbox where that cannot be (PAGEDLAB_CORE_DIRECT_SEND=0, or no select.poll / no
    non-blocking pipes: Windows)."""
    if os.environ.get("PAGEDLAB_CORE_DIRECT_SEND", "1") != "0" and hasattr(select, "poll"):
        try:
            return Outbox(conn, name)
        except OSError:
            pass
    return ThreadOutbox(conn, name)


class Outbox:
    """The sending end of one pipe (the core's outbox to a front end, or a front end's inbox to the
    core): put() writes now when the pipe has room (the caller's thread, no wait) and leaves the
    rest to a writer thread that waits for room. put(None): write what is left, then close. A
    reader that is gone: everything put is dropped (the other direction tells that side it left).
    The pipe's descriptor is only written and closed under one lock, and nothing writes once it is
    closed, so a descriptor number the system hands out again is never written to."""

    def __init__(self, conn, name: str = "core-writer"):
        self._conn, self._fd = conn, conn.fileno()
        os.set_blocking(self._fd, False)      # this end only: the reading end stays blocking
        self._lock = threading.Lock()
        self._pending: collections.deque = collections.deque()   # frames (memoryviews) not yet written
        self._wake = threading.Event()
        self._closing = self._gone = False
        self.direct = self.deferred = 0       # messages written at once / left to the writer (tests)
        self._writer = threading.Thread(target=self._write_pending, name=name, daemon=True)
        self._writer.start()

    def put(self, msg) -> None:
        if msg is None:
            with self._lock:
                self._closing = True
            self._wake.set()
            return
        if self._gone or self._closing:
            return
        data = memoryview(frame(msg))
        with self._lock:
            if self._gone:
                return
            if not self._pending:             # nothing queued ahead of it: try the pipe now
                try:
                    data = data[os.write(self._fd, data):]
                except BlockingIOError:
                    pass
                except OSError:               # the reader is gone
                    self._gone = True
                    return
                if not data:
                    self.direct += 1
                    return
            self.deferred += 1
            self._pending.append(data)
        self._wake.set()

    def _write_pending(self) -> None:
        poller = select.poll()
        poller.register(self._fd, select.POLLOUT)
        while True:
            self._wake.wait()
            with self._lock:
                self._wake.clear()
                if self._gone:
                    break
                if not self._pending:
                    if self._closing:
                        break
                    continue
            poller.poll(1000)                 # room in the pipe (or its reader gone: POLLERR)
            with self._lock:                  # (written and popped under the lock: put() sees the
                if self._gone:                # frame pending until it is whole, and close() never
                    break                     # closes the descriptor under a write)
                data = self._pending[0]
                try:
                    n = os.write(self._fd, data)
                except BlockingIOError:
                    n = 0
                except OSError:
                    self._gone = True
                    self._pending.clear()
                    break
                if n < len(data):
                    self._pending[0] = data[n:]
                else:
                    self._pending.popleft()
                if self._pending or self._closing:
                    self._wake.set()
        self.close()

    def close(self) -> None:
        """Close the pipe now (what is pending is dropped; the writer thread ends)."""
        with self._lock:
            self._gone = True
            self._pending.clear()
            try:
                self._conn.close()
            except OSError:
                pass
        self._wake.set()

    def join(self, timeout: float) -> None:
        self._writer.join(timeout)


class ThreadOutbox:
    """Every message pickled and sent by a writer thread (PAGEDLAB_CORE_DIRECT_SEND=0)."""

    def __init__(self, conn, name: str = "core-writer"):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._conn = conn
        self._writer = threading.Thread(target=_write, args=(self._q, conn), name=name, daemon=True)
        self._writer.start()

    def put(self, msg) -> None:
        self._q.put(msg)

    def close(self) -> None:
        try:
            self._conn.close()
        except OSError:
            pass

    def join(self, timeout: float) -> None:
        self._writer.join(timeout)


def _write(sendq, outbox) -> None:
    while True:
        msg = sendq.get()
        if msg is None:
            break
        try:
            outbox.send(msg)
        except OSError:                       # the front end is gone: its inbox says so too
            break
    try:
        outbox.close()
    except OSError:
        pass

"""The front end: many asyncio callers at once, the engine core elsewhere.

    allm = AsyncLLM.from_model("smollm2")              # the engine core in a process of its own
    allm = AsyncLLM(LLM("smollm2"))                    # or: an LLM of this process, on a thread
    async for delta in allm.generate("Hi!", SamplingParams(max_tokens=32), chat=True):
        print(delta.text, end="")

The split (vLLM's EngineCore / front end, SGLang's scheduler / tokenizer processes):

    front end, on the asyncio loop               engine core (core_process.py, or a thread)
      check + tokenize, number the request  -->  add
      route it to the least-loaded core          schedule -> run -> accept, every step
      one OutputProcessor: detokenize,      <--  one StepOutput per step (token ids, endings)
      stop strings, deltas, RequestOutputs
      a caller left / a stop string         -->  abort

Nothing per request crosses per step: one message per step in each direction. A caller is woken
when its request moved; it computes its own delta (text) when it runs, so a slow client's steps
coalesce into one delta. Leaving an `async for` early (break, cancellation, a client that went away)
aborts the request; its blocks are freed at the core's next step.

Data parallelism: from_model(..., data_parallel_size=N) starts N cores (one per GPU, or N on the
CPU) behind this one front end; each request goes to the core with the least work assigned (prompt +
max tokens of its unfinished requests). Seeds of requests without one are drawn here, as one engine
would draw them, so N cores give one engine's outputs.

A core that dies is seen at once (its pipe reaches end-of-file): every open stream ends with
finish_reason "error", is_alive() turns False (the server's /health says so) and `on_core_death`
(the CLI server: exit) runs.

A core that is alive but does not answer -- stopped (SIGSTOP), or stuck in one step (a hung GPU
kernel) -- closes no pipe. Liveness: each core's link keeps `heard_t`, when a message last came
from it, and a core whose loop turns sends one at least every 0.25 s whether it is idle or busy
(core_mailbox.py), so the front end always expects to hear and needs no ping. Silent for more than
`silent_s` (30 s; PAGEDLAB_CORE_SILENT_S): not_answering() names it, the server's /health answers
503 with a one-line reason and /metrics' pagedlab_core_silent_seconds shows the silence; heard
again, it is healthy again by itself. The threshold is far above any step that is merely long (a
huge prefill is seconds, a first-time Triton compile seconds to a minute; the warm-up and CUDA
graph capture run before the core says it is ready). Silent for more than `give_up_s` (300 s;
PAGEDLAB_CORE_GIVE_UP_S, 0: never): the core is taken for hung -- its open streams end with
finish_reason "error" (a client waits no longer than that, and may retry elsewhere), their requests
are aborted in the core (their blocks freed if it ever answers again: an abort waits in its pipe),
and new requests go to another core, or get 503 while none answers. Streams of other cores, and
the core itself, are left alone: it is not killed (the CLI server does not exit), a supervisor
reading /health decides; if it answers again it serves on. A stall of this front end's own (its
loop blocked, or the whole server stopped with Ctrl-Z) is not counted against the cores (watch).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import os
import queue
import threading
import time
import traceback
from dataclasses import replace
from typing import NamedTuple

import torch

from .core_mailbox import request_ids
from .core_process import CoreInfo, CoreProcess, core_info
from .engine import SEED_BITS, check_request
from .llm import check_text
from .loop_watch import LoopWatch
from .output_processor import OutputProcessor, RequestState

IDLE_WAIT_S = 0.05        # how long the engine thread sleeps on an empty queue when it has no work
CORE_SILENT_S = 30.0      # a core silent this long is reported (/health 503): PAGEDLAB_CORE_SILENT_S
CORE_GIVE_UP_S = 300.0    # ... this long, its streams are ended: PAGEDLAB_CORE_GIVE_UP_S (0: never)
FRONT_END_STALL_S = 5.0   # watch() woken this much late: this front end stalled, not the cores
KEEPALIVE_S = 15.0        # a stream with nothing new this long gets a keep-alive: PAGEDLAB_SSE_KEEPALIVE_S (0: never)
BUSY_TIMES = {"busy_start_t": min, "busy_end_t": max}     # core stats that are moments (time.monotonic)
log = logging.getLogger("pagedlab.async_llm")


def liveness_seconds(name: str, value, default: float, zero_ok: bool = False) -> float:
    """A liveness threshold: `value` if given, else the environment variable `name`, else `default`;
    a number > 0 (>= 0 where 0 means never, zero_ok), else ValueError naming it."""
    what = name if value is None else name.removeprefix("PAGEDLAB_CORE_").lower()
    raw = os.environ.get(name, "") if value is None else value
    if raw in ("", None):
        return float(default)
    try:
        x = float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number of seconds, got {raw!r:.40}") from None
    if not (x > 0 or (zero_ok and x == 0)) or x != x or x == float("inf"):
        raise ValueError(f"{what} must be a number of seconds {'>= 0' if zero_ok else '> 0'}, got {raw!r:.40}")
    return x


def liveness(silent_s, give_up_s) -> tuple[float, float]:
    """The liveness thresholds, checked: the arguments given, else PAGEDLAB_CORE_SILENT_S and
    PAGEDLAB_CORE_GIVE_UP_S, else 30 s and 300 s."""
    return (liveness_seconds("PAGEDLAB_CORE_SILENT_S", silent_s, CORE_SILENT_S),
            liveness_seconds("PAGEDLAB_CORE_GIVE_UP_S", give_up_s, CORE_GIVE_UP_S, zero_ok=True))


class CoreThread:
    """An LLM of this process, its core stepped on a thread: the same messages as a core process,
    through in-process queues (AsyncLLM(llm): tests, notebooks, serve(llm))."""

    def __init__(self, llm):
        other = getattr(llm, "_core_thread", None)
        if other is not None and other.thread.is_alive():
            raise RuntimeError("this LLM's engine is already driven by another AsyncLLM (its engine thread "
                               "steps it): use that one, or call its shutdown() first")
        self.llm, self.core = llm, llm.core
        self.info: CoreInfo = core_info(llm, self.core)
        self.dead: str | None = None
        self.heard_t = time.monotonic()      # the thread's loop last turned (AsyncLLM's liveness)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._out: collections.deque = collections.deque()
        self._wake = None                    # set by AsyncLLM: schedules its reader on its loop
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="pagedlab-engine", daemon=True)
        llm._core_thread = self       # llm.generate / stream refuse while this thread steps the core
        self.thread.start()

    def send(self, msg) -> None:
        self._commands.put(msg)

    def messages(self):
        while self._out:
            yield self._out.popleft()

    def is_alive(self) -> bool:
        return self.dead is None and self.thread.is_alive() and not self._stop.is_set()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(("wake",))
        self.thread.join(timeout)

    def _deliver(self, msg) -> None:
        self._out.append(msg)
        wake = self._wake
        if wake is not None:
            try:
                wake()
            except RuntimeError:      # that loop is closed (an asyncio.run that ended): the message
                pass                  # waits in _out for the next loop's _attach (_read_all)

    def _run(self) -> None:
        core = self.core
        try:
            while not self._stop.is_set():
                self.heard_t = time.monotonic()     # (a clock read per turn: idle, every IDLE_WAIT_S)
                self._take_commands(block=not core.has_work())
                if core.has_work():
                    step = core.step()
                    if step.request_ids:
                        self._deliver(("step", step))
        except BaseException as e:              # the engine itself failed: every stream learns it
            self._deliver(("died", f"the engine stopped: {type(e).__name__}: {e}\n{traceback.format_exc()}"))
            return
        core.abort(list(core.sent))             # shut down: nothing is left running
        while core.has_work():
            step = core.step()
            if step.request_ids:
                self._deliver(("step", step))

    def _take_commands(self, block: bool) -> None:
        try:
            msg = self._commands.get(timeout=IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if msg[0] == "add":
                self.core.add(msg[1])
            elif msg[0] == "abort":
                self.core.abort(msg[1])
            try:
                msg = self._commands.get_nowait()
            except queue.Empty:
                return


def core_specs(model, data_parallel_size: int, llm_kwargs: dict) -> list[tuple[dict, dict, str]]:
    """The engine cores to start for LLM(model, **llm_kwargs) x data_parallel_size: (LLM arguments,
    environment, name) each. On GPUs, core k gets GPUs k*T .. k*T+T-1 (T = tensor_parallel_size);
    only the first shows its loading progress."""
    from .llm import parallel_sizes
    tp, dp = parallel_sizes(llm_kwargs.get("tensor_parallel_size", 1), data_parallel_size)
    if model is not None:
        llm_kwargs = dict(llm_kwargs, model=model)
    device = str(llm_kwargs.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.startswith("cuda") and dp > 1 and torch.cuda.device_count() < tp * dp:
        raise ValueError(f"data_parallel_size={dp} x tensor_parallel_size={tp} needs {tp * dp} GPUs; "
                         f"torch sees {torch.cuda.device_count()}")
    specs = []
    for k in range(dp):
        env = {}
        if device.startswith("cuda") and dp > 1:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(k * tp + j) for j in range(tp))
        specs.append((dict(llm_kwargs, show_progress=k == 0 and llm_kwargs.get("show_progress", True)),
                      env, f"pagedlab-core{k}"))
    return specs


class CoreNotAnswering(RuntimeError):
    """submit() while every running core has been silent past give_up_s (the server: 503)."""


class CoreStopped(RuntimeError):
    """submit() once the engine is gone: a core died, or this AsyncLLM was shut down (the server:
    503, as it is unavailable rather than broken by the request)."""


class Checked(NamedTuple):
    """A request as check_request returned it: safe to queue."""
    ids: list
    text: str | None
    params: object


class _Caller:
    """One request's caller: its state in the output processor, its core, an event that says the
    request moved; `idle`: seconds since its stream last moved (watch() adds them up), `nudged`: a
    keep-alive is due (the event was set with nothing new)."""
    __slots__ = ("state", "core", "cost", "event", "idle", "nudged")

    def __init__(self, state: RequestState, core: int, cost: int):
        self.state, self.core, self.cost, self.event = state, core, cost, asyncio.Event()
        self.idle, self.nudged = 0.0, False


class AsyncLLM:
    def __init__(self, llm, *, silent_s: float | None = None, give_up_s: float | None = None):
        """Serve an LLM built in this process: its engine core runs on a thread of this process.
        silent_s, give_up_s: the liveness thresholds (the module's doc; None: the environment's, or
        30 s and 300 s)."""
        if getattr(llm, "data_parallel_size", 1) > 1:
            raise ValueError("AsyncLLM(llm) drives one engine, and this LLM has data_parallel_size > 1: "
                             "use AsyncLLM.from_model(model, data_parallel_size=N) (or serve "
                             "--data-parallel-size N), which starts one engine core per replica")
        silent_s, give_up_s = liveness(silent_s, give_up_s)       # (checked before a thread starts)
        self.llm, self.engine = llm, llm.engine
        self._init([CoreThread(llm)], silent_s=silent_s, give_up_s=give_up_s)

    @classmethod
    def from_model(cls, model=None, *, data_parallel_size: int = 1, silent_s: float | None = None,
                   give_up_s: float | None = None, **llm_kwargs) -> "AsyncLLM":
        """Start data_parallel_size engine cores, each in a process of its own building
        LLM(model, **llm_kwargs); returns once every one is ready. On GPUs, core k gets GPUs
        k*T .. k*T+T-1 (T = tensor_parallel_size). silent_s, give_up_s: as AsyncLLM()."""
        silent_s, give_up_s = liveness(silent_s, give_up_s)
        cores = []
        try:
            for kwargs, env, name in core_specs(model, data_parallel_size, llm_kwargs):
                cores.append(CoreProcess(kwargs, env, name=name))
            for c in cores:
                c.wait_ready()
        except BaseException:
            for c in cores:
                c.kill()
            raise
        self = cls.__new__(cls)
        self.llm = self.engine = None
        self._init(cores, silent_s=silent_s, give_up_s=give_up_s)
        return self

    @classmethod
    def connect(cls, links, frontend: int = 0, frontends: int = 1, *, silent_s: float | None = None,
                give_up_s: float | None = None) -> "AsyncLLM":
        """Front end `frontend` of `frontends` in front of cores another process started
        (core_process.CoreLink's, each ready: its .info read). Its request ids are frontend,
        frontend + frontends, ...: unique across the front ends, and each core hands a request's
        output to the front end its id names (core_mailbox.py). silent_s, give_up_s: as AsyncLLM()."""
        silent_s, give_up_s = liveness(silent_s, give_up_s)
        self = cls.__new__(cls)
        self.llm = self.engine = None
        self._init(links, frontend, frontends, silent_s, give_up_s)
        return self

    def _init(self, cores, frontend: int = 0, frontends: int = 1, silent_s: float = CORE_SILENT_S,
              give_up_s: float = CORE_GIVE_UP_S) -> None:
        self.cores = cores
        # liveness (the module's doc): report a core silent past silent_s, end its streams past give_up_s
        self.silent_s, self.give_up_s = silent_s, give_up_s
        # a stream with nothing new for keepalive_s (a long wait in the queue, a silent core) is
        # nudged: the server writes an SSE comment, so that proxies and clients with an idle timeout
        # do not cut it (0: never)
        self.keepalive_s = liveness_seconds("PAGEDLAB_SSE_KEEPALIVE_S", None, KEEPALIVE_S, zero_ok=True)
        self._quiet: set[int] = set()       # the cores reported not answering (watch: logged once)
        self.frontend, self.frontends = frontend, frontends
        info = cores[0].info
        self.tokenizer, self.vocab_size, self.pool_hint = info.tokenizer, info.vocab_size, info.pool_hint
        self.max_model_len = min(c.info.max_model_len for c in cores)
        self.max_num_seqs = sum(c.info.max_num_seqs for c in cores)
        self.model_name = info.model_name
        self.outputs = OutputProcessor(info.tokenizer, info.stop_sources)
        # (several front ends: each draws from a stream of its own, none repeats another's seeds)
        self._seeds = (torch.Generator().manual_seed(info.seed + 1_000_003 * frontend)
                       if len(cores) > 1 else None)
        self._stats = [dict(c.info.stats) for c in cores]
        self._load = [0] * len(cores)
        self._callers: dict[int, _Caller] = {}
        self._ids = request_ids(frontend, frontends)     # frontend, + frontends, ...: unique across front ends
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = False
        self._output_s = 0.0                # time in _read: what the front end spends per step
        self._loop_watch = None             # watch(): how long this front end's loop stood still
        self.on_core_death = None           # called once, on the loop, when a core dies

    # -- what the server reads -----------------------------------------------------------------
    def check_request(self, prompt, params=None, chat: bool = False) -> "Checked":
        """What the core would refuse, refused here, before anything is queued: a Checked (token
        ids, text, params), which submit() takes as it is."""
        if isinstance(prompt, str):
            check_text(prompt, "the prompt's text")       # a lone surrogate: named here, not in the tokenizer
        return Checked(*check_request(prompt, params, chat, self.tokenizer, self.vocab_size,
                                      self.max_model_len, self.pool_hint))

    def stats(self) -> dict:
        """The engine's gauges summed over its cores (running, waiting, KV blocks ...), as of each
        core's last step (an engine on a thread: read now)."""
        per_core = [c.core.stats() if isinstance(c, CoreThread) else s for c, s in zip(self.cores, self._stats)]
        total = {}
        for s in per_core:
            for k, v in s.items():
                if k in BUSY_TIMES:             # times, not amounts: the cores' first start, last end
                    total[k] = BUSY_TIMES[k](total.get(k, v), v)
                elif k != "t":
                    total[k] = total.get(k, 0) + v
        total["frontend_output_s"] = self._output_s
        total["frontend_cpu_s"] = time.process_time()     # this front-end process's CPU, all its threads
        if self._loop_watch is not None:
            total.update({"frontend_" + k: v for k, v in self._loop_watch.totals().items()})
        if "prefix_queries" in total:
            total["hit_rate"] = total["prefix_hits"] / total["prefix_queries"] if total["prefix_queries"] else 0.0
        return total

    def core_status(self) -> list[dict]:
        """Each engine core: its process id, whether it runs, why it stopped, how long it has been
        silent (seconds since its last message) and whether it answers (silent no longer than
        silent_s)."""
        silence = self.core_silence()
        return [dict(pid=c.info.pid, alive=c.is_alive(), silent_s=round(s, 3), answering=s <= self.silent_s,
                     **({"error": c.dead} if c.dead else {}))
                for c, s in zip(self.cores, silence)]

    # -- liveness (the module's doc) -------------------------------------------------------------
    def core_silence(self) -> list[float]:
        """Seconds since each core last answered (sent anything); a core that runs answers at least
        every 0.25 s, idle or busy (core_mailbox.py). What /metrics shows (pagedlab_core_silent_seconds).
        Read on the loop: what the cores sent and nobody read yet is read first."""
        if not self._stopped and self._loop is not None and _on_loop(self._loop):
            for k, core in enumerate(self.cores):
                if core.dead is None:
                    self._read(k)
        now = time.monotonic()
        return [max(0.0, now - c.heard_t) for c in self.cores]

    def not_answering(self, longer_than: float | None = None) -> list[tuple[int, float]]:
        """The cores alive but silent for more than `longer_than` seconds (default silent_s):
        [(core index, seconds silent)]. A dead core is is_alive()'s to report, not this."""
        limit = self.silent_s if longer_than is None else longer_than
        return [(k, s) for k, s in enumerate(self.core_silence())
                if s > limit and self.cores[k].dead is None and self.cores[k].is_alive()]

    def health(self) -> tuple[bool, str]:
        """(healthy, one line): every core runs and answers; else what is wrong, naming the core --
        what the server's /health answers."""
        if self._stopped:
            return False, "engine stopped: shut down"
        dead = [(k, c) for k, c in enumerate(self.cores) if not c.is_alive()]
        if dead:
            return False, "; ".join(f"engine core {k} (pid {c.info.pid}) stopped: {c.dead or 'ended'}"
                                    for k, c in dead)
        quiet = self.not_answering()
        if quiet:
            return False, "; ".join(self._silent_line(k, s) for k, s in quiet)
        return True, "ok"

    def _silent_line(self, k: int, seconds: float) -> str:
        return (f"engine core {k} (pid {self.cores[k].info.pid}) has not answered for {seconds:.1f} s "
                f"(more than {self.silent_s:g} s): stopped, or stuck in a step")

    def _look_at_liveness(self) -> None:
        """watch(), every second: log a core that stops answering and one that answers again, and
        give up on one silent past give_up_s (its streams end, its requests are aborted)."""
        quiet = dict(self.not_answering())
        for k, s in quiet.items():
            if k not in self._quiet:
                log.warning("pagedlab: %s", self._silent_line(k, s))
        for k in self._quiet - quiet.keys():
            log.warning("pagedlab: engine core %d (pid %s) answers again", k, self.cores[k].info.pid)
        self._quiet = set(quiet)
        if self.give_up_s:
            for k, s in self.not_answering(self.give_up_s):
                self._give_up(k, s)

    def _keep_alive(self, seconds: float) -> None:
        """watch(), every second: streams that did not move for keepalive_s are nudged (their
        deltas(keepalive=True) yields None once). Nothing is added to a step: _on_step only sets a
        moved stream's idle time back to 0."""
        if not self.keepalive_s:
            return
        for caller in self._callers.values():
            if caller.state.stream:
                caller.idle += seconds
                if caller.idle >= self.keepalive_s:
                    caller.idle, caller.nudged = 0.0, True
                    caller.event.set()

    def _give_up(self, k: int, seconds: float) -> None:
        """Core k has not answered for `seconds` (> give_up_s): end its open streams with an error
        and abort their requests in it (the aborts wait in its pipe: if it answers again it frees
        their blocks first thing). Nothing else changes: other cores' streams run on."""
        rids = [rid for rid, c in self._callers.items() if c.core == k]
        if not rids:
            return
        why = (f"the engine core {k} has not answered for {seconds:.0f} s (more than {self.give_up_s:g} s): "
               "taken for hung")
        log.warning("pagedlab: %s; ending its %d open request(s)", why, len(rids))
        self._end_callers(lambda c: c.core == k, "error", why)
        self.cores[k].send(("abort", rids))

    def _given_up(self, k: int, now: float) -> bool:
        """Is core k silent past give_up_s (new requests go elsewhere)?"""
        return bool(self.give_up_s) and now - self.cores[k].heard_t > self.give_up_s

    def is_alive(self) -> bool:
        """Is every engine core running (not shut down, not dead)?"""
        return not self._stopped and all(c.is_alive() for c in self.cores)

    # -- the caller's side ---------------------------------------------------------------------
    async def generate(self, prompt, params=None, chat: bool = False, stream: bool = True):
        """Yield StreamDelta's for one prompt; the last has finished=True and the RequestOutput.
        stream=False: only that last one. Bad input raises here, before anything is queued."""
        request = self.submit(prompt, params, chat, stream)
        try:
            async for delta in request.deltas():
                yield delta
        finally:
            request.abort()               # a no-op once it finished

    def submit(self, prompt, params=None, chat: bool = False, stream: bool = True) -> "Submitted":
        """Check one request and send it to a core NOW, before this call returns; iterate the
        returned handle's deltas() for its output. What the server calls in its request handler: a
        burst's first requests reach the core while the later ones are still being read, rather
        than once every request of the burst has passed every `await` of the HTTP layer (asyncio
        runs ready tasks in turn, so a burst moves through a handler in lockstep). `prompt` may be
        a Checked (what check_request returned): it is not checked twice."""
        if not self.is_alive():
            raise CoreStopped("AsyncLLM was shut down" if self._stopped else
                              "the engine core stopped: " + (self._why_dead() or "?"))
        ids, text, params = prompt if isinstance(prompt, Checked) else self.check_request(prompt, params, chat)
        self._attach(asyncio.get_running_loop())
        now = time.monotonic()
        k = min(range(len(self.cores)), key=lambda i: (not self.cores[i].is_alive(), self._given_up(i, now),
                                                        self._load[i]))
        if self._given_up(k, now):  # every core running is taken for hung: refused, not queued (and
            raise CoreNotAnswering(  # before a seed is drawn: the seeds of later requests do not shift)
                f"the engine core {k} has not answered for {now - self.cores[k].heard_t:.0f} s "
                f"(more than {self.give_up_s:g} s)")
        if self._seeds is not None and params.seed is None:
            params = replace(params, seed=int(torch.randint(0, 2**SEED_BITS, (1,), generator=self._seeds)))
        rid = next(self._ids)
        cost = len(ids) + params.max_new_tokens
        state = self.outputs.add(rid, ids, text, params, stream=stream)
        caller = self._callers[rid] = _Caller(state, k, cost)
        self._load[k] += cost
        self._queue(k, ("add", (rid, ids, text, params)))
        return Submitted(self, rid, caller)

    # -- messages ------------------------------------------------------------------------------
    def _queue(self, k: int, item) -> None:
        """An add or abort goes to its core at once (a core process: through its writer thread, so
        the loop never waits on a pipe; the core takes every message waiting between two steps).
        Holding them for a later turn of the loop would hold a burst's first requests until the
        whole burst is parsed."""
        kind, what = item
        self.cores[k].send((kind, [what]))

    async def watch(self, every_s: float = 1.0) -> None:
        """Read the cores' messages on the running loop from now on, and look at the cores every
        `every_s`: one that ended without a word (killed) is reported like one whose pipe closed;
        one silent past silent_s is logged, past give_up_s given up on (the module's doc). The
        server runs this for its whole life."""
        self._attach(asyncio.get_running_loop())
        # this front end's own stalls and collections (/metrics pagedlab_frontend_stall_*), while it watches
        self._loop_watch = (self._loop_watch or LoopWatch()).start()
        try:
            await self._watch_cores(every_s)
        finally:
            self._loop_watch.stop()

    async def _watch_cores(self, every_s: float) -> None:
        while not self._stopped:
            for k, core in enumerate(self.cores):
                if core.dead is None and not core.is_alive() and not self._stopped:
                    code = getattr(getattr(core, "process", None), "exitcode", None)
                    self._on_death(k, f"the engine core process ended (exit code {code})")
            if not self._stopped:
                self._look_at_liveness()
            t = time.monotonic()
            await asyncio.sleep(every_s)
            self._keep_alive(time.monotonic() - t)
            late = time.monotonic() - t - every_s
            if late > FRONT_END_STALL_S:    # this front end did not run (its loop blocked, the whole
                now = time.monotonic()      # server stopped): the cores' silence meanwhile is not theirs
                for core in self.cores:
                    core.heard_t = min(core.heard_t + late, now)

    def _attach(self, loop) -> None:
        """Read the cores' messages on this loop (the first caller's; a later asyncio.run's loop
        takes over once the earlier one is closed)."""
        if self._loop is loop:
            return
        old, self._loop = self._loop, loop
        for k, core in enumerate(self.cores):
            if isinstance(core, CoreThread):
                core._wake = lambda k=k: loop.call_soon_threadsafe(self._read, k)
            else:
                if old is not None and not old.is_closed():
                    old.remove_reader(core.fileno())
                loop.add_reader(core.fileno(), self._read, k)
        self._read_all()

    def _read_all(self) -> None:
        for k in range(len(self.cores)):
            self._read(k)

    def _read(self, k: int) -> None:
        core = self.cores[k]
        t0 = time.perf_counter()
        for msg in core.messages():
            if msg[0] == "step":
                self._on_step(k, msg[1])
            elif msg[0] == "stats":
                self._stats[k] = msg[1]
            elif msg[0] == "died":
                self._on_death(k, msg[1])
                break
        self._output_s += time.perf_counter() - t0

    def _on_step(self, k: int, step) -> None:
        if step.stats:
            self._stats[k] = step.stats
        changed, stopped = self.outputs.process(step)
        if stopped:
            for rid in stopped:
                self._queue(k, ("abort", rid))
        callers = self._callers
        for state in changed:
            caller = callers.get(state.request_id)
            if caller is None:
                continue
            if state.output is not None:
                self._forget(state.request_id)
                caller.event.set()
            elif state.stream:
                caller.idle = 0.0
                caller.event.set()

    def _forget(self, rid: int) -> None:
        caller = self._callers.pop(rid, None)
        if caller is not None:
            self._load[caller.core] -= caller.cost

    def _on_death(self, k: int, why: str) -> None:
        core = self.cores[k]
        if core.dead is not None:
            return
        core.dead = why.strip().splitlines()[-1] if why.strip() else "the engine core ended"
        if not isinstance(core, CoreThread) and self._loop is not None:
            self._loop.remove_reader(core.fileno())
        self._end_callers(lambda c: c.core == k, "error", f"the engine core stopped: {core.dead}")
        if self.on_core_death is not None and not self._stopped:
            self.on_core_death(k, core.dead)

    def _end_callers(self, which, reason: str, error: str | None) -> None:
        from .output_processor import Finished
        for rid, caller in list(self._callers.items()):
            if which(caller):
                state = caller.state
                if state.output is None:
                    state.finish(reason, self.outputs.stop_sources, done=Finished(reason, error=error))
                self.outputs.states.pop(rid, None)
                self._forget(rid)
                caller.event.set()

    def _why_dead(self) -> str | None:
        return next((c.dead or "the engine core process ended" for c in self.cores if not c.is_alive()), None)

    # -- the end -------------------------------------------------------------------------------
    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine cores. Every stream still open ends (finish_reason "abort"), now."""
        if self._stopped:
            return
        self._stopped = True
        loop = self._loop
        end = lambda: self._end_callers(lambda c: True, "abort", None)     # noqa: E731
        if loop is not None and loop.is_running() and not _on_loop(loop):
            done = threading.Event()
            loop.call_soon_threadsafe(lambda: (end(), done.set()))
            done.wait(timeout)
        else:
            end()
        for core in self.cores:
            if not isinstance(core, CoreThread) and loop is not None and not loop.is_closed():
                try:
                    loop.call_soon_threadsafe(loop.remove_reader, core.fileno())
                except RuntimeError:
                    pass
            core.stop(timeout)

    # kept for the thread design's callers (tests look at the thread)
    @property
    def _thread(self):
        return self.cores[0].thread if isinstance(self.cores[0], CoreThread) else None


class Submitted:
    """One request sent to its core (AsyncLLM.submit): iterate deltas() for its output; abort()
    (or leaving deltas() early) stops it in its core. A handle nobody iterates must be aborted."""
    __slots__ = ("allm", "request_id", "caller")

    def __init__(self, allm: AsyncLLM, request_id: int, caller: _Caller):
        self.allm, self.request_id, self.caller = allm, request_id, caller

    async def deltas(self, keepalive: bool = False):
        """StreamDelta's as the request moves; the last has finished=True (stream=False: only that one).
        keepalive: also None each time the stream has not moved for the AsyncLLM's keepalive_s (what
        the server turns into an SSE comment; watch() must be running)."""
        caller, state = self.caller, self.caller.state
        while True:
            await caller.event.wait()
            caller.event.clear()
            delta = state.delta()
            if delta is None:
                if caller.nudged:
                    caller.nudged = False
                    if keepalive:
                        yield None
                continue
            yield delta
            if delta.finished:
                return

    def abort(self) -> None:
        """Stop the request in its core unless it finished (then: nothing)."""
        allm, rid = self.allm, self.request_id
        if self.caller.state.output is None and rid in allm._callers:
            allm.outputs.states.pop(rid, None)
            allm._forget(rid)
            allm._queue(self.caller.core, ("abort", rid))


def _on_loop(loop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False

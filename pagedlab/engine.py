"""The engine: request -> queue -> slot -> prefill -> decode steps -> stop -> blocks freed -> slot refilled.

    engine = Engine(model, tokenizer, EngineConfig(...))
    engine.add_request([token ids] or "text", SamplingParams(...))   # any time, even between steps
    while engine.has_work():
        for req in engine.step():          # one forward pass over every scheduled request
            ...                            # requests that finished (each handed out once)

Three rooms, one step:

    batch = scheduler.schedule()           # plain Python: who runs, blocks, preemption
    tokens = runner.run(batch)             # the device: pack, forward, sample, one host read
    scheduler.accept(batch, tokens)        # append tokens, stop, finish, free blocks

Overlap (CUDA graphs, greedy decoding): the host runs one step ahead. Step n+1 is launched before
step n is read, so the host's bookkeeping happens while the GPU computes; `_step_overlap` next to
`_step_plain` is the whole idea. A launched but unread token is counted in its request's
`num_in_flight` (never written into its output); the runner's launch knows where it is on the device.

Nothing a request or an interrupt does can wedge the engine: a step that raises is rerun one request
at a time and only the requests that raise alone fail (finish_reason "error"); a KeyboardInterrupt
anywhere in a step leaves every request and block accounted for, and the next step() goes on (the
bookkeeping holds a Ctrl-C until it is whole, the device work does not: interrupts.py).
"""
from __future__ import annotations

import logging
import numbers
import time
import weakref
from collections import deque

import torch

from .config import EngineConfig, max_positions, resolve_admit_group
from .interrupts import deferred, interruptible
from .kv_cache import KVCache, blocks_needed
from .request import Request, RequestStatus
from .runner import ModelRunner
from .sampling import SamplingParams
from .scheduler import Batch, Scheduler
from .trace import StepRecord, Trace
from .validation import show

log = logging.getLogger(__name__)

CPU_KV_POOL_CAP_BYTES = 4 << 30     # on CPU the KV pool never takes more than 4 GiB
SEED_BITS = 31                      # seeds drawn for requests without one: [0, 2**31)


def pool_size(model_config, cfg: EngineConfig, max_model_len: int, device, dtype,
              num_kv_heads: int | None = None) -> int:
    """Number of KV blocks: given, or a fraction of free device memory (CUDA), or on CPU enough
    for every slot at max_model_len (capped at CPU_KV_POOL_CAP_BYTES). num_kv_heads: the heads
    this device holds (fewer under tensor parallelism). On CPU a single block past the cap is
    refused (ValueError naming block_size): the pool would otherwise be that one block."""
    per_block = KVCache.bytes_per_block(model_config.num_layers, cfg.block_size,
                                        num_kv_heads or model_config.num_kv_heads, model_config.head_dim, dtype)
    if device.type != "cuda" and per_block > CPU_KV_POOL_CAP_BYTES:
        raise ValueError(f"block_size={cfg.block_size}: one KV block of this model takes "
                         f"{per_block / 2**30:.1f} GiB, more than the CPU KV pool's cap of "
                         f"{CPU_KV_POOL_CAP_BYTES / 2**30:.0f} GiB; use a smaller block_size (16 is usual)")
    if cfg.num_blocks is not None:
        return cfg.num_blocks
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(1, int(free * cfg.memory_fraction) // per_block)
    want = cfg.max_num_seqs * blocks_needed(max_model_len, cfg.block_size)
    return max(1, min(want, CPU_KV_POOL_CAP_BYTES // per_block))


def kv_cache_for(model, cfg: EngineConfig) -> KVCache:
    """The model's paged KV pool: pool_size blocks of this device's KV heads. Under tensor
    parallelism every rank must hold the same number of blocks: the smallest of them."""
    mc = model.config
    longest = min(max_positions(cfg, mc), model.cos_sin.shape[0])
    heads = getattr(model, "num_kv_heads", mc.num_kv_heads)
    num_blocks = pool_size(mc, cfg, longest, model.device, model.dtype, heads)
    if getattr(model, "tp", None) is not None:
        num_blocks = model.tp.agree_min(num_blocks)
    return KVCache(mc.num_layers, num_blocks, cfg.block_size, heads, mc.head_dim, model.dtype, model.device)


def max_model_len(model, cfg: EngineConfig, num_blocks: int) -> int:
    """The longest sequence this engine holds: asked for (or the model's own limit), and never
    more than the whole KV pool (a sequence that cannot fit would wait forever)."""
    return min(max_positions(cfg, model.config), model.cos_sin.shape[0], num_blocks * cfg.block_size)


def stop_tokens(tokenizer, model_config) -> dict[int, str]:
    """Every token that ends a turn, and where it comes from: the model's own metadata (config.json,
    generation_config.json, GGUF), the chat template's end-of-turn token and the tokenizer's EOS. A
    tokenizer alone is not enough: transformers versions disagree on a GGUF tokenizer's EOS."""
    stops = {t: "model eos" for t in model_config.eos_token_ids}
    for t in getattr(tokenizer, "eos_token_ids", None) or []:
        stops.setdefault(t, "tokenizer eos")
    for t, source in (getattr(tokenizer, "stop_token_ids", None) or {}).items():
        stops.setdefault(t, source)
    return stops


class PhaseTimer:
    """Host seconds per phase of a step, summed over steps: what the host side costs.
    `with timer("schedule"): ...` adds that block's time to totals["schedule"]; then
    `timer.of(batch)` adds it to totals["decode_schedule"] too if the batch had no prompt tokens
    (the decode-only steps' phases apart: a prompt step's launch is an eager forward, tens of ms)."""

    PHASES = ("schedule", "launch", "read", "accept")

    def __init__(self):
        self.totals = (dict.fromkeys(self.PHASES, 0.0) | dict.fromkeys(self.decode_keys(), 0.0)
                       | {"steps": 0})
        self._name, self._t, self._last = None, 0.0, 0.0

    @classmethod
    def decode_keys(cls) -> tuple[str, ...]:
        return tuple(f"decode_{k}" for k in cls.PHASES)

    def __call__(self, name: str) -> "PhaseTimer":
        self._name = name
        return self

    def __enter__(self):
        self._t = time.perf_counter()

    def __exit__(self, *exc):
        self._last = time.perf_counter() - self._t
        self.totals[self._name] += self._last

    def of(self, batch) -> None:
        """The phase just timed was `batch`'s: a decode-only step's counts among those too."""
        if not batch.prefill:
            self.totals["decode_" + self._name] += self._last


class Engine:
    def __init__(self, model, tokenizer, config: EngineConfig | None = None, *,
                 allocator=None, scheduler=None):
        """allocator / scheduler: plug in your own (plugins.py): a factory taking num_blocks, and a
        Scheduler subclass or factory with Scheduler's signature. None: pagedlab's own."""
        self.model, self.tokenizer = model, tokenizer
        self.config = cfg = config or EngineConfig()
        mc = model.config
        self.device, self.dtype = model.device, model.dtype
        self.kv_cache = kv_cache_for(model, cfg)
        self.max_model_len = max_len = max_model_len(model, cfg, self.kv_cache.num_blocks)
        num_blocks = self.kv_cache.num_blocks
        self.stop_token_ids = stop_tokens(tokenizer, mc)
        extra = {} if allocator is None else dict(allocator=allocator)
        self.scheduler = (scheduler or Scheduler)(num_blocks, cfg.block_size, cfg.max_num_seqs, self.max_model_len,
                                   cfg.max_num_batched_tokens, cfg.policy, self.stop_token_ids,
                                   record_views=cfg.trace, prefix_caching=cfg.prefix_caching, **extra)
        self.scheduler.admit_group = resolve_admit_group(cfg.admit_group, self.device)
        self.scheduler.admit_wait = cfg.admit_wait
        spec_rows = 1 + cfg.speculative_config.num_speculative_tokens if cfg.speculative_config else 1
        self.runner = ModelRunner(model, self.kv_cache, cfg.max_num_seqs, max_len, cfg.cuda_graphs, spec_rows)
        # prefix caching hashes the blocks a step fills while the device runs that step
        self.runner.while_running = getattr(self.scheduler, "hash_ahead", None)
        self.speculator = None
        if cfg.speculative_config is not None:      # guess k tokens, verify them in one step (spec/)
            from .spec import make_proposer
            from .spec.speculator import Speculator
            sc = cfg.speculative_config
            self.speculator = self.scheduler.speculator = Speculator(
                make_proposer(sc, model, cfg, self.max_model_len, num_blocks), sc.num_speculative_tokens, sc.adaptive)
        self.trace = Trace(cfg.max_num_seqs, cfg.block_size, num_blocks,
                           max_steps=cfg.max_trace_steps) if cfg.trace else None
        self._traced_endings = weakref.WeakSet()    # finished requests a trace record has named
        self._next_id = 0
        self._seed_rng = torch.Generator().manual_seed(cfg.seed)
        self._t0 = time.perf_counter()
        self.timer = PhaseTimer()
        # overlap the host's work for step n with the GPU running step n+1 (graphs, greedy); a trace
        # shows steps one by one, so it runs the plain loop. Speculating, a step runs ahead only
        # where nobody guesses (Speculator.wants_sync): guesses start from the last token.
        self.overlap = cfg.overlap and self.runner.graphs is not None and not cfg.trace
        self.last_batch: Batch | None = None       # what the last step ran (prompt tokens or not: /metrics)
        self._unread: deque[tuple[Batch, object]] = deque()   # launched, tokens not read yet
        self.num_overlapped = 0         # steps launched before the previous one was read
        self.num_isolated_steps = 0     # steps that raised and were rerun a request at a time

    @property
    def timing(self) -> dict:
        return self.timer.totals

    def reset_timing(self) -> None:
        self.timer = PhaseTimer()

    # -- requests -------------------------------------------------------------
    def check_request(self, prompt, params: SamplingParams | None = None, chat: bool = False):
        """Everything add_request checks, with nothing changed: (token ids, text, params). Raises
        ValueError / TypeError naming the problem."""
        return check_request(prompt, params, chat, self.tokenizer, self.model.config.vocab_size,
                             self.max_model_len, self.pool_hint())

    def pool_hint(self) -> str:
        return (f"limited by the model's max length and the KV pool of {self.kv_cache.num_blocks} blocks x "
                f"{self.config.block_size}")

    def add_request(self, prompt, params: SamplingParams | None = None, chat: bool = False) -> int:
        """Queue a prompt (text, or a list of token ids). Checked completely before anything changes,
        so a bad request raises and running requests are untouched. Returns its id."""
        return self.add_checked(*self.check_request(prompt, params, chat))

    def add_checked(self, ids: list[int], text: str | None, params: SamplingParams,
                    request_id: int | None = None) -> int:
        """Queue what check_request returned (a request without a seed draws one now). request_id:
        given by a front end that numbers requests itself (engine_core.py); default the next free."""
        seed = params.seed if params.seed is not None else self.draw_seed()
        if request_id is None:
            request_id = self._next_id
        elif request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id} is already in use")
        self._next_id = max(self._next_id, request_id + 1)
        req = Request(request_id, ids, params, seed, prompt=text)
        self.scheduler.add(req)
        return req.request_id

    def hand_back(self, finished: list[Request]) -> None:
        """Finished requests a driver took from step() that were not its own (another caller added
        them): the next step() hands them out again. The one way a finished request goes back."""
        self.scheduler.finished[:0] = finished

    def draw_seed(self) -> int:
        """The seed of the next request queued without one: [0, 2**31), from EngineConfig.seed."""
        return int(torch.randint(0, 2**SEED_BITS, (1,), generator=self._seed_rng))

    def abort(self, request_id: int) -> bool:
        """Cancel a request wherever it is: its blocks are freed and the next step() hands it out
        with finish_reason "abort". False if no unfinished request has that id."""
        return self.scheduler.abort(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._unread) or bool(self.scheduler.finished)

    # -- one step -------------------------------------------------------------
    def step(self, into: list | None = None) -> list[Request]:
        """Run one step; returns the requests that finished (each handed out once).

        The step's bookkeeping is one deferred section (interrupts.py): a Ctrl-C during it is
        raised at its end, with every request and block accounted for; the device work inside
        stays interruptible. Interrupted, the step hands out nothing: its finished requests wait
        for the next step(). The one gap left is between this function returning and the caller
        storing the list; `into`, a list of the caller's, gets them appended inside the section,
        so a driver that must never lose one (Ctrl-C may stop it anywhere) passes it."""
        t_start = time.perf_counter()
        with deferred():
            batch = self.last_batch = self._step()
            self.timer.totals["steps"] += 1
            if self.trace is not None and (not batch.empty or self.scheduler.finished):
                self.trace.append(self._record(batch, self.scheduler.finished, t_start))
            if into is not None:
                finished = self.scheduler.take_finished()
                into += finished
                return finished
        return self.scheduler.take_finished()

    def _step(self) -> Batch:
        # (a method, not an attribute holding a bound method: that would be a reference cycle, and
        # `del llm` would keep the KV pool on the GPU until the garbage collector happened to run)
        return self._step_overlap() if self.overlap else self._step_plain()

    def _step_plain(self) -> Batch:
        with self.timer("schedule"):
            batch = self.scheduler.schedule()
        self.timer.of(batch)
        if batch.empty:
            return self._idle(batch)
        try:
            with self.timer("launch"), interruptible():
                tokens = self.runner.run(batch)
        except Exception as e:                # not KeyboardInterrupt: that leaves and is retried
            if getattr(e, "fatal", False):    # the tensor-parallel group stopped: nothing to retry
                raise
            self._isolate(batch, e)
            return batch
        self.timer.of(batch)
        with self.timer("accept"):
            self.scheduler.accept(batch, tokens)
        self.timer.of(batch)
        return batch

    def _step_overlap(self) -> Batch:
        """As _step_plain, but the step is launched BEFORE the previous one is read: the host reads
        step n and does its bookkeeping while the GPU runs step n+1. Only when the next schedule
        cannot depend on step n's tokens (scheduler.can_run_ahead); otherwise step n is read first."""
        while self._unread and not self._can_run_ahead():
            self._read_oldest()
        with self.timer("schedule"):
            batch = self.scheduler.schedule()
        self.timer.of(batch)
        if batch.empty:
            while self._unread:
                self._read_oldest()
            return self._idle(batch)
        ahead = self._unread[-1][1] if self._unread else None
        try:
            with self.timer("launch"), interruptible():
                launch = self.runner.launch(batch, after=ahead)
        except Exception as e:
            if getattr(e, "fatal", False):
                raise
            while self._unread:
                self._read_oldest()
            self._isolate(batch, e)
            return batch
        self.timer.of(batch)
        self.scheduler.advance(batch)            # its tokens are in flight until read
        self._unread.append((batch, launch))
        self.num_overlapped += ahead is not None
        later = launch.read_later and not batch.guessed   # (a verify step: the next one needs it)
        while self._unread and (len(self._unread) > 1 or not later):
            self._read_oldest()                  # step n, while the GPU runs step n+1
        return batch

    def _can_run_ahead(self) -> bool:
        batch, launch = self._unread[-1]
        graphs = self.runner.graphs
        return (len(self._unread) == 1 and launch is self.runner.last and launch.read_later
                and self.scheduler.can_run_ahead(graphs.sizes[-1])
                and (self.speculator is None or not self.speculator.wants_sync(self.scheduler)))

    def _read_oldest(self) -> None:
        batch, launch = self._unread[0]
        with self.timer("read"), interruptible():
            tokens = self.runner.read(launch)       # waits for that step only
        self.timer.of(batch)
        with self.timer("accept"):
            if self.speculator is None:
                self.scheduler.settle(batch, tokens)
            else:                                   # (a verify step: the kept guesses too)
                self.scheduler.accept(batch, tokens, launched=True)
        self.timer.of(batch)
        self._unread.popleft()

    def _isolate(self, batch: Batch, error: Exception) -> None:
        """A step raised. Run its requests one at a time: a request that raises alone finishes
        with finish_reason "error" and the message; the others go on as if nothing happened.
        Said once per step in the log (a step that raises and whose requests then all run alone
        is a bug the outputs do not show)."""
        self.num_isolated_steps += 1
        log.warning("a step of %d requests raised %s: %s; running them one at a time",
                    len(batch.prefill) + len(batch.decode), type(error).__name__, error)
        for part in self.scheduler.split(batch):
            req = (part.prefill + part.decode)[0]
            if req.status is not RequestStatus.RUNNING:
                continue
            try:
                with interruptible():
                    tokens = self.runner.run(part)
            except Exception as e:
                self.scheduler.fail(req, f"{type(e).__name__}: {e}")
                continue
            self.scheduler.accept(part, tokens)

    def _idle(self, batch: Batch) -> Batch:
        if self.scheduler.has_work():
            raise RuntimeError("scheduler made no progress with requests waiting (a bug: please report)")
        return batch

    def _record(self, batch: Batch, finished: list[Request], t_start: float) -> StepRecord:
        """The step as plain data for the trace (slots as they ran this step). `finished`: the
        requests waiting to be handed out; each is named by one record only (a step interrupted
        at its end hands its finished requests out with the next one)."""
        emitted = {}
        for r, i in zip(batch.sampled, batch.out_index):
            if i < len(r.output_token_ids):
                emitted[r.request_id] = r.output_token_ids[i]
        ended = [r for r in finished if r not in self._traced_endings]
        self._traced_endings.update(ended)
        return StepRecord(step=self.trace.next_step, start_s=t_start - self._t0,
                          duration_s=time.perf_counter() - t_start, emitted=emitted,
                          finished=[r.request_id for r in ended], spec=getattr(batch, "spec_log", None) or {},
                          **batch.view)

    def run(self, on_finish=None) -> list[Request]:
        """Step until the queue and the slots are empty."""
        done = []
        while self.has_work():
            finished = self.step(into=done)
            if on_finish:
                for r in finished:
                    on_finish(r)
        return done


def prompt_ids(prompt) -> list[int]:
    """A prompt given as token ids, checked: a list (or tuple, or 1-D integer tensor) of integers.
    Floats, strings, bytes and bools are refused, naming the element and its index."""
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.dtype == torch.bool:
            raise ValueError(f"a prompt tensor must be 1-D with an integer dtype, got {prompt.dim()}-D "
                             f"{prompt.dtype}")
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        raise ValueError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
    if not prompt:
        raise ValueError("empty prompt: give some text or a non-empty list of token ids")
    if set(map(type, prompt)) == {int}:        # the common case, at C speed (a server reads many)
        return list(prompt)
    for i, t in enumerate(prompt):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise ValueError(f"a prompt is a string or a list of token ids: element {i} is "
                             f"{t!r} ({type(t).__name__}), not an integer")
    return [int(t) for t in prompt]


def check_request(prompt, params, chat: bool, tokenizer, vocab: int, max_model_len: int, pool_hint: str = ""):
    """A request checked against an engine's limits (its tokenizer, vocabulary and longest
    sequence), with nothing changed: (token ids, text, params). Raises ValueError / TypeError naming
    the problem. Also what a front end in another process runs before anything is queued."""
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    if params.n != 1:
        raise ValueError(f"SamplingParams.n={params.n}: the engine runs one sample per request; "
                         "LLM.generate and the server expand n into n requests")
    text = None
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("empty prompt: give some text or a non-empty list of token ids")
        text = prompt
        ids = tokenizer.chat(prompt) if chat else tokenizer.encode(prompt, add_bos=True)
    else:
        ids = prompt_ids(prompt)
    bad = (min(ids) < 0 or max(ids) >= vocab) and [(i, t) for i, t in enumerate(ids) if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token id(s) [{', '.join(show(t) for _, t in bad[:5])}] (at index {[i for i, _ in bad[:5]]}) "
                         f"outside the vocabulary [0, {vocab}) of this model")
    bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"stop_token_ids [{', '.join(show(t) for t in bad[:5])}] outside the vocabulary [0, {vocab}) of this model")
    if len(ids) >= max_model_len:
        raise ValueError(
            f"prompt has {len(ids)} tokens but this engine holds at most {max_model_len} per "
            f"sequence (prompt + at least one new token; {pool_hint}). Shorten the "
            f"prompt or give the engine more blocks (num_blocks / memory_fraction).")
    return ids, text, params

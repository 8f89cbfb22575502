"""The engine: request -> queue -> slot -> prefill -> decode steps -> stop -> blocks freed -> slot refilled.

    engine = Engine(model, tokenizer, EngineConfig(...))
    engine.add_request([token ids] or "text", SamplingParams(...))   # any time, even between steps
    while engine.has_work():
        for req in engine.step():          # one forward pass over every scheduled request
            ...                            # requests that finished (see "overlap" below)

One step = schedule (plain Python) -> pack the batch -> model forward (prefill tokens and decode
tokens together) -> sample on the device -> one small host read of the chosen tokens -> update.

Overlap (CUDA graphs, greedy decoding): the host runs one step ahead. A decode step is launched
before the previous one is read, so the host's schedule/pack/update work happens while the GPU
computes, and step() returns the requests that finished in the step it just read. A launched but
unread token is PENDING in its request's output_token_ids until then.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .attention import AttentionMetadata
from .config import EngineConfig
from .kv_cache import KVCache, blocks_needed
from .request import Request, RequestStatus
from .sampling import SamplingParams, sample
from .scheduler import Scheduler
from .trace import StepRecord, Trace


PENDING = -1        # an output token launched but not yet read back (see Engine.step)


@dataclass
class InFlight:
    """A launched step whose tokens the host has not read yet."""
    reqs: list[Request]            # the requests that get a token, in row order
    rows: dict[int, int]           # request id -> row
    out_index: list[int]           # where each one's token goes in its output_token_ids
    replay: object = None          # cuda_graph.Replay (graph steps)
    tokens: list[int] | None = None   # already on the host (eager steps, sampling)


def resolve_device_dtype(device=None, dtype=None):
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    elif isinstance(dtype, str):
        names = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
        dtype = getattr(torch, names.get(dtype, dtype))
    return device, dtype


def pool_size(model_config, cfg: EngineConfig, max_model_len: int, device, dtype) -> int:
    """Number of KV blocks: given, or a fraction of free device memory (CUDA), or on CPU enough
    for every slot at max_model_len (capped at 4 GiB)."""
    if cfg.num_blocks is not None:
        return cfg.num_blocks
    per_block = KVCache.bytes_per_block(model_config.num_layers, cfg.block_size,
                                        model_config.num_kv_heads, model_config.head_dim, dtype)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(1, int(free * cfg.memory_fraction) // per_block)
    want = cfg.max_num_seqs * blocks_needed(max_model_len, cfg.block_size)
    return max(1, min(want, (4 << 30) // per_block))


class Engine:
    def __init__(self, model, tokenizer, config: EngineConfig | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.config = cfg = config or EngineConfig()
        mc = model.config
        self.device, self.dtype = model.device, model.dtype
        self.max_model_len = min(cfg.max_model_len or mc.max_position_embeddings, model.cos_sin.shape[0])
        num_blocks = pool_size(mc, cfg, self.max_model_len, self.device, self.dtype)
        # A sequence can never outgrow the whole pool: cap its length there (never a deadlock).
        self.max_model_len = min(self.max_model_len, num_blocks * cfg.block_size)
        self.kv_cache = KVCache(mc.num_layers, num_blocks, cfg.block_size, mc.num_kv_heads, mc.head_dim,
                                self.dtype, self.device)
        self.scheduler = Scheduler(num_blocks, cfg.block_size, cfg.max_num_seqs,
                                   blocks_needed(self.max_model_len, cfg.block_size),
                                   cfg.max_num_batched_tokens, cfg.policy, self.device,
                                   null_block=self.kv_cache.null_block)
        self.eos_token_ids = set(getattr(tokenizer, "eos_token_ids", None) or mc.eos_token_ids)
        self.trace = Trace(cfg.max_num_seqs, cfg.block_size, num_blocks) if cfg.trace else None
        self._next_id = 0
        self._seed_rng = torch.Generator().manual_seed(cfg.seed)
        self._t0 = time.perf_counter()
        self.requests: dict[int, Request] = {}     # every request not yet returned as finished
        # host-side time per phase of a step (seconds, summed): what the scheduler itself costs
        self.timing = dict(schedule=0.0, pack=0.0, forward_sample=0.0, update=0.0, steps=0)
        self.graphs = None
        self._in_flight: InFlight | None = None
        self.num_overlapped = 0         # steps launched before the previous one was read
        if cfg.cuda_graphs and self.device.type == "cuda":
            from .cuda_graph import DecodeGraphs
            self.graphs = DecodeGraphs(model, self.kv_cache, self.scheduler.block_table.table,
                                       self.max_model_len, min(cfg.max_num_seqs, 512))
        # overlap the host's work for step n with the GPU running step n+1 (graphs, greedy)
        self.overlap = cfg.overlap and self.graphs is not None and not cfg.trace

    # -- requests -------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams | None = None, chat: bool = False) -> int:
        """Queue a prompt (text, or a list of token ids). Checked completely before anything changes,
        so a bad request raises ValueError and running requests are untouched. Returns its id."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        text = None
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError("empty prompt: give some text or a non-empty list of token ids")
            text = prompt
            ids = self.tokenizer.chat(prompt) if chat else self.tokenizer.encode(prompt, add_bos=True)
        else:
            try:
                ids = [int(t) for t in prompt]
            except (TypeError, ValueError):
                raise ValueError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}") from None
            if not ids:
                raise ValueError("empty prompt: give some text or a non-empty list of token ids")
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id(s) {bad[:5]} outside the vocabulary [0, {vocab}) of this model")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens but this engine holds at most {self.max_model_len} per "
                f"sequence (prompt + at least one new token; limited by the model's max length and the "
                f"KV pool of {self.kv_cache.num_blocks} blocks x {self.config.block_size}). Shorten the "
                f"prompt or give the engine more blocks (num_blocks / memory_fraction).")
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**31, (1,), generator=self._seed_rng))
        req = Request(self._next_id, ids, params, seed, prompt=text)
        self._next_id += 1
        self.requests[req.request_id] = req
        self.scheduler.add(req)
        return req.request_id

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    # -- one step -------------------------------------------------------------
    def _pack(self, prefill: list[Request], decode: list[Request]):
        """Build the step's tensors: each prefill's chunk of new tokens, then one token per decode.
        Logits are computed only where a next token is due: the last token of a prefill that
        completes its sequence, and every decode."""
        bs = self.config.block_size
        ids, pos, owner = [], [], []            # per token: id, position, slot of its request
        cu, p_lens, logit_rows = [0], [], []
        for r in prefill:
            start, end = r.num_computed, r.num_computed + r.num_scheduled
            ids += r.all_token_ids[start:end]
            pos += range(start, end)
            owner += [r.slot] * r.num_scheduled
            cu.append(cu[-1] + r.num_scheduled)
            p_lens.append(end)
            if end == r.num_tokens:
                logit_rows.append(cu[-1] - 1)
        d_lens = [r.num_tokens for r in decode]
        ids += [r.last_token_id for r in decode]
        pos += [n - 1 for n in d_lens]
        owner += [r.slot for r in decode]
        logit_rows += range(cu[-1], cu[-1] + len(decode))
        table = self.scheduler.block_table.table
        p_slots, d_slots = [r.slot for r in prefill], [r.slot for r in decode]
        parts = [ids, pos, owner, cu, p_lens, d_lens, p_slots, d_slots, logit_rows]
        flat = torch.tensor([x for part in parts for x in part], dtype=torch.int64)
        flat = flat.to(self.device, non_blocking=True)          # one host -> device copy per step
        ids_t, positions, owner, cu_t, p_lens_t, d_lens_t, p_slots_t, d_slots_t, rows_t = \
            flat.split([len(part) for part in parts])
        # Where each new token's K/V goes, read from the block table on the device.
        slot_mapping = table[owner, positions // bs].long() * bs + positions % bs
        # Only as many block-table columns as the longest sequence uses (kernels never read past).
        p_cols = blocks_needed(max(p_lens, default=1), bs)
        d_cols = blocks_needed(max(d_lens, default=1), bs)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping, num_prefill_tokens=cu[-1],
            prefill_block_table=table[p_slots_t, :p_cols], cu_seqlens_q=cu_t.int(),
            prefill_seq_lens=p_lens_t.int(),
            max_q_len=max((cu[i + 1] - cu[i] for i in range(len(prefill))), default=0),
            decode_block_table=table[d_slots_t, :d_cols], decode_seq_lens=d_lens_t.int(),
            max_seq_len=max(d_lens, default=0))
        return ids_t, positions, meta, rows_t

    def _graph_rows(self, reqs: list[Request]) -> list[tuple]:
        """Host rows for a graph replay: token, position, KV slot, length, slot, and the row of the
        step in flight whose (not yet read) token is this request's input, or -1."""
        bs = self.config.block_size
        pending = self._in_flight.rows if self._in_flight is not None else {}
        rows = []
        for r in reqs:
            n = r.num_tokens
            rows.append((max(r.last_token_id, 0), n - 1, r.blocks[(n - 1) // bs] * bs + (n - 1) % bs,
                         n, r.slot, pending.get(r.request_id, -1)))
        return rows

    def _sample(self, logits, reqs: list[Request]) -> list[int]:
        ps = [r.params for r in reqs]
        if all(p.greedy for p in ps):
            tokens = logits.argmax(dim=-1)
        else:
            dev = logits.device
            tokens = sample(
                logits,
                temperature=torch.tensor([float(p.temperature) for p in ps], device=dev),
                top_k=torch.tensor([p.top_k for p in ps], device=dev),
                top_p=torch.tensor([float(p.top_p) for p in ps], device=dev),
                seeds=torch.tensor([r.seed for r in reqs], device=dev),
                positions=torch.tensor([r.num_tokens for r in reqs], device=dev),
                any_top_filter=any(p.top_k > 0 or p.top_p < 1 for p in ps))
        return tokens.tolist()          # the step's one device -> host read

    def step(self) -> list[Request]:
        """Run one step; returns the requests that finished (and forgets them).

        With overlap (CUDA graphs, greedy decoding) the host does not wait for a decode step
        before launching the next one: step n+1 is launched with step n's tokens still on the
        device (the graph picks them up there), and only THEN is step n read back and its requests
        updated, while the GPU already runs n+1. So a call returns the requests that finished in
        the step before the one it launched. Whenever the next step's schedule could depend on
        step n's tokens (a request about to hit its length limit, requests waiting for a slot,
        sampling that is not greedy, too few free blocks) step n is read first, as without
        overlap."""
        t_start = time.perf_counter()
        finished = []
        if self._in_flight is not None and not self._can_overlap():
            finished += self._read_in_flight()
        t_sched = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.empty:
            if self._in_flight is not None:
                return finished + self._read_in_flight()
            if self.has_work():
                raise RuntimeError("scheduler made no progress with requests waiting (a bug: please report)")
            return finished
        # the requests that get a next token this step (a prefill chunk that does not reach the
        # end of its sequence only fills the cache)
        reqs = [r for r in sched.prefill if r.num_computed + r.num_scheduled == r.num_tokens] + sched.decode
        t_packed = time.perf_counter()
        greedy = all(r.params.greedy for r in reqs)
        replay = None
        if self.graphs is not None and not sched.prefill and self.graphs.batch_size(len(reqs)):
            replay = self.graphs.launch(self._graph_rows(reqs))
            logits = replay.logits
        else:
            assert self._in_flight is None
            input_ids, positions, meta, rows = self._pack(sched.prefill, sched.decode)
            logits = self.model.forward(input_ids, positions, self.kv_cache, meta, rows)
        t_forward = time.perf_counter()
        tokens = None
        if replay is None or not greedy:           # sampled here (before the requests change:
            tokens = self._sample(logits, reqs)     # seeded noise depends on their positions)
            self.timing["forward_sample"] += time.perf_counter() - t_forward
        record = self._record(t_start, sched) if self.trace is not None else None
        for r in sched.prefill + sched.decode:
            r.num_computed += r.num_scheduled
        step = InFlight(reqs, {r.request_id: i for i, r in enumerate(reqs)},
                        [len(r.output_token_ids) for r in reqs], replay, tokens)
        for r in reqs:
            r.output_token_ids.append(PENDING)           # its token, once read (see _read_in_flight)
        if tokens is None and self._in_flight is not None:
            self.num_overlapped += 1
            finished += self._read_in_flight()           # step n, read while the GPU runs this one
        self._in_flight = step
        if tokens is not None or not self.overlap:
            finished += self._read_in_flight()
        if record is not None:
            record.duration_s = time.perf_counter() - t_start
            record.emitted = {r.request_id: r.output_token_ids[i] for r, i in zip(reqs, step.out_index)}
            record.finished = [r.request_id for r in finished]
            self.trace.append(record)
        tm = self.timing
        tm["schedule"] += t_packed - t_sched
        tm["pack"] += t_forward - t_packed      # includes the forward's launches (async on CUDA)
        tm["steps"] += 1                        # (forward_sample and update: in _read_in_flight)
        return finished

    def _can_overlap(self) -> bool:
        """Can the next step be launched before the step in flight is read? Only if it is sure to
        be a graph decode of exactly the running requests, none of which can stop by length in
        the step in flight, with blocks for all of them (no preemption) and nobody waiting."""
        s = self.scheduler
        if not self.overlap or s.waiting or not s.admitted or not self.graphs.batch_size(len(s.admitted)):
            return False
        need = 0
        for r in s.admitted:
            p, n = r.params, r.num_tokens
            if (not p.greedy or n - r.num_computed != 1 or len(r.output_token_ids) >= p.max_new_tokens
                    or n >= self.max_model_len):
                return False
            need += blocks_needed(n, self.config.block_size) - len(r.blocks)
        return need <= s.allocator.num_free

    def _read_in_flight(self) -> list[Request]:
        """Read the step in flight (waiting for it, not for anything launched after it), put each
        token in place of its PENDING entry and stop the requests that are done."""
        step, self._in_flight = self._in_flight, None
        t0 = time.perf_counter()
        tokens = step.tokens if step.tokens is not None else step.replay.read_tokens()
        now = time.perf_counter()
        self.timing["forward_sample"] += now - t0        # waiting for the device
        finished = []
        for r, i, tok in zip(step.reqs, step.out_index, tokens):
            if r.status is RequestStatus.FINISHED:
                continue              # it stopped in the step before; this row ran in vain
            r.output_token_ids[i] = tok
            r.token_times.append(now)
            reason = self._stop_reason(r, tok, i + 1)
            if reason:
                del r.output_token_ids[i + 1:]   # a token launched after the stop, never computed
                r.finish_time = now
                self.scheduler.finish(r, reason)
                del self.requests[r.request_id]
                finished.append(r)
        self.timing["update"] += time.perf_counter() - now
        return finished

    def _stop_reason(self, r: Request, tok: int, num_out: int) -> str | None:
        p = r.params
        if (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            return "stop"
        if num_out >= p.max_new_tokens or len(r.prompt_token_ids) + num_out >= self.max_model_len:
            return "length"
        return None

    def _record(self, t_start, sched) -> StepRecord:
        """The step as plain data (taken before the update: slots as they ran this step)."""
        s = self.scheduler
        phases = {r.request_id: "prefill" for r in sched.prefill} | {r.request_id: "decode" for r in sched.decode}
        num_tokens = sum(r.num_scheduled for r in sched.prefill + sched.decode)
        return StepRecord(
            step=len(self.trace), start_s=t_start - self._t0, duration_s=0.0,
            slot_request=[r.request_id if r else None for r in s.slots],
            slot_phase=[phases.get(r.request_id) if r else None for r in s.slots],
            block_table=[list(r.blocks) if r else [] for r in s.slots],
            pool_used=s.allocator.num_used, pool_total=s.allocator.num_blocks,
            queue=[r.request_id for r in s.waiting], emitted={}, num_tokens=num_tokens,
            preempted=[r.request_id for r in sched.preempted])

    def run(self, on_finish=None) -> list[Request]:
        """Step until the queue and the slots are empty."""
        done = []
        while self.has_work():
            finished = self.step()
            done += finished
            if on_finish:
                for r in finished:
                    on_finish(r)
        return done

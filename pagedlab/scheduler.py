"""The scheduler: a queue of waiting requests, `max_num_seqs` slots, and the block allocator.

It owns every request's state. A step is   batch = schedule()  ->  (the runner runs it)  ->
accept(batch, tokens):

schedule() decides who runs, within a budget of `max_num_batched_tokens` tokens:
  1. every decoding request computes one token and needs room for it; when the pool is out of
     blocks, the newest running request is preempted (blocks freed, back to the front of the queue;
     its tokens are kept and recomputed by a prefill when it returns);
  2. requests whose prefill did not fit in earlier steps continue with their next chunk;
  3. free slots are filled from the queue, while blocks and budget last. A prompt that fits in a
     step's budget waits for a step with room for all of it; a prompt longer than the whole budget
     is prefilled in chunks over several steps (chunked prefill), so no step is ever larger than
     the budget. Blocks for the whole prompt are taken at admission.
     policy "continuous": any free slot, any step.  policy "static": only when every slot is free,
     so a batch starts together and ends with its longest member. With admit_group > 1 continuous
     batching holds the queue, while requests run and no prompt is in the step, until
     min(admit_group, waiting) slots are free or it has held admit_wait steps in a row: prompts
     then share one eager step instead of one each (config.py says why).
accept() appends each new token, finds the requests that stop, finishes them and frees their
blocks; their slots are refilled by the next schedule(). Finished requests wait in `finished`
until the engine hands them out (`take_finished`), so none is lost if a step is interrupted.

Prefix caching (prefix_caching=True, prefix_cache.py): a full block whose tokens are known and
whose K/V are computed is named by its prefix (registered) while the next step runs (hash_ahead),
when a waiting request that starts the same way is looked up, or when its request leaves. A new request takes the registered blocks that match the start of its
sequence (each held by one more request), starts with them computed, and computes only the rest.
Nobody ever writes a shared block: a request writes only at positions >= its num_computed, which
are in blocks it took fresh.

accept = advance + settle. When the host runs one step ahead of the GPU (engine.py, overlap) the
two halves happen apart: advance() when the step is launched (each sampled request counts one more
token in flight, `num_in_flight`), settle() once its tokens are read back (each token appended to
its request's output, one fewer in flight). An output list holds only tokens read back.

Interrupts: schedule, advance, settle, finish, preempt and abort are each one deferred section
(interrupts.atomic): a Ctrl-C that arrives inside one is raised at its end, so a request is never
left half-finished or half-admitted (plain statements are not enough: Python raises a pending
KeyboardInterrupt right after any call returns, `list.append` included).

Plain Python: no tensors here, so it can be taught, drawn and tested without a GPU. The block-table
entries a step changes travel in its batch (`table_edits`); the runner writes them to the device.
"""
from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field

from .interrupts import atomic
from .kv_cache import BlockAllocator, blocks_needed
from .plugged_allocator import plug_allocator
from .prefix_cache import extend_keys
from .request import Request, RequestStatus


@dataclass
class Batch:
    """One step's work, as schedule() decided it."""
    prefill: list[Request] = field(default_factory=list)     # each computes a chunk of its prompt
    decode: list[Request] = field(default_factory=list)      # each computes one token
    preempted: list[Request] = field(default_factory=list)
    sampled: list[Request] = field(default_factory=list)     # who gets a next token, in row order
    # (slot, logical block, physical block) entries of the block table to write before running;
    # re-sent by every batch until one that carried them has run (writing twice is harmless)
    table_edits: list[tuple[int, int, int]] = field(default_factory=list)
    out_index: list[int] = field(default_factory=list)       # where each sampled token goes (advance)
    logprobs: list | None = None        # the runner's TokenLogprob per sampled row (None: nobody asked)
    view: dict | None = None                                 # slots, blocks, queue as they ran (trace)
    guessed: bool = False               # speculating: some decodes bring guesses (spec/speculator.py)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    speculator = None       # spec.speculator.Speculator when speculative decoding is on (engine.py)

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, max_model_len: int,
                 max_num_batched_tokens: int = 8192, policy: str = "continuous",
                 stop_token_ids: dict[int, str] | None = None, record_views: bool = False,
                 prefix_caching: bool = False, allocator=None):
        """allocator: a class or factory taking num_blocks, used instead of BlockAllocator
        (plugged_allocator.plug_allocator checks and wraps it; prefix caching needs a BlockAllocator's API)."""
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.stop_token_ids = dict(stop_token_ids or {})   # token id -> where it comes from (EOS)
        self.record_views = record_views
        self.prefix_caching = prefix_caching
        if allocator is None:
            self.allocator = BlockAllocator(num_blocks)
        else:
            self.allocator = plug_allocator(allocator, num_blocks, prefix_caching)
        self.waiting: deque[Request] = deque()
        self.slots: list[Request | None] = [None] * max_num_seqs
        self.admitted: list[Request] = []     # running requests in the order they got their slot
        self.requests: dict[int, Request] = {}   # every request not finished yet, by id
        self.finished: list[Request] = []     # finished, not yet handed out (take_finished)
        self.table_edits: list[tuple[int, int, int]] = []
        self.unsettled: list[tuple[Batch, list[int] | None]] = []   # advanced, tokens not all in
        self._head_match = None     # (request, prefix_cache.evictions, hits): the queue head's last match
        self._by_first_key: dict[bytes, dict[Request, None]] = {}   # admitted requests by first key

    # -- queue and slots ------------------------------------------------------
    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting) or bool(self.admitted)

    def take_finished(self) -> list[Request]:
        """The requests that finished since the last call (each handed out once)."""
        out, self.finished = self.finished, []
        return out

    # -- blocks ---------------------------------------------------------------
    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Give `req` blocks for `num_tokens` tokens; False if the pool cannot."""
        need = blocks_needed(num_tokens, self.block_size) - len(req.blocks)
        if need <= 0:
            return True
        if need > self.allocator.num_free:
            return False
        blocks = self.allocator.allocate(req.request_id, need)
        for b in blocks:
            self.table_edits.append((req.slot, len(req.blocks), b))
            req.blocks.append(b)
        return True

    def _release(self, req: Request) -> None:
        """Blocks back to the pool, the slot emptied. (Its table entries are not cleared: entries
        past a sequence's length are never read, and the next owner overwrites them.) With prefix
        caching its full blocks are registered first, so they stay cached for later requests."""
        if self.prefix_caching:
            self._register_full_blocks(req)     # may be interrupted: nothing else has changed yet
            self._untrack(req)
        # With prefix caching, last block first: a cached chain is then evicted from its end (LRU
        # first) and its start, the part other requests can share, stays longest (a chain is
        # useless past its first miss).
        self.allocator.free(req.blocks[::-1] if self.prefix_caching else req.blocks)
        req.blocks = []
        req.num_computed = 0
        req.num_registered_blocks = 0
        self.slots[req.slot] = None
        req.slot = None
        self.admitted.remove(req)

    @atomic
    def preempt(self, req: Request) -> None:
        self._release(req)
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    @atomic
    def finish(self, req: Request, reason: str, error: str | None = None) -> None:
        """Stop a request for good: blocks freed, slot emptied, out of the queue; handed out once."""
        if req.slot is not None:
            self._release(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.num_in_flight = 0                   # launched but never read: not part of the output
        req.status, req.finish_reason, req.error = RequestStatus.FINISHED, reason, error
        req.finish_time = time.perf_counter()
        self.requests.pop(req.request_id, None)
        self.finished.append(req)

    @atomic
    def abort(self, request_id: int) -> bool:
        """Remove a request wherever it is (queued, prefilling, decoding, preempted). It is handed
        out once more, with finish_reason "abort". False if it is unknown or already finished."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self.finish(req, "abort")
        return True

    # -- prefix cache -----------------------------------------------------------
    # What it costs when nothing is shared (docs/prefix_caching.md): each full block is hashed ONCE
    # (the key chain is kept on the request), and both the hashing and the naming (registering)
    # run while the device computes a step (hash_ahead, which the runner calls between queuing a
    # step and reading it back), not in schedule(). A block computed by step n is named while
    # step n + 1 runs -- or at once, when a waiting request could take it: a request's blocks can
    # only be taken by one whose first block has the same key, so admitted requests are filed by
    # their first key (`_by_first_key`) and a match that finds its first key there names that
    # request's computed blocks first (`_match_prefix`). With nothing shared, schedule() does one
    # hash and two dict lookups per admission.
    def _track(self, req: Request) -> None:
        """File an admitted request under its first block's key (once that key is known)."""
        if req.block_keys:
            self._by_first_key.setdefault(req.block_keys[0], {})[req] = None

    def _untrack(self, req: Request) -> None:
        if req.block_keys:
            group = self._by_first_key.get(req.block_keys[0])
            if group is not None:
                group.pop(req, None)
                if not group:
                    del self._by_first_key[req.block_keys[0]]

    def _match_prefix(self, req: Request) -> list[int]:
        """The cached blocks that hold the start of req's sequence (prefix_cache.py): changes
        nothing but req.block_keys (its key chain, a memo of its own tokens), the memo of the
        queue head's match (a request waiting at the head is looked up again each step, from where
        its last lookup stopped, unless a key was dropped since), and -- when a running request
        starts with the same block -- the naming of that request's computed blocks.

        At most (num_tokens - 1) // block_size blocks, i.e. only full blocks *before the block of
        the last token*. The last token must be computed whatever the cache holds -- its logits
        give the first new token -- and computing it writes its K/V into its block. When the
        sequence ends exactly at a block boundary and every full block is cached, taking the last
        one as a hit would mean writing that token's K/V into a shared block, which other requests
        are reading. So that block is not taken: it is recomputed into a fresh block of the
        request's own (one block of work; the shared block stays untouched)."""
        last = min(req.num_known_tokens, req.num_tokens - 1)   # (a waiting request has none in flight)
        most = last // self.block_size
        cache = self.allocator.prefix_cache
        keys = req.block_keys
        if most and not keys:
            extend_keys(keys, req.all_token_ids, self.block_size, 1)
        if most and keys[0] in self._by_first_key:            # someone running starts the same way:
            for other in list(self._by_first_key[keys[0]]):  # name its computed blocks now
                self._register_full_blocks(other)
        memo = self._head_match
        before = memo[2] if memo is not None and memo[0] is req and memo[1] == cache.evictions else None
        hits = cache.match(keys, req.all_token_ids, self.block_size, most, hits=before)
        self._head_match = (req, cache.evictions, hits)
        return hits

    def _hash_blocks(self, req: Request, full: int) -> None:
        """Extend req's key chain to its first `full` blocks (their tokens all known)."""
        bs = self.block_size
        keys, prompt = req.block_keys, req.prompt_token_ids
        a, b, p = len(keys) * bs, full * bs, len(prompt)     # the tokens of the blocks not hashed yet,
        tokens = prompt[a:b] + req.output_token_ids[max(a - p, 0):max(b - p, 0)]   # not all of them
        extend_keys(keys, tokens, bs, full, start=a)

    @atomic
    def hash_ahead(self, batch: Batch) -> None:
        """The prefix cache's bookkeeping, while the device runs `batch` (the runner calls this
        after queuing the step, before reading it back): name the blocks the batch's requests
        computed in earlier steps, and hash the blocks this step fills (they are named once
        computed: while the next step runs). One deferred section (a block is named in two dicts)."""
        if not self.prefix_caching:
            return
        bs, running = self.block_size, RequestStatus.RUNNING
        for r in batch.prefill + batch.decode:
            if r.status is not running:
                continue
            if min(r.num_computed, len(r.prompt_token_ids) + len(r.output_token_ids)) // bs > r.num_registered_blocks:
                self._register_full_blocks(r)      # (its own first test, here: most steps fill no block)
            n = r.num_computed + r.num_scheduled
            if n // bs > len(r.block_keys):
                full = min(n, r.num_known_tokens) // bs
                if full > len(r.block_keys):
                    first = not r.block_keys
                    self._hash_blocks(r, full)
                    if first:
                        self._track(r)

    def _register_full_blocks(self, req: Request) -> None:
        """Name req's blocks that are full, computed and whose tokens are all known (a token in
        flight in the overlap loop is not), so later requests can take them. Safe to interrupt
        and to repeat: registering a block twice changes nothing. (PrefixCache.register inlined:
        this runs for every block of every request.)"""
        full = min(req.num_computed, req.num_known_tokens) // self.block_size
        if full <= req.num_registered_blocks:
            return
        keys = req.block_keys
        if full > len(keys):
            first = not keys
            self._hash_blocks(req, full)       # not hashed ahead (a token in flight at the time)
            if first and req.slot is not None:
                self._track(req)
        cache = self.allocator.prefix_cache
        block_of, key_of, blocks = cache.block_of, cache.key_of, req.blocks
        for j in range(req.num_registered_blocks, full):
            key, b = keys[j], blocks[j]
            if key not in block_of and b not in key_of:
                block_of[key] = b
                key_of[b] = key
        req.num_registered_blocks = full

    # -- one step -------------------------------------------------------------
    def make_room(self, req: Request, step: Batch) -> bool:
        """Blocks for req's next token: while the pool is out, preempt the newest running request
        (it has done the least work). False if req itself was preempted. The hook to override for
        another preemption choice (plugins.scheduler_with_make_room plugs in notebook 10's)."""
        while not self._grow(req, req.num_tokens):
            victim = self.admitted[-1]
            self.preempt_in_step(victim, step)
            if victim is req:
                return False
        return True

    def preempt_in_step(self, victim: Request, step: Batch) -> None:
        self.preempt(victim)
        step.preempted.append(victim)
        if victim in step.decode:
            step.decode.remove(victim)

    admit_group, admit_wait = 1, 8   # (EngineConfig's; see the module doc)
    _held = 0                        # steps the queue has been held in a row

    def _holding(self) -> bool:
        """admit_group: does the queue wait in this step (if no prompt is in it anyway)?"""
        if self.admit_group == 1 or not self.admitted or not self.waiting:
            return False
        free = self.slots.count(None)
        return 0 < free < min(self.admit_group, len(self.waiting)) and self._held < self.admit_wait

    @atomic
    def schedule(self) -> Batch:
        self._settle_leftovers()
        step = Batch()
        # 1. decodes: room for each one's next token; oldest first, the newest is preempted.
        caching, bs = self.prefix_caching, self.block_size
        own_room = type(self).make_room is Scheduler.make_room   # (not a plugged preemption choice)
        running, ends = RequestStatus.RUNNING, self.RUN_AHEAD_PAST_ENDS
        for req in list(self.admitted):
            n = req.num_tokens                      # (this loop runs for every request, every step)
            if req.status is not running or n - req.num_computed != 1:
                continue
            if ends and req.num_in_flight and (n - len(req.prompt_token_ids) >= req.params.max_new_tokens
                                               or n >= self.max_model_len):
                continue                            # its last token is in flight: nothing to run (ends_in_flight)
            if (own_room and -(-n // bs) <= len(req.blocks)) or self.make_room(req, step):
                req.num_scheduled = 1               # (its blocks hold its next token already)
                step.decode.append(req)
        if self.speculator is not None:             # guesses for the decodes: one more row each
            self.speculator.plan(self, step)
        budget = self.max_num_batched_tokens - len(step.decode)
        if self.speculator is not None:             # (a guess is a row too)
            budget -= sum(len(r.spec_token_ids) for r in step.decode)
        # 2. prefills that did not finish in earlier steps: their next chunk (blocks already held).
        for req in self.admitted:
            if budget > 0 and len(req.prompt_token_ids) + len(req.output_token_ids) + req.num_in_flight - req.num_computed > 1:
                req.num_scheduled = min(req.num_tokens - req.num_computed, budget)
                budget -= req.num_scheduled
                step.prefill.append(req)
        # 3. fill free slots from the queue.
        fill = self.policy == "continuous" or not self.admitted    # static: only into an empty engine
        if fill and self.admit_group > 1 and not step.prefill:
            if self._holding():
                fill, self._held = False, self._held + 1     # a decode-only step; prompts gather
            elif None in self.slots:
                self._held = 0
        alloc = self.allocator
        while fill and self.waiting and None in self.slots and budget > 0:
            req = self.waiting[0]
            hits = self._match_prefix(req) if caching else []     # cached blocks of its prefix
            need = req.num_tokens - len(hits) * bs                 # tokens left to compute
            if budget < need <= self.max_num_batched_tokens:
                break                  # fits a later step whole: wait (measured faster than splitting)
            fresh = blocks_needed(req.num_tokens, bs) - len(hits)
            if fresh + alloc.num_cached_in(hits) > alloc.num_free:
                break                  # wait for running requests to free blocks
            blocks = alloc.allocate(req.request_id, fresh, shared=hits)
            self.waiting.popleft()
            req.slot = self.slots.index(None)
            self.slots[req.slot] = req
            self.admitted.append(req)
            req.status = RequestStatus.RUNNING
            for b in blocks:
                self.table_edits.append((req.slot, len(req.blocks), b))
                req.blocks.append(b)
            req.num_computed = len(hits) * bs
            req.num_registered_blocks = len(hits)
            if caching:
                self._track(req)
                alloc.prefix_queries += req.num_tokens
                alloc.prefix_hits += req.num_computed
                if not req.num_preemptions:        # as the user is told: hits at its first admission
                    req.num_cached_tokens = req.num_computed
            req.num_scheduled = min(need, budget)
            budget -= req.num_scheduled
            step.prefill.append(req)
        # who gets a next token: a prefill chunk that reaches the end of its sequence, and decodes
        step.sampled = [r for r in step.prefill if r.num_computed + r.num_scheduled == r.num_tokens]
        step.sampled += step.decode
        step.table_edits = list(self.table_edits)
        if self.record_views:
            step.view = self._view(step)
        return step

    @atomic
    def accept(self, batch: Batch, tokens: list[int], launched: bool = False) -> None:
        """After the step ran: append each new token, stop, finish, free. (Speculating, `tokens`
        has a row per guess too: the speculator keeps what verifies, spec/speculator.py.)
        launched: advance() was called at its launch (the overlap loop)."""
        rows = None
        if self.speculator is not None and any(r.spec_token_ids for r in batch.decode):
            tokens, rows = self.speculator.rows(batch, tokens)
        if not launched:
            self.advance(batch, tokens)
        self.settle(batch, tokens)
        if self.speculator is not None:
            self.speculator.settle(self, batch, rows)

    @atomic
    def advance(self, batch: Batch, tokens: list[int] | None = None) -> None:
        """The step is launched: its tokens are in the cache, and each sampled request's next token
        is due (in flight until settle). Block-table edits it carried are written."""
        batch.out_index = [len(r.output_token_ids) + r.num_in_flight for r in batch.sampled]
        self.unsettled.append((batch, tokens))
        for r in batch.prefill + batch.decode:
            r.num_computed += r.num_scheduled
            r.num_scheduled = 0
        for r in batch.sampled:
            r.num_in_flight += 1
        del self.table_edits[:len(batch.table_edits)]

    @atomic
    def settle(self, batch: Batch, tokens: list[int]) -> None:
        """Each token read back appended to its request's output (one fewer in flight); requests
        that are done stop. Steps settle in launch order. Safe to call again for the same batch if
        it was interrupted (what is done stays done: a row whose token is in is skipped)."""
        now, finished, logprobs = time.perf_counter(), RequestStatus.FINISHED, batch.logprobs
        for row, (r, i, tok) in enumerate(zip(batch.sampled, batch.out_index, tokens)):
            if r.status is finished:
                continue                    # stopped (or aborted) before: this row ran in vain
            out = r.output_token_ids
            if len(out) == i:
                out.append(tok)
                r.num_in_flight -= 1
                r.token_times.append(now)
                if logprobs is not None and r.params.logprobs is not None:
                    r.logprobs.append(logprobs[row])
            reason = self.stop_reason(r, i)
            if reason:
                self.finish(r, reason)      # tokens launched after the stop are dropped with it
        self.unsettled = [u for u in self.unsettled if u[0] is not batch]

    def _settle_leftovers(self) -> None:
        """Finish the settling of a step that was interrupted half-way through accept."""
        for batch, tokens in list(self.unsettled):
            if tokens is not None:
                self.settle(batch, tokens)

    def stop_reason(self, r: Request, i: int) -> str | None:
        """Why the request stops at its output token i, or None."""
        tok, p = r.output_token_ids[i], r.params
        if (tok in self.stop_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            r.stop_token_id = tok
            return "stop"
        if i + 1 >= p.max_new_tokens or len(r.prompt_token_ids) + i + 1 >= self.max_model_len:
            return "length"
        return None

    # Run ahead past a request whose last token (by length) is in flight: the next step decodes the
    # others without it (its slot is refilled one step later). False (PAGEDLAB_RUN_AHEAD_PAST_ENDS=0
    # at import): read that step first, as before session 19.
    RUN_AHEAD_PAST_ENDS = os.environ.get("PAGEDLAB_RUN_AHEAD_PAST_ENDS", "1") != "0"

    def ends_in_flight(self, r: Request) -> bool:
        """Is r's last token by length (max_new_tokens or the model's length) already in flight?
        Then it stops when that token is read, whatever the token is: nothing is left to schedule."""
        return r.num_in_flight > 0 and self.RUN_AHEAD_PAST_ENDS and (
            len(r.output_token_ids) + r.num_in_flight >= r.params.max_new_tokens or r.num_tokens >= self.max_model_len)

    def can_run_ahead(self, max_batch: int) -> bool:
        """Is the next step sure to be a decode of exactly the running requests whatever the tokens
        of the step in flight are? (Tokens the device chooses alone -- greedy, or seeded sampling
        without penalties or logprobs; whether the step in flight left its tokens on the device is
        the runner's to say -- blocks for all of them, no free slot a waiting request would take --
        none free, or the queue held for admit_group.) Then it can be launched before
        that step is read. A request whose last token by length is in flight is left out of it
        (ends_in_flight); one that stops on a token in the step in flight runs one spare row. Either
        way its slot is refilled one step later."""
        if (self.waiting and None in self.slots and not self._holding()) or not self.admitted or len(self.admitted) > max_batch:
            return False
        need = rows = 0
        bs, longest, ends = self.block_size, self.max_model_len, self.RUN_AHEAD_PAST_ENDS
        for r in self.admitted:                     # (ends_in_flight inlined: every request, every step)
            p, out = r.params, len(r.output_token_ids) + r.num_in_flight
            n = len(r.prompt_token_ids) + out
            if out >= p.max_new_tokens or n >= longest:
                if ends and r.num_in_flight:
                    continue                        # its last token is in flight: left out
                return False
            if not p.chosen_on_device or n - r.num_computed != 1:
                return False
            need += -(-n // bs) - len(r.blocks)
            rows += 1
        return rows > 0 and need <= self.allocator.num_free

    def fail(self, req: Request, error: str) -> None:
        """A step raised while serving this request: it finishes with finish_reason "error"."""
        if req.status is not RequestStatus.FINISHED:
            self.finish(req, "error", error)

    def split(self, batch: Batch) -> list[Batch]:
        """The batch as one batch per request (to find which request makes a step fail)."""
        return [Batch(prefill=[r] if r in batch.prefill else [], decode=[r] if r in batch.decode else [],
                      sampled=[r] if r in batch.sampled else [], table_edits=batch.table_edits)
                for r in batch.prefill + batch.decode]

    def _view(self, step: Batch) -> dict:
        """The step as plain data, for the trace (slots as they run this step)."""
        phases = {r.request_id: "prefill" for r in step.prefill} | {r.request_id: "decode" for r in step.decode}
        return dict(
            slot_request=[r.request_id if r else None for r in self.slots],
            slot_phase=[phases.get(r.request_id) if r else None for r in self.slots],
            block_table=[list(r.blocks) if r else [] for r in self.slots],
            pool_used=self.allocator.num_used, pool_total=self.allocator.num_blocks,
            queue=[r.request_id for r in self.waiting],
            num_tokens=sum(r.num_scheduled + len(r.spec_token_ids) for r in step.prefill + step.decode),
            preempted=[r.request_id for r in step.preempted],
            block_refs={b: n for b, n in self.allocator.ref_count.items() if n > 1},
            cached_tokens=[r.num_cached_tokens if r else 0 for r in self.slots],
            pool_cached=self.allocator.num_cached,
            prefix_hits=self.allocator.prefix_hits, prefix_queries=self.allocator.prefix_queries)

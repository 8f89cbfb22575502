"""The scheduler: a queue of waiting requests, `max_num_seqs` slots, and the block allocator.

Each step it decides who runs, within a budget of `max_num_batched_tokens` tokens:
  1. every decoding request computes one token and needs room for it; when the pool is out of
     blocks, the newest running request is preempted (blocks freed, back to the front of the queue;
     its tokens are kept and recomputed by a prefill when it returns);
  2. requests whose prefill did not fit in earlier steps continue with their next chunk;
  3. free slots are filled from the queue, while blocks and budget last. A prompt that fits in a
     step's budget waits for a step with room for all of it; a prompt longer than the whole budget
     is prefilled in chunks over several steps (chunked prefill), so no step is ever larger than
     the budget. Blocks for the whole prompt are taken at admission.
     policy "continuous": any free slot, any step.  policy "static": only when every slot is free,
     so a batch starts together and ends with its longest member.
Plain Python: no tensors here, so it can be taught, drawn and tested without a GPU.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .kv_cache import BlockAllocator, BlockTable, blocks_needed
from .request import Request, RequestStatus


@dataclass
class ScheduledStep:
    prefill: list[Request] = field(default_factory=list)     # new tokens: all not yet computed
    decode: list[Request] = field(default_factory=list)      # one token each
    preempted: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, max_blocks_per_seq: int,
                 max_num_batched_tokens: int = 8192, policy: str = "continuous", device="cpu",
                 null_block: int | None = None):
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.allocator = BlockAllocator(num_blocks)
        self.block_table = BlockTable(max_num_seqs, max_blocks_per_seq, device,
                                      num_blocks if null_block is None else null_block)
        self.waiting: deque[Request] = deque()
        self.slots: list[Request | None] = [None] * max_num_seqs
        self.admitted: list[Request] = []     # running requests in the order they got their slot

    # -- queue and slots ------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting) or bool(self.admitted)

    # -- blocks ---------------------------------------------------------------
    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Give `req` blocks for `num_tokens` tokens; False if the pool cannot."""
        need = blocks_needed(num_tokens, self.block_size) - len(req.blocks)
        if need <= 0:
            return True
        if need > self.allocator.num_free:
            return False
        new = self.allocator.allocate(req.request_id, need)
        self.block_table.set(req.slot, len(req.blocks), new)
        req.blocks += new
        return True

    def _release(self, req: Request) -> None:
        """Blocks back to the pool, the slot emptied."""
        self.allocator.free(req.blocks)
        req.blocks = []
        req.num_computed = 0
        self.slots[req.slot] = None
        req.slot = None
        self.admitted.remove(req)

    def preempt(self, req: Request) -> None:
        self._release(req)
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if req.slot is not None:
            self._release(req)

    # -- one step -------------------------------------------------------------
    def schedule(self) -> ScheduledStep:
        step = ScheduledStep()
        # 1. decodes: room for each one's next token; oldest first, the newest is preempted.
        for req in list(self.admitted):
            if req.status is not RequestStatus.RUNNING or req.num_tokens - req.num_computed != 1:
                continue
            while not self._grow(req, req.num_tokens):
                victim = self.admitted[-1]
                self.preempt(victim)
                step.preempted.append(victim)
                if victim in step.decode:
                    step.decode.remove(victim)
                if victim is req:
                    break
            else:
                req.num_scheduled = 1
                step.decode.append(req)
        budget = self.max_num_batched_tokens - len(step.decode)
        # 2. prefills that did not finish in earlier steps: their next chunk (blocks already held).
        for req in self.admitted:
            if budget > 0 and req.num_tokens - req.num_computed > 1:
                req.num_scheduled = min(req.num_tokens - req.num_computed, budget)
                budget -= req.num_scheduled
                step.prefill.append(req)
        # 3. fill free slots from the queue.
        if self.policy == "static" and self.admitted:
            self.block_table.flush()
            return step
        while self.waiting and None in self.slots and budget > 0:
            req = self.waiting[0]
            need = req.num_tokens - req.num_computed
            if budget < need <= self.max_num_batched_tokens:
                break                  # fits a later step whole: wait (measured faster than splitting)
            if blocks_needed(req.num_tokens, self.block_size) > self.allocator.num_free:
                break                  # wait for running requests to free blocks
            self.waiting.popleft()
            req.slot = self.slots.index(None)
            self.slots[req.slot] = req
            self.admitted.append(req)
            req.status = RequestStatus.RUNNING
            self._grow(req, req.num_tokens)
            req.num_scheduled = min(need, budget)
            budget -= req.num_scheduled
            step.prefill.append(req)
        self.block_table.flush()
        return step

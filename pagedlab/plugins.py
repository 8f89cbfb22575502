"""Your pieces in pagedlab's engine: LLM(..., allocator=, scheduler=, decode_kernel=).

    from pagedlab.plugins import scheduler_with_make_room, decode_kernel_from
    llm = LLM(model, allocator=Allocator,                          # notebook 07: a class taking num_blocks
              scheduler=scheduler_with_make_room(make_room),       # notebook 10: who is preempted
              decode_kernel=decode_kernel_from(decode_one))        # notebook 06: the decode loop

allocator      a class or factory taking num_blocks, with allocate(owner, n) -> n block ids (raises
               when out), free(blocks), and num_free or free_list. The scheduler reaches it through
               PluggedAllocator, which checks every answer (n distinct blocks, in range, not in use;
               only blocks in use freed): a wrong allocator is a clear error, not a corrupt cache.
               prefix_caching=True needs the whole prefix-cache API of kv_cache.BlockAllocator.
scheduler      a Scheduler subclass or factory with Scheduler's signature. Overriding
               Scheduler.make_room changes who is preempted; scheduler_with_make_room(fn) plugs in
               notebook 10's make_room(state, seq), run on a copy of the engine's state.
decode_kernel  a function with kernels.decode_attention_torch's signature; decode_kernel_from(fn)
               makes one from notebook 06's decode_one (one head of one sequence: slow, for small
               runs). CUDA graphs are off unless cuda_graphs is given.
Nothing changes when they are not given.
"""
from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from .kv_cache import blocks_needed
from .plugged_allocator import PREFIX_API, PluggedAllocator, plug_allocator  # noqa: F401  (re-exported)
from .scheduler import Scheduler

class _ShadowPool:
    """The pool as make_room sees it: a count of free blocks (frees and allocations only counted)."""

    def __init__(self, real):
        self.num_free, self.num_blocks, self.real = real.num_free, real.num_blocks, real
        self.num_used = self.num_blocks - self.num_free

    def allocate(self, who, n=1):
        if n > self.num_free:
            raise RuntimeError(f"out of blocks: need {n}, {self.num_free} free")
        self.num_free -= n
        return [-1] * n                   # placeholders: the engine allocates the real blocks

    def free(self, blocks):
        refs = self.real.ref_count        # a block another request holds too stays held
        self.num_free += sum(refs.get(b, 1) == 1 for b in blocks if b >= 0)


def scheduler_with_make_room(make_room):
    """A Scheduler whose preemption choice is `make_room(state, seq) -> bool` (notebook 10): it runs
    on a copy of the engine's state (state.running oldest first, state.slots, state.queue,
    state.allocator, state.block_size, state.preempted; seq.rid, seq.blocks, seq.num_tokens), and
    the engine then preempts the requests it put back in the queue, in that order."""

    class LearnerScheduler(Scheduler):
        def make_room(self, req, step) -> bool:
            seqs = {r.request_id: SimpleNamespace(rid=r.request_id, blocks=list(r.blocks),
                                                  num_tokens=r.num_tokens) for r in self.admitted}
            state = SimpleNamespace(
                block_size=self.block_size, running=[seqs[r.request_id] for r in self.admitted],
                slots=[seqs[r.request_id] if r is not None else None for r in self.slots],
                queue=deque(), allocator=_ShadowPool(self.allocator), preempted=[], finished=[])
            ok = make_room(state, seqs[req.request_id])
            victims = [s.rid for s in reversed(state.queue)]        # appendleft: the first is last
            for rid in victims:
                victim = self.requests.get(rid)
                if victim is None or victim not in self.admitted:
                    raise RuntimeError(f"make_room preempted request {rid}, which is not running")
                self.preempt_in_step(victim, step)
            if bool(ok) == (req.request_id in victims):
                raise RuntimeError(f"make_room returned {ok!r} for request {req.request_id}, which it "
                                   f"{'preempted' if req.request_id in victims else 'kept running'}")
            if ok and not self._grow(req, req.num_tokens):
                raise RuntimeError(f"make_room returned True but the pool has {self.allocator.num_free} free "
                                   f"blocks, too few for request {req.request_id}'s next token")
            return bool(ok)

    LearnerScheduler.__qualname__ = LearnerScheduler.__name__ = f"Scheduler_with_{getattr(make_room, '__name__', 'make_room')}"
    return LearnerScheduler


def decode_kernel_from(decode_one):
    """A decode attention kernel (decode_attention_torch's signature) from notebook 06's
    `decode_one(q, k, v, row, length, kv_head, scale)`: one head of one sequence at a time."""

    def decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale, max_seq_len=None):
        b, hq, d = q.shape
        group, bs = hq // k_cache.shape[2], k_cache.shape[1]
        out = q.new_empty(b, hq, d)
        for i, n in enumerate(seq_lens.tolist()):
            row = block_table[i, :blocks_needed(n, bs)].tolist()
            for h in range(hq):
                out[i, h] = decode_one(q[i, h], k_cache, v_cache, row, n, h // group, scale).to(q.dtype)
        return out

    decode_attention.__name__ = f"decode_attention_from_{getattr(decode_one, '__name__', 'decode_one')}"
    return decode_attention

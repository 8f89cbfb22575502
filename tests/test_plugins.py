"""LLM(allocator=, scheduler=, decode_kernel=): the course's pieces plugged into the engine give
pagedlab's own outputs, token for token; wrong pieces are caught (different output or a clear error)."""
import importlib.util
import random
from collections import deque
from pathlib import Path

import pytest

from pagedlab import LLM, SamplingParams
from pagedlab.kv_cache import BlockAllocator
from pagedlab.plugins import PluggedAllocator, decode_kernel_from, scheduler_with_make_room
from pagedlab.scheduler import Scheduler


def _pieces():
    path = Path(__file__).resolve().parents[1] / "notebooks" / "solutions" / "pieces.py"
    spec = importlib.util.spec_from_file_location("pagedlab_course_pieces_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


P = _pieces()
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(3, 500) for _ in range(_rng.randint(10, 30))] for _ in range(6)]
PARAMS = SamplingParams(max_new_tokens=12, ignore_eos=True)
# a small pool: 4 slots, 8 blocks of 8 tokens -- requests are preempted
KW = dict(device="cpu", dtype="float32", max_num_seqs=4, num_blocks=8, block_size=8, show_progress=False)


@pytest.fixture(scope="module")
def ours():
    out = LLM("random:tiny", **KW).generate(PROMPTS, PARAMS)
    assert sum(o.num_preemptions for o in out) > 0      # the pool is small enough to preempt
    return out


def run(**plugins):
    return LLM("random:tiny", **KW, **plugins).generate(PROMPTS, PARAMS)


def same(a, b):
    return [o.token_ids for o in a] == [o.token_ids for o in b] and \
        [o.num_preemptions for o in a] == [o.num_preemptions for o in b]


def test_default_is_pagedlabs_own():
    llm = LLM("random:tiny", **KW)
    assert type(llm.engine.scheduler) is Scheduler
    assert type(llm.engine.scheduler.allocator) is BlockAllocator


def test_solution_pieces_equal_pagedlabs_own(ours):
    llm = LLM("random:tiny", allocator=P.Allocator, scheduler=scheduler_with_make_room(P.make_room),
              decode_kernel=decode_kernel_from(P.decode_one), **KW)
    assert isinstance(llm.engine.scheduler.allocator, PluggedAllocator)
    assert isinstance(llm.engine.scheduler.allocator.inner, P.Allocator)
    assert same(llm.generate(PROMPTS, PARAMS), ours)
    assert llm.engine.scheduler.allocator.num_used == 0          # every block back


@pytest.mark.parametrize("piece", ["allocator", "scheduler", "decode_kernel"])
def test_each_piece_alone(ours, piece):
    plug = dict(allocator=P.Allocator, scheduler=scheduler_with_make_room(P.make_room),
                decode_kernel=decode_kernel_from(P.decode_one))[piece]
    assert same(run(**{piece: plug}), ours)


class TwiceAllocator(P.Allocator):
    """Wrong: hands its first block out again and again."""

    def allocate(self, who, n=1):
        got = super().allocate(who, n)
        self.free_list.appendleft(got[0]) if got[0] not in self.free_list else None
        return got


def test_allocator_handing_a_block_out_twice_is_an_error():
    with pytest.raises(RuntimeError, match="already in use"):
        run(allocator=TwiceAllocator)


def test_allocator_needs_the_prefix_api_for_prefix_caching():
    with pytest.raises(ValueError, match="prefix_caching=True needs"):
        LLM("random:tiny", allocator=P.Allocator, prefix_caching=True, **KW)
    # pagedlab's own allocator class has it
    LLM("random:tiny", allocator=BlockAllocator, prefix_caching=True, **KW)


def test_decode_kernel_ignoring_the_block_table_differs(ours):
    def no_table(q, k, v, row, length, kv_head, scale):
        return P.decode_one(q, k, v, list(range(len(row))), length, kv_head, scale)   # logical = physical
    assert [o.token_ids for o in run(decode_kernel=decode_kernel_from(no_table))] != [o.token_ids for o in ours]


def test_make_room_preempting_the_oldest_differs(ours):
    def oldest(state, seq):
        need = P.blocks_needed(seq.num_tokens, state.block_size) - len(seq.blocks)
        while need > state.allocator.num_free:
            victim = state.running[0]
            state.allocator.free(victim.blocks)
            victim.blocks = []
            state.slots[state.slots.index(victim)] = None
            state.running.remove(victim)
            state.queue.appendleft(victim)
            if victim is seq:
                return False
        if need > 0:
            seq.blocks += state.allocator.allocate(seq.rid, need)
        return True
    assert not same(run(scheduler=scheduler_with_make_room(oldest)), ours)


def test_make_room_lying_is_an_error():
    with pytest.raises(RuntimeError, match="make_room returned True"):
        run(scheduler=scheduler_with_make_room(lambda state, seq: True))


def test_scheduler_subclass(ours):
    class Counting(Scheduler):
        calls = 0

        def make_room(self, req, step):
            Counting.calls += 1
            return super().make_room(req, step)
    assert same(run(scheduler=Counting), ours)
    assert Counting.calls > 0


def test_warm_up_leaves_a_plugged_decode_kernel_alone():
    """The warm-up at load compiles split_kv's variants through the model's decode kernel; a
    learner's kernel (decode_attention_torch's signature, no num_splits) is not Triton's: it is
    left out of that (LLM() on CUDA warms up at load: it raised TypeError there)."""
    from pagedlab.warmup import compile_decode_splits
    kw = dict(KW, attention_backend="triton", cuda_graphs=False)
    assert compile_decode_splits(LLM("random:tiny", **kw).engine)           # Triton's own: variants compiled
    llm = LLM("random:tiny", decode_kernel=decode_kernel_from(P.decode_one), **kw)
    assert compile_decode_splits(llm.engine) == []

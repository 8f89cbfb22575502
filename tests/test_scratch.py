"""Each model's kernels take their scratch memory (split-K partials and counters) from the model's
own pool (kernels/scratch.py): every launch inside LlamaModel.forward, none outside it."""
from types import SimpleNamespace

from helpers import tiny_llm
from pagedlab import SamplingParams
from pagedlab.kernels import scratch


def watch_owner(llm, seen):
    """Replace the model's LM head function with one that records which pool is current."""
    ops = llm.model.kernels
    head = ops.norm_lm_head

    def recorded(*a, **k):
        seen.append(scratch.current())
        return head(*a, **k)
    llm.model.kernels = SimpleNamespace(**{**vars(ops), "norm_lm_head": recorded})


def test_each_model_owns_its_kernels_scratch():
    one, two = tiny_llm(dtype="float32"), tiny_llm(dtype="float32")
    assert one.model.scratch is not two.model.scratch
    seen_one, seen_two = [], []
    watch_owner(one, seen_one)
    watch_owner(two, seen_two)
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    a = one.generate([[3, 4, 5], [6, 7]], sp)
    b = two.generate([[3, 4, 5], [6, 7]], sp)
    assert seen_one and all(p is one.model.scratch for p in seen_one)
    assert seen_two and all(p is two.model.scratch for p in seen_two)
    assert scratch.current() is scratch.DEFAULT                    # back outside the forward
    assert [o.token_ids for o in a] == [o.token_ids for o in b]    # (same weights: same tokens)

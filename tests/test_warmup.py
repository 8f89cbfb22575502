"""The warm-up at load (pagedlab/warmup.py) leaves the engine as it found it: it compiles (on
CUDA), and nothing a user sees changes -- request ids, sampled tokens (seeds drawn from the
engine's seed), the prefix cache and its counters, every block back."""
from helpers import tiny_llm

from pagedlab import SamplingParams
from pagedlab.warmup import warm_up, warmup_waves


def test_waves_fit_the_engine():
    for max_len, seqs, budget in ((64, 1, 8192), (4096, 256, 8192), (3000, 2, 512)):
        waves = warmup_waves(max_len, seqs, budget, 512)
        assert waves and all(len(w) <= seqs for w in waves)
        assert all(1 <= p and p + n <= max_len for w in waves for p, n in w)
        assert any(len(w) > 1 for w in waves) or seqs == 1        # mixed steps where slots allow


def test_warm_up_changes_nothing_a_user_sees():
    kw = dict(max_num_seqs=3, num_blocks=96, block_size=4, max_model_len=64, prefix_caching=True)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [11] * 19, [3, 4]]
    params = [SamplingParams(max_new_tokens=5, ignore_eos=True),
              SamplingParams(max_new_tokens=4, temperature=0.8, ignore_eos=True),    # a drawn seed
              SamplingParams(max_new_tokens=3, temperature=1.0, top_k=5, ignore_eos=True)]
    ref = tiny_llm(**kw).generate(prompts, params)
    llm = tiny_llm(**kw)
    eng = llm.engine
    alloc = eng.scheduler.allocator
    before = (eng._next_id, alloc.prefix_queries, alloc.prefix_hits, alloc.num_free)
    info = warm_up(eng, show_progress=False, force=True)
    assert info["requests"] >= 5 and info["steps"] > info["requests"]
    assert (eng._next_id, alloc.prefix_queries, alloc.prefix_hits, alloc.num_free) == before
    assert len(alloc.prefix_cache) == 0 and alloc.num_used == 0 and not eng.has_work()
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert [o.request_id for o in got] == [o.request_id for o in ref]


def test_warm_up_is_skipped_on_cpu_unless_forced():
    llm = tiny_llm(max_num_seqs=2)
    assert llm.warmup_info == {} and warm_up(llm.engine, show_progress=False) == {}


def test_decode_split_variants_are_launched_for_the_triton_backend():
    """Every split count auto can choose (powers of two up to MAX_SPLITS) runs once at warm-up,
    through the model's own decode kernel (interpreter on the CPU): right answers, no error."""
    import os
    if os.environ.get("TRITON_INTERPRET") != "1":
        import pytest
        pytest.skip("the Triton backend on the CPU needs TRITON_INTERPRET=1 (test_kernels sets it)")
    from pagedlab.kernels.decode_attention import MAX_SPLITS
    from pagedlab.warmup import compile_decode_splits
    llm = tiny_llm(max_num_seqs=2, attention_backend="triton", cuda_graphs=False)
    assert compile_decode_splits(llm.engine) == [2 ** i for i in range(1, MAX_SPLITS.bit_length())]
    torch_llm = tiny_llm(max_num_seqs=2)
    assert compile_decode_splits(torch_llm.engine) == []


def test_prefill_tiers_are_launched_for_the_triton_backend():
    """One prefill attention launch per launch tier (each tier is its own kernel) runs at warm-up,
    through the model's own prefill kernel and launch config: every tier met once, no error."""
    import os
    if os.environ.get("TRITON_INTERPRET") != "1":
        import pytest
        pytest.skip("the Triton backend on the CPU needs TRITON_INTERPRET=1 (test_kernels sets it)")
    from pagedlab.kernels.prefill_attention import PREFILL_CONFIG, prefill_launch_config
    from pagedlab.warmup import compile_prefill_tiers
    import torch
    llm = tiny_llm(max_num_seqs=2, attention_backend="triton", cuda_graphs=False)
    lengths = compile_prefill_tiers(llm.engine)
    met = [prefill_launch_config(PREFILL_CONFIG, n, torch.device("cpu")) for n in lengths]
    assert met == [dict(t) for t in PREFILL_CONFIG.values()]
    assert compile_prefill_tiers(tiny_llm(max_num_seqs=2).engine) == []

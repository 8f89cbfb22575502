"""The engine on the Triton kernels (CPU: the interpreter, fp32) gives the torch backend's tokens."""
from helpers import tiny_llm
from pagedlab import SamplingParams


def test_triton_backend_engine_matches_torch_backend():
    prompts = [[5, 6, 7, 8, 9], [11] * 19, [3, 4]]
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
    kw = dict(max_num_seqs=2, num_blocks=32, block_size=4)
    ref = [o.token_ids for o in tiny_llm(attention_backend="torch", **kw).generate(prompts, sp)]
    for variant in ("naive", "blocked", "gqa", "split_kv"):
        got = [o.token_ids for o in tiny_llm(attention_backend="triton", decode_variant=variant, **kw).generate(prompts, sp)]
        assert got == ref, variant

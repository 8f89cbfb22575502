"""The embedded default model: GGUF loading and greedy generation against transformers' own."""
import pytest
import torch

from conftest import DEMO_PROMPTS
from pagedlab import SamplingParams


@pytest.fixture(scope="module")
def hf_gguf_model(smollm2):
    """transformers' own GGUF loader on the same file (it dequantizes and un-permutes itself)."""
    import transformers
    from transformers import AutoModelForCausalLM
    transformers.logging.set_verbosity_error()
    # `dtype=` since transformers 4.56; before, `torch_dtype=` (an unknown `dtype` reaches the model)
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    kw = {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": torch.float32}
    return AutoModelForCausalLM.from_pretrained(smollm2.tokenizer_dir, gguf_file=smollm2.gguf_file, **kw).eval()


def test_gguf_weights_equal_transformers_loader(smollm2, hf_gguf_model):
    theirs = hf_gguf_model.state_dict()
    for name, ours in smollm2.tensors.items():
        assert name in theirs, name
        assert ours.shape == theirs[name].shape, name
        assert torch.equal(ours, theirs[name].float()), name      # same dequantization, same rows
    assert smollm2.config.tie_word_embeddings == hf_gguf_model.config.tie_word_embeddings


def test_unpermute_is_the_inverse_of_llama_cpp_permute():
    from pagedlab.weights import unpermute_rope_rows
    heads, d, inp = 3, 8, 5
    w = torch.randn(heads * d, inp)
    # llama.cpp's converter: per head, rows (first half, second half) -> interleaved pairs
    permuted = w.reshape(heads, 2, d // 2, inp).swapaxes(1, 2).reshape(heads * d, inp)
    assert torch.equal(unpermute_rope_rows(permuted, heads), w)


def test_greedy_generation_equals_transformers(smollm2_llm, hf_gguf_model):
    tok = smollm2_llm.tokenizer
    prompts = [tok.chat(p) for p in DEMO_PROMPTS]
    outs = smollm2_llm.generate(prompts, SamplingParams(max_new_tokens=48, ignore_eos=True))
    # what the engine stops on: model eos + tokenizer eos + the template's end of turn (<|im_end|>,
    # whatever transformers reports as the tokenizer's eos)
    eos = set(getattr(smollm2_llm.engine, "stop_token_ids", None) or tok.stop_token_ids)
    assert 2 in eos
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf_gguf_model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False,
                                         eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        assert out.token_ids == ref
        # and with EOS honoured, the engine stops exactly where transformers would
        cut = next((i + 1 for i, t in enumerate(ref) if t in eos), len(ref))
        assert smollm2_llm.generate([ids], SamplingParams(max_new_tokens=48))[0].token_ids == ref[:cut]


def test_demo_answers_four(smollm2_llm):
    out = smollm2_llm.chat("What is 2+2?", SamplingParams(max_new_tokens=48))[0]
    assert "4" in out.text and out.finish_reason == "stop"
    assert out.token_ids[-1] == 2                  # <|im_end|>: the end of the assistant's turn


def test_chat_template_ids_equal_transformers(smollm2_llm):
    """tok.chat gives the ids of transformers' own apply_chat_template (benign prompts)."""
    tok = smollm2_llm.tokenizer
    for p in DEMO_PROMPTS:
        ref = tok.hf.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                         tokenize=True)
        assert tok.chat(p) == list(ref["input_ids"] if hasattr(ref, "keys") else ref)

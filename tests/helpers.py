"""Shared test helpers: a transformers model on the same weights, and small engines."""
from __future__ import annotations

import torch


def hf_model(ckpt, dtype=torch.float32, device="cpu"):
    """transformers' LlamaForCausalLM holding exactly the checkpoint's weights."""
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    cfg = LlamaConfig(**ckpt.config.to_hf_dict())
    cfg._attn_implementation = "eager" if dtype == torch.float32 else "sdpa"
    with torch.device("meta"):
        m = LlamaForCausalLM(cfg)
    m = m.to_empty(device=device)
    state = dict(ckpt.tensors)
    if ckpt.config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = m.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all("rotary" in k for k in missing), missing
    # buffers (rotary inv_freq) were on meta: rebuild them
    m.model.rotary_emb = type(m.model.rotary_emb)(cfg).to(device)
    return m.to(dtype).eval()


def tiny_llm(seed=0, **kw):
    from pagedlab import LLM, tiny_config
    from pagedlab.weights import random_checkpoint
    cfg = kw.pop("config", None) or tiny_config()
    return LLM(checkpoint=random_checkpoint(cfg, seed), device="cpu", show_progress=False, **kw)


def random_prompts(n, vocab, rng, lo=1, hi=40):
    return [[int(x) for x in torch.randint(3, vocab, (int(torch.randint(lo, hi, (1,), generator=rng)),),
                                          generator=rng)] for _ in range(n)]

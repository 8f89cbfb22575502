"""transformers' LlamaForCausalLM on pagedlab's weights: the reference every check compares with."""
from __future__ import annotations

import torch


def hf_model(ckpt, dtype=torch.float32, device="cpu", attn_implementation: str | None = None):
    """A transformers LlamaForCausalLM holding exactly `ckpt`'s weights (a pagedlab Checkpoint).
    fp32 uses eager attention (the most literal reference); other dtypes use SDPA."""
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    cfg = LlamaConfig(**ckpt.config.to_hf_dict())
    cfg._attn_implementation = attn_implementation or ("eager" if dtype == torch.float32 else "sdpa")
    with torch.device("meta"):
        m = LlamaForCausalLM(cfg)
    m = m.to_empty(device=device)
    state = dict(ckpt.tensors)
    if ckpt.config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = m.load_state_dict(state, strict=False)
    if unexpected or any("rotary" not in k for k in missing):
        raise RuntimeError(f"weights do not fit LlamaForCausalLM: missing {missing}, unexpected {unexpected}")
    m.model.rotary_emb = type(m.model.rotary_emb)(cfg).to(device)   # its buffers were on meta
    if ckpt.config.tie_word_embeddings:
        m.tie_weights()
    return m.to(dtype).eval()

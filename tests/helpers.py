"""Shared test helpers: a transformers model on the same weights, and small engines."""
from __future__ import annotations

import torch

from pagedlab.reference import hf_model  # noqa: F401  (re-exported for the tests)


def tiny_llm(seed=0, **kw):
    from pagedlab import LLM, tiny_config
    from pagedlab.weights import random_checkpoint
    cfg = kw.pop("config", None) or tiny_config()
    kw.setdefault("device", "cpu")
    return LLM(checkpoint=random_checkpoint(cfg, seed), show_progress=False, **kw)


def random_prompts(n, vocab, rng, lo=1, hi=40):
    return [[int(x) for x in torch.randint(3, vocab, (int(torch.randint(lo, hi, (1,), generator=rng)),),
                                          generator=rng)] for _ in range(n)]

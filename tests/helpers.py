"""Shared test helpers: a transformers model on the same weights, and small engines."""
from __future__ import annotations

import contextlib

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


def mixed_params(free_outputs, rnd, max_tokens=16):
    """One SamplingParams per request, mixing every feature: plain greedy (the overlap loop runs
    ahead of it), a stop string cut from the request's free-running text, logprobs, penalties, and
    seeded sampling with top-k and min-p."""
    from pagedlab import SamplingParams
    params = []
    for o in free_outputs:
        kind = rnd.choice(["greedy", "greedy", "stop", "logprobs", "penalty", "sampled"])
        kw = dict(max_tokens=rnd.randint(4, max_tokens), ignore_eos=True)
        if kind == "stop" and len(o.text) > 6:
            a = rnd.randrange(2, len(o.text) - 2)
            kw["stop"] = [o.text[a:a + 2]]
        elif kind == "logprobs":
            kw["logprobs"] = rnd.randint(0, 4)
        elif kind == "penalty":
            kw.update(presence_penalty=0.5, frequency_penalty=0.5)
        elif kind == "sampled":
            kw.update(temperature=0.8, seed=rnd.randrange(1000), min_p=0.1, top_k=50)
        params.append(SamplingParams(**kw))
    return params


@contextlib.contextmanager
def interrupts_in_finalizers_dropped():
    """For tests that inject KeyboardInterrupt at engine calls: Python cannot raise out of a
    finalizer, so an injected interrupt that lands in one (an unfinished generator closed when it
    is collected) is reported as "Exception ignored" and dropped -- by Python's rules, not a crash.
    Those are counted here (yielded list) instead of printed; any other unraisable exception fails."""
    import gc
    import sys
    dropped, other = [], []

    def hook(u):
        (dropped if isinstance(u.exc_value, KeyboardInterrupt) else other).append(
            f"{u.exc_type.__name__}: {u.exc_value} in {u.object!r}")
    old, sys.unraisablehook = sys.unraisablehook, hook
    try:
        yield dropped
        gc.collect()
    finally:
        sys.unraisablehook = old
    assert not other, other

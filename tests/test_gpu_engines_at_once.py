"""On a GPU: two engines of one process at work at the same moment -- one decoding on a thread while
the others are built in this one, their CUDA graph captures warming up on a side stream meanwhile.
Each model keeps its own split-kernel scratch (kernels/scratch.py: partial sums and arrival
counters), and a capture forbids nothing to the other thread (capture_error_mode="thread_local"),
so the running engine's tokens are its own: what it gives alone."""
import threading

import pytest
import torch

from helpers import tiny_llm
from pagedlab import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# split-K in every fused launch of the tiny model (K = 96 or 160: 3 or 5 programs per output)
SPLIT = {"K_SPLIT": 32, "BLOCK_K": 32}


def engine():
    return tiny_llm(device="cuda", dtype="float32", attention_backend="triton", max_num_seqs=1,
                    kernel_options={"gemv_config": {k: dict(SPLIT) for k in
                                                    ("qkv", "residual", "down", "swiglu", "lm_head")}})


def test_an_engine_decoding_while_others_capture_their_graphs():
    a = engine()
    prompt, sp = [[5, 6, 7, 8]], SamplingParams(max_tokens=400, ignore_eos=True)
    want = a.generate(prompt, sp)[0].token_ids
    assert any(key[0] == "gemv" for key in a.model.scratch)      # the split-K launches ran, a's own
    got, errors = [], []

    def decode():
        try:
            for _ in range(6):
                got.append(a.generate(prompt, sp)[0].token_ids)
        except BaseException as e:                  # noqa: BLE001 -- reported below
            errors.append(e)
    t = threading.Thread(target=decode)
    t.start()
    others = []
    while t.is_alive() and len(others) < 8:
        others.append(engine())                     # graphs captured while `a` decodes
    t.join()
    assert not errors, errors
    assert len(got) == 6 and all(g == want for g in got)
    assert others and others[-1].generate(prompt, sp)[0].token_ids == want     # (same seed: same weights)
    assert all(o.model.scratch is not a.model.scratch for o in others)

import os

import torch

# Triton kernels run on CPU only under its interpreter, which must be chosen before any kernel is
# defined (before pagedlab.kernels is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from pagedlab.course import DEMO_PROMPTS  # noqa: E402,F401  (the tests import it from here)


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct checkpoint (dequantized once per session)."""
    from pagedlab.weights import load_checkpoint
    return load_checkpoint("smollm2", show_progress=False)


@pytest.fixture(scope="session")
def smollm2_llm(smollm2):
    from pagedlab import LLM
    return LLM(checkpoint=smollm2, device="cpu", max_num_seqs=4, max_model_len=512, show_progress=False)

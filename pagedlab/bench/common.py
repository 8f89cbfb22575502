"""What the benchmarks share: timing on the GPU, the device's copy bandwidth, where results go, and
the record of what they ran on.

Every time here is in microseconds, every bandwidth in TB/s of bytes read + written (the names
say so); the GPU-only helpers need CUDA and are only called after require_cuda().
"""
from __future__ import annotations

import datetime
import json
import platform
import subprocess
import sys
from pathlib import Path

import torch

COPY_BYTES = 1 << 30                 # the copy-bandwidth buffer: 1 GiB, several times any L2
RANDOM_TOKEN_LIMIT = 128000          # random prompts use ids below Llama 3's special tokens
# One stream (bench engine, bench step): one request, a 128-token prompt, 256 new tokens (EOS
# ignored); the median of five runs after a warm-up of WARMUP_NEW_TOKENS.
STREAM_PROMPT_LEN = 128
STREAM_NEW_TOKENS = 256
STREAM_RUNS = 5
WARMUP_NEW_TOKENS = 16
STREAM_SEED = 1


def require_cuda(what: str) -> None:
    """Exit with one line when there is no CUDA GPU (the benchmarks measure GPU kernels)."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{what} needs a CUDA GPU")


def median(xs, key=None):
    """The middle element (the upper one of an even count)."""
    xs = sorted(xs, key=key)
    return xs[len(xs) // 2]


def do_bench_us(fn, graph: bool = False, warmup: int = 25, rep: int = 100) -> float:
    """Median microseconds of fn() under triton.testing.do_bench (host launch included), or
    (graph=True) do_bench_cudagraph (the GPU time alone)."""
    import triton.testing
    fn()
    torch.cuda.synchronize()
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=rep) * 1e3
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e3


def event_time_us(fn, calls_per_round: int = 1, rounds: int = 30) -> float:
    """GPU microseconds per call of fn: CUDA events around `calls_per_round` back-to-back calls,
    the median of `rounds` rounds."""
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls_per_round):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls_per_round)
    return median(times)


def graph_time_us(calls, rounds: int = 30) -> float:
    """Microseconds per call of `calls` (a list of closures) captured back to back in one CUDA
    graph, the median of `rounds` replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):               # warm up (compile, allocate) outside the capture
        for f in calls[:2]:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in calls:
            f()
    g.replay()
    torch.cuda.synchronize()
    us = event_time_us(g.replay, rounds=rounds) / len(calls)
    del g
    return us


def copy_bandwidth_tbs(device, nbytes: int = COPY_BYTES) -> float:
    """TB/s of a device-to-device copy of `nbytes`, counting the bytes read and the bytes written
    (median of do_bench): the practical ceiling of a memory-bound kernel."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    us = do_bench_us(lambda: b.copy_(a), warmup=50, rep=300)
    return 2 * nbytes / (us * 1e-6) / 1e12


def kernel_times_us(fn, iters: int) -> dict:
    """{kernel name (60 chars): GPU microseconds per call of fn} from the torch profiler over
    `iters` calls, largest first. (With PDL on, a kernel's time includes its wait for the one
    before, so the times add up to more than the wall time.)"""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per: dict = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        if t:
            per[e.key[:60]] = per.get(e.key[:60], 0) + t / iters
    return dict(sorted(per.items(), key=lambda kv: -kv[1]))


def random_prompt(length: int = STREAM_PROMPT_LEN, seed: int = STREAM_SEED) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, RANDOM_TOKEN_LIMIT, (length,), generator=g).tolist()


def git_commit() -> str | None:
    """The commit of the code that ran, with '+dirty' for local changes (None outside git)."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10)
        if head.returncode:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def metadata(command: str, argv=None) -> dict:
    """What a result was measured on: device, versions, date, commit and the command line."""
    import triton
    meta = dict(date=datetime.date.today().isoformat(), torch=torch.__version__,
                triton=triton.__version__, cuda=torch.version.cuda, python=platform.python_version(),
                commit=git_commit(),
                command=" ".join([command] + list(sys.argv[1:] if argv is None else argv)))
    if torch.cuda.is_available():
        from pagedlab.kernels.launch import sm_count
        dev = torch.device("cuda")
        meta.update(device=torch.cuda.get_device_name(dev),
                    capability=".".join(map(str, torch.cuda.get_device_capability(dev))),
                    sm_count=sm_count(dev))
    try:
        import transformers
        meta["transformers"] = transformers.__version__
    except ImportError:
        pass
    return meta


def device_line(meta: dict) -> str:
    """One line for a table or a figure title."""
    extra = f", transformers {meta['transformers']}" if "transformers" in meta else ""
    return (f"{meta.get('device', 'no GPU')}, torch {meta['torch']}, triton {meta['triton']}{extra}, "
            f"{meta['date']}" + (f", commit {meta['commit']}" if meta.get("commit") else ""))


def out_dir(path) -> Path:
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    return out


def _plain(obj):
    """json.dump's fallback: read-only configs as dicts, anything else as its str()."""
    from collections.abc import Mapping
    if isinstance(obj, Mapping):
        return dict(obj)
    return str(obj)


def write_json(path, obj) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, default=_plain))
    return path

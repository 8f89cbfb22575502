"""How many threads torch uses when the engine runs on the CPU.

torch starts one intra-op thread per core. Decoding on the CPU is a long run of small matrix-vector
products, and each one waits at a barrier for every thread: when another process holds one of the
cores (a shared machine, a second notebook, the test suite), every step waits for a thread that is
not running, and decoding collapses (README, "CPU threads", and docs/cpu_threads.md have the
measurements: on an idle 2-core machine two threads decode 1.3-1.6x faster than one; on a busy one
7-25x slower). One thread's worst case is mild and two threads' a collapse, and the load changes
while a model runs, so an LLM on the CPU uses one thread
-- unless the user chose: OMP_NUM_THREADS (or MKL_NUM_THREADS) in the environment, or
torch.set_num_threads called before the LLM is built. The choice is made once, when an LLM picks
its device; PAGEDLAB_CPU_THREADS=N sets it explicitly.
"""
from __future__ import annotations

import os

import torch

THREADS_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
_TORCH_DEFAULT = torch.get_num_threads()          # what torch chose, read when pagedlab is imported
# (`import pagedlab` imports this module at once; under `python -m pagedlab` the first LLM does: pagedlab/__init__.py)


def cpu_threads_for(device) -> int | None:
    """The thread count to set for an engine on `device`, or None to leave torch's as it is."""
    if getattr(device, "type", str(device)) != "cpu":
        return None
    explicit = os.environ.get("PAGEDLAB_CPU_THREADS")
    if explicit:
        try:
            n = int(explicit)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"PAGEDLAB_CPU_THREADS must be an integer >= 1, got {explicit!r}")
        return n
    if any(os.environ.get(v) for v in THREADS_ENV) or torch.get_num_threads() != _TORCH_DEFAULT:
        return None                                # the user chose
    return 1


def apply_cpu_thread_policy(device) -> None:
    n = cpu_threads_for(device)
    if n is not None and n != torch.get_num_threads():
        torch.set_num_threads(n)

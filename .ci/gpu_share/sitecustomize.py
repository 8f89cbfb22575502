"""Imported by every Python process of `.ci/gpu_notebooks` (on PYTHONPATH): several notebooks share one
GPU, so each process sees at most NB_GPU_CAP_GB of it as free -- an engine sizes its KV pool from
torch.cuda.mem_get_info, and four notebooks each taking half of the free memory would not fit."""
import os

_cap = float(os.environ.get("NB_GPU_CAP_GB") or 0) * 2**30
if _cap:
    import torch

    _mem_get_info = torch.cuda.mem_get_info

    def _capped(device=None):
        free, total = _mem_get_info(device)
        return max(0, min(free, int(_cap) - torch.cuda.memory_reserved(device))), total

    torch.cuda.mem_get_info = _capped

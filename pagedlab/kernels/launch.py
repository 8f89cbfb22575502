"""What the Triton launchers share: facts about the device they launch on, and launch configs.

A launch config (tile sizes, num_warps, num_stages) is a plain mapping. Each kernel module holds
its defaults, tuned on the H200, FROZEN (read-only mappings): nothing changes them at run time. A
caller who wants other values passes a config explicitly (the launchers' `config=` argument, or
`select_kernels(..., decode_config=...)`), built with merge_config() from the defaults and the
values to change. Configs tuned on an H200 are made safe on older GPUs at launch (num_stages()).
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType

import torch

# Triton's interpreter (CPU) has no SMs; launch plans that depend on the SM count (split_kv's
# number of splits) are made as for a small GPU of this many SMs.
CPU_SM_COUNT = 4
# A tensor of at least this many elements needs 64-bit element offsets in a kernel.
INT32_LIMIT = 2 ** 31
# Below Ampere (compute capability 8.0) there are no asynchronous copies to pipeline, and a deep
# software pipeline only costs shared memory (64 KB per SM on a T4): at most this many stages.
AMPERE = (8, 0)
MAX_STAGES_BEFORE_AMPERE = 2


def freeze(config: Mapping) -> Mapping:
    """A read-only copy of a (nested) config mapping."""
    return MappingProxyType({k: freeze(v) if isinstance(v, Mapping) else v for k, v in config.items()})


def to_plain(config):
    """A config as plain dicts (for JSON and printing)."""
    if isinstance(config, Mapping):
        return {k: to_plain(v) for k, v in config.items()}
    return config


def merge_config(default: Mapping, overrides: Mapping | None = None, name: str = "config") -> Mapping:
    """A new frozen config: `default` with the values of `overrides` in its place. Nested
    mappings merge level by level, so {"split_kv": {"BLOCK_N": 64}} changes one value of one
    variant. A name that `default` does not have is an error (a typo would otherwise be ignored)."""
    if overrides is None:
        return freeze(default)
    if not isinstance(overrides, Mapping):
        raise TypeError(f"{name} must be a mapping, got {type(overrides).__name__}")
    merged = dict(default)
    for key, value in overrides.items():
        if key not in default:
            raise ValueError(f"{name} has no entry {key!r}; it has {sorted(default)}")
        if isinstance(default[key], Mapping):
            merged[key] = merge_config(default[key], value, f"{name}[{key!r}]")
        else:
            merged[key] = value
    return freeze(merged)


@functools.lru_cache(maxsize=None)
def capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) compute capability of a CUDA device; (0, 0) for anything else."""
    if device.type != "cuda":
        return (0, 0)
    return tuple(torch.cuda.get_device_capability(device))


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (CPU_SM_COUNT under the interpreter)."""
    if device.type != "cuda":
        return CPU_SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_stages(stages: int, device: torch.device) -> int:
    """A config's software-pipeline depth, capped on GPUs older than Ampere."""
    if device.type == "cuda" and capability(device) < AMPERE:
        return min(stages, MAX_STAGES_BEFORE_AMPERE)
    return stages


def clear_device_cache() -> None:
    """Forget cached device facts (tests that fake a device's capability call this)."""
    capability.cache_clear()
    sm_count.cache_clear()

"""LLM(...)'s keyword arguments: vLLM's names taken where they mean the same, and an unknown name
refused before anything loads, with the nearest known name.

    LLM("smollm2", gpu_memory_utilization=0.8)   # vLLM's name for memory_fraction
    LLM("smollm2", max_num_seq=4)                # TypeError: ... did you mean 'max_num_seqs'?
"""
from __future__ import annotations

import difflib
from dataclasses import fields

from .config import EngineConfig

# vLLM's name -> (pagedlab's EngineConfig field, how the value maps)
VLLM_NAMES = {
    "gpu_memory_utilization": ("memory_fraction", lambda v: v),
    "enable_prefix_caching": ("prefix_caching", lambda v: v),
    "enforce_eager": ("cuda_graphs", lambda v: not v if isinstance(v, bool) else v),
}


def engine_config_kwargs(engine_kwargs: dict, other_names) -> dict:
    """engine_kwargs with vLLM's names renamed to EngineConfig's; a TypeError naming an unknown
    keyword (and the nearest known one), or a name given twice under both spellings.
    other_names: LLM's own keyword arguments (for the suggestion)."""
    config_names = {f.name for f in fields(EngineConfig)}
    out = {}
    for name, value in engine_kwargs.items():
        if name in VLLM_NAMES:
            target, convert = VLLM_NAMES[name]
            if name == "enforce_eager" and not isinstance(value, bool):
                raise TypeError(f"LLM(): enforce_eager must be True or False, got {value!r:.60}")
            if target in engine_kwargs:
                raise TypeError(f"LLM(): {name} is vLLM's name for {target}: give one of them, not both")
            out[target] = convert(value)
        elif name in config_names:
            out[name] = value
        else:
            known = sorted(config_names | set(VLLM_NAMES) | set(other_names))
            guess = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hint = f": did you mean {guess[0]!r}?" if guess else " (see help(pagedlab.EngineConfig))"
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r}{hint}")
    return out

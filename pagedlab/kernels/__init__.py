"""Kernels: each file holds one kernel family as a plain-torch reference (also the CPU path),
a Triton kernel, and a launcher that picks between them.

Shapes used everywhere (T = packed tokens, B = sequences, Hq/Hkv = query/KV heads, D = head dim):
  k_cache, v_cache : [num_blocks, block_size, Hkv, D]  one layer's paged pool
  block_table      : [B, max_blocks_per_seq] int32     logical block -> physical block
  seq_lens         : [B] int32                         tokens of context, including new ones
  slot_mapping     : [T] int64                         physical slot (block * block_size + offset)
"""

import functools
import importlib
from types import SimpleNamespace

# The kernel functions the model calls, by file. RMSNorm, RoPE, the K/V store and SiLU-and-mul
# (rmsnorm.py, rope.py, kv_store.py, activation.py) are not called directly: the functions of
# gemv.py fuse them into the matmuls at one token and compose them around cuBLAS otherwise.
KERNEL_FAMILIES = {
    "norm_qkv_rope_store": "gemv", "linear_residual": "gemv", "norm_swiglu": "gemv",
    "norm_lm_head": "gemv",
    "prefill_attention": "prefill_attention", "decode_attention": "decode_attention",
}


def select_kernels(backend: str = "torch", decode_variant: str = "auto", *,
                   decode_config=None, prefill_config=None, gemv_config=None,
                   pdl: str | None = None) -> SimpleNamespace:
    """The kernel functions the model calls, from one backend: "torch" (the references, any
    device) or "triton" (the fused/paged kernels; CUDA, or CPU under TRITON_INTERPRET=1).

    For "triton", the launch settings are bound to the functions (functools.partial), so the
    model calls them as it calls the references:
      decode_variant  naive | blocked | gqa | split_kv | auto (decode_attention.py)
      decode_config   changes to decode_attention.DECODE_CONFIG, e.g. {"split_kv": {"BLOCK_N": 64}}
      prefill_config  changes to prefill_attention.PREFILL_CONFIG (one entry per length tier),
                      e.g. {"long": {"num_stages": 2}}
      gemv_config     changes to gemv.GEMV_CONFIG, e.g. {"residual": {"num_warps": 8}}
      pdl             "off" | "late" | None (the device's default; pdl.py)
    Each config is merged into the module's defaults (launch.merge_config: unknown names are an
    error) and the defaults themselves never change. The torch references take no launch
    settings: they are checked, and not used. The result's `options` holds the merged settings."""
    from .decode_attention import DECODE_CONFIG, VARIANTS
    from .gemv import CONFIG_KEYS, GEMV_CONFIG
    from .launch import merge_config
    from .pdl import check_mode
    from .prefill_attention import PREFILL_CONFIG

    if backend not in ("torch", "triton"):
        raise ValueError(f"kernel backend must be 'torch' or 'triton', got {backend!r}")
    if decode_variant not in VARIANTS + ("auto",):
        raise ValueError(f"decode variant must be one of {VARIANTS + ('auto',)}, got {decode_variant!r}")
    options = dict(decode_variant=decode_variant,
                   decode_config=merge_config(DECODE_CONFIG, decode_config, "decode_config"),
                   prefill_config=merge_config(PREFILL_CONFIG, prefill_config, "prefill_config"),
                   gemv_config=merge_config(GEMV_CONFIG, gemv_config, "gemv_config"),
                   pdl=pdl if pdl is None else check_mode(pdl))
    fns = {}
    for fn, module in KERNEL_FAMILIES.items():
        mod = importlib.import_module(f"{__name__}.{module}")
        impl = getattr(mod, f"{fn}_{backend}", None)
        if impl is None:
            raise NotImplementedError(f"pagedlab.kernels.{module} has no {fn}_{backend}")
        fns[fn] = impl
    if backend == "triton":
        fns["decode_attention"] = functools.partial(
            fns["decode_attention"], variant=decode_variant, config=options["decode_config"], pdl=pdl)
        fns["prefill_attention"] = functools.partial(fns["prefill_attention"],
                                                     config=options["prefill_config"])
        for fn, key in CONFIG_KEYS.items():
            fns[fn] = functools.partial(fns[fn], config=options["gemv_config"][key], pdl=pdl,
                                        fp8_config=options["gemv_config"][key + "_fp8"])
        fns["linear_residual"] = functools.partial(fns["linear_residual"],   # K > N: its own tiles
                                                   down_config=options["gemv_config"]["down"],
                                                   down_fp8_config=options["gemv_config"]["down_fp8"])
    extra = {}
    key = CONFIG_KEYS["norm_qkv_rope_store"]
    attn_on = any(options["gemv_config"][k].get("ATTN") for k in (key, key + "_fp8"))
    if backend == "triton" and decode_variant in ("auto", "gqa") and attn_on:
        # decode attention inside the QKV launch (gemv.py, the config's ATTN; off by default: the
        # model then takes its two launches as before): used by the model only while
        # `attend_fuses` still names the two functions it replaces (a learner's own decode
        # attention or QKV, plugged in later, turns it off)
        from .gemv import norm_qkv_rope_store_attend_triton
        extra["norm_qkv_rope_store_attend"] = functools.partial(
            norm_qkv_rope_store_attend_triton, config=options["gemv_config"][key], pdl=pdl,
            fp8_config=options["gemv_config"][key + "_fp8"], decode_attention=fns["decode_attention"])
        extra["attend_fuses"] = (fns["norm_qkv_rope_store"], fns["decode_attention"])
    return SimpleNamespace(backend=backend, options=options, **fns, **extra)

"""Kernels: each file holds one kernel family as a plain-torch reference (also the CPU path),
a Triton kernel, and a launcher that picks between them.

Shapes used everywhere (T = packed tokens, B = sequences, Hq/Hkv = query/KV heads, D = head dim):
  k_cache, v_cache : [num_blocks, block_size, Hkv, D]  one layer's paged pool
  block_table      : [B, max_blocks_per_seq] int32     logical block -> physical block
  seq_lens         : [B] int32                         tokens of context, including new ones
  slot_mapping     : [T] int64                         physical slot (block * block_size + offset)
"""

from types import SimpleNamespace

# The kernel functions the model calls, by file. RMSNorm, RoPE, the K/V store and SiLU-and-mul
# (rmsnorm.py, rope.py, kv_store.py, activation.py) are not called directly: the functions of
# gemv.py fuse them into the matmuls at one token and compose them around cuBLAS otherwise.
KERNEL_FAMILIES = {
    "norm_qkv_rope_store": "gemv", "linear_residual": "gemv", "norm_swiglu": "gemv",
    "norm_lm_head": "gemv",
    "prefill_attention": "prefill_attention", "decode_attention": "decode_attention",
}


def select_kernels(backend: str = "torch", decode_variant: str = "auto") -> SimpleNamespace:
    """The kernel functions the model calls, from one backend: "torch" (the references, any
    device) or "triton" (the fused/paged kernels; CUDA, or CPU under TRITON_INTERPRET=1)."""
    import functools
    import importlib

    if backend not in ("torch", "triton"):
        raise ValueError(f"kernel backend must be 'torch' or 'triton', got {backend!r}")
    fns = {}
    for fn, module in KERNEL_FAMILIES.items():
        mod = importlib.import_module(f"{__name__}.{module}")
        impl = getattr(mod, f"{fn}_{backend}", None)
        if impl is None:
            raise NotImplementedError(f"pagedlab.kernels.{module} has no {fn}_{backend}")
        fns[fn] = impl
    if backend == "triton":
        fns["decode_attention"] = functools.partial(fns["decode_attention"], variant=decode_variant)
    return SimpleNamespace(backend=backend, **fns)

"""KV-store: write one step's new K/V rows (all sequences at once) into the paged cache.

After the QKV projection and RoPE, every new token's K and V [Hkv, D] must land in its slot of the
paged pool: slot = physical_block * block_size + offset, computed on the host by the runner
(runner.kv_slots: slot_mapping). The tokens of one step belong to many sequences whose pages are
scattered, so this is a scatter: one program per token copies its K row and V row to the slot (one
launch for the whole batch, for both caches). The padding rows of a CUDA-graph batch store into
the pool's null block, which no sequence reads (kv_cache.KVCache.null_block). The Triton kernel
also skips a negative slot (stores nothing); the torch reference takes only slots >= 0.

kv_store_torch is the reference; kv_store_triton has the same signature (in place, returns None).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def kv_store_torch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D]; slot_mapping: [T] physical slot of each token (block * block_size + offset)."""
    num_blocks, block_size, hkv, d = k_cache.shape
    k_cache.view(num_blocks * block_size, hkv, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(num_blocks * block_size, hkv, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


@triton.jit
def _kv_store_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, HKV, stride_kt, stride_kh,
                     stride_vt, stride_vh, stride_kcs, stride_kch, stride_vcs, stride_vch,
                     D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    slot_2d = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.int64) + slot
    mask = (offs_h[:, None] < HKV) & (offs_d[None, :] < D) & (slot_2d >= 0)
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(kc_ptr + slot * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :],
             k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + slot * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :],
             v.to(vc_ptr.dtype.element_ty), mask=mask)


def kv_store_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Same contract as kv_store_torch (one launch for all T tokens, K and V together)."""
    t, hkv, d = k.shape
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert k_cache.stride(0) == k_cache.shape[1] * k_cache.stride(1)   # slots are evenly spaced
    assert v_cache.stride(0) == v_cache.shape[1] * v_cache.stride(1)
    if t == 0:
        return
    _kv_store_kernel[(t,)](k, v, k_cache, v_cache, slot_mapping, hkv,
                           k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                           k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
                           D=d, BLOCK_H=triton.next_power_of_2(hkv),
                           BLOCK_D=triton.next_power_of_2(d), num_warps=4)

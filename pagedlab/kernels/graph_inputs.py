"""A decode graph's first launch: every row's step inputs, gathered on the device.

A replay (cuda_graph.py) starts from its static buffer `inputs` [N, 6] int64 -- per row: token,
position, KV slot, length, slot of the request, index of the row's token in `token_src` (the host's
token or the one the previous replay chose) -- and the forward needs, per row:

    token id      token_src[inputs[:, 5]]
    position      inputs[:, 1]                    (int64)
    KV slot       inputs[:, 2]                    (int64)
    length        inputs[:, 3] as int32           (decode attention's seq_lens)
    block table   table[inputs[:, 4], :]          (the request's row of the engine's table)
    embedding     embed[token id, :]              (the residual stream's first value)

As torch ops those are 4-6 small launches (a cast, two index_selects, the embedding gather, and at
more than one row two strided copies), each a few microseconds at batch 1 where the whole step is
~0.9 ms. decode_inputs_triton does them in ONE launch, a program per row. The values are copies,
bit for bit the torch composition's (decode_inputs_torch, the reference).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

COLS = 6                    # the columns of cuda_graph.inputs
BLOCK_COLS = 1024           # block-table entries / embedding values per step of a program's loops


def decode_inputs_torch(inputs: torch.Tensor, token_src: torch.Tensor, table: torch.Tensor,
                        embed: torch.Tensor):
    """inputs [B, 6] int64, token_src [S] int64, table [R, W] int32, embed [V, H]. Returns
    (token ids [B] int64, positions [B] int64, KV slots [B] int64, lengths [B] int32,
    block-table rows [B, W] int32, embeddings [B, H])."""
    ids = token_src.index_select(0, inputs[:, 5])
    return (ids, inputs[:, 1].contiguous(), inputs[:, 2].contiguous(), inputs[:, 3].to(torch.int32),
            table.index_select(0, inputs[:, 4]), embed[ids])


@triton.jit
def _decode_inputs_kernel(x_ptr, src_ptr, table_ptr, emb_ptr, ids_ptr, pos_ptr, slot_ptr, len_ptr,
                          bt_ptr, h_ptr, W, H, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    row = x_ptr + i * 6
    tok = tl.load(src_ptr + tl.load(row + 5))
    tl.store(ids_ptr + i, tok)
    tl.store(pos_ptr + i, tl.load(row + 1))
    tl.store(slot_ptr + i, tl.load(row + 2))
    tl.store(len_ptr + i, tl.load(row + 3).to(tl.int32))
    slot = tl.load(row + 4)
    offs = tl.arange(0, BLOCK)
    for c in range(0, W, BLOCK):
        m = c + offs < W
        tl.store(bt_ptr + i * W + c + offs, tl.load(table_ptr + slot * W + c + offs, mask=m), mask=m)
    for c in range(0, H, BLOCK):
        m = c + offs < H
        tl.store(h_ptr + i * H + c + offs, tl.load(emb_ptr + tok * H + c + offs, mask=m), mask=m)


def decode_inputs_triton(inputs: torch.Tensor, token_src: torch.Tensor, table: torch.Tensor,
                         embed: torch.Tensor):
    """Same contract as decode_inputs_torch, one launch (a program per row). Every index must be
    in range (the graph's rows always are: padding rows point at the table's null row, the null
    KV block and their own token)."""
    b = inputs.shape[0]
    assert inputs.shape[1] == COLS and inputs.is_contiguous() and token_src.is_contiguous()
    assert table.is_contiguous() and embed.is_contiguous()
    dev = inputs.device
    ids = torch.empty(b, dtype=torch.int64, device=dev)
    pos = torch.empty(b, dtype=torch.int64, device=dev)
    slots = torch.empty(b, dtype=torch.int64, device=dev)
    lens = torch.empty(b, dtype=torch.int32, device=dev)
    w, h = table.shape[1], embed.shape[1]
    bt = torch.empty((b, w), dtype=table.dtype, device=dev)
    x = torch.empty((b, h), dtype=embed.dtype, device=dev)
    if b:
        _decode_inputs_kernel[(b,)](inputs, token_src, table, embed, ids, pos, slots, lens, bt, x, w, h,
                                    BLOCK=min(BLOCK_COLS, triton.next_power_of_2(max(w, h))), num_warps=4)
    return ids, pos, slots, lens, bt, x

"""Kernels: each file holds one kernel family as a plain-torch reference (also the CPU path),
a Triton kernel, and a launcher that picks between them.

Shapes used everywhere (T = packed tokens, B = sequences, Hq/Hkv = query/KV heads, D = head dim):
  k_cache, v_cache : [num_blocks, block_size, Hkv, D]  one layer's paged pool
  block_table      : [B, max_blocks_per_seq] int32     logical block -> physical block
  seq_lens         : [B] int32                         tokens of context, including new ones
  slot_mapping     : [T] int64                         physical slot (block * block_size + offset)
"""

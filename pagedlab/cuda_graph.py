"""CUDA graphs for decode steps.

A decode step of Llama-3.2-1B launches ~200 small kernels; at batch 1 launching them from Python
costs more than running them. A CUDA graph records the launches once (per batch size) and replays
them with one call. Everything a graph reads lives in static buffers that we refill before each
replay; the kernels' launch shapes are fixed at capture: batch size (padded up to the nearest
captured size) and the block-table width (the engine's longest sequence). Padded rows point at a
"null" KV block that no request owns, so they compute harmless garbage that nobody reads.
"""
from __future__ import annotations

import torch

from .attention import AttentionMetadata

DEFAULT_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class DecodeGraphs:
    def __init__(self, model, kv_cache, block_table_width: int, max_seq_len: int, max_batch: int,
                 null_block: int, sizes=DEFAULT_SIZES):
        self.model, self.kv_cache = model, kv_cache
        self.sizes = sorted({s for s in sizes if s < max_batch} | {max_batch})
        self.block_size = kv_cache.block_size
        self.null_block, self.max_seq_len = null_block, max_seq_len
        n, dev = self.sizes[-1], model.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), null_block * self.block_size, dtype=torch.int64, device=dev)
        self.block_table = torch.full((n, block_table_width), null_block, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.graphs, self.logits = {}, {}
        self.pool = None
        self._capture_all()

    def _meta(self, b):
        dev = self.model.device
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:b], num_prefill_tokens=0,
            prefill_block_table=self.block_table[:0], cu_seqlens_q=torch.zeros(1, dtype=torch.int32, device=dev),
            prefill_seq_lens=self.seq_lens[:0], max_q_len=0,
            decode_block_table=self.block_table[:b], decode_seq_lens=self.seq_lens[:b],
            max_seq_len=self.max_seq_len)

    def _run(self, b):
        return self.model.forward(self.input_ids[:b], self.positions[:b], self.kv_cache, self._meta(b))

    def _capture_all(self):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in reversed(self.sizes):       # largest first: later graphs reuse its memory pool
                for _ in range(2):
                    self._run(b)                 # warm up: compile kernels, fill caches
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool, stream=stream):
                    self.logits[b] = self._run(b)
                if self.pool is None:
                    self.pool = g.pool()
                self.graphs[b] = g
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def can_run(self, n: int) -> bool:
        return 0 < n <= self.sizes[-1]

    def run(self, packed: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
        """packed [3, n] on the device: token ids, sequence lengths, slots. Returns logits [n, V]."""
        n = packed.shape[1]
        b = next(s for s in self.sizes if s >= n)
        ids, lens, slots = packed
        bs = self.block_size
        self.input_ids[:n] = ids
        self.seq_lens[:n] = lens
        pos = self.positions[:n]
        torch.sub(lens, 1, out=pos)
        torch.index_select(block_table, 0, slots, out=self.block_table[:n])
        self.slot_mapping[:n] = self.block_table[:n].gather(1, (pos // bs)[:, None])[:, 0].long() * bs + pos % bs
        if n < b:                                # padding rows -> the null block
            self.input_ids[n:b] = 0
            self.seq_lens[n:b] = 1
            self.positions[n:b] = 0
            self.block_table[n:b] = self.null_block
            self.slot_mapping[n:b] = self.null_block * bs
        self.graphs[b].replay()
        return self.logits[b][:n]

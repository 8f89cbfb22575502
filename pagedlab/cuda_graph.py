"""CUDA graphs for decode steps.

A decode step of Llama-3.2-1B launches ~200 small kernels; at batch 1 launching them from Python
costs more than running them. A CUDA graph records the launches once (per batch size) and replays
them with one call. Everything a graph reads lives in static buffers refilled before each replay:

    inputs [N, 5] int64 : per row  token id, position, KV slot, sequence length, slot of the request
    block table         : the engine's own device table (its address never changes); the graph
                          gathers the rows it needs itself

so a step costs one host -> device copy, one replay, and one device -> host copy of the chosen
tokens (greedy argmax runs inside the graph). Launch shapes are fixed at capture: the batch
(padded up to the nearest captured size) and the block-table width. Padding rows point at the
"null" KV block and the table's null row, so they compute harmless garbage nobody reads.
"""
from __future__ import annotations

import torch

from .attention import AttentionMetadata

DEFAULT_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class DecodeGraphs:
    def __init__(self, model, kv_cache, block_table: torch.Tensor, max_seq_len: int, max_batch: int,
                 sizes=DEFAULT_SIZES):
        self.model, self.kv_cache, self.table = model, kv_cache, block_table
        self.sizes = sorted({s for s in sizes if s < max_batch} | {max_batch})
        self.max_seq_len = max_seq_len
        self.null_row = block_table.shape[0] - 1
        self.inputs = torch.zeros(self.sizes[-1], 5, dtype=torch.int64, device=model.device)
        self.inputs[:] = torch.tensor(self.padding_row(), dtype=torch.int64)
        # the host side of the copy: pinned (page-locked), so the copy is a plain async DMA
        self.host_inputs = torch.zeros(self.sizes[-1], 5, dtype=torch.int64, pin_memory=True)
        self._host_np = self.host_inputs.numpy()
        self._host_np[:] = self.padding_row()
        self.graphs, self.logits, self.tokens = {}, {}, {}
        self.pool = None
        self._capture_all()

    def padding_row(self) -> list[int]:
        null = self.kv_cache.null_block
        return [0, 0, null * self.kv_cache.block_size, 1, self.null_row]

    def _run(self, b):
        x = self.inputs[:b]
        dev = self.model.device
        seq_lens = x[:, 3].to(torch.int32)
        meta = AttentionMetadata(
            slot_mapping=x[:, 2].contiguous(), num_prefill_tokens=0,
            prefill_block_table=self.table[:0], cu_seqlens_q=torch.zeros(1, dtype=torch.int32, device=dev),
            prefill_seq_lens=seq_lens[:0], max_q_len=0,
            decode_block_table=self.table.index_select(0, x[:, 4]), decode_seq_lens=seq_lens,
            max_seq_len=self.max_seq_len)
        return self.model.forward(x[:, 0].contiguous(), x[:, 1].contiguous(), self.kv_cache, meta,
                                  greedy=True)

    def _capture_all(self):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in reversed(self.sizes):       # largest first: later graphs reuse its memory pool
                for _ in range(2):
                    self._run(b)                 # warm up: compile kernels, fill caches
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool, stream=stream):
                    self.logits[b], self.tokens[b] = self._run(b)
                if self.pool is None:
                    self.pool = g.pool()
                self.graphs[b] = g
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def batch_size(self, n: int) -> int | None:
        """The captured size that holds n rows (None if none does)."""
        return next((s for s in self.sizes if s >= n), None) if n > 0 else None

    def run(self, rows: list) -> tuple:
        """rows: n <= max batch tuples (token, position, KV slot, length, slot). Pads them to the
        captured size b, copies them to the device (one copy) and replays b's graph.
        Returns (logits [n, V], greedy tokens [n]) on the device."""
        n = len(rows)
        b = self.batch_size(n)
        self._host_np[:n] = rows
        self._host_np[n:b] = self.padding_row()
        self.inputs[:b].copy_(self.host_inputs[:b], non_blocking=True)
        self.graphs[b].replay()
        return self.logits[b][:n], self.tokens[b][:n]

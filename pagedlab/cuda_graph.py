"""CUDA graphs for decode steps.

A decode step of Llama-3.2-1B launches ~100 small kernels; at batch 1 launching them from Python
costs more than running them. A CUDA graph records the launches once (per batch size) and replays
them with one call. Everything a graph reads lives in static buffers refilled before each replay:

    inputs [N, 6] int64 : per row  token id, position, KV slot, sequence length, slot of the
                          request, and where the row's token comes from (see below)
    block table         : the engine's own device table (its address never changes); the graph
                          gathers the rows it needs itself

so a step costs one host -> device copy, one replay, and one device -> host copy of the chosen
tokens (greedy argmax runs inside the graph). Launch shapes are fixed at capture: the batch
(padded up to the nearest captured size) and the block-table width. Padding rows point at the
"null" KV block and the table's null row, so they compute harmless garbage nobody reads.

Where a row's token comes from: either the host wrote it (column 0), or it is the token that the
PREVIOUS replay chose for one of its rows -- still on the device, not yet read by the host. That
second case lets the engine launch step n+1 before it has read step n's tokens (engine.py's
overlap loop; runner.py: launch(after=...), whose pending map names those rows). Both live in one
buffer, `token_src` = [previous replay's tokens | this replay's inputs], and column 5 holds an
index into it, so picking every row's token is one gather.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager

import numpy as np
import torch

from .attention import AttentionMetadata

DEFAULT_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
COLS = 6          # token, position, KV slot, length, slot, index of the token in token_src


@contextmanager
def collector_paused():
    """No garbage collection while graphs are captured. An engine dropped earlier in this process
    but kept alive by a reference cycle (a notebook's or a test's hook on it, say) is freed
    whenever the collector next runs; if that happens inside a capture, its CUDA graphs, events,
    pinned buffers and memory pool are torn down while this stream captures -- CUDA calls a capture
    forbids. So: what is already dead goes first, and nothing is collected until the captures end
    (torch.cuda.graph no longer collects by itself; vLLM and SGLang freeze the collector around
    their captures too)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class Replay:
    """A launched decode step: its device outputs and the pinned host copy of its tokens."""

    def __init__(self, logits, host_tokens, event):
        self.logits = logits                                # device, [n, V] fp32
        self._host_tokens, self._event = host_tokens, event

    def read_tokens(self) -> list[int]:
        """Wait for THIS replay only (not for anything launched after it) and return its tokens."""
        if self._event is not None:
            self._event.synchronize()
        return self._host_tokens.tolist()


class DecodeGraphs:
    # FUSED_INPUTS: the rows' token ids, positions, slots, lengths, block-table rows and embeddings
    # come from ONE launch (kernels/graph_inputs.py) instead of 4-6 torch ops, and the LM head's
    # argmax writes the tokens straight into prev_tokens (no copy launch), where the model runs the
    # Triton kernels (CUDA, or the interpreter) on one device. On: H200, Llama-3.2-1B, batch-1
    # graph at context 258 881.3 / 881.5 us against 890.4 / 886.0 / 890.4 off (bf16), FP8 674.8 /
    # 676.6 against 683.0 / 682.8 (same process, docs/kernels.md "One stream, session 15").
    FUSED_INPUTS = True

    def __init__(self, model, kv_cache, block_table: torch.Tensor, max_seq_len: int, max_batch: int,
                 sizes=DEFAULT_SIZES, capture: bool | None = None):
        """capture=False runs the very same step eagerly (any device): what the CPU tests use to
        check the engine's bookkeeping around replays."""
        self.model, self.kv_cache, self.table = model, kv_cache, block_table
        self.sizes = sorted({s for s in sizes if s < max_batch} | {max_batch})
        self.max_seq_len = max_seq_len
        self.null_row = block_table.shape[0] - 1
        self.capture = model.device.type == "cuda" if capture is None else capture
        big = self.sizes[-1]
        dev = model.device
        self.token_src = torch.zeros(big + big * COLS, dtype=torch.int64, device=dev)
        self.prev_tokens = self.token_src[:big]                  # the last replay's chosen tokens
        self.inputs = self.token_src[big:].view(big, COLS)
        # a padding row per position: its token is its own column 0
        self._padding = np.array([self.padding_row()] * big, dtype=np.int64)
        self._own_token = big + COLS * np.arange(big, dtype=np.int64)
        self._padding[:, 5] = self._own_token
        self.fill_padding()
        # host sides of the copies, two of each: while step n's copies may still be pending, step
        # n+1 fills the other one. Pinned (page-locked), so each copy is a plain async DMA.
        pin = dev.type == "cuda"
        self._host_inputs = [torch.zeros(big, COLS, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._host_tokens = [torch.zeros(big, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._events = [torch.cuda.Event() if pin else None for _ in range(2)]
        self._turn = 0
        self._cu0 = torch.zeros(1, dtype=torch.int32, device=dev)
        self.fused_inputs = (self.FUSED_INPUTS and getattr(model, "tp", None) is None
                             and getattr(getattr(model, "kernels", None), "backend", None) == "triton"
                             and isinstance(getattr(model, "embed", None), torch.Tensor))
        self.graphs, self.logits, self.tokens = {}, {}, {}
        self.pool = None
        if self.capture:
            self._capture_all()

    def padding_row(self) -> list[int]:
        null = self.kv_cache.null_block
        return [0, 0, null * self.kv_cache.block_size, 1, self.null_row, 0]

    def _run(self, b):
        if self.fused_inputs:
            return self._run_fused(b)
        x = self.inputs[:b]
        dev = self.model.device
        seq_lens = x[:, 3].to(torch.int32)
        meta = AttentionMetadata(
            slot_mapping=x[:, 2].contiguous(), num_prefill_tokens=0,
            prefill_block_table=self.table[:0], cu_seqlens_q=torch.zeros(1, dtype=torch.int32, device=dev),
            prefill_seq_lens=seq_lens[:0], max_q_len=0,
            decode_block_table=self.table.index_select(0, x[:, 4]), decode_seq_lens=seq_lens,
            max_seq_len=self.max_seq_len)
        token_ids = self.token_src.index_select(0, x[:, 5])     # host-given or last replay's
        logits, tokens = self.model.forward(token_ids, x[:, 1].contiguous(), self.kv_cache, meta,
                                            greedy=True)
        self.prev_tokens[:b].copy_(tokens)                       # for the next replay to read
        return logits, tokens

    def _run_fused(self, b):
        """_run with the inputs gathered in one launch (FUSED_INPUTS)."""
        from .kernels.graph_inputs import decode_inputs_triton
        ids, positions, slots, seq_lens, rows, h = decode_inputs_triton(
            self.inputs[:b], self.token_src, self.table, self.model.embed)
        meta = AttentionMetadata(
            slot_mapping=slots, num_prefill_tokens=0, prefill_block_table=self.table[:0],
            cu_seqlens_q=self._cu0, prefill_seq_lens=seq_lens[:0], max_q_len=0,
            decode_block_table=rows, decode_seq_lens=seq_lens, max_seq_len=self.max_seq_len)
        out = self.prev_tokens[:b]
        logits, tokens = self.model.forward(ids, positions, self.kv_cache, meta, greedy=True, embedded=h,
                                            tokens_out=out)
        if tokens.data_ptr() != out.data_ptr():                  # (the LM head did not write them)
            out.copy_(tokens)
        return logits, out

    def _capture_all(self):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with collector_paused(), torch.cuda.stream(stream):
            for b in reversed(self.sizes):       # largest first: later graphs reuse its memory pool
                for _ in range(2):
                    self._run(b)                 # warm up: compile kernels, fill caches
                g = torch.cuda.CUDAGraph()
                # thread_local: the capture forbids CUDA calls to this thread only -- another
                # thread's engine (a notebook's server, say) goes on stepping meanwhile ("global",
                # torch's default, would fail that engine's syncs and copies while we capture)
                with torch.cuda.graph(g, pool=self.pool, stream=stream, capture_error_mode="thread_local"):
                    self.logits[b], self.tokens[b] = self._run(b)
                if self.pool is None:
                    self.pool = g.pool()
                self.graphs[b] = g
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def fill_padding(self) -> None:
        """Every input row a padding row (null block, its own token): a replay of any size then
        reads and writes nothing of a request's (what a benchmark replays)."""
        self.inputs.copy_(torch.from_numpy(self._padding))

    def batch_size(self, n: int) -> int | None:
        """The captured size that holds n rows (None if none does)."""
        return next((s for s in self.sizes if s >= n), None) if n > 0 else None

    def replay(self, b: int) -> torch.Tensor:
        """Run batch size b's step with the inputs in place (no copy in or out): its logits.
        (What `launch` does after filling the inputs; benchmarks time it alone.)"""
        if self.capture:
            self.graphs[b].replay()
            return self.logits[b]
        return self._run(b)[0]

    def launch(self, rows: list, choose=None) -> Replay:
        """rows: n <= max batch tuples (token, position, KV slot, length, slot, prev_row), where
        prev_row >= 0 says "my token is the one the previous replay chose for its row prev_row"
        (the host's token is then ignored) and -1 says "the host's token". Pads the rows to the
        captured size b, copies them to the device (one copy), replays b's graph and queues the copy
        of the chosen tokens back to pinned host memory. Returns without waiting for the device.
        The host buffers come in pairs, so read a replay before launching the second after it.
        choose: logits [n, V] -> token ids [n] on the device, chosen outside the graph (sampling):
        they replace the graph's argmax where the next replay and the host read them."""
        n = len(rows)
        b = self.batch_size(n)
        k = self._turn = 1 - self._turn
        host = self._host_inputs[k].numpy()
        host[:n] = rows
        host[:n, 5] = np.where(host[:n, 5] < 0, self._own_token[:n], host[:n, 5])
        host[n:b] = self._padding[n:b]
        self.inputs[:b].copy_(self._host_inputs[k][:b], non_blocking=True)
        logits = self.replay(b)
        if choose is not None:
            self.prev_tokens[:n].copy_(choose(logits[:n]))
        host_tokens = self._host_tokens[k][:n]
        host_tokens.copy_(self.prev_tokens[:n], non_blocking=True)
        if self._events[k] is not None:
            self._events[k].record()
        return Replay(logits[:n], host_tokens, self._events[k])

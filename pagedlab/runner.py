"""The runner: the device side of a step.

    tokens = runner.run(batch)     # block-table edits -> pack -> forward -> sample -> one host read

  * The device block table lives here; each batch brings the few entries that changed.
  * Packing: each prefill's chunk of new tokens, then one token per decode, in flat tensors that
    reach the device in one copy; logits are computed only where a next token is due.
  * Where each new token's K/V goes (its KV slot) is computed in one place, `kv_slots`.
  * On CUDA an eager step's rows are padded with padding tokens up to one of a few row counts
    (kernels/row_buckets.py: cuBLAS pays for every new shape), once, on the host lists.
  * Decode-only steps replay a captured CUDA graph instead of launching ~100 kernels
    (cuda_graph.py); greedy tokens are chosen inside the graph.
  * Sampling runs on the device; the chosen ids are the step's one device -> host read.

`launch()` starts a step without waiting for it and `read()` waits for it: the engine's overlap
loop launches step n+1 before it reads step n (`after=`: its rows' input tokens are then taken on
the device from step n's output).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

from .attention import AttentionMetadata
from .kernels.row_buckets import bucket_rows
from .kv_cache import BlockTable, blocks_needed
from .sampling import TokenLogprob, apply_penalties, sample, token_counts

MAX_GRAPH_BATCH = 512      # the largest decode batch captured as a CUDA graph


def kv_slots(blocks: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Where tokens start..end-1 of a sequence keep their K and V: token p goes to physical block
    blocks[p // block_size] at offset p % block_size, flat slot blocks[p // bs] * bs + p % bs.
    (Built one block at a time, not one Python step per token.)"""
    bs, out = block_size, []
    for j in range(start // bs, blocks_needed(end, bs)):
        base = blocks[j] * bs
        out += range(base + max(start - j * bs, 0), base + min(end - j * bs, bs))
    return out


def decode_kv_slots(reqs, block_size: int) -> list[int]:
    """kv_slots of each request's last token (position num_tokens - 1): a decode step's slots, in
    one comprehension (no call per request: at batch 256 this runs every ~3 ms)."""
    bs = block_size
    return [r.blocks[(p := r.num_tokens - 1) // bs] * bs + p % bs for r in reqs]


def verify_rows(reqs) -> tuple[list, list[int]]:
    """Speculative steps: each request once per row (its last token, then each guess), and the
    row's offset from its first row."""
    out, offsets = [], []
    for r in reqs:
        m = 1 + len(r.spec_token_ids)
        out += [r] * m
        offsets += range(m)
    return out, offsets


@dataclass
class StepInputs:
    """A step's device work as host data: "pack" (data = the packed lists of _host_inputs) or
    "replay" (data = the rows of a CUDA-graph replay), and the block-table entries that changed."""
    kind: str
    table_edits: list
    data: list


@dataclass
class Launch:
    """A step on its way: where each request's token is, and how to get the tokens."""
    rows: dict[int, int]           # request id -> row of its token in this step's output
    tokens: list[int] | None       # already on the host (eager steps and sampled steps)
    replay: object = None          # cuda_graph.Replay: tokens still on the device

    @property
    def read_later(self) -> bool:
        return self.tokens is None


class ModelRunner:
    def __init__(self, model, kv_cache, max_num_seqs: int, max_model_len: int, cuda_graphs=True,
                 rows_per_seq: int = 1):
        """cuda_graphs: True (capture on CUDA), False (never), "eager" (the graph code path run
        without capturing, on any device: what the CPU tests use to check the overlap loop).
        rows_per_seq: decode rows one sequence may take (speculative decoding: 1 + k), so graphs
        are captured for max_num_seqs * rows_per_seq rows (at most MAX_GRAPH_BATCH)."""
        self.model, self.kv_cache = model, kv_cache
        # tensor parallelism: rank 0 sends each step's inputs to the other ranks (parallel/group.py)
        tp = getattr(model, "tp", None)
        self.peers = tp if tp is not None and tp.rank == 0 else None
        self.block_size = kv_cache.block_size
        self.device = model.device
        self.block_table = BlockTable(max_num_seqs, blocks_needed(max_model_len, self.block_size),
                                      self.device, kv_cache.null_block)
        # eager steps run at a bucketed row count on CUDA (padding tokens, see _host_inputs)
        self.pad_rows = self.device.type == "cuda"
        # sampled rows drawn in one pass over the logits (kernels/gumbel_sample.py) on CUDA
        self.fused_sampling = self.FUSED_SAMPLING and self.device.type == "cuda"
        self.graphs = None
        self.spec_fused_rows = None     # the kernels/gemv.py fused_rows mode of the few-row graphs
        if cuda_graphs == "eager" or (cuda_graphs and self.device.type == "cuda"):
            from .cuda_graph import DEFAULT_SIZES, DecodeGraphs
            # speculative: a graph for every row count of one sequence's verify (1 + 1..k rows)
            sizes = sorted(set(DEFAULT_SIZES) | set(range(1, rows_per_seq + 1)))
            capture = cuda_graphs is True
            biggest = min(max_num_seqs * rows_per_seq, MAX_GRAPH_BATCH)
            if self.GRAPH_PREFILL_SIZES:
                # graphs for the prompt steps too, up to the prefill bound: past the decode sizes
                # only powers of two (a padded prompt row costs little: the weights' reads dominate)
                bound = min(self.prefill_rows_limit(capture), MAX_GRAPH_BATCH)
                sizes = [s for s in sizes if s <= biggest or s & (s - 1) == 0] + [biggest]
                biggest = max(biggest, bound)
            with self._verify_kernels(rows_per_seq):
                self.graphs = DecodeGraphs(model, kv_cache, self.block_table.table, max_model_len,
                                           biggest, sizes=sizes, capture=capture)
        self.last: Launch | None = None      # the latest launch, if it completed
        # called with each batch once its device work is queued, before anything waits for it:
        # host work that needs no result of the step runs there while the device computes
        self.while_running = None
        # requests may bring guesses (spec/): only then are decode rows looked at for them
        self.speculative = rows_per_seq > 1

    # A speculative engine captures its graphs of a few rows with the fused decode kernels in this
    # kernels/gemv.py fused_rows mode: "fma" (2..FMA_ROWS rows, each row against the weight tile
    # as loaded), "fma_layers" (the same, cuBLAS LM head), "dot" (tensor cores, rows padded to 16),
    # None (cuBLAS plus the separate norm / RoPE / store / SwiGLU kernels), or "auto": "fma_layers"
    # for models of hidden size <= FMA_MAX_HIDDEN, else None. Measured on the H200 (2026-12-02,
    # docs/speculative.md): SmolLM2 (576) graph replay 2 / 3 / 4 / 5 rows 0.755 / 0.865 / 0.947 /
    # 1.022 ms with fma_layers against 1.067-1.075 with cuBLAS; at Llama-3.2-1B's shapes (2048) one
    # layer's fma kernels at 5 rows took 114 us against cuBLAS's 52. `bench spec --fused-rows`.
    SPEC_FUSED_ROWS = "auto"
    FMA_MAX_HIDDEN = 1024

    def _verify_kernels(self, rows_per_seq: int):
        mode = self.SPEC_FUSED_ROWS
        if mode == "auto":
            mode = "fma_layers" if self.model.config.hidden_size <= self.FMA_MAX_HIDDEN else None
        self.spec_fused_rows = mode if rows_per_seq > 1 and mode and self.device.type == "cuda" else None
        if self.spec_fused_rows:                 # (what the graphs were captured with: bench spec)
            from .kernels.gemv import fused_rows
            return fused_rows(mode)
        return contextlib.nullcontext()

    def run(self, batch) -> list[int]:
        """Run a step to its end: the sampled tokens, on the host, in batch.sampled order."""
        return self.read(self.launch(batch))

    def read(self, launch: Launch) -> list[int]:
        """Wait for that step only (not for anything launched after it) and return its tokens."""
        return launch.tokens if launch.tokens is not None else launch.replay.read_tokens()

    # Steps with prompt tokens of at most this many rows in all (and no guesses) replay the decode
    # graphs too: each prompt token is one more decode row (position p, length p + 1), as a verify
    # step's guesses are. An eager step of a few prompt tokens is launch-bound: H200, SmolLM2 bf16,
    # 12 prompt tokens 11.9 ms eager, 1.37 ms replayed (2026-12-02, docs/speculative.md; copy one
    # stream 1,076 -> 1,368 tok/s plain, 1,611 -> 2,391 speculative). None (the default):
    # GRAPH_PREFILL_AUTO rows where the graphs are captured (CUDA), 0 where they run eagerly (the
    # CPU tests' graph code path); 0: off. Rows past the largest captured graph stay eager.
    # AUTO was 80 (session 14); 128 since session 15, with GRAPH_PREFILL_SIZES below: one stream's
    # 128-token prompt (Llama-3.2-1B, H200) replays in 1.2-1.5 ms of GPU time, TTFT 9-16 -> 2.5-2.7
    # ms; with FUSED_INPUTS bf16 1,047-1,049 -> 1,084-1,101 tokens/s (docs/kernels.md, session 15).
    # Sampled decode steps (temperature > 0, seeded noise, no penalties or logprobs) that replay a
    # graph choose their tokens on the device (sample() after the replay, written where the next
    # replay reads its input tokens), so the overlap loop runs ahead of them as of greedy steps.
    # On since session 20: H200, the 512-request burst at temperature 1, offline 27,061 against
    # 24,178 tokens/s, TTFT p99 1,805 against 2,023 ms; served 25,550 against 23,186 (docs/serving.md).
    # PAGEDLAB_RUN_AHEAD_SAMPLED=0 at import turns it off.
    RUN_AHEAD_SAMPLED = os.environ.get("PAGEDLAB_RUN_AHEAD_SAMPLED", "1") != "0"
    # Sampled rows without top-k / top-p / min-p: the Gumbel-max draw in one Triton pass over the
    # logits instead of ~30 torch passes (kernels/gumbel_sample.py; H200: 142 against 2,654 us at
    # 256 rows x 128,256, the same tokens). On since session 21: the GPU suite passed with it on and
    # off side by side (94 and 94; session 20's one illegal address with it on did not come back),
    # and the 512-request burst at temperature 1 ran offline at 43,187-43,931 tokens/s against
    # 29,358 without it, served 40,420-44,676 against 25,546-30,023 (H200, docs/serving.md session
    # 21): once the host no longer waited for the GPU (a90d13f), the sampling math was the step.
    # PAGEDLAB_FUSED_SAMPLING=0 at import turns it off.
    FUSED_SAMPLING = os.environ.get("PAGEDLAB_FUSED_SAMPLING", "1") != "0"

    GRAPH_PREFILL_ROWS = None
    GRAPH_PREFILL_AUTO = 128
    # The captured sizes go up to max_num_seqs * rows_per_seq, so an engine of few slots replays
    # none but its shortest prompts. GRAPH_PREFILL_SIZES: capture graphs up to the prefill bound
    # above too (at load, where graphs are captured; past the decode sizes the powers of two of
    # DEFAULT_SIZES and the bound itself), so that a prompt step of up to that many rows replays
    # whatever max_num_seqs is. Decode steps never use the extra sizes. On by default (session 15,
    # measured above); load time on the H200 for max_num_seqs 8: 1.1-1.9 s either way (warm cache).
    GRAPH_PREFILL_SIZES = True

    def prefill_rows_limit(self, captured: bool) -> int:
        """The most rows (prompt + decode) of a step with prompt tokens that replays a graph."""
        limit = self.GRAPH_PREFILL_ROWS
        if limit is None:
            limit = self.GRAPH_PREFILL_AUTO if captured else 0
        return limit

    def replays(self, batch) -> bool:
        """Is this step a CUDA-graph replay (decode only -- or a few prompt tokens, see
        GRAPH_PREFILL_ROWS -- at a captured size)?"""
        if self.graphs is None:
            return False
        rows = len(batch.decode)
        guesses = sum(len(r.spec_token_ids) for r in batch.decode) if self.speculative else 0
        if batch.prefill:
            limit = self.prefill_rows_limit(self.graphs.capture)
            if guesses:
                return False
            rows += sum(r.num_scheduled for r in batch.prefill)
            if rows > limit:
                return False
        return self.graphs.batch_size(rows + guesses) is not None

    def launch(self, batch, after: Launch | None = None) -> Launch:
        """Start the step. `after`: the launch just before this one, not read yet; rows of this
        step whose previous token is still on the device take it from there."""
        prev, self.last = self.last, None
        if after is not None and after is not prev:
            raise RuntimeError("launch(after=...) must name the latest launch")
        reqs, offsets = batch.sampled, None
        if self.speculative and any(r.spec_token_ids for r in batch.decode):   # a row per guess too
            reqs, offsets = verify_rows(reqs)
        prompt_rows = None
        if self.replays(batch):
            rows = self._graph_rows(batch.decode, after.rows if after is not None else {})
            if batch.prefill:                    # prompt tokens as rows first, decodes after them
                rows, prompt_rows = self._prompt_rows(batch.prefill) + rows, True
            step = StepInputs("replay", batch.table_edits, rows)
        else:
            step = StepInputs("pack", batch.table_edits, self._host_inputs(batch))
        choose, greedy = None, all(r.params.plain_greedy for r in reqs)    # (one pass over the rows)
        if (not greedy and self.RUN_AHEAD_SAMPLED and step.kind == "replay" and not prompt_rows and offsets is None
                and self.peers is None and getattr(self.model, "tp", None) is None
                and all(r.params.chosen_on_device for r in reqs)):
            choose = lambda lg: self._device_tokens(lg, reqs)     # noqa: E731 -- sampled on the device
        logits, replay = self.execute(step, choose)
        if self.while_running is not None:
            self.while_running(batch)        # host work that overlaps the device's (prefix hashing)
        tokens = None
        if prompt_rows:                      # logits of each sampled prompt's last row, and decodes'
            ends, n = [], 0
            for r in batch.prefill:
                n += r.num_scheduled
                if r.num_computed + r.num_scheduled == r.num_tokens:
                    ends.append(n - 1)
            logits = logits[ends + list(range(n, n + len(batch.decode)))]
            tokens, batch.logprobs = self._sample(logits, reqs, offsets)
        elif choose is None and (replay is None or not greedy):
            tokens, batch.logprobs = self._sample(logits, reqs, offsets)
        self.last = launch = Launch({r.request_id: i for i, r in enumerate(reqs)}, tokens, replay)
        return launch

    def execute(self, step: "StepInputs", choose=None):
        """The step's device work from its host inputs: block-table edits, then a graph replay or
        the packed forward. Returns (logits, Replay or None). Under tensor parallelism rank 0 first
        sends the same inputs to the other ranks (parallel/group.py), which run this very function.
        choose: a replay's tokens chosen outside its graph (DecodeGraphs.launch; never under TP)."""
        if self.peers is not None:
            with self.peers.step_section():      # all ranks or none: Ctrl-C waits for its end
                self.peers.send_step(step)
                return self._execute(step)
        return self._execute(step, choose)

    def _execute(self, step, choose=None):
        self.block_table.write(step.table_edits)
        if step.kind == "replay":
            replay = self.graphs.launch(step.data, choose)
            return replay.logits, replay
        input_ids, positions, meta, rows = self._device_inputs(step.data)
        return self.model.forward(input_ids, positions, self.kv_cache, meta, rows), None

    # -- inputs -----------------------------------------------------------------
    def _host_inputs(self, batch) -> list[list[int]]:
        """The step's inputs as host lists: each prefill's chunk of new tokens, then one token per
        decode. Logits are computed only where a next token is due: the last token of a prefill
        that completes its sequence, and every decode."""
        bs = self.block_size
        ids, pos, slot_mapping = [], [], []          # per token
        cu, p_lens, logit_rows = [0], [], []
        for r in batch.prefill:
            start, end = r.num_computed, r.num_computed + r.num_scheduled
            ids += r.all_token_ids[start:end]
            pos += range(start, end)
            slot_mapping += kv_slots(r.blocks, start, end, bs)
            cu.append(cu[-1] + r.num_scheduled)
            p_lens.append(end)
            if end == r.num_tokens:
                logit_rows.append(cu[-1] - 1)
        if self.speculative and any(r.spec_token_ids for r in batch.decode):
            d_lens, d_slots = [], []
            for r in batch.decode:              # verify: the last token, then each guess, one row each
                n, m = r.num_tokens, len(r.spec_token_ids)
                ids += [r.last_token_id] + r.spec_token_ids
                pos += range(n - 1, n + m)
                d_lens += range(n, n + m + 1)   # row i sees the sequence up to its own position
                slot_mapping += kv_slots(r.blocks, n - 1, n + m, bs)
                d_slots += [r.slot] * (m + 1)
        else:
            d_lens = [r.num_tokens for r in batch.decode]
            ids += [r.last_token_id for r in batch.decode]
            pos += [n - 1 for n in d_lens]
            slot_mapping += decode_kv_slots(batch.decode, bs)
            d_slots = [r.slot for r in batch.decode]
        logit_rows += range(cu[-1], cu[-1] + len(d_lens))
        p_slots = [r.slot for r in batch.prefill]
        pad = bucket_rows(len(ids)) - len(ids) if self.pad_rows else 0
        if pad:           # padding tokens up to a bucket (kernels/row_buckets.py): every kernel of
            ids += [0] * pad          # the step then meets one of a few row counts; they store
            pos += [0] * pad          # their K/V in the null block no request owns (as a graph's
            slot_mapping += [self.kv_cache.null_block * bs] * pad   # padding rows do), attend to
                                      # nothing and give no logits
        return [ids, pos, slot_mapping, cu, p_lens, d_lens, p_slots, d_slots, logit_rows]

    def _device_inputs(self, parts):
        """Host lists -> the step's tensors, in one host -> device copy."""
        bs = self.block_size
        _, _, _, cu, p_lens, d_lens, _, _, _ = parts
        flat = torch.tensor([x for part in parts for x in part], dtype=torch.int64)
        flat = flat.to(self.device, non_blocking=True)          # one host -> device copy per step
        ids_t, positions, slots_t, cu_t, p_lens_t, d_lens_t, p_slots_t, d_slots_t, rows_t = \
            flat.split([len(part) for part in parts])
        table = self.block_table.table
        # Only as many block-table columns as the longest sequence uses (kernels never read past).
        p_cols = blocks_needed(max(p_lens, default=1), bs)
        d_cols = blocks_needed(max(d_lens, default=1), bs)
        meta = AttentionMetadata(
            slot_mapping=slots_t, num_prefill_tokens=cu[-1],
            prefill_block_table=table[p_slots_t, :p_cols], cu_seqlens_q=cu_t.int(),
            prefill_seq_lens=p_lens_t.int(),
            max_q_len=max((b - a for a, b in zip(cu, cu[1:])), default=0),
            decode_block_table=table[d_slots_t, :d_cols], decode_seq_lens=d_lens_t.int(),
            max_seq_len=max(d_lens, default=0))
        return ids_t, positions, meta, rows_t

    def _prompt_rows(self, prefill) -> list[tuple]:
        """Graph rows of a step's prompt tokens: each token of each chunk one row, at its position,
        its KV slot, the sequence's length up to it (the causal mask), the request's slot."""
        rows = []
        for r in prefill:
            start, end = r.num_computed, r.num_computed + r.num_scheduled
            rows += [(tok, p, s, p + 1, r.slot, -1) for tok, p, s in
                     zip(r.all_token_ids[start:end], range(start, end), kv_slots(r.blocks, start, end, self.block_size))]
        return rows

    def _graph_rows(self, reqs, pending: dict[int, int]) -> list[tuple]:
        """Host rows for a graph replay: token, position, KV slot, length, slot, and the row of the
        step before whose (not yet read) token is this request's input, or -1. `pending` (request
        id -> row of the unread step) is the one place that knows where a token in flight is; the
        host's token of such a row (its last known one) is ignored on the device."""
        if self.speculative and any(r.spec_token_ids for r in reqs):
            rows = []
            for r in reqs:                      # verify rows (never run ahead: the host knows every token)
                n, m = r.num_tokens, len(r.spec_token_ids)
                for i, (tok, s) in enumerate(zip([r.last_token_id] + r.spec_token_ids,
                                                  kv_slots(r.blocks, n - 1, n + m, self.block_size))):
                    rows.append((tok, n - 1 + i, s, n + i, r.slot, -1))
            return rows
        bs = self.block_size                    # (decode_kv_slots inlined: one length per request)
        return [(r.last_token_id, (p := (n := r.num_tokens) - 1), r.blocks[p // bs] * bs + p % bs, n, r.slot,
                 pending.get(r.request_id, -1)) for r in reqs]

    # -- output -----------------------------------------------------------------
    def _sample(self, logits, reqs, offsets=None):
        """The sampled token ids on the host -- the step's one device -> host read -- and, if any
        request asked for logprobs, a TokenLogprob per row (None for rows that did not ask).
        offsets: verify rows (speculative) -- row i of a request draws the token at its position
        num_tokens + offset, with the very noise a plain step at that position would use."""
        ps = [r.params for r in reqs]
        if all(p.plain_greedy for p in ps):
            return logits.argmax(dim=-1).tolist(), None
        raw = logits.float()
        tokens = self._device_tokens(raw, reqs, offsets)
        k = max((p.logprobs for p in ps if p.logprobs is not None), default=None)
        if k is None:
            return tokens.tolist(), None
        # logprobs: the chosen token's and the k most likely, read with the tokens in one copy
        lp = raw.log_softmax(dim=-1)
        cols = [tokens[:, None].double(), lp.gather(1, tokens[:, None]).double()]
        if k:
            top = lp.topk(k, dim=-1)
            cols += [top.indices.double(), top.values.double()]
        rows = torch.cat(cols, dim=1).tolist()
        out = []
        for p, row in zip(ps, rows):
            n = p.logprobs or 0
            out.append(None if p.logprobs is None else TokenLogprob(
                int(row[0]), row[1], [(int(i), v) for i, v in zip(row[2:2 + n], row[2 + k:2 + k + n])]))
        return [int(row[0]) for row in rows], out

    def _device_tokens(self, logits, reqs, offsets=None) -> torch.Tensor:
        """Each row's next token, on the device (no host read): penalties applied where asked,
        then sample() -- greedy rows take the argmax, sampled rows draw with their seed at their
        position (the noise depends on nothing else, so the token does not depend on the batch)."""
        ps = [r.params for r in reqs]
        dev = logits.device
        logits = logits.float()
        if any(p.has_penalties for p in ps):
            logits = self._penalize(logits, reqs)
        if all(p.greedy for p in ps):
            return logits.argmax(dim=-1)
        # every row's sampling inputs reach the device in two copies that do not wait for it: a
        # torch.tensor(list, device="cuda") is a blocking copy, which waits for everything queued
        # before it (the step's replay) -- five of them a sampled step held the host until the GPU
        # was done (H200: launch 3.4 ms of a 4.3 ms decode-only step at temperature 1, session 20)
        pos = ([r.num_tokens for r in reqs] if offsets is None else
               [r.num_tokens + o for r, o in zip(reqs, offsets)])
        ints = torch.tensor([[r.seed for r in reqs], pos, [p.top_k for p in ps]], dtype=torch.int64)
        reals = torch.tensor([[float(p.temperature) for p in ps], [float(p.top_p) for p in ps],
                              [float(p.min_p) for p in ps]], dtype=torch.float32)
        (seeds, positions, top_k), (temperature, top_p, min_p) = (
            ints.to(dev, non_blocking=True), reals.to(dev, non_blocking=True))
        any_min_p = any(p.min_p > 0 for p in ps)
        filtered = [i for i, p in enumerate(ps) if p.top_k > 0 or p.top_p < 1 or p.min_p > 0]
        if self.fused_sampling and len(filtered) < len(ps):
            # one pass over the logits (kernels/gumbel_sample.py) for the rows with no top-k /
            # top-p / min-p; rows with them are drawn by sample() apart, so a row's token never
            # depends on which way its batch-mates go
            from .kernels.gumbel_sample import gumbel_argmax_triton
            tokens = gumbel_argmax_triton(logits, temperature, seeds, positions)
            if filtered:
                idx = torch.tensor(filtered).to(dev, non_blocking=True)
                sub = [ps[i] for i in filtered]
                tokens[idx] = sample(
                    logits[idx], temperature[idx], top_k[idx], top_p[idx], seeds[idx], positions[idx],
                    any_top_filter=any(p.top_k > 0 or p.top_p < 1 for p in sub),
                    min_p=min_p[idx] if any_min_p else None)
            return tokens
        return sample(logits, temperature, top_k, top_p, seeds, positions,
                      any_top_filter=bool(filtered) and any(p.top_k > 0 or p.top_p < 1 for p in ps),
                      min_p=min_p if any_min_p else None)

    def _penalize(self, logits, reqs):
        """Presence / frequency / repetition penalties on the rows that have them (one device copy
        of their tokens; rows without penalties are left as they are)."""
        rows = [i for i, r in enumerate(reqs) if r.params.has_penalties]
        sub = [reqs[i] for i in rows]
        v, dev = logits.shape[1], logits.device
        out_counts = token_counts([r.output_token_ids for r in sub], v, dev)
        seen = (out_counts + token_counts([r.prompt_token_ids for r in sub], v, dev)) > 0
        knobs = torch.tensor([[r.params.presence_penalty, r.params.frequency_penalty,
                               r.params.repetition_penalty] for r in sub], dtype=torch.float32)
        knobs = knobs.to(dev, non_blocking=True)
        idx = torch.tensor(rows).to(dev, non_blocking=True)
        logits = logits.clone()
        logits[idx] = apply_penalties(logits[idx], out_counts, seen, knobs[:, 0], knobs[:, 1], knobs[:, 2])
        return logits

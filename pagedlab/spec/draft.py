"""method "draft": a smaller model with the same tokenizer guesses k tokens, greedily.

The draft keeps its own paged KV cache (same block size, a pool of its own) and a shadow of each
speculating request: the tokens it has seen, its blocks, how many of them it has computed. Each
step, per request:

    sync      the target's sequence now vs the tokens the draft computed: where they part (a
              guess the target did not keep), the draft's num_computed falls back -- its K/V past
              that point are simply overwritten, as in the target
    catch up  one packed forward over the tokens the draft has not computed (a prefill chunk the
              first time, usually the 1-2 tokens the target emitted since) -> guess 0
    k - 1     decode steps -> guesses 1 .. k-1

all requests together, through the draft's own ModelRunner (so its decode steps replay CUDA
graphs). Guesses are argmaxes: one-token guesses, so the engine's accept rule is exact rejection
sampling for sampled requests too (rejection.py). A draft equal to the target keeps every guess;
a random one keeps almost none, and the output is the same either way.

Its pool holds as many blocks as the target's (plus every slot's guesses). Requests that share
prefix-cached blocks in the target hold them each in the draft: when that runs the draft's pool
out, the proposal fails, the draft forgets its shadows and that step has no guesses
(speculator.py: a failing proposer costs only its guesses).
"""
from __future__ import annotations

from ..kv_cache import BlockAllocator, KVCache, blocks_needed
from ..request import Request, RequestStatus
from ..runner import ModelRunner
from ..sampling import SamplingParams
from ..validation import ValidationError, show
from .config import _OWNER

GREEDY = SamplingParams(max_new_tokens=2**31 - 1)


class _Step:
    """The part of a scheduler Batch the runner reads."""

    def __init__(self, prefill, decode, table_edits):
        self.prefill, self.decode, self.table_edits = prefill, decode, table_edits
        self.sampled = prefill + decode
        self.logprobs = None


def load_draft(spec_model, target_model, engine_config):
    """The draft model: a LlamaModel as given, or built from a Checkpoint or a name / path
    (load_checkpoint) on the target's device and dtype, with the target's kernels' backend."""
    from ..model import LlamaModel
    if isinstance(spec_model, LlamaModel):
        return spec_model
    from ..config import resolve_backend
    from ..model import build_model
    from ..weights import Checkpoint, load_checkpoint
    try:
        ckpt = spec_model.validate() if isinstance(spec_model, Checkpoint) else \
            load_checkpoint(spec_model, show_progress=False)
    except (OSError, ValueError) as e:          # not found, gated, a bad checkpoint: the draft's
        raise draft_error(e) from e
    backend = resolve_backend(engine_config.attention_backend, target_model.device)
    return build_model(ckpt.config, ckpt.tensors, target_model.device, target_model.dtype, engine_config, backend)


def draft_error(e: Exception) -> Exception:
    """An error loading the draft model, said as the draft's -- "speculative_config: model: ..."
    -- not as the target model's (the command line named it --model). The same type where it is
    one of weights.py's (ModelNotFound, GatedModelError), else ValueError / OSError; `.owner` is
    "speculative_config" (the CLI names its flag, --speculative-config)."""
    from ..weights import GatedModelError, ModelNotFound
    cls = type(e) if type(e) in (ModelNotFound, GatedModelError) else ValueError if isinstance(e, ValueError) \
        else OSError
    out = cls(f"{_OWNER}: model: {e}")
    out.owner = _OWNER
    return out


class DraftProposer:
    method = "draft"

    def __init__(self, spec_model, target_model, engine_config, max_model_len=None, num_blocks=None):
        """max_model_len / num_blocks: the target engine's (the draft holds the same sequences:
        its pool gets as many blocks, plus room for every slot's guesses)."""
        self.model = model = load_draft(spec_model, target_model, engine_config)
        if model.config.vocab_size != target_model.config.vocab_size:
            named = isinstance(spec_model, str)        # (not the model itself: the error is pickled)
            raise ValidationError(
                "model", f"a model with the target's vocabulary ({target_model.config.vocab_size} tokens: the "
                "same tokenizer)", spec_model if named else model.config.vocab_size, owner=_OWNER,
                shown=f"{show(spec_model) if named else 'a model'} ({model.config.vocab_size} tokens)")
        cfg, k = engine_config, engine_config.speculative_config.num_speculative_tokens
        max_len = min(max_model_len or cfg.max_model_len or target_model.config.max_position_embeddings,
                      target_model.cos_sin.shape[0], model.cos_sin.shape[0] - k)
        per_seq = blocks_needed(max_len + k, cfg.block_size)
        pool = cfg.max_num_seqs * per_seq if num_blocks is None else \
            min(cfg.max_num_seqs * per_seq, num_blocks + cfg.max_num_seqs * blocks_needed(k + 1, cfg.block_size))
        mc = model.config
        self.kv = KVCache(mc.num_layers, pool, cfg.block_size,
                          getattr(model, "num_kv_heads", mc.num_kv_heads), mc.head_dim, model.dtype, model.device)
        self.allocator = BlockAllocator(self.kv.num_blocks)
        self.runner = ModelRunner(model, self.kv, cfg.max_num_seqs, max_len + k, cfg.cuda_graphs)
        self.block_size = cfg.block_size
        self.shadows: dict[int, Request] = {}

    # -- per-request shadows -------------------------------------------------------------
    def _drop(self, rid: int) -> None:
        s = self.shadows.pop(rid)
        self.allocator.free(s.blocks)

    def reset(self) -> None:
        """Forget every shadow (after a failed proposal: their state is not known)."""
        for rid in list(self.shadows):
            self._drop(rid)

    def forget_except(self, live: set[int]) -> None:
        """Free the shadows of requests that left their slot (finished, aborted, preempted)."""
        for rid in [rid for rid in self.shadows if rid not in live]:
            self._drop(rid)

    def _shadow(self, r, edits) -> Request:
        s = self.shadows.get(r.request_id)
        if s is not None and s.slot != r.slot:
            self._drop(r.request_id)
            s = None
        if s is None:
            s = Request(r.request_id, [], GREEDY, seed=0)
            s.slot, s.status = r.slot, RequestStatus.RUNNING
            self.shadows[r.request_id] = s
        tokens = r.all_token_ids
        seen = s.prompt_token_ids
        common = 0
        for a, b in zip(seen, tokens):        # where the draft's tokens part from the target's
            if a != b:
                break
            common += 1
        s.num_computed = min(s.num_computed, common)
        s.prompt_token_ids, s.output_token_ids = list(tokens), []
        return s

    def _grow(self, s: Request, num_tokens: int, edits) -> None:
        need = blocks_needed(num_tokens, self.block_size) - len(s.blocks)
        if need > 0:
            for b in self.allocator.allocate(s.request_id, need):
                edits.append((s.slot, len(s.blocks), b))
                s.blocks.append(b)

    # -- proposing -----------------------------------------------------------------------
    def propose(self, requests, ks: list[int]) -> list[list[int]]:
        out = [[] for _ in requests]
        work = [(i, r, k) for i, (r, k) in enumerate(zip(requests, ks)) if k > 0]
        if not work:
            return out
        edits, shadows = [], []
        for i, r, k in work:
            s = self._shadow(r, edits)
            self._grow(s, s.num_tokens + k - 1, edits)
            s.num_scheduled = s.num_tokens - s.num_computed
            shadows.append((i, s, k))
        # catch up: prefill chunks (and 1-token decodes) over what the draft has not computed
        prefill = [s for _, s, _ in shadows if s.num_scheduled > 1]
        decode = [s for _, s, _ in shadows if s.num_scheduled == 1]
        step = _Step(prefill, decode, edits)
        tokens = self.runner.run(step)
        for s, t in zip(step.sampled, tokens):
            s.num_computed = s.num_tokens
            s.prompt_token_ids.append(t)          # the guess is the draft's next input
        guesses = {s.request_id: [t] for s, t in zip(step.sampled, tokens)}
        for j in range(1, max(k for _, _, k in shadows)):
            decode = [s for _, s, k in shadows if k > j]
            tokens = self.runner.run(_Step([], decode, []))
            for s, t in zip(decode, tokens):
                s.num_computed = s.num_tokens
                s.prompt_token_ids.append(t)
                guesses[s.request_id].append(t)
        for i, s, _ in shadows:
            out[i] = guesses[s.request_id]
        return out

"""The Llama forward pass over a packed batch (prefill tokens and decode tokens together).

    embed -> for each layer:  q = RoPE(RMSNorm(h) Wq), and RoPE(RMSNorm(h) Wk), RMSNorm(h) Wv -> paged cache
                              h = h + attention(q, paged K/V) Wo
                              h = h + (SiLU(RMSNorm(h) Wg) * RMSNorm(h) Wu) Wd
          -> final RMSNorm -> LM head (only at the rows whose next token we need)

h is the residual stream. Q/K/V and gate/up are fused into one matrix each at load time (fewer,
larger matmuls). Each line above is one kernel function (kernels/gemv.py): with one token in the
step (decode at batch 1) it is ONE launch that streams its weight matrix once, with the norm,
RoPE, K/V store, SwiGLU and residual add done on the way; with more tokens it is the unfused
composition (RMSNorm, cuBLAS matmul, RoPE, K/V store ...).

Tensor parallelism (parallel/shard.py): with `tp` (a parallel.group.ParallelGroup) each rank loads
its cut of every weight -- whole heads of QKV and O, a slice of gate/up and down, a vocabulary
range of the embedding and LM head -- and the forward adds three things: the embedding and the two
row-parallel matmuls of each layer (O, down) end in an all-reduce, and the LM head's logits are
all-gathered into full rows. Everything else, kernels included, runs unchanged on fewer heads.

FP8 weights (quantization="fp8", quantization.py): every linear weight -- QKV, O, gate/up, down and
the LM head -- is quantized at load, from the checkpoint's own precision, to fp8 codes with one
fp32 scale per output row (an FP8Weight); the embedding and the norms stay in the model dtype. The
kernel functions take an FP8Weight wherever they take a weight.
"""
from __future__ import annotations

import functools
import inspect

import torch

from .attention import AttentionMetadata, attend
from .config import EngineConfig, ModelConfig, max_positions
from .kernels import scratch, select_kernels
from .kernels.rope import rope_cos_sin
from .parallel.shard import check_split, shard, split_rule, vocab_parallel_embedding
from .quantization import FP8Weight, check_quantization, quantize_weight


@functools.lru_cache(maxsize=None)
def _takes(fn, name: str = "prefetch") -> bool:
    """Does this kernel function take the keyword `name` (pagedlab's own do; a namespace of other
    functions, such as the course's learner pieces, may not)?"""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _prefetch(fn, w) -> dict:
    """prefetch=w for fn where it takes it: the matrix the kernel after fn streams."""
    return {"prefetch": w} if _takes(fn, "prefetch") else {}


def _own_scratch(forward):
    """forward, with its kernels' scratch memory the model's own (self.scratch; kernels/scratch.py)."""
    @functools.wraps(forward)
    def run(self, *args, **kwargs):
        with scratch.owned_by(self.scratch):
            return forward(self, *args, **kwargs)
    return run


class LlamaModel:
    def __init__(self, config: ModelConfig, tensors: dict, device="cpu", dtype=torch.float32,
                 kernels=None, max_positions: int | None = None, tp=None, presharded: bool = False,
                 quantization: str | None = None):
        """tp: this rank's tensor-parallel group (None: one device holds the whole model); the
        tensors are cut here for rank tp.rank, or are that rank's cut already (presharded=True).
        quantization: None (weights in `dtype`) or "fp8" (linear weights as FP8Weight)."""
        self.config = c = config
        self.device, self.dtype = torch.device(device), dtype
        check_quantization(quantization, self.device)
        self.quantization = quantization
        self.kernels = kernels or select_kernels("torch")
        self.tp = tp if tp is not None and tp.size > 1 else None
        rank, size = (tp.rank, tp.size) if self.tp else (0, 1)
        check_split(c, size)
        self.num_heads, self.num_kv_heads = c.num_heads // size, c.num_kv_heads // size

        def w(name, dt=dtype):
            t = tensors[name] if presharded else shard(tensors[name], split_rule(name), rank, size)
            return t.to(device=self.device, dtype=dt).contiguous()

        def lin(*names):
            """A linear weight (names: stacked row-wise): in `dtype`, or quantized to FP8 from
            the checkpoint's own precision (fp32 on the way, so bf16 and fp32 sources are exact)."""
            if quantization is None:
                return torch.cat([w(n) for n in names]) if len(names) > 1 else w(names[0])
            full = torch.cat([w(n, torch.float32) for n in names])
            return quantize_weight(full, names[0] if len(names) == 1 else "+".join(names))

        self.embed = w("model.embed_tokens.weight")
        self.layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            self.layers.append(dict(
                attn_norm=w(p + "input_layernorm.weight"),
                qkv=lin(*(p + f"self_attn.{x}_proj.weight" for x in "qkv")),
                o=lin(p + "self_attn.o_proj.weight"),
                mlp_norm=w(p + "post_attention_layernorm.weight"),
                gate_up=lin(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                down=lin(p + "mlp.down_proj.weight")))
        self.norm = w("model.norm.weight")
        head = "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
        # tied embeddings: the head is the lookup table itself, or (fp8) a quantized copy of it
        self.lm_head = self.embed if c.tie_word_embeddings and quantization is None else lin(head)
        self.cos_sin = rope_cos_sin(c.head_dim, c.rope_theta, max_positions or c.max_position_embeddings,
                                    c.rope_scaling, device=self.device)
        # the split kernels' partial sums and counters, this model's alone (kernels/scratch.py): an
        # engine capturing its graphs never shares them with another engine stepping meanwhile
        self.scratch: dict = {}
        self.scale = c.head_dim ** -0.5

    def num_bytes(self) -> int:
        """Bytes of all weights held (FP8 codes and their scales included)."""
        ts = [self.embed, self.norm] + [t for layer in self.layers for t in layer.values()]
        if self.lm_head is not self.embed:
            ts.append(self.lm_head)
        return sum(t.num_bytes() if isinstance(t, FP8Weight) else t.numel() * t.element_size()
                   for t in ts)

    @torch.inference_mode()
    @_own_scratch
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache,
                meta: AttentionMetadata, logits_indices: torch.Tensor | None = None,
                greedy: bool = False, embedded: torch.Tensor | None = None,
                tokens_out: torch.Tensor | None = None):
        """input_ids, positions: [T]. Returns fp32 logits [len(logits_indices) or T, vocab]
        (and with greedy=True also their argmax, the greedy tokens, computed in the LM head).
        embedded: self.embed[input_ids], where the caller gathered it already (the decode graphs'
        input launch, kernels/graph_inputs.py). tokens_out (greedy): int64 [rows] where the LM
        head may write the tokens itself (when it takes tokens_out= and fuses the argmax: the
        returned tokens are then this very tensor; otherwise a new one)."""
        c, ops = self.config, self.kernels
        t, eps = input_ids.shape[0], c.rms_norm_eps
        if embedded is not None:
            h = embedded
        else:
            h = self.embed[input_ids] if self.tp is None else self._embed_parallel(input_ids)
        qkv_attend = self._qkv_attend(meta, t)
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = kv_cache.k[i], kv_cache.v[i]
            # prefetch=: the matrix the next kernel streams (the Triton launchers may pull it into
            # L2 with extra programs at one token, kernels/gemv.py; the references ignore it)
            nxt = self.layers[i + 1]["qkv"] if i + 1 < len(self.layers) else None
            if qkv_attend is not None:      # decode only: attention may run in the QKV launch
                o = qkv_attend(h, layer["attn_norm"], eps, layer["qkv"], positions, self.cos_sin,
                               k_cache, v_cache, meta.slot_mapping, self.num_heads,
                               meta.decode_block_table, meta.decode_seq_lens, self.scale,
                               meta.max_seq_len, prefetch=layer["o"])
            else:
                q = ops.norm_qkv_rope_store(h, layer["attn_norm"], eps, layer["qkv"], positions, self.cos_sin,
                                            k_cache, v_cache, meta.slot_mapping, self.num_heads,
                                            **_prefetch(ops.norm_qkv_rope_store, layer["o"]))
                o = attend(ops, q, k_cache, v_cache, meta, self.scale)
            h = self._linear_residual(o.reshape(t, self.num_heads * c.head_dim), layer["o"], h,
                                      prefetch=layer["gate_up"])
            a = ops.norm_swiglu(h, layer["mlp_norm"], eps, layer["gate_up"],
                                **_prefetch(ops.norm_swiglu, layer["down"]))
            h = self._linear_residual(a, layer["down"], h, prefetch=nxt)
        if logits_indices is not None:
            h = h[logits_indices]
        if self.tp is None:
            kw = {"tokens_out": tokens_out} if greedy and tokens_out is not None and _takes(
                ops.norm_lm_head, "tokens_out") else {}
            return ops.norm_lm_head(h, self.norm, eps, self.lm_head, greedy=greedy, **kw)
        logits = self.tp.all_gather(ops.norm_lm_head(h, self.norm, eps, self.lm_head))  # [rows, V]
        return (logits, logits.argmax(dim=-1)) if greedy else logits

    def _qkv_attend(self, meta: AttentionMetadata, t: int):
        """The kernels' QKV-and-decode-attention function (select_kernels, Triton: attention in
        the QKV launch's tail where the config's ATTN allows) for a step of decode tokens only
        (none padded), while it still fuses the model's own QKV and decode functions; else None."""
        ops = self.kernels
        fn = getattr(ops, "norm_qkv_rope_store_attend", None)
        if fn is None or getattr(ops, "attend_fuses", None) != (ops.norm_qkv_rope_store, ops.decode_attention):
            return None
        if meta.num_prefill_tokens != 0 or meta.num_decode_tokens != t:
            return None
        return fn

    # -- tensor parallelism: the three places where ranks talk -----------------------------------
    def _linear_residual(self, x, w, h, prefetch=None):
        """h + x W^T. Row-parallel under TP: each rank's partial product, summed by an all-reduce;
        the residual h is added by rank 0 only (the others add zeros), so it is counted once."""
        kw = _prefetch(self.kernels.linear_residual, prefetch)
        if self.tp is None:
            return self.kernels.linear_residual(x, w, h, **kw)
        y = self.kernels.linear_residual(x, w, h if self.tp.rank == 0 else torch.zeros_like(h), **kw)
        self.tp.all_reduce(y)
        return y

    def _embed_parallel(self, ids):
        """Vocabulary-parallel lookup: ids outside this rank's range read zeros; all-reduce."""
        return vocab_parallel_embedding(ids, self.embed, self.tp.rank, self.tp.all_reduce)


def build_model(config, tensors: dict, device, dtype, engine_config: EngineConfig, backend: str,
                kernel_options: dict | None = None, tp=None, presharded: bool = False,
                decode_kernel=None) -> LlamaModel:
    """Kernels for this device (decode_kernel: a learner's decode attention instead), then the
    model -- this rank's cut when `tp` (a parallel.group.ParallelGroup) is given."""
    kernels = select_kernels(backend, engine_config.decode_variant, **(kernel_options or {}))
    if decode_kernel is not None:
        kernels.decode_attention = decode_kernel
        kernels.decode_plugged = True                 # warm-up compiles no split variants for it
    return LlamaModel(config, tensors, device, dtype, kernels, max_positions=max_positions(engine_config, config),
                      tp=tp, presharded=presharded, quantization=engine_config.quantization)

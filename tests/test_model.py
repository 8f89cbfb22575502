"""The model against transformers' LlamaForCausalLM on the same weights."""
import pytest
import torch

from helpers import hf_model
from pagedlab import tiny_config
from pagedlab.attention import AttentionMetadata
from pagedlab.kernels import select_kernels
from pagedlab.kv_cache import KVCache
from pagedlab.model import LlamaModel
from pagedlab.weights import random_checkpoint


def full_logits(model, ids, block_size=16, num_blocks=64, shuffle_seed=0):
    """All-position logits of one sequence through the paged prefill path (shuffled blocks)."""
    c, dev = model.config, model.device
    cache = KVCache(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim, model.dtype, dev)
    nb = -(-len(ids) // block_size)
    blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(shuffle_seed))[:nb].to(dev)
    pos = torch.arange(len(ids), device=dev)
    i32 = dict(dtype=torch.int32, device=dev)
    meta = AttentionMetadata(
        slot_mapping=blocks[pos // block_size] * block_size + pos % block_size, num_prefill_tokens=len(ids),
        prefill_block_table=blocks[None].int(), cu_seqlens_q=torch.tensor([0, len(ids)], **i32),
        prefill_seq_lens=torch.tensor([len(ids)], **i32), max_q_len=len(ids),
        decode_block_table=torch.zeros(0, nb, **i32), decode_seq_lens=torch.zeros(0, **i32), max_seq_len=0)
    return model.forward(torch.tensor(ids, device=dev), pos, cache, meta)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("seq_len", [1, 37, 100])
def test_logits_match_transformers_llama3_rope(tied, seq_len):
    cfg = tiny_config(tie_word_embeddings=tied, max_position_embeddings=256)
    ckpt = random_checkpoint(cfg, seed=seq_len)
    ours = LlamaModel(cfg, ckpt.tensors)
    ref = hf_model(ckpt)
    ids = torch.randint(0, cfg.vocab_size, (seq_len,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expect = ref(torch.tensor([ids])).logits[0].double()
    got = full_logits(ours, ids, block_size=7)
    assert got.shape == expect.shape
    assert rel(got, expect) < 1e-4


def test_logits_match_transformers_smollm2(smollm2):
    ours = LlamaModel(smollm2.config, smollm2.tensors, max_positions=512)
    ref = hf_model(smollm2)
    ids = torch.randint(0, smollm2.config.vocab_size, (45,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        expect = ref(torch.tensor([ids])).logits[0]
    assert rel(full_logits(ours, ids), expect) < 1e-4


def test_triton_kernels_match_torch_in_the_model():
    """The whole forward with the Triton backend (CPU interpreter here, fp32) equals the torch one."""
    cfg = tiny_config(num_layers=1)
    ckpt = random_checkpoint(cfg, seed=3)
    ids = torch.randint(0, cfg.vocab_size, (21,), generator=torch.Generator().manual_seed(3)).tolist()
    a = full_logits(LlamaModel(cfg, ckpt.tensors, kernels=select_kernels("torch")), ids)
    b = full_logits(LlamaModel(cfg, ckpt.tensors, kernels=select_kernels("triton")), ids)
    assert rel(b, a) < 1e-4


def test_rope_llama3_scaling_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from pagedlab.config import LLAMA_3_2_1B
    from pagedlab.kernels.rope import rope_inv_freq
    c = LLAMA_3_2_1B
    hf_cfg = LlamaConfig(**c.to_hf_dict())
    inv, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    ours = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
    assert torch.allclose(ours.float(), inv.float(), rtol=1e-6, atol=0)

"""FP8 weights (pagedlab/quantization.py): the per-channel round trip, its edge cases, the
refusals, the model's storage, and the fp8 engine on SmolLM2 against its unquantized run."""
import pytest
import torch

from pagedlab.config import ConfigError, EngineConfig, tiny_config
from pagedlab.quantization import (FP8_MAX, FP8Weight, check_quantization, dequantize_fp8,
                                   fp8_linear, quantization_error, quantize_fp8,
                                   quantize_rows_fp8, quantize_weight)

SHAPES = [(1, 1), (7, 13), (33, 250), (129, 70)]


def within_fp8_rounding(w, back, scale):
    """|back - w| <= half a step of e4m3 at w: 2^-4 |w| in the normal range, 2^-10 * scale (half
    the subnormal step 2^-9, in units of the row's scale) below it; plus fp32 rounding."""
    w, back, s = w.double(), back.double(), scale.double()[:, None]
    bound = torch.maximum(w.abs() * 2.0 ** -4, s * 2.0 ** -10) * (1 + 1e-6) + 1e-30
    return ((back - w).abs() <= bound).all().item()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_random(shape, dtype):
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    # rows of very different magnitudes: each must get its own scale
    w = (torch.randn(*shape, generator=g) * torch.logspace(-6, 3, shape[0])[:, None]).to(dtype)
    q, scale = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == shape
    assert scale.dtype == torch.float32 and scale.shape == (shape[0],)
    back = dequantize_fp8(q, scale)
    assert within_fp8_rounding(w, back, scale)
    # each row's largest magnitude maps to +-448 exactly, so it comes back to fp32 precision
    amax = w.float().abs().amax(1)
    assert torch.allclose(back.abs().amax(1), amax, rtol=1e-6)
    assert (q.float().abs().amax(1) == FP8_MAX).all()
    assert torch.equal(quantize_weight(w).dequantize(torch.bfloat16), back.to(torch.bfloat16))


def test_zeros():
    w = torch.zeros(5, 9)
    q, scale = quantize_fp8(w)
    assert torch.equal(scale, torch.ones(5)) and (q.float() == 0).all()
    assert torch.equal(dequantize_fp8(q, scale), w)
    w = torch.randn(6, 40, generator=torch.Generator().manual_seed(0))
    w[2] = 0.0                        # one zero row among others: exact zeros, finite scale
    w[4, ::3] = 0.0                   # zeros inside a row stay exact zeros
    q, scale = quantize_fp8(w)
    back = dequantize_fp8(q, scale)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert (back[2] == 0).all() and (back[4, ::3] == 0).all()


def test_an_outlier_costs_only_its_own_row():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 300, generator=g)
    with_outlier = w.clone()
    with_outlier[3, 17] = 1e6
    q_a, s_a = quantize_fp8(w)
    q_b, s_b = quantize_fp8(with_outlier)
    others = [i for i in range(8) if i != 3]
    assert torch.equal(q_a[others].float(), q_b[others].float()) and torch.equal(s_a[others], s_b[others])
    back = dequantize_fp8(q_b, s_b)
    assert back[3, 17].item() == pytest.approx(1e6, rel=1e-6)        # the outlier itself: exact
    assert within_fp8_rounding(with_outlier, back, s_b)
    # ...but the rest of its row falls below the smallest fp8 step: values ~1 against a row
    # scale of 1e6 / 448 flush to zero, where without the outlier they kept 2^-4 precision
    rest = torch.ones(300, dtype=torch.bool)
    rest[17] = False
    assert (back[3, rest] == 0).float().mean() > 0.9
    assert ((dequantize_fp8(q_a, s_a)[3] - w[3]).abs() <= w[3].abs() * 2.0 ** -4 + 1e-2).all()


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_refused(bad):
    w = torch.randn(4, 6)
    w[2, 5] = bad
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.up_proj\.weight.*non-finite.*\[2, 5\]"):
        quantize_fp8(w, "model.layers.0.mlp.up_proj.weight")


def test_bad_inputs_refused():
    with pytest.raises(ValueError, match="2-D"):
        quantize_fp8(torch.randn(3, 4, 5))
    with pytest.raises(ValueError, match="floating-point"):
        quantize_fp8(torch.ones(3, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="float32"):
        FP8Weight(torch.zeros(3, 4, dtype=torch.float8_e4m3fn), torch.ones(3, dtype=torch.float64))


def test_activation_rows_quantize_like_weight_rows():
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(2)) * torch.logspace(-3, 2, 9)[:, None]
    x[4] = 0.0
    q, s = quantize_rows_fp8(x)
    qw, sw = quantize_fp8(x)
    assert torch.equal(q.float(), qw.float()) and torch.equal(s[:, 0], sw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_is_the_matmul_with_dequantized_weights(dtype):
    g = torch.Generator().manual_seed(3)
    x, r = torch.randn(5, 70, generator=g).to(dtype), torch.randn(5, 33, generator=g).to(dtype)
    w = quantize_weight(torch.randn(33, 70, generator=g))
    ref = x.double() @ w.dequantize(torch.float64).t() + r.double()
    out = fp8_linear(x, w, r, activations="keep")
    assert out.dtype == dtype
    assert ((out.double() - ref).norm() / ref.norm()) < (1e-6 if dtype == torch.float32 else 1e-2)
    # W8A8's reference: the activations rounded per token too -- larger error, same formula
    xq, xs = quantize_rows_fp8(x)
    ref8 = (xq.double() * xs.double()) @ w.dequantize(torch.float64).t() + r.double()
    out8 = fp8_linear(x, w, r, activations="fp8-reference")
    assert ((out8.double() - ref8).norm() / ref8.norm()) < (1e-6 if dtype == torch.float32 else 1e-2)
    with pytest.raises(ValueError, match="activations"):
        fp8_linear(x, w, r, activations="int8")


def test_config_and_device_checks(monkeypatch):
    assert EngineConfig(quantization="fp8").quantization == "fp8"
    assert EngineConfig().quantization is None
    with pytest.raises(ConfigError, match="quantization"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="quantization"):
        check_quantization("fp4", "cpu")
    check_quantization("fp8", "cpu")
    # below sm89 the refusal names the GPU
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Tesla T4")
    with pytest.raises(ValueError, match=r"Tesla T4.*sm75"):
        check_quantization("fp8", "cuda")


def test_model_stores_linear_weights_in_fp8():
    from pagedlab.model import LlamaModel
    from pagedlab.weights import random_checkpoint
    ckpt = random_checkpoint(tiny_config(vocab_size=301, hidden_size=80, intermediate_size=144), seed=4)
    plain = LlamaModel(ckpt.config, ckpt.tensors, "cpu", torch.float32)
    m = LlamaModel(ckpt.config, ckpt.tensors, "cpu", torch.float32, quantization="fp8")
    for layer in m.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            assert isinstance(layer[name], FP8Weight)
        assert layer["attn_norm"].dtype == torch.float32
    assert m.embed.dtype == torch.float32                  # the lookup table stays
    assert isinstance(m.lm_head, FP8Weight)                # tied: the head gets its own fp8 copy
    assert torch.equal(m.lm_head.dequantize(), quantize_weight(ckpt.tensors["model.embed_tokens.weight"]).dequantize())
    assert torch.equal(m.layers[0]["qkv"].dequantize(), quantize_weight(plain.layers[0]["qkv"]).dequantize())
    # bytes: a byte per linear weight and 4 per output row, against 4 per weight
    c = ckpt.config
    lin = sum(layer[n].q.numel() for layer in m.layers for n in ("qkv", "o", "gate_up", "down"))
    rows = sum(layer[n].q.shape[0] for layer in m.layers for n in ("qkv", "o", "gate_up", "down"))
    emb = c.vocab_size * c.hidden_size
    assert m.num_bytes() == plain.num_bytes() - 4 * lin + lin + 4 * rows + emb + 4 * c.vocab_size


@pytest.mark.slow
def test_fp8_engine_greedy_on_smollm2(smollm2, smollm2_llm):
    """SmolLM2's greedy continuations with FP8 weights, checked token by token against the
    unquantized model under teacher forcing: its argmax agrees with the FP8 engine's choice as
    often as measured (docs/quantization.md: 88% of next tokens on the shipped text, fp32
    activations), and the FP8 engine picks its own model's argmax (the engine adds no error)."""
    from pagedlab import LLM, SamplingParams
    from pagedlab.bench.fp8 import teacher_forced_logits
    # many prompts, few tokens: on the CPU a step's cost is converting the fp8 weights, whatever the batch
    prompts = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):",
               "Three facts about the moon:", "The best way to learn a language is", "Once upon a time,"]
    llm = LLM(checkpoint=smollm2, tokenizer=smollm2_llm.tokenizer, device="cpu", max_num_seqs=6,
              max_model_len=128, show_progress=False, quantization="fp8")
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    agree = own = total = 0
    for o in outs:
        seq = list(o.prompt_token_ids) + list(o.token_ids)
        n = len(o.token_ids)
        ref = teacher_forced_logits(smollm2_llm.model, seq)[-n - 1:-1].argmax(-1).tolist()
        mine = teacher_forced_logits(llm.model, seq)[-n - 1:-1].argmax(-1).tolist()
        agree += sum(a == b for a, b in zip(ref, o.token_ids))
        own += sum(a == b for a, b in zip(mine, o.token_ids))
        total += n
    print(f"agreement {agree}/{total}, own {own}/{total}")
    assert own / total >= 0.97, f"the FP8 engine's tokens are its model's argmax at {own}/{total}"
    assert agree / total >= 0.80, f"unquantized argmax agrees with FP8's tokens at {agree}/{total}"

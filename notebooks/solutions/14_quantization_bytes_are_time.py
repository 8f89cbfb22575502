# Solutions to notebook 14. Run from the notebook (uses ckpt, cfg, quantize_fp8, dequantize_fp8,
# quant_course, torch).
import dataclasses

from pagedlab.config import LLAMA_3_2_1B


def rel(w, back):
    return ((back.double() - w.double()).norm() / w.double().norm()).item()


# 1. Per tensor vs per channel. One scale for the whole matrix is set by its largest value: rows
#    whose values are much smaller than that use only the bottom of e4m3's range, where the steps
#    are coarse (subnormals) -- their relative error grows. With an outlier row (x100), every
#    OTHER row is pushed 100x further down the range; per channel, only the outlier row has its
#    own scale and nothing else changes.
w = ckpt.tensors["model.layers.0.mlp.down_proj.weight"].float()


def per_tensor(w):
    s = w.abs().max() / 448.0
    return (w / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s


for name, m in (("as is", w), ("row 0 x 100", torch.cat([w[:1] * 100, w[1:]]))):
    pc = dequantize_fp8(*quantize_fp8(m))
    pt = per_tensor(m)
    print(f"{name:12s} per channel {rel(m, pc):.4f} (other rows {rel(m[1:], pc[1:]):.4f}); "
          f"per tensor {rel(m, pt):.4f} (other rows {rel(m[1:], pt[1:]):.4f})")


# 2. e5m2: 2 mantissa bits instead of 3, so each value is rounded twice as coarsely (within 2^-3
#    instead of 2^-4): about twice the error. Its extra exponent bit buys range (up to 57344, down
#    to 2^-16), which weights -- scaled per channel into a narrow band -- do not need, and gradients
#    (spanning many orders of magnitude) do.
def e5m2_round_trip(w):
    amax = w.abs().amax(dim=1)
    s = torch.where(amax > 0, amax / 57344.0, torch.ones_like(amax))
    return (w / s[:, None]).clamp(-57344, 57344).to(torch.float8_e5m2).float() * s[:, None]


print(f"e4m3 {rel(w, dequantize_fp8(*quantize_fp8(w))):.4f}, e5m2 {rel(w, e5m2_round_trip(w)):.4f}")


# 3. Llama-3.1-8B: about 16 GB per token in bf16 and 8 GB in FP8 (its LM head is untied: the
#    embedding is read one row per token, the head whole). At 4.8 TB/s: ~300 and ~600 tokens/s at
#    most, i.e. 3.3 ms and 1.7 ms per step -- a fixed cost of ~0.33 ms per step is a far smaller
#    share of that than of Llama-3.2-1B's 0.73 ms FP8 step (measured on the H200), so the bigger
#    model gets closer to its floor, and FP8's gain is nearer the full 2x.
llama8b = dataclasses.replace(LLAMA_3_2_1B, hidden_size=4096, intermediate_size=14336, num_layers=32,
                              num_heads=32, num_kv_heads=8, head_dim=128, tie_word_embeddings=False,
                              name="Llama-3.1-8B")
for name, b in (("bf16", 2), ("fp8", 1)):
    r = quant_course.weight_bytes_per_token(llama8b, b)
    print(f"Llama-3.1-8B {name}: {r['total'] / 1e9:.2f} GB per token -> "
          f"{4.8e12 / r['total']:,.0f} tokens/s at most ({r['total'] / 4.8e12 * 1e3:.2f} ms per step)")

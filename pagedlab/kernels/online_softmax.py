"""The online-softmax update that both attention kernels (prefill and decode) run per K/V tile.

Attention over a long context is computed tile by tile, never holding the whole score row. Each
query row keeps a running max m, a running sum l of exp(s - m) and an output accumulator acc;
a new tile of scores s [rows, tile] (already in log2 units, masked with -inf) and its values v
[tile, D] update them:

    m' = max(m, max(s));  alpha = 2^(m - m');  p = 2^(s - m')
    l' = l * alpha + sum(p);  acc' = acc * alpha + p @ v

and the output is acc / l at the end (flash attention's recurrence). Scores are in log2 units
because the launchers fold LOG2E into the softmax scale: exp(x) = 2^(x * log2(e)).
"""
import triton
import triton.language as tl

LOG2E = 1.4426950408889634          # log2(e)


@triton.jit
def online_softmax_update(acc, m_i, l_i, s, v, IEEE: tl.constexpr):
    """One tile: returns the updated (acc [rows, D], m [rows], l [rows]). IEEE: fp32 dot
    products in full precision (the fp32 path), else the tensor cores' default."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i

# Solutions to notebook 04. Run from the notebook (uses triton, tl, torch, DEVICE, DTYPE, T, HQ, HKV, D, q, k, tol).
from pagedlab.kernels.rope import rope_cos_sin, rope_torch


# 1. RoPE: one program per token, all query heads as a [HQ, D/2] tile.
@triton.jit
def rope_kernel(x_ptr, o_ptr, pos_ptr, cs_ptr, H: tl.constexpr, HALF: tl.constexpr):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    offs_h = tl.arange(0, H)[:, None]
    offs_d = tl.arange(0, HALF)[None, :]
    cos = tl.load(cs_ptr + pos * 2 * HALF + offs_d)
    sin = tl.load(cs_ptr + pos * 2 * HALF + HALF + offs_d)
    base = t * H * 2 * HALF + offs_h * 2 * HALF + offs_d
    x1 = tl.load(x_ptr + base).to(tl.float32)
    x2 = tl.load(x_ptr + base + HALF).to(tl.float32)
    tl.store(o_ptr + base, (x1 * cos - x2 * sin).to(o_ptr.dtype.element_ty))
    tl.store(o_ptr + base + HALF, (x2 * cos + x1 * sin).to(o_ptr.dtype.element_ty))


cs = rope_cos_sin(D, 500000.0, T, device=DEVICE)
pos = torch.arange(T, device=DEVICE)
out = torch.empty_like(q)
rope_kernel[(T,)](q, out, pos, cs, H=HQ, HALF=D // 2)
torch.testing.assert_close(out, rope_torch(q, k, pos, cs)[0], **tol)
print("our RoPE kernel == rope_torch")


# 2. Two phases: tiles fully in the past (no mask), then the tiles on the diagonal (masked).
@triton.jit
def _tile(acc, m, l, q, k_ptr, v_ptr, start, offs_m, offs_n, offs_d, T, kvh, scale,
          HKV: tl.constexpr, D: tl.constexpr, MASK: tl.constexpr):
    kn = start + offs_n
    k = tl.load(k_ptr + (kn[:, None] * HKV + kvh) * D + offs_d[None, :], mask=kn[:, None] < T, other=0.0)
    v = tl.load(v_ptr + (kn[:, None] * HKV + kvh) * D + offs_d[None, :], mask=kn[:, None] < T, other=0.0)
    s = tl.dot(q, tl.trans(k)) * scale
    if MASK:
        s = tl.where((kn[None, :] <= offs_m[:, None]) & (kn[None, :] < T), s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v), m_new, l * alpha + tl.sum(p, axis=1)


@triton.jit
def flash2_kernel(q_ptr, k_ptr, v_ptr, o_ptr, T, scale, HQ: tl.constexpr, HKV: tl.constexpr,
                  D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m, h = tl.program_id(0), tl.program_id(1)
    kvh = h // (HQ // HKV)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + (offs_m[:, None] * HQ + h) * D + offs_d[None, :], mask=offs_m[:, None] < T, other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    full_end = (pid_m * BLOCK_M // BLOCK_N) * BLOCK_N
    for start in range(0, full_end, BLOCK_N):
        acc, m, l = _tile(acc, m, l, q, k_ptr, v_ptr, start, offs_m, offs_n, offs_d, T, kvh, scale, HKV, D, False)
    for start in range(full_end, (pid_m + 1) * BLOCK_M, BLOCK_N):
        acc, m, l = _tile(acc, m, l, q, k_ptr, v_ptr, start, offs_m, offs_n, offs_d, T, kvh, scale, HKV, D, True)
    tl.store(o_ptr + (offs_m[:, None] * HQ + h) * D + offs_d[None, :],
             (acc / l[:, None]).to(o_ptr.dtype.element_ty), mask=offs_m[:, None] < T)


bm = 16 if DEVICE == "cpu" else 64
out2 = torch.empty_like(q)
flash2_kernel[(triton.cdiv(T, bm), HQ)](q, k, v, out2, T, D ** -0.5, HQ=HQ, HKV=HKV, D=D, BLOCK_M=bm, BLOCK_N=bm)
torch.testing.assert_close(out2, ours, **tol)
print("two-phase kernel == the one-phase kernel")

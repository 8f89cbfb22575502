"""Solutions to the Triton kernels the notebooks ask you to complete (each checked by a
course.check_* cell). Read one with course.show_solution("name"); PAGEDLAB_SOLUTIONS=1 makes every
check use these. (A file of its own: it needs Triton, the other pieces do not.)"""
import triton
import triton.language as tl


# -- 04 -----------------------------------------------------------------------------------------
@triton.jit
def rmsnorm_kernel(x_ptr, w_ptr, out_ptr, H, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)                      # one program per token row
    offs = tl.arange(0, BLOCK)                  # BLOCK >= H lanes
    mask = offs < H                             # the lanes past the row's end do nothing
    x = tl.load(x_ptr + row * H + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * H + offs, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def flash_attn_kernel(q_ptr, k_ptr, v_ptr, o_ptr, T, scale, HQ: tl.constexpr, HKV: tl.constexpr,
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
    for start in range(0, (pid_m + 1) * BLOCK_M, BLOCK_N):          # causal: no key after the last query
        kn = start + offs_n
        kv_mask = kn[:, None] < T
        k = tl.load(k_ptr + (kn[:, None] * HKV + kvh) * D + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + (kn[:, None] * HKV + kvh) * D + offs_d[None, :], mask=kv_mask, other=0.0)
        # the tile's scores, the future (and keys past T) masked out, then the online softmax's update
        s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where((kn[None, :] <= offs_m[:, None]) & (kn[None, :] < T), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)                   # what the old terms must be scaled by
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    tl.store(o_ptr + (offs_m[:, None] * HQ + h) * D + offs_d[None, :],
             (acc / l[:, None]).to(o_ptr.dtype.element_ty), mask=offs_m[:, None] < T)

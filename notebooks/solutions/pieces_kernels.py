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

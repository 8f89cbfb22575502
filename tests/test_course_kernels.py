"""Notebook 04's check (pagedlab.course.checks.check_rmsnorm_kernel): the course's Triton kernel passes; a
stub and planted bugs fail with the hint that names each. Triton kernels run in its interpreter on
a CPU (conftest sets TRITON_INTERPRET=1 before any kernel is defined)."""
from __future__ import annotations

import pytest

from pagedlab.course import checks

triton = pytest.importorskip("triton")
tl = triton.language


@pytest.fixture(autouse=True)
def _no_solutions(monkeypatch):
    monkeypatch.delenv("PAGEDLAB_SOLUTIONS", raising=False)


def fails(check, fn, *words):
    with pytest.raises(checks.CheckFailed) as e:
        check(fn)
    msg = str(e.value)
    for w in words:
        assert w in msg, (w, msg)
    return msg


@triton.jit
def _rms_stub(x_ptr, w_ptr, out_ptr, H, eps, BLOCK: tl.constexpr):
    pass                                            # the notebook's stub: stores nothing


@triton.jit
def _rms_mean_over_block(x_ptr, w_ptr, out_ptr, H, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(x_ptr + row * H + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / BLOCK + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * H + offs, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_no_eps(x_ptr, w_ptr, out_ptr, H, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(x_ptr + row * H + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * H + offs, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_no_weight(x_ptr, w_ptr, out_ptr, H, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(x_ptr + row * H + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    tl.store(out_ptr + row * H + offs, (x * rstd).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_first_row_only(x_ptr, w_ptr, out_ptr, H, eps, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)                      # forgets program_id: every program does row 0
    mask = offs < H
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def test_rmsnorm_kernel_check(capsys):
    from pagedlab import course
    sol = checks.solution("rmsnorm_kernel")
    assert course.check_rmsnorm_kernel(sol) is sol and "\u2713" in capsys.readouterr().out
    msg = fails(checks.check_rmsnorm_kernel, _rms_stub, "rmsnorm_kernel is not written yet", "stored nothing",
                "show_solution('rmsnorm_kernel')")
    fails(checks.check_rmsnorm_kernel, _rms_mean_over_block, "divides by H = 5", "not by BLOCK = 8")
    fails(checks.check_rmsnorm_kernel, _rms_no_eps, "row of zeros", "add eps")
    fails(checks.check_rmsnorm_kernel, _rms_no_weight, "multiply by the weight w")
    fails(checks.check_rmsnorm_kernel, _rms_first_row_only, "rows [1, 2]", "never stored")
    assert "Traceback" not in msg
    checks.show_solution("rmsnorm_kernel")
    shown = capsys.readouterr().out
    assert "@triton.jit" in shown and "def rmsnorm_kernel" in shown and "tl.sqrt" in shown


def test_rmsnorm_kernel_solutions_switch(monkeypatch):
    monkeypatch.setenv("PAGEDLAB_SOLUTIONS", "1")
    got = checks.check_rmsnorm_kernel(_rms_stub)
    assert got is not _rms_stub and got.fn.__name__ == "rmsnorm_kernel"


# -- 04's second piece: the tile loop of causal flash attention --------------------------------------

@triton.jit
def _flash_planted(q_ptr, k_ptr, v_ptr, o_ptr, T, scale, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BUG: tl.constexpr):
    """The course's kernel with planted bug BUG (0: none; -1: the notebook's stub, an empty loop)."""
    pid_m, h = tl.program_id(0), tl.program_id(1)
    kvh = h % HKV if BUG == 6 else h // (HQ // HKV)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + (offs_m[:, None] * HQ + h) * D + offs_d[None, :], mask=offs_m[:, None] < T, other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start in range(0, (pid_m + 1) * BLOCK_M, BLOCK_N):
        kn = start + offs_n
        kv_mask = kn[:, None] < T
        k = tl.load(k_ptr + (kn[:, None] * HKV + kvh) * D + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + (kn[:, None] * HKV + kvh) * D + offs_d[None, :], mask=kv_mask, other=0.0)
        if BUG != -1:
            s = tl.dot(q, tl.trans(k)) * (1.0 if BUG == 5 else scale)
            if BUG == 3:
                s = tl.where(kn[None, :] < T, s, float("-inf"))
            elif BUG == 4:
                s = tl.where((kn[None, :] < offs_m[:, None]) & (kn[None, :] < T), s, float("-inf"))
            else:
                s = tl.where((kn[None, :] <= offs_m[:, None]) & (kn[None, :] < T), s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l = l * (1.0 if BUG == 2 else alpha) + tl.sum(p, axis=1)
            if BUG == 1:
                acc = acc + tl.dot(p.to(v.dtype), v)
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
    tl.store(o_ptr + (offs_m[:, None] * HQ + h) * D + offs_d[None, :],
             (acc / l[:, None]).to(o_ptr.dtype.element_ty), mask=offs_m[:, None] < T)


class _Planted:
    """kernel[grid](...) as the check launches it, with the planted bug's flag added."""

    def __init__(self, bug):
        self.bug = bug

    def __getitem__(self, grid):
        return lambda *a, **kw: _flash_planted[grid](*a, BUG=self.bug, **kw)


def test_flash_kernel_check(capsys):
    sol = checks.solution("flash_attn_kernel")
    assert checks.check_flash_kernel(sol) is sol and "\u2713 flash_attn_kernel" in capsys.readouterr().out
    assert checks.check_flash_kernel(_Planted(0)) is not None                 # the planted kernel itself is right
    fails(checks.check_flash_kernel, _Planted(-1), "flash_attn_kernel is not written yet", "NaN",
          "show_solution('flash_attn_kernel')")
    for bug, words in [(1, "acc is not rescaled"), (2, "l is not rescaled"), (3, "the future is not masked"),
                       (4, "the diagonal is masked too"), (5, "not scaled"), (6, "another KV head")]:
        fails(checks.check_flash_kernel, _Planted(bug), "off by", words)

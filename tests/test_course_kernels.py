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

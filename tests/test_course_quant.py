"""Notebook 14's check (pagedlab.course.quant.check_fp8): the course's solution passes and is
returned; a stub and each usual mistake in per-channel FP8 fail with the hint that names it."""
import pytest
import torch

from pagedlab.course import quant as qc
from pagedlab.course.chapter import CheckFailed

FP8, MAX = torch.float8_e4m3fn, 448.0


@pytest.fixture(autouse=True)
def _no_solutions(monkeypatch):
    monkeypatch.delenv("PAGEDLAB_SOLUTIONS", raising=False)


def dequantize(codes, scale):
    return codes.float() * scale[:, None]


def quantizer(amax=lambda w: w.abs().amax(dim=1), zero_row=True, clamp=True, refuse=True,
              divide=lambda w, s: w / s[:, None]):
    """The course's quantize_fp8 with one step done another way."""
    def quantize_fp8(w):
        w = w.float()
        if refuse and not torch.isfinite(w).all():
            raise ValueError("non-finite")
        a = amax(w)
        scale = torch.where(a > 0, a / MAX, torch.ones_like(a)) if zero_row else a / MAX
        x = divide(w, scale)
        return (x.clamp(-MAX, MAX) if clamp else x).to(FP8), scale
    return quantize_fp8


def fails(q, d, *words):
    with pytest.raises(CheckFailed) as e:
        qc.check_fp8(q, d)
    msg = str(e.value)
    for w in words:
        assert w in msg, (w, msg)
    return msg


def test_solution_passes_and_is_returned(capsys):
    q, d = qc.solution("quantize_fp8"), qc.solution("dequantize_fp8")
    assert qc.check_fp8(q, d) == (q, d) and "\u2713" in capsys.readouterr().out
    assert qc.check_fp8(quantizer(), dequantize)                 # the variant helper itself is right


def test_solutions_switch(monkeypatch):
    monkeypatch.setenv("PAGEDLAB_SOLUTIONS", "1")
    q, d = qc.check_fp8(None, None)
    assert q.__name__ == "quantize_fp8" and d.__name__ == "dequantize_fp8"


def test_stubs_say_not_written():
    def stub(*a):
        raise NotImplementedError("quantize each row")
    fails(stub, dequantize, "quantize_fp8 is not written yet", "quant_course.show_solution('quantize_fp8')")
    fails(quantizer(), stub, "dequantize_fp8 is not written yet")


@pytest.mark.parametrize("bug,words", [
    (dict(amax=lambda w: w.abs().amax().expand(w.shape[0])), ["ONE scale for the whole tensor"]),
    (dict(amax=lambda w: w.amax(dim=1)), ["largest MAGNITUDE", "w.abs().amax(dim=1)"]),
    (dict(zero_row=False), ["all-zero row", "scale 1.0"]),
    (dict(refuse=False), ["accepted a weight holding inf", "raise ValueError"]),
    (dict(amax=lambda w: w.abs().amax(dim=0)), ["raised RuntimeError", "scale[:, None]", "amax over dim=0"]),
    (dict(divide=lambda w, s: w / s.max()), ["divide each ROW by its own scale"]),
])
def test_mistakes_are_named(bug, words):
    fails(quantizer(**bug), dequantize, *words)


@pytest.mark.parametrize("deq,words", [(lambda c, s: c.float() * s, ["dequantize_fp8 raised", "scale[:, None]"]),
                                       (lambda c, s: c.float(), ["times their row's scale", "q.float() * scale[:, None]"])])
def test_dequantize_mistakes_are_named(deq, words):
    fails(quantizer(), deq, *words)

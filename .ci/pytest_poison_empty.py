"""pytest -p pytest_poison_empty (PYTHONPATH=.ci): torch.empty / empty_like / Tensor.new_empty
return memory filled with values that fail loudly when read (int: huge, an illegal address as an
index; float: NaN), so that a kernel or an op reading memory nobody wrote fails every time instead
of now and then, as the caching allocator's leftovers decide. A hunting tool for flaky GPU failures
(docs/kernels.md, session 25: `GPU_SUITE_POISON=1 .ci/gpu gpu-suite`); the fills cost a launch per
tensor, so never for timing."""
import torch

_POISON = {torch.float32: float("nan"), torch.float16: float("nan"), torch.bfloat16: float("nan"),
           torch.float64: float("nan"), torch.int64: 2**62 + 12345, torch.int32: 2**30 + 12345,
           torch.int16: 30000, torch.uint8: 255, torch.int8: 127}


def _poison(t):
    v = _POISON.get(t.dtype)
    if v is not None and t.numel() and t.device.type != "meta":
        try:
            t.fill_(v)
        except Exception:
            pass
    return t


_empty, _empty_like, _new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty


def empty(*a, **k):
    return _poison(_empty(*a, **k))


def empty_like(*a, **k):
    return _poison(_empty_like(*a, **k))


def new_empty(self, *a, **k):
    return _poison(_new_empty(self, *a, **k))


torch.empty, torch.empty_like, torch.Tensor.new_empty = empty, empty_like, new_empty

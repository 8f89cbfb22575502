"""Scratch memory of the split kernels -- partial sums and arrival counters -- and who owns it.

gemv.py's split-K launches and split_kv decode attention divide one output among several programs;
each writes a partial result, counts its arrival on a counter, and the program that arrives last
sums the partials and sets the counter back to zero. That memory is allocated once per shape and
reused, so a launch can live in a CUDA graph (the graph keeps the addresses it was captured with).

Reuse is safe only between launches that run one after the other. Two engines in one process can
run kernels AT THE SAME TIME on one GPU -- one engine's graph capture warms up on a side stream
while another engine (a server's thread) steps on the default stream -- and with one shared pool
their counts and partials would mix: wrong sums, NaN, a token past the vocabulary. So each model
owns its scratch: LlamaModel.forward runs under `owned_by(self.scratch)`, and every launch in it
(eager steps, warm-up, graph capture) takes its buffers from that model's dict; they are freed
with the model. Kernels called outside a model (tests, benchmarks) use the process-wide default
dict, as before.
"""
from __future__ import annotations

import contextlib
import contextvars

DEFAULT: dict = {}        # outside any model's forward
_OWNER: contextvars.ContextVar[dict] = contextvars.ContextVar("pagedlab_scratch", default=DEFAULT)


def get(key, device, make):
    """The current owner's buffer for `key` (a tuple naming the kernel and the shape), made by
    make() the first time (_made: on `device`'s default stream)."""
    pool = _OWNER.get()
    buf = pool.get(key)
    if buf is None:
        buf = pool[key] = _made(make, device)
    return buf


def _made(make, device):
    """make(), its memory from the default stream's pool and its zeros visible to the current
    stream. A model's scratch is first made in a graph capture's warm-up, on the capture's side
    stream, and is freed with the model while the default stream may still run kernels that use it:
    the default stream's blocks are reused only by work queued after those kernels."""
    import torch
    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return make()
    here, home = torch.cuda.current_stream(device), torch.cuda.default_stream(device)
    if here == home:
        return make()
    with torch.cuda.stream(home):
        buf = make()
    here.wait_stream(home)
    return buf


def current() -> dict:
    """The dict launches take their scratch from now."""
    return _OWNER.get()


@contextlib.contextmanager
def owned_by(pool: dict):
    """Launches in this block (this thread, this task) take their scratch from `pool`."""
    token = _OWNER.set(pool)
    try:
        yield pool
    finally:
        _OWNER.reset(token)

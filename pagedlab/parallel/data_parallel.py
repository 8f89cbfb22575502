"""Data parallelism: D independent copies of the engine (replicas), and a router that hands each
one a share of the requests.

    router (rank 0)  --work-->   replica r (its own scheduler, KV pool, and T ranks if T > 1)
                     <--outputs--

The router balances by estimated work: each request goes, in arrival order, to the replica with
the least work assigned so far, counting prompt tokens + max new tokens. Replicas never talk to
each other -- that is the whole point: no collective in the step, each GPU runs at full speed on
its own batch, and throughput adds up. What it costs: every replica holds the whole model.

Seeds are drawn by the router exactly as one engine would draw them, so a request's output is the
same whichever replica runs it (sampling depends only on the request's seed and position).
Work and outputs are Python objects sent over torch.distributed (gloo: send/recv_object_list).
"""
from __future__ import annotations

import threading
import traceback

import torch.distributed as dist


def assign(costs: list[int], num_replicas: int) -> list[int]:
    """Replica of each request: in arrival order, the one with the least work so far (ties: the
    lowest replica index). Returns a list as long as costs."""
    load, out = [0] * num_replicas, []
    for c in costs:
        r = min(range(num_replicas), key=lambda i: (load[i], i))
        load[r] += c
        out.append(r)
    return out


def request_cost(ids: list[int], params) -> int:
    """A request's estimated work: its prompt tokens plus the most new tokens it may make."""
    return len(ids) + params.max_new_tokens


class RemoteError:
    """A replica's exception, sent back to the router instead of outputs."""

    def __init__(self, rank: int, text: str):
        self.rank, self.text = rank, text


class Stopped(Exception):
    """A replica's work list ended early: rank 0 was interrupted (WorldSpec.stop)."""


STOPPED = "stopped"             # a replica's answer to a work list it ended early


class Stoppable:
    """An EngineCore whose step() raises Stopped once `stop` is set: run_requests then aborts the
    work list's unfinished requests (as for a Ctrl-C), and the replica answers STOPPED."""

    def __init__(self, core, stop):
        self._core, self._stop = core, stop

    def step(self):
        if self._stop is not None and self._stop.value:
            raise Stopped
        return self._core.step()

    def __getattr__(self, name):
        return getattr(self._core, name)


def send(obj, dst: int, group) -> None:
    dist.send_object_list([obj], dst=dst, group=group)


def recv(src: int, group):
    box = [None]
    dist.recv_object_list(box, src=src, group=group)
    return box[0]


def collect(sources: list[int], group, stop) -> dict:
    """{rank: its answer} from every replica leader in `sources` (the work lists just sent). The
    answers are received on a helper thread, so that a Ctrl-C while this one waits is not held up
    by the receive (a C call): it sets `stop`, the replicas end their work lists at their next step
    and answer, and once every answer is in (the router stays in step with them) the
    KeyboardInterrupt is raised. Without it, rank 0 interrupted during generate() waited until each
    replica had finished its whole share."""
    answers, failed = {}, []

    def receive():
        try:
            for src in sources:
                answers[src] = recv(src, group)
        except BaseException as e:       # noqa: BLE001 -- raised on the caller's thread
            failed.append(e)
    t = threading.Thread(target=receive, name="pagedlab-dp-collect", daemon=True)
    t.start()
    interrupted = False
    while t.is_alive():
        try:
            t.join(0.5)
        except KeyboardInterrupt:
            interrupted = True
            stop.value = 1
    if failed:
        raise failed[0]
    if interrupted:
        raise KeyboardInterrupt
    return answers


def serve_replica(rank: int, spec, tensors: dict, group, router, fail_at=None) -> None:
    """Replica leader (tensor-parallel rank 0 of replica rank // T > 0): build its own engine, then
    run each work list the router sends (None: leave) and send back the outputs."""
    import torch

    from ..engine_core import run_requests
    from ..rank import build_engine, build_model
    model = build_model(spec.config, tensors, spec.device(rank), getattr(torch, spec.dtype), spec.engine_config,
                        spec.backend, spec.kernel_options, tp=group, presharded=True)
    _, core, outputs = build_engine(model, spec.tokenizer, spec.engine_config)
    calls = 0
    while (work := recv(0, router)) is not None:
        calls += 1
        if calls == fail_at:
            raise RuntimeError(f"injected failure on rank {rank} at call {calls}")
        try:
            out = run_requests(Stoppable(core, spec.stop), outputs, work)
        except Stopped:
            out = STOPPED
        except Exception:
            out = RemoteError(rank, traceback.format_exc())
        send(out, 0, router)
    if group is not None:
        group.send_step(None)                  # its own tensor-parallel ranks leave too

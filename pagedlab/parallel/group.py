"""The ranks of one model copy and how they talk: torch.distributed, NCCL on GPUs and gloo on CPU.

Two kinds of traffic, two process groups over the same ranks:

    device group  the model's collectives: all-reduce after each row-parallel matmul, all-gather of
                  the logits (NCCL between GPUs -- also inside captured CUDA graphs; gloo on CPU)
    cpu group     rank 0 -> the others, once per step: the step's inputs as one int64 tensor
                  (`send_step` / `recv_step`, gloo broadcasts), so every rank runs the same step

Rank 0 runs the scheduler; the other ranks only ever wait for the next step and run it
(workers.py). The step message is the host data ModelRunner already builds for its one host ->
device copy, so every rank builds identical device inputs from it.

If anything raises inside a step on rank 0 (a peer died, a collective failed), the ranks are no
longer in step: the group is marked stopped and WorkerFailed (fatal: the engine does not retry it)
names the rank and its error. A Ctrl-C during a step's collectives is held until the step is
issued on every rank, then raised as usual.
"""
from __future__ import annotations

import contextlib
import signal
import threading

import torch
import torch.distributed as dist

from ..runner import StepInputs

KINDS = ("exit", "pack", "replay")


class WorkerFailed(RuntimeError):
    """A rank of a tensor/data-parallel LLM failed; its workers are shut down. Create a new LLM."""
    fatal = True


class ParallelGroup:
    def __init__(self, rank: int, ranks: list[int], device_group, cpu_group, on_failure=None):
        self.rank, self.size = rank, len(ranks)       # rank within the group; 0 runs the scheduler
        self.ranks = ranks                            # their global ranks (torch.distributed's)
        self.device_group, self.cpu_group = device_group, cpu_group
        self.on_failure = on_failure                  # rank 0: () -> message of the rank that failed
        self.on_stop = None                           # rank 0: () -> None, stops every process
        self.stopped: str | None = None

    # -- the model's collectives ---------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum t over the ranks, in place."""
        dist.all_reduce(t, group=self.device_group)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[rows, cols] on every rank -> [rows, size * cols], rank 0's columns first."""
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=-1)

    def agree_min(self, n: int) -> int:
        """The smallest n over the ranks (e.g. KV blocks: each rank's free memory differs)."""
        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t)

    # -- rank 0 -> the others: one message per step ---------------------------------------------
    def send_step(self, step: StepInputs | None) -> None:
        """Broadcast a step (None: exit) as [kind, #edits, #parts, part lengths, edits, data]."""
        if self.stopped:
            raise WorkerFailed(self.stopped)
        if step is None:
            msg = [0, 0, 0]
        else:
            edits = [x for e in step.table_edits for x in e]
            parts = step.data if step.kind == "pack" else [[x for row in step.data for x in row]]
            msg = [KINDS.index(step.kind), len(step.table_edits), len(parts), *map(len, parts), *edits]
            for part in parts:
                msg += part
        body = torch.tensor(msg, dtype=torch.int64)
        dist.broadcast(torch.tensor([len(msg)], dtype=torch.int64), self.ranks[0], group=self.cpu_group)
        dist.broadcast(body, self.ranks[0], group=self.cpu_group)

    def recv_step(self) -> StepInputs | None:
        n = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(n, self.ranks[0], group=self.cpu_group)
        body = torch.zeros(int(n), dtype=torch.int64)
        dist.broadcast(body, self.ranks[0], group=self.cpu_group)
        msg = body.tolist()
        kind, n_edits, n_parts = KINDS[msg[0]], msg[1], msg[2]
        if kind == "exit":
            return None
        lens, pos = msg[3:3 + n_parts], 3 + n_parts
        edits = [tuple(msg[pos + 3 * i: pos + 3 * i + 3]) for i in range(n_edits)]
        pos += 3 * n_edits
        parts = []
        for n in lens:
            parts.append(msg[pos:pos + n])
            pos += n
        if kind == "replay":
            flat = parts[0]
            parts = [tuple(flat[i:i + 6]) for i in range(0, len(flat), 6)]
        return StepInputs(kind, edits, parts)

    @contextlib.contextmanager
    def step_section(self):
        """Rank 0's part of a step that the other ranks mirror. A Ctrl-C inside is held until the
        section ends (then raised); any error inside stops the group (WorkerFailed)."""
        interrupted = []
        old = None
        if threading.current_thread() is threading.main_thread():
            old = signal.signal(signal.SIGINT, lambda *_: interrupted.append(True))
        try:
            yield
        except Exception as e:
            self.stop(e)
        finally:
            if old is not None:
                signal.signal(signal.SIGINT, old)
        if interrupted:
            raise KeyboardInterrupt

    def stop(self, error: BaseException) -> None:
        """The ranks are out of step: mark the group stopped and raise WorkerFailed naming why."""
        cause = self.on_failure() if self.on_failure else None
        self.stopped = (f"{cause}" if cause else
                        f"rank 0 failed during a step: {type(error).__name__}: {error}") + \
            " -- the parallel workers were shut down; create a new LLM"
        if self.on_stop is not None:
            self.on_stop()                 # the other ranks may wait in a collective: end them
        raise WorkerFailed(self.stopped) from error

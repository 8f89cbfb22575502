"""Worker processes: one per rank, started with torch.multiprocessing, joined by torch.distributed.

    LLM(model, tensor_parallel_size=T, data_parallel_size=D)       T * D ranks, rank 0 = this process

    global rank g = replica * T + tp_rank        device cuda:g on GPUs (or the CPU)
    rank 0          this process: loads the checkpoint, sends every rank its cut of the weights,
                    runs replica 0's scheduler and (D > 1) the router (data_parallel.py)
    tp_rank 0 of    runs its replica's engine: requests from the router in, outputs back
    replica > 0
    tp_rank > 0     waits for its replica's next step (group.recv_step) and runs it; nothing else

Shutdown is one message down the same paths (an empty step, an empty work list), then a join; a
process that does not leave in time is terminated. Workers ignore SIGINT (Ctrl-C is for rank 0,
which finishes the step it is in), and a worker that raises writes its traceback to the error
queue and exits: its peers' next collective fails, and rank 0 reports the worker's error.
"""
from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..interrupts import sigint_ignored
from .group import ParallelGroup, WorkerFailed
from .shard import shard, split_rule

WAIT = timedelta(days=7)        # a worker may wait this long for the next step (an idle engine)
SETUP = timedelta(minutes=10)   # joining the world and receiving the weights
START_TIMEOUT_S = 600.0         # a worker process must have started (imported pagedlab) by then
JOIN_TIMEOUT_S = 20.0
LEAVE_TIMEOUT_S = 20.0
PARENT_CHECK_S = 0.5            # how often a worker looks whether rank 0 is still its parent
FAULT_ENV = "PAGEDLAB_TEST_FAIL_RANK"   # "rank:step": that rank raises at that step (tests only)


@dataclass
class WorldSpec:
    """What every rank needs to build its part (picklable; no weights: those go by send/recv)."""
    tp: int
    dp: int
    device_type: str               # "cpu" or "cuda"
    dtype: str                     # "float32", "bfloat16", ...
    config: object                 # ModelConfig
    engine_config: object          # EngineConfig
    backend: str
    kernel_options: dict | None
    manifest: dict                 # tensor name -> full shape
    init_file: str = ""
    tokenizer: object = None       # replicas > 0 need it (their own engine)
    errors: object = None          # mp SimpleQueue: (rank, traceback) of a failed worker
    ready: object = None           # mp SimpleQueue: each worker's rank once its process runs
    parent_pid: int = 0            # rank 0's process: a worker whose parent is gone exits (watch_parent)
    stop: object = None            # mp RawValue, 1: rank 0 was interrupted, replicas end their work lists

    @property
    def world(self) -> int:
        return self.tp * self.dp

    def device(self, rank: int) -> torch.device:
        return torch.device(f"cuda:{rank}") if self.device_type == "cuda" else torch.device("cpu")


def init_world(rank: int, spec: WorldSpec):
    """Join the world and build the groups (every rank builds every group, in the same order).
    Returns (this rank's tensor-parallel ParallelGroup or None, the router group or None)."""
    if spec.device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("gloo", init_method=f"file://{spec.init_file}", rank=rank,
                            world_size=spec.world, timeout=SETUP)
    mine = None
    for r in range(spec.dp):
        ranks = list(range(r * spec.tp, (r + 1) * spec.tp))
        cpu = dist.new_group(ranks, backend="gloo", timeout=WAIT)
        dev = dist.new_group(ranks, backend="nccl") if spec.device_type == "cuda" else cpu
        if rank in ranks:
            mine = ParallelGroup(rank - ranks[0], ranks, dev, cpu)
    router = dist.new_group([r * spec.tp for r in range(spec.dp)], backend="gloo", timeout=WAIT)
    return (mine if spec.tp > 1 else None), (router if spec.dp > 1 else None)


def send_weights(tensors: dict, spec: WorldSpec, dtype: torch.dtype) -> None:
    """Rank 0 -> every other rank: its cut of each tensor, already in the run dtype."""
    for name in sorted(spec.manifest):
        rule = split_rule(name)
        for g in range(1, spec.world):
            dist.send(shard(tensors[name], rule, g % spec.tp, spec.tp).to(dtype).contiguous(), dst=g)


def recv_weights(rank: int, spec: WorldSpec, dtype: torch.dtype) -> dict:
    out = {}
    for name in sorted(spec.manifest):
        shape = shard(torch.empty(spec.manifest[name], device="meta"), split_rule(name),
                      rank % spec.tp, spec.tp).shape
        out[name] = torch.empty(shape, dtype=dtype)
        dist.recv(out[name], src=0)
    return out


class Workers:
    """Rank 0's handle on the other processes: start, error reports, shutdown."""

    def __init__(self, spec: WorldSpec):
        ctx = mp.get_context("spawn")
        self.spec = spec
        fd, spec.init_file = tempfile.mkstemp(prefix="pagedlab-dist-")
        os.close(fd)
        os.unlink(spec.init_file)                       # the file store creates it
        spec.errors, spec.ready = ctx.SimpleQueue(), ctx.SimpleQueue()
        spec.stop = ctx.RawValue("b", 0)
        spec.parent_pid = os.getpid()
        self.procs = [ctx.Process(target=worker_main, args=(g, spec), name=f"pagedlab-rank{g}", daemon=True)
                      for g in range(1, spec.world)]
        with sigint_ignored():      # they begin with SIGINT ignored: a Ctrl-C while they import
            for p in self.procs:    # (it reaches the whole process group) printed a KeyboardInterrupt
                p.start()           # traceback from each; Ctrl-C is rank 0's to handle
        self.closed = False

    def wait_started(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait until every worker process runs (has imported pagedlab). A worker that dies first --
        most often a script without `if __name__ == "__main__":`, which spawn re-runs in the child --
        is reported at once instead of leaving rank 0 waiting for it to join."""
        started, deadline = set(), time.monotonic() + timeout_s
        while len(started) < len(self.procs):
            while not self.spec.ready.empty():
                started.add(self.spec.ready.get())
            dead = [p for g, p in enumerate(self.procs, 1) if g not in started and not p.is_alive()]
            if dead:
                raise WorkerFailed(
                    f"{dead[0].name} exited with code {dead[0].exitcode} before it started. Worker "
                    f"processes are started with 'spawn', which imports your __main__ script again: in "
                    f"a script, create the LLM under `if __name__ == \"__main__\":`.")
            if time.monotonic() > deadline:
                raise WorkerFailed(f"worker processes did not start within {timeout_s:.0f} s")
            time.sleep(0.02)

    def failure(self, wait_s: float = 2.0) -> str | None:
        """The first failed worker's report (waits a little: it may still be writing it)."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not self.spec.errors.empty():
                rank, tb = self.spec.errors.get()
                return f"rank {rank} failed:\n{tb.rstrip()}"
            if not any(p.is_alive() for p in self.procs) and self.spec.errors.empty():
                break
            time.sleep(0.05)
        dead = [p for p in self.procs if not p.is_alive()]
        if dead:
            return f"{dead[0].name} exited with code {dead[0].exitcode}"
        return None

    def shutdown(self, say_goodbye=None) -> None:
        """Tell the ranks to leave (say_goodbye), leave the world together with them (NCCL's
        teardown flushes every rank's communicator: all ranks call it), join them, terminate any
        that hang. After a failure (a rank is gone) the world is aborted instead of flushed."""
        if self.closed:
            return
        self.closed = True
        clean = say_goodbye is not None and all(p.is_alive() for p in self.procs)
        if clean:
            try:
                say_goodbye()
            except Exception:
                clean = False              # a peer is gone already
        if clean:
            leave_world(True, self.spec.device_type)
            for p in self.procs:
                p.join(JOIN_TIMEOUT_S)
        for p in self.procs:               # out of step (or hanging): a rank may wait in a
            if p.is_alive():               # collective for ever -- end it, then leave the world
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        if not clean:
            leave_world(False, self.spec.device_type)
        if os.path.exists(self.spec.init_file):
            os.unlink(self.spec.init_file)


def leave_world(clean: bool, device_type: str = "cpu", timeout_s: float = LEAVE_TIMEOUT_S) -> bool:
    """Leave torch.distributed on a helper thread, never waiting more than timeout_s (False if it
    did not finish). gloo (CPU): destroy_process_group, with every rank (clean) or alone. NCCL: abort
    the communicators -- a local call; a flushing destroy waits on every rank's communicator and
    was seen to hang (H200 x2, torch 2.11, NCCL 2.28.3, 2026-12-01)."""
    if not dist.is_initialized():
        return True
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    fn = abort if device_type == "cuda" and abort is not None else dist.destroy_process_group

    def run():
        try:
            fn()
        except Exception:
            pass
    t = threading.Thread(target=run, daemon=True, name="pagedlab-leave-world")
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        import warnings
        warnings.warn(f"torch.distributed did not shut down within {timeout_s:.0f} s; this process "
                      "may not start another parallel LLM")
        return False
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    return True


def watch_parent(parent_pid: int, every_s: float = PARENT_CHECK_S) -> None:
    """A daemon thread that ends this worker as soon as rank 0, its parent, is gone (SIGKILLed,
    crashed): the worker is then re-parented, and os.getppid() changes. Without it a worker whose
    rank 0 died during setup waited out torch.distributed's SETUP timeout (10 minutes) in
    init_world. (Not prctl(PR_SET_PDEATHSIG): that fires when the *thread* that started the worker
    ends, and an LLM may be built on a thread that ends before it does.)"""
    if not parent_pid:
        return

    def run():
        while os.getppid() == parent_pid:
            time.sleep(every_s)
        os._exit(1)
    threading.Thread(target=run, name="pagedlab-parent-watch", daemon=True).start()


def worker_main(rank: int, spec: WorldSpec) -> None:
    """Entry point of every rank but 0."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)        # Ctrl-C is rank 0's business (also ignored from the start)
    watch_parent(spec.parent_pid)
    spec.ready.put(rank)
    if spec.device_type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world))
    try:
        group, router = init_world(rank, spec)
        dtype = getattr(torch, spec.dtype)
        tensors = recv_weights(rank, spec, dtype)
        fault = os.environ.get(FAULT_ENV, "")
        fail_at = int(fault.split(":")[1]) if fault and int(fault.split(":")[0]) == rank else None
        if rank % spec.tp == 0:
            from .data_parallel import serve_replica
            serve_replica(rank, spec, tensors, group, router, fail_at)
        else:
            run_steps(rank, spec, tensors, group, fail_at)
    except Exception:
        spec.errors.put((rank, traceback.format_exc()))
        os._exit(1)                      # no clean-up through a broken group: peers see it go
    if spec.device_type == "cuda":
        torch.cuda.synchronize()
    else:
        leave_world(clean=True)          # gloo: together with rank 0 (Workers.shutdown)
    os._exit(0)                          # NCCL: process exit frees the communicators


def build_model(rank: int, spec: WorldSpec, tensors: dict, group):
    from ..rank import build_model as build
    return build(spec.config, tensors, spec.device(rank), getattr(torch, spec.dtype), spec.engine_config,
                 spec.backend, spec.kernel_options, tp=group, presharded=True)


def run_steps(rank: int, spec: WorldSpec, tensors: dict, group: ParallelGroup, fail_at=None) -> None:
    """A tensor-parallel rank > 0: build the model's cut, its KV pool and runner, then run every
    step rank 0 sends until the exit message."""
    from ..engine import kv_cache_for, max_model_len
    from ..runner import ModelRunner
    cfg = spec.engine_config
    model = build_model(rank, spec, tensors, group)
    kv = kv_cache_for(model, cfg)
    spec_rows = 1 + cfg.speculative_config.num_speculative_tokens if cfg.speculative_config else 1
    runner = ModelRunner(model, kv, cfg.max_num_seqs, max_model_len(model, cfg, kv.num_blocks), cfg.cuda_graphs,
                         spec_rows)
    steps = 0
    while (step := group.recv_step()) is not None:
        steps += 1
        if steps == fail_at:
            raise RuntimeError(f"injected failure on rank {rank} at step {steps} ({FAULT_ENV})")
        runner.execute(step)


__all__ = ["WorldSpec", "Workers", "WorkerFailed", "init_world", "send_weights", "worker_main"]

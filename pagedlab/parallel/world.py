"""Starting a parallel world for rank 0 (LLM(..., tensor_parallel_size=T, data_parallel_size=D)):
the other ranks' processes, the torch.distributed groups, the weights to every rank, then rank 0's
own engine -- and, from then on, how they all leave.

    workers, router, close = start_world(llm, T, D, device, dtype, checkpoint, engine_config,
                                         backend, kernel_options, tokenizer, setup=build_rank0)

gloo's connection mesh over the loopback fails now and then while it is set up (on any rank,
before any step): the processes are then started again, up to WORLD_ATTEMPTS times.
"""
from __future__ import annotations

import weakref

from .group import WorkerFailed
from . import workers as ranks          # (looked up at each call: tests plant failures there)

WORLD_ATTEMPTS = 3              # tries at forming the torch.distributed world


def start_world(owner, tp: int, dp: int, device, dtype, ckpt, engine_config, backend, kernel_options,
                tokenizer, setup):
    """Start ranks 1 .. T*D-1, form the world, send each rank its weights, then `setup(group)`
    builds rank 0's engine. Returns (workers, router group, close): close() (also run when `owner`
    is garbage-collected) tells every rank to leave and joins them."""
    spec = ranks.WorldSpec(tp, dp, device.type, engine_config.dtype, ckpt.config, engine_config, backend,
                     kernel_options, {n: tuple(t.shape) for n, t in ckpt.tensors.items()},
                     tokenizer=tokenizer if dp > 1 else None)
    for attempt in range(WORLD_ATTEMPTS):
        workers = ranks.Workers(spec)
        groups = [None, None]          # filled in below; the finalizer reads them when it runs
        close = weakref.finalize(owner, shutdown_workers, workers, tp, dp, groups)
        try:
            workers.wait_started()
            try:
                group, router = groups[:] = ranks.init_world(0, spec)
                ranks.send_weights(ckpt.tensors, spec, dtype)
            except RuntimeError:
                if attempt + 1 < WORLD_ATTEMPTS:
                    close.detach()
                    workers.shutdown()         # no goodbye: end them at once, leave the world
                    continue
                raise
            if group is not None:
                group.on_failure, group.on_stop = workers.failure, close
            setup(group)
            return workers, router, close
        except Exception as e:
            why = getattr(e, "fatal", False) and str(e) or workers.failure(wait_s=2.0)
            close()
            if why and not getattr(e, "fatal", False):
                raise WorkerFailed(why) from e
            raise
        except BaseException:       # Ctrl-C while the world forms: the workers are mid-setup (importing,
            close.detach()          # joining, receiving weights) and would not hear a goodbye -- the
            workers.shutdown()      # exit waited JOIN_TIMEOUT_S for them (`generate --data-parallel-size
            raise                   # 2`: 20 s after Ctrl-C). They are ended at once instead.


def shutdown_workers(workers, tp: int, dp: int, groups: list) -> None:
    """Tell every rank to leave -- replicas through the router, tensor-parallel ranks with an empty
    step -- then join them (workers.py). Safe to call twice and after a failure."""
    group, router = groups

    def goodbye():
        if router is not None:
            from .data_parallel import send
            for k in range(1, dp):
                send(None, k * tp, router)
        if group is not None:
            group.send_step(None)
            group.stopped = "this LLM was closed; create a new LLM"
    # a stopped group is out of step: its ranks cannot be told, only ended
    workers.shutdown(None if group is not None and group.stopped else goodbye)

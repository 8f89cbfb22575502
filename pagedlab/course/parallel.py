"""Notebook 13's hands-on pieces and their checks: tensor parallelism, the sharded layers.

    shard = parallel_course.check_shard(shard)
    column_parallel_linear = parallel_course.check_column_parallel(column_parallel_linear)
    row_parallel_linear = parallel_course.check_row_parallel(row_parallel_linear)
    vocab_parallel_embedding = parallel_course.check_vocab_embedding(vocab_parallel_embedding)
    parallel_course.check_tp_layer(llama_layer)

`check_shard` compares the learner's cut of a weight, `shard(tensor, rule, rank, size)`, with
pagedlab's (`parallel.shard.shard`) for every rank of 1-4 ranks, both rules and none, and a
dimension that does not divide (must raise).

The other checks run the learner's function in TWO RANKS at once, the way the engine does: two
processes forked from this one (torch.multiprocessing's "fork" start method, so that functions
defined in a notebook reach them), joined by `torch.distributed` over gloo (CPU), rendezvous
through a file in a temporary folder. Each rank gets its own shard of random inputs of irregular
shapes in fp32, calls the learner's function with an `all_reduce` (an in-place sum over the
ranks, like `torch.distributed.all_reduce`), and sends back what it returned; the check compares
every rank's answer with the unsharded layer computed in float64 (pagedlab's reference pieces,
parallel/shard.py), and names the case, the rank, what was expected and what came back, with a
hint (a forgotten all-reduce, two of them, the wrong dimension, the wrong rank offset ...).
Where fork is missing (Windows) or unsafe (macOS), or PAGEDLAB_RANKS=threads, the two ranks run
as two threads of this process with the same all_reduce / all_gather, and the check says so.

`check_tp_layer` runs a whole Llama decoder layer (attention + MLP) cut over two ranks and
compares its output, and each rank's K/V (its KV heads only), with the unsharded layer.

A mistake raises `CheckFailed` (pagedlab.checks). The solutions live with the notebooks, in
notebooks/solutions/pieces_parallel.py; with PAGEDLAB_SOLUTIONS=1 the checks run them instead of
the learner's code.
"""
from __future__ import annotations

import math
import multiprocessing
import os
import random
import re
import shutil
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch

from ..config import LLAMA_3_2_1B, ModelConfig, tiny_config
from ..parallel import shard as ref
from .chapter import Chapter, CheckFailed

SIZE = 2                     # ranks in the checks: two processes
TIMEOUT_S = 20.0             # a collective that waits longer than this fails (a rank that never joins)
# docs/parallel_bench.json, shipped with pagedlab as course data (pagedlab.course.data)
BENCH_JSON = Path(__file__).resolve().parent / "data" / "parallel_bench.json"

# SmolLM2-135M-Instruct's shape (its GGUF metadata): 9 query heads, 3 KV heads.
SMOLLM2_135M = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                           num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                           max_position_embeddings=8192, tie_word_embeddings=True, name="SmolLM2-135M-Instruct")
# Llama-3.1-70B's shape (its config.json), for the memory arithmetic.
LLAMA_3_1_70B = ModelConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
                            num_heads=64, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                            max_position_embeddings=131072, name="Llama-3.1-70B")


# -- the solutions: notebooks/solutions/pieces_parallel.py ("shard", "column_parallel_linear",
# "row_parallel_linear", "vocab_parallel_embedding") ---------------------------------------------------
chapter = Chapter("pieces_parallel.py", module="parallel_course")
solution, show_solution = chapter.solution, chapter.show_solution


# -- N ranks: processes over gloo (or threads) ----------------------------------------------------------

def ranks_mode() -> tuple[str, str]:
    """("processes" | "threads", why): how the checks run their ranks on this machine."""
    forced = os.environ.get("PAGEDLAB_RANKS", "").lower()
    if forced in ("processes", "threads"):
        return forced, f"PAGEDLAB_RANKS={forced}"
    import torch.distributed as dist
    if "fork" not in multiprocessing.get_all_start_methods():
        return "threads", (f"this platform ({sys.platform}) cannot fork a process, so the ranks run as "
                           "threads of this one, with the same all_reduce; on Linux they are processes")
    if sys.platform == "darwin":
        return "threads", ("on macOS forking a process that has loaded system frameworks can crash it, so "
                           "the ranks run as threads of this one, with the same all_reduce; on Linux they "
                           "are processes")
    if not (dist.is_available() and dist.is_gloo_available()):
        return "threads", "this torch build has no torch.distributed/gloo, so the ranks run as threads"
    return "processes", "processes forked from this one, torch.distributed over gloo"


class Comm:
    """What one rank's code gets: its `rank`, the group `size`, and the collectives.

    all_reduce(t): t becomes the sum of every rank's t, in place (returns None, like
        torch.distributed.all_reduce). Every rank must call it, the same number of times, with
        tensors of the same shape.
    all_gather(t): every rank's t [..., V/N] side by side, in rank order: [..., V] (a new tensor).
    """

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size
        self.calls = {"all_reduce": 0, "all_gather": 0}
        self.busy = False            # inside a collective: an error there is the group's, not the caller's
        self.where = ""              # what the rank is running (for messages)

    def all_reduce(self, t) -> None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"all_reduce takes a tensor, got {type(t).__name__}")
        self.calls["all_reduce"] += 1
        self.busy = True
        buf = t if t.is_contiguous() else t.contiguous()
        self._all_reduce(buf)
        if buf is not t:
            t.copy_(buf)
        self.busy = False

    def all_gather(self, t) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"all_gather takes a tensor, got {type(t).__name__}")
        self.calls["all_gather"] += 1
        self.busy = True
        parts = self._all_gather(t.contiguous())
        self.busy = False
        return torch.cat(parts, dim=-1)


class _ProcessComm(Comm):
    def _all_reduce(self, t):
        import torch.distributed as dist
        dist.all_reduce(t)

    def _all_gather(self, t):
        import torch.distributed as dist
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t)
        return parts


class _ThreadGroup:
    def __init__(self, size, timeout_s):
        self.barrier = threading.Barrier(size, timeout=timeout_s)
        self.slots = [None] * size


class _ThreadComm(Comm):
    def __init__(self, rank, size, group):
        super().__init__(rank, size)
        self.group = group

    def _exchange(self, t):
        g = self.group
        g.slots[self.rank] = t.clone()
        g.barrier.wait()
        parts = list(g.slots)
        g.barrier.wait()             # nobody overwrites a slot before everyone has read them all
        return parts

    def _all_reduce(self, t):
        parts = self._exchange(t)
        total = parts[0].clone()
        for p in parts[1:]:          # rank order, as gloo: the same sum on every rank
            total += p
        t.copy_(total)

    def _all_gather(self, t):
        return self._exchange(t)


def _rank_main(job, comm) -> dict:
    try:
        return {"result": job(comm), "calls": dict(comm.calls)}
    except BaseException as e:               # noqa: BLE001  (reported to the parent, whatever it is)
        return {"error": f"{type(e).__name__}: {e}", "not_written": isinstance(e, NotImplementedError),
                "in_collective": comm.busy, "where": comm.where, "calls": dict(comm.calls)}


def _process_rank(job, rank, size, tmp, timeout_s):
    """One rank, in a forked child: join the gloo group, run the job, write what it gave."""
    torch.set_num_threads(1)                 # two ranks on a laptop's cores
    out_file = Path(tmp) / f"rank{rank}.pt"

    def write(out):
        part = out_file.with_suffix(".part")
        torch.save(out, part)
        part.rename(out_file)

    import torch.distributed as dist
    try:
        dist.init_process_group("gloo", init_method="file://" + str(Path(tmp) / "rendezvous"), rank=rank,
                                world_size=size, timeout=timedelta(seconds=timeout_s))
    except Exception as e:                   # noqa: BLE001
        write({"error": f"torch.distributed (gloo) did not start: {type(e).__name__}: {e}", "setup": True})
        return
    out = _rank_main(job, _ProcessComm(rank, size))
    try:
        write(out)
    except Exception as e:                   # noqa: BLE001  (a result torch.save cannot write)
        write({"error": f"the rank's result could not be sent back: {type(e).__name__}: {e}"})
    if "error" in out:
        os._exit(1)                          # do not wait for the others: they may be stuck in a collective
    dist.destroy_process_group()


def _run_processes(job, size, timeout_s):
    ctx = multiprocessing.get_context("fork")
    tmp = tempfile.mkdtemp(prefix="pagedlab-ranks-")
    try:
        procs = [ctx.Process(target=_process_rank, args=(job, r, size, tmp, timeout_s), daemon=True)
                 for r in range(size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s + 30
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
        hung = [p.is_alive() for p in procs]
        for p, h in zip(procs, hung):
            if h:                            # only the processes started here
                p.kill()
                p.join(5)
        outs = []
        for r, p in enumerate(procs):
            f = Path(tmp) / f"rank{r}.pt"
            if f.exists():
                outs.append(torch.load(f, weights_only=False))
            elif hung[r]:
                outs.append({"error": f"rank {r} did not finish within {timeout_s + 30:.0f} s", "hung": True})
            else:
                outs.append({"error": f"rank {r}'s process died (exit code {p.exitcode}) without a result"})
        return outs
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run_threads(job, size, timeout_s):
    group = _ThreadGroup(size, timeout_s)
    outs: list = [None] * size

    def target(r):
        outs[r] = _rank_main(job, _ThreadComm(r, size, group))
        if "error" in outs[r]:
            group.barrier.abort()            # the others stop waiting for this rank

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 30)
    return [o if o is not None else {"error": f"rank {r} did not finish in time", "hung": True}
            for r, o in enumerate(outs)]


def _run(job, size=SIZE, timeout_s=TIMEOUT_S, mode=None, attempts: int = 5):
    """[what rank r's job returned or raised, as a dict] for r in 0..size-1. Gloo's connection set-up
    on the loopback now and then fails ("Connection closed by peer" in connectFullMesh, about one
    start in a few hundred here): that is before any rank has run the job, so it is tried again --
    after a pause that doubles (0.25 s, 0.5 s, ...): CI once saw three immediate tries fail within
    0.1 s of each other, whatever held the loopback had not let go yet."""
    mode = mode or ranks_mode()[0]
    if mode != "processes":
        return _run_threads(job, size, timeout_s)
    for i in range(attempts):
        outs = _run_processes(job, size, timeout_s)
        if not any(o.get("setup") for o in outs):
            break
        if i + 1 < attempts:
            time.sleep(0.25 * 2 ** i)
    return outs


def _failure(name, outs, hint="") -> str | None:
    """The message for ranks that raised (None when none did): the learner's own error first."""
    errs = [(r, o) for r, o in enumerate(outs) if "error" in o]
    if not errs:
        return None
    size = len(outs)
    for r, o in errs:
        if o.get("not_written"):
            return chapter.not_written(name, o["error"].split(": ", 1)[-1])
    where = lambda o: f"\n  while running: {o['where']}" if o.get("where") else ""       # noqa: E731
    own = [(r, o) for r, o in errs if not (o.get("in_collective") or o.get("setup") or o.get("hung"))]
    if own:
        r, o = own[0]
        return f"{name} raised {o['error']} on rank {r} of {size}{where(o)}" + (f"\nHint: {hint}" if hint else "")
    setup = [(r, o) for r, o in errs if o.get("setup")]
    if setup:
        r, o = setup[0]
        return (f"the ranks could not run: {o['error']}\nThis is the machine, not your code: run "
                "os.environ['PAGEDLAB_RANKS'] = 'threads' and this check again (the ranks then run as "
                "threads of this process).")
    def line(r, o):
        calls = o.get("calls", {}).get("all_reduce", "?")
        if "error" not in o:
            return f"  rank {r}: returned, after calling all_reduce {calls} times"
        err = re.sub(r"\[[^\]]*\.(cc|cpp):\d+\] ", "", o["error"]).split(". ")[0]
        return f"  rank {r}: {err[:200]} (all_reduce called {calls} times)"
    lines = "\n".join(line(r, o) for r, o in enumerate(outs))
    return (f"{name}: the ranks did not meet in a collective{where(errs[0][1])}\n{lines}\n"
            "Hint: every rank must call all_reduce the same number of times, in the same order, with "
            "tensors of the same shape: a collective waits until every rank has joined it.")


def run_ranks(job, size: int = SIZE, timeout_s: float = TIMEOUT_S, name: str | None = None, hint: str | None = None):
    """Run job(comm) on `size` ranks at once (see `Comm`); returns [what each rank returned], in rank
    order. Raises CheckFailed, with each rank's error, if any rank raised (`name`: what to call the
    job in it; `hint`: said when the job's own code raised)."""
    outs = _run(job, size, timeout_s)
    msg = _failure(name or getattr(job, "__name__", "job"), outs, hint)
    if msg:
        raise CheckFailed(msg)
    return [o["result"] for o in outs]


def _mode_words() -> str:
    mode, why = ranks_mode()
    return f"{SIZE} processes (torch.distributed, gloo)" if mode == "processes" else f"{SIZE} threads ({why})"


# -- comparing what a rank returned with the float64 reference -----------------------------------------

def _record(out):
    """What a rank sends back for one case: the tensor (a copy), or what it was instead."""
    if isinstance(out, torch.Tensor):
        return out.detach().clone()
    return ("not a tensor", type(out).__name__, repr(out)[:120])


def _close(got, want) -> bool:
    return (isinstance(got, torch.Tensor) and tuple(got.shape) == tuple(want.shape)
            and bool(torch.isfinite(got).all())
            and torch.allclose(got.double(), want.double(), rtol=1e-4, atol=1e-4))


def _show(t, n=6) -> str:
    if not isinstance(t, torch.Tensor):
        return f"{t[1]} {t[2]}" if isinstance(t, tuple) and t and t[0] == "not a tensor" else repr(t)
    row = t.reshape(-1, t.shape[-1])[0] if t.dim() else t.reshape(1)
    vals = ", ".join(f"{v:.4f}" for v in row[:n].tolist())
    return f"shape {list(t.shape)}, {str(t.dtype)[6:]}, row 0: [{vals}{', ...' if row.numel() > n else ''}]"


def _shape(t) -> str:
    return f"{list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def _mismatch(call, what, rank, size, got, want, hint) -> CheckFailed:
    err = ""
    if isinstance(got, torch.Tensor) and tuple(got.shape) == tuple(want.shape):
        err = f"\n  max |got - expected| = {(got.double() - want.double()).abs().max().item():.3g}"
    return CheckFailed(f"{call} on rank {rank} of {size}   # {what}\n"
                       f"  expected {_show(want)}\n"
                       f"  got      {_show(got)}{err}\n"
                       f"Hint: {hint}")


def _none_hint(got) -> str | None:
    if isinstance(got, tuple) and got and got[1] == "NoneType":
        return ("it returned None. all_reduce(t) sums t IN PLACE and returns None (as torch.distributed's "
                "does): call all_reduce(y), then return y. Did you `return all_reduce(y)`?")
    if isinstance(got, tuple):
        return "return a torch.Tensor."
    return None


def _randn(g, *shape):
    return torch.randn(*shape, generator=g, dtype=torch.float64)


# -- piece 1: the cut of one weight ---------------------------------------------------------------------

def _shard_hint(t, rule, rank, size, got) -> str:
    if not isinstance(got, torch.Tensor):
        return "return a tensor: rank `rank`'s part of `tensor` (tensor.narrow(dim, start, length) is one way)."
    if rule is None or size == 1:
        return "rule None (norms: replicated) or size 1: every rank keeps the whole tensor, unchanged."
    dim = 0 if rule == "rows" else 1
    n = t.shape[dim]
    for other in (0, 1):
        if other != dim:
            m = t.shape[other]
            if m % size == 0 and torch.equal(got, t.narrow(other, rank * (m // size), m // size)):
                return (f"that is a cut along dim {other}; rule {rule!r} cuts dim {dim}: 'rows' = dim 0 "
                        "(the rows of W [out, in]: output features), 'cols' = dim 1 (input features).")
    if torch.equal(got, t):
        return f"with size {size} each rank keeps 1/{size} of dim {dim}, not the whole tensor."
    for r in range(size):
        if r != rank and torch.equal(got, t.narrow(dim, r * (n // size), n // size)):
            return (f"that is rank {r}'s part: rank r's part starts at r * (n // size) along the cut "
                    f"dimension (here {rank} * {n // size} = {rank * (n // size)}).")
    return (f"rank r keeps indices r*(n//size) .. (r+1)*(n//size) - 1 of dim {dim} "
            f"(n = {n}, size = {size}): shape {list(ref.shard(t, rule, rank, size).shape)}.")


def check_shard(fn, seed: int = 0):
    """fn(tensor, rule, rank, size) -> rank's part of tensor under rule ("rows": dim 0, "cols": dim 1,
    None: the whole tensor), as pagedlab's parallel.shard.shard; a dimension that does not split into
    `size` equal parts must raise. Returns the function that passed."""
    name = "shard"
    fn = chapter.pick(fn, name)
    rng = random.Random(seed)
    n = 0
    cases = []
    for size in (1, 2, 3, 4):
        for rule in ("rows", "cols", None):
            a, b = rng.choice([1, 3, 5, 8]), rng.choice([2, 3, 7])
            shape = (size * a, size * b) if rule != "cols" else (rng.choice([3, 5, 6]), size * b)
            cases.append((shape, rule, size))
    cases.append(((7,), None, 2))                                   # a norm weight: replicated
    for shape, rule, size in cases:
        t = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
        for rank in range(size):
            want = ref.shard(t, rule, rank, size)
            call = f"shard(tensor of shape {list(shape)}, {rule!r}, rank={rank}, size={size})"
            try:
                got = fn(t, rule, rank, size)
            except Exception as e:                                  # noqa: BLE001
                raise chapter.raised(name, e, call, f"\nHint: {_shard_hint(t, rule, rank, size, None)}") from None
            if not (isinstance(got, torch.Tensor) and got.shape == want.shape and torch.equal(got, want)):
                raise CheckFailed(f"{call}\n  expected shape {list(want.shape)}: {want.flatten()[:8].tolist()}...\n"
                                  f"  got      shape {_shape(got)}"
                                  + (f": {got.flatten()[:8].tolist()}..." if isinstance(got, torch.Tensor) else "")
                                  + f"\nHint: {_shard_hint(t, rule, rank, size, got)}")
            n += 1
    for shape, rule, size in (((9, 4), "rows", 2), ((4, 10), "cols", 4), ((6, 9), "cols", 2)):
        t = torch.zeros(shape)
        try:
            fn(t, rule, 0, size)
        except NotImplementedError as e:
            raise CheckFailed(chapter.not_written(name, e)) from None
        except Exception:                                           # noqa: BLE001
            n += 1
            continue
        dim = 0 if rule == "rows" else 1
        raise CheckFailed(f"shard(tensor of shape {list(shape)}, {rule!r}, rank=0, size={size}) returned a part, "
                          f"but dim {dim} ({shape[dim]}) does not split into {size} equal parts.\n"
                          "Hint: raise ValueError: every rank must hold an equal part (whole heads), or the "
                          "ranks' matmuls would not line up.")
    print(f"\u2713 {name}: {n} cuts equal pagedlab's (rows, cols, replicated; 1-4 ranks, every rank), "
          "and a dimension that does not divide raises")
    return fn


# -- pieces 2-4: the layers, run on two ranks --------------------------------------------------------

def _linear_cases(seed, size):
    """(what, x [T, in], W [out, in]) in float64 (values exactly representable in fp32)."""
    g = torch.Generator().manual_seed(seed)
    dims = [("one token (a decode step), in=8, out=6", 1, 4, 3),
            ("one feature per rank", 3, 1, 1),
            ("column's W_r square ([out/N, in] = [6, 6])", 5, 3, 6),
            ("row's W_r square ([out, in/N] = [4, 4])", 4, 4, 2),
            ("prefill of 13 tokens", 13, 12, 5)]
    rng = random.Random(seed)
    for _ in range(8):
        dims.append(("random", rng.choice([1, 2, 5, 9, 16]), rng.choice([3, 5, 7, 12, 17]), rng.choice([2, 3, 7, 11])))
    cases = []
    for what, t, a, b in dims:
        fin, fout = size * a, size * b
        x = _randn(g, t, fin).float().double()
        w = (_randn(g, fout, fin) / fin ** 0.5).float().double()
        cases.append((what, x, w))
    return cases


def _run_cases(name, cases, where, call, hint):
    """call(comm, case) for every case on SIZE ranks, in one run: per rank, per case, (what it returned,
    recorded; how many times it called all_reduce). A rank that raised, hung or missed a collective
    -> CheckFailed (with `hint` where the learner's code raised)."""
    def job(comm):
        outs = []
        for i, case in enumerate(cases):
            comm.where = f"case {i}: {where(case)}"
            before = comm.calls["all_reduce"]
            y = call(comm, case)
            outs.append((_record(y), comm.calls["all_reduce"] - before))
        return outs

    return run_ranks(job, name=name, hint=hint)


def check_column_parallel(fn, seed: int = 0):
    """fn(x, w_shard) -> this rank's slice of the output features [T, out/N], as
    parallel.shard.column_parallel_linear, on 2 ranks. Returns the function that passed."""
    name = "column_parallel_linear"
    fn = chapter.pick(fn, name)
    size = SIZE
    cases = _linear_cases(seed, size)
    outs = _run_cases(name, cases, lambda c: c[0],
                      lambda comm, c: fn(c[1].float(), ref.shard(c[2].float(), "rows", comm.rank, comm.size)),
                      "y_r = x @ w_shard.t(): w_shard is [out/N, in] (rows of W), x is [T, in].")
    for i, (what, x, w) in enumerate(cases):
        full = x @ w.t()
        for rank in range(size):
            want = ref.shard(full, "cols", rank, size)       # this rank's output features
            got = outs[rank][i][0]
            if _close(got, want):
                continue
            t, out_f, in_f = x.shape[0], w.shape[0], w.shape[1]
            call = f"{name}(x [{t}, {in_f}], w_shard [{out_f // size}, {in_f}])"
            hint = _none_hint(got)
            if hint is None and tuple(got.shape) == (t, out_f):
                hint = (f"it returned all {out_f} output features. Column-parallel: each rank computes only "
                        f"its own slice [T, out/N] = [{t}, {out_f // size}]; nothing is exchanged.")
            elif hint is None and tuple(got.shape) == (out_f // size, t):
                hint = "that is y transposed: y = x W^T, so x @ w_shard.t() ([T, in] @ [in, out/N])."
            elif hint is None and tuple(got.shape) == tuple(want.shape):
                xw = x @ w.t()
                if _close(got, ref.shard(xw, "cols", rank, size) * size) or _close(got, want / size):
                    hint = "the right numbers times a constant: column-parallel needs no scaling."
                elif tuple(ref.shard(w, "rows", rank, size).shape) == (in_f, in_f) and _close(
                        got, x @ ref.shard(w, "rows", rank, size)):
                    hint = "x @ w_shard is missing a transpose: y = x W^T, so x @ w_shard.t()."
                else:
                    hint = "y_r = x @ w_shard.t(): the same x on every rank, this rank's rows of W."
            elif hint is None:
                hint = f"the output is [T, out/N] = {list(want.shape)}: x @ w_shard.t()."
            raise _mismatch(call, what, rank, size, got, want, hint)
    print(f"\u2713 {name}: {len(cases)} cases on {_mode_words()}: each rank's output is its slice of the "
          "unsharded x W^T (float64), so side by side they are the whole y; no communication")
    return fn


def check_row_parallel(fn, seed: int = 1):
    """fn(x_shard, w_shard, all_reduce) -> the full y = x W^T [T, out] on every rank, as
    parallel.shard.row_parallel_linear, on 2 ranks. Returns the function that passed."""
    name = "row_parallel_linear"
    fn = chapter.pick(fn, name)
    size = SIZE
    cases = _linear_cases(seed, size)
    outs = _run_cases(name, cases, lambda c: c[0],
                      lambda comm, c: fn(ref.shard(c[1].float(), "cols", comm.rank, comm.size),
                                         ref.shard(c[2].float(), "cols", comm.rank, comm.size), comm.all_reduce),
                      "y_r = x_shard @ w_shard.t() ([T, in/N] @ [in/N, out]), then all_reduce(y_r).")
    for i, (what, x, w) in enumerate(cases):
        want = x @ w.t()
        for rank in range(size):
            got, calls = outs[rank][i]
            if _close(got, want):
                continue
            t, out_f, in_f = x.shape[0], w.shape[0], w.shape[1]
            call = f"{name}(x_shard [{t}, {in_f // size}], w_shard [{out_f}, {in_f // size}], all_reduce)"
            partial = ref.shard(x, "cols", rank, size) @ ref.shard(w, "cols", rank, size).t()
            hint = _none_hint(got)
            if hint is None and calls == 0:
                hint = (f"all_reduce was not called: rank {rank} holds only ITS partial sum (its {in_f // size} "
                        f"input features of {in_f}); y is the sum of the {size} partials: all_reduce(y_r).")
            elif hint is None and calls > 1:
                hint = (f"all_reduce was called {calls} times: the partials are summed ONCE; a second "
                        f"all_reduce adds the {size} equal sums again ({size}x too big).")
            elif hint is None and isinstance(got, torch.Tensor) and tuple(got.shape) != tuple(want.shape):
                hint = (f"every rank returns the whole y [T, out] = {list(want.shape)}: x_shard @ w_shard.t() is "
                        "already full width; only its values are partial.")
            elif hint is None and _close(got, want / size):
                hint = "that is the mean of the partials: y is their SUM (all_reduce sums; do not divide)."
            elif hint is None and _close(got, partial):
                hint = ("rank's own partial sum came back: all_reduce sums in place the tensor you GIVE it; "
                        "reduce y_r itself (not a copy), then return it.")
            elif hint is None:
                hint = "y_r = x_shard @ w_shard.t() ([T, in/N] @ [in/N, out]), all_reduce(y_r), return y_r."
            raise _mismatch(call, what, rank, size, got, want, hint)
    print(f"\u2713 {name}: {len(cases)} cases on {_mode_words()}: every rank ends with the unsharded "
          "x W^T (float64): the partial sums of its input features, added by one all-reduce")
    return fn


def _embedding_cases(seed, size):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    cases = []
    for what, per_rank, hidden in (("edge ids: 0, V/N - 1, V/N, V - 1", 5, 6), ("random", 16, 8),
                                   ("random", 3, 5), ("random, hidden 1", 7, 1)):
        v = size * per_rank
        e = _randn(g, v, hidden).float().double()
        if what.startswith("edge"):
            ids = torch.tensor([0, per_rank - 1, per_rank, v - 1, per_rank, 0])
        else:
            ids = torch.tensor([rng.randrange(v) for _ in range(rng.randint(1, 12))])
        cases.append((what, ids, e))
    return cases


def check_vocab_embedding(fn, seed: int = 2):
    """fn(ids, embed_shard, rank, all_reduce) -> the embedding rows of ids [T, hidden] on every rank, as
    parallel.shard.vocab_parallel_embedding, on 2 ranks. Returns the function that passed."""
    name = "vocab_parallel_embedding"
    fn = chapter.pick(fn, name)
    size = SIZE
    cases = _embedding_cases(seed, size)
    outs = _run_cases(name, cases, lambda c: f"ids {c[1].tolist()}",
                      lambda comm, c: fn(c[1].clone(), ref.shard(c[2].float(), "rows", comm.rank, comm.size),
                                         comm.rank, comm.all_reduce),
                      "rank r holds token ids r*n .. (r+1)*n - 1 (n = embed_shard.shape[0]): look up "
                      "ids - r*n where that is in [0, n), zeros elsewhere, then all_reduce.")
    for i, (what, ids, e) in enumerate(cases):
        want = e[ids]
        n = e.shape[0] // size
        for rank in range(size):
            got, calls = outs[rank][i]
            if _close(got, want):
                continue
            call = f"{name}(ids {ids.tolist()}, embed_shard [{n}, {e.shape[1]}] (ids {rank * n}..{rank * n + n - 1}), rank={rank}, all_reduce)"
            shards = [ref.shard(e, "rows", r, size) for r in range(size)]

            def lookup(r, offset=True, mask=True):
                local = ids - r * n if offset else ids
                mine = (local >= 0) & (local < n)
                rows = shards[r][local.clamp(0, n - 1)]
                return rows * mine.unsqueeze(-1) if mask else rows

            hint = _none_hint(got)
            if hint is None and calls == 0:
                hint = (f"all_reduce was not called: rank {rank} has rows only for ids {rank * n}..{rank * n + n - 1} "
                        "(zeros for the others); the all-reduce adds the other ranks' rows in.")
            elif hint is None and calls > 1:
                hint = f"all_reduce was called {calls} times: once is enough (each id's row comes from one rank)."
            elif hint is None and _close(got, sum(lookup(r, offset=False) for r in range(size))):
                hint = (f"wrong rank offset: row i of rank r's shard is token r*n + i (n = {n}): look up "
                        "ids - rank * n, not ids.")
            elif hint is None and _close(got, sum(lookup(r, mask=False) for r in range(size))):
                hint = ("ids outside this rank's range must give ZEROS (multiply by a mask), not a clamped row: "
                        "the all-reduce adds every rank's rows, and only the owner's may count.")
            elif hint is None:
                hint = ("local = ids - rank * n; mine = (local >= 0) & (local < n); rows = embed_shard["
                        "local.clamp(0, n - 1)] * mine[:, None]; all_reduce(rows).")
            raise _mismatch(call, what, rank, size, got, want, hint)
    print(f"\u2713 {name}: {len(cases)} cases on {_mode_words()}: each rank looks up only its vocabulary range "
          "(zeros elsewhere), one all-reduce gives every rank the unsharded rows")
    return fn


# -- a whole Llama layer, cut by the rules --------------------------------------------------------------

def rms_norm(x, w, eps):
    """RMSNorm in x's dtype: x / rms(x) * w."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.to(x.dtype)


def rope(x, positions, config):
    """RoPE (rotate-half, the engine's frequencies with llama3 scaling) of x [T, H, D] at positions [T]."""
    from ..kernels.rope import rope_inv_freq
    inv = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    ang = positions.double()[:, None] * inv[None, :]
    cos, sin = ang.cos().to(x.dtype)[:, None, :], ang.sin().to(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def causal_attention(q, k, v):
    """q [T, Hq, D], k and v [T, Hkv, D] (GQA: Hq/Hkv query heads per KV head) -> [T, Hq * D]."""
    t, hq, d = q.shape
    group = hq // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) * d ** -0.5
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(t, hq * d)


def layer_weights(tensors: dict, i: int = 0) -> dict:
    """Layer i's tensors of a checkpoint, named as in the layer ("self_attn.q_proj.weight", ...)."""
    p = f"model.layers.{i}."
    return {k[len(p):]: v for k, v in tensors.items() if k.startswith(p)}


def reference_layer(h, positions, w, config):
    """One Llama decoder layer, unsharded, in h's dtype -> (h_out, k, v) with k, v [T, Hkv, D]."""
    c, t, d = config, h.shape[0], config.head_dim
    x = rms_norm(h, w["input_layernorm.weight"], c.rms_norm_eps)
    q = (x @ w["self_attn.q_proj.weight"].t()).view(t, c.num_heads, d)
    k = (x @ w["self_attn.k_proj.weight"].t()).view(t, c.num_kv_heads, d)
    v = (x @ w["self_attn.v_proj.weight"].t()).view(t, c.num_kv_heads, d)
    q, k = rope(q, positions, c), rope(k, positions, c)
    h = h + causal_attention(q, k, v) @ w["self_attn.o_proj.weight"].t()
    x = rms_norm(h, w["post_attention_layernorm.weight"], c.rms_norm_eps)
    gate, up = x @ w["mlp.gate_proj.weight"].t(), x @ w["mlp.up_proj.weight"].t()
    h = h + (torch.nn.functional.silu(gate) * up) @ w["mlp.down_proj.weight"].t()
    return h, k, v


def reference_logits(tensors, config, ids):
    """The whole model, unsharded, from reference_layer: logits [T, V] (to check the pieces above)."""
    h = tensors["model.embed_tokens.weight"][ids]
    positions = torch.arange(len(ids))
    for i in range(config.num_layers):
        h = reference_layer(h, positions, layer_weights(tensors, i), config)[0]
    head = tensors["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
    return rms_norm(h, tensors["model.norm.weight"], config.rms_norm_eps) @ head.t()


def tp_layer_case(config=None, tokens: int = 9, seed: int = 0):
    """(config, layer-0 weights in float64, h [T, hidden] in float64, positions) for check_tp_layer."""
    from ..weights import random_checkpoint
    config = config or tiny_config()
    w = {k: v.double() for k, v in layer_weights(random_checkpoint(config, seed).tensors).items()}
    g = torch.Generator().manual_seed(seed + 1)
    return config, w, _randn(g, tokens, config.hidden_size).float().double(), torch.arange(tokens)


def check_tp_layer(layer_fn, config=None, seed: int = 0):
    """layer_fn(h, positions, w, config, size, all_reduce) -> (h_out, k, v): one Llama layer on one
    rank, w = that rank's cut of the layer's weights (parallel.shard.shard_checkpoint). On 2 ranks,
    every rank's h_out must equal the unsharded layer's (float64), and rank r's k, v must be the
    unsharded k, v of its KV heads only. Returns layer_fn."""
    name = "llama_layer"
    config, w, h, positions = tp_layer_case(config, seed=seed)
    size = SIZE
    ref.check_split(config, size)
    want_h, want_k, want_v = reference_layer(h, positions, w, config)

    def job(comm):
        comm.where = f"{name} on rank {comm.rank}"
        wr = ref.shard_checkpoint({k: v.float() for k, v in w.items()}, comm.rank, comm.size)
        out = layer_fn(h.float(), positions, wr, config, comm.size, comm.all_reduce)
        if not (isinstance(out, tuple) and len(out) == 3):
            return ("not a tensor", f"{type(out).__name__} (expected a tuple (h_out, k, v))", repr(out)[:80])
        return tuple(_record(o) for o in out) + (comm.calls["all_reduce"],)

    outs = run_ranks(job, size, name=name, hint="run the layer's pieces in order: norm, q/k/v column-parallel, "
                     "RoPE, attention over this rank's heads, O row-parallel, + h; norm, gate/up column-parallel, "
                     "SwiGLU, down row-parallel, + h.")
    hk = config.num_kv_heads // size
    for rank in range(size):
        res = outs[rank]
        if isinstance(res, tuple) and res and res[0] == "not a tensor":
            raise CheckFailed(f"{name} returned {res[1]} on rank {rank}: return (h_out, k, v).")
        got_h, got_k, got_v, calls = res
        for what, got, want in (("k (this rank's KV cache entries)", got_k, want_k[:, rank * hk:(rank + 1) * hk]),
                                ("v (this rank's KV cache entries)", got_v, want_v[:, rank * hk:(rank + 1) * hk]),
                                ("h_out (the layer's output)", got_h, want_h)):
            if _close(got, want):
                continue
            call = f"{name}(h [{h.shape[0]}, {config.hidden_size}], ...) -> {what.split(' ')[0]}"
            if isinstance(got, torch.Tensor) and tuple(got.shape) != tuple(want.shape):
                hint = (f"rank {rank} holds {config.num_heads // size} of the {config.num_heads} query heads and "
                        f"{hk} of the {config.num_kv_heads} KV heads: view q as [T, num_heads // size, D] and k, v "
                        f"as [T, num_kv_heads // size, D]; expected {list(want.shape)}.")
            elif what.startswith("h") and calls != 2:
                hint = (f"all_reduce was called {calls} times on rank {rank}: a layer needs exactly TWO, one "
                        "after O (row-parallel) and one after down (row-parallel).")
            elif what.startswith("h"):
                hint = ("k and v are right, so attention's inputs are: look at what follows. The residual h is the "
                        "same on every rank: add it AFTER the all-reduce (h + row_parallel_linear(...)); added "
                        f"before it, it is counted {size} times.")
            else:
                hint = ("k and v are this rank's KV heads of the unsharded layer: column-parallel k_proj / v_proj "
                        "of the normed h, RoPE on k (not on v).")
            raise _mismatch(call, what, rank, size, got, want, hint)
    print(f"\u2713 {name}: on {_mode_words()}, every rank's output equals the unsharded layer (float64), "
          f"with 2 all-reduces; each rank's K/V cache entries are its {hk} of the {config.num_kv_heads} KV "
          "heads of the unsharded layer")
    return layer_fn


# -- the model's numbers, and the lab's measured table ---------------------------------------------------

def model_config(model: str) -> ModelConfig:
    """The ModelConfig of a course model name, without loading its weights when that can be avoided."""
    from ..weights import RANDOM_PRESETS, load_checkpoint
    name = str(model)
    if name.startswith("random:") and name.split(":", 1)[1] in RANDOM_PRESETS:
        return RANDOM_PRESETS[name.split(":", 1)[1]]()
    if name.lower() in ("smollm2", "default", "smollm2-135m-instruct"):
        return SMOLLM2_135M
    if name.startswith("meta-llama/Llama-3.2-1B"):
        return LLAMA_3_2_1B
    if (Path(name) / "config.json").exists():
        return ModelConfig.from_json(Path(name) / "config.json")
    return load_checkpoint(name, show_progress=False).config


def load_parallel_bench(path: str | Path | None = None) -> dict | None:
    """docs/parallel_bench.json (the lab's run on two H200s), or None when it is not there."""
    from .data import load_json
    return load_json("parallel_bench.json", path)

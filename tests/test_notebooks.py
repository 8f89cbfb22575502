"""The notebooks: each runs top to bottom (nbclient) with the solutions filled in (PAGEDLAB_SOLUTIONS=1),
each with pieces to write stops at its first check when the stubs are untouched, and none is
committed with outputs.

On a machine without CUDA: PAGEDLAB_SMALL=1 (tiny random model, tiny workloads) and
TRITON_INTERPRET=1 (Triton cells run in the interpreter). With CUDA the environment is left as it
is, so the notebooks pick their GPU path (random Llama-3.2-1B shape when there is no hub access).
Each notebook has a time budget; PAGEDLAB_NB_BUDGET_SCALE scales all budgets (slow machines).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NB_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NB_DIR.glob("[0-9][0-9]_*.ipynb"))

# Seconds allowed per notebook on the 2-core CPU CI box (SMALL path); the GPU path is given the same.
BUDGET_S = {"04": 150, "06": 150}
DEFAULT_BUDGET_S = 90


def _cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


def test_notebooks_exist():
    names = [p.stem[:2] for p in NOTEBOOKS]
    assert names == sorted(set(names)) and names[:1] == ["00"], names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_clean(path):
    """Committed notebooks carry no outputs, no execution counts and no widget state."""
    nb = json.loads(path.read_text())
    assert "widgets" not in nb.get("metadata", {}), f"{path.name}: widget state in the metadata"
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        assert not cell.get("outputs"), f"{path.name} cell {i} has outputs (clear them before committing)"
        assert cell.get("execution_count") is None, f"{path.name} cell {i} has an execution count"
        assert "widgets" not in cell.get("metadata", {}), f"{path.name} cell {i} has widget metadata"


def test_notebook_structure():
    """Every notebook: a title, learning goals, the set-up cell, a recap, exercises, a summary."""
    for path in NOTEBOOKS:
        nb = json.loads(path.read_text())
        md = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
        code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
        assert md.lstrip().startswith("# "), f"{path.name}: no title"
        for part in ("Learning goals", "## Recap", "## Exercises", "## Summary"):
            assert part in md, f"{path.name}: no {part!r}"
        assert "PAGEDLAB_PIP" in code and "choose_model()" in code, f"{path.name}: no set-up/parameters cell"


def _check_cells(nb) -> list[int]:
    """Indices of the code cells that check a piece the learner writes (course.check_*)."""
    return [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and "course.check_" in c.source]


def _client(path, monkeypatch, solutions: bool):
    import ipykernel  # noqa: F401  (a missing test dependency must fail, not skip)
    import nbclient
    import nbformat
    if not _cuda():
        monkeypatch.setenv("PAGEDLAB_SMALL", "1")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("PAGEDLAB_NO_INSTALL", "1")     # never pip install during tests
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("TQDM_DISABLE", "1")
    if solutions:
        monkeypatch.setenv("PAGEDLAB_SOLUTIONS", "1")
    else:
        monkeypatch.delenv("PAGEDLAB_SOLUTIONS", raising=False)
    budget = BUDGET_S.get(path.stem[:2], DEFAULT_BUDGET_S) * float(os.environ.get("PAGEDLAB_NB_BUDGET_SCALE", "1"))
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=int(budget * 2), kernel_name="python3",
                                     resources={"metadata": {"path": str(NB_DIR)}})
    return nb, client, budget


def _run_queue_wait_s(pid: int) -> float:
    """Seconds process `pid`'s main thread (the kernel's: it runs the cells) has spent ready to run
    but waiting for a CPU that other processes held (Linux schedstat; 0 where there is none). The
    budget is the notebook's time on a machine of its own: on a busy one (other tests, other jobs)
    the wall clock also counts the time other processes ran, so that wait is not the notebook's.
    Only the kernel's own wait is taken off: a child process's (notebook 13's ranks) still counts."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def _text(cell) -> str:
    return "".join(o.get("text", "") + str(o.get("evalue", "")) + "".join(o.get("traceback", []))
                   for o in cell.get("outputs", []))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
    """With PAGEDLAB_SOLUTIONS=1 (every check runs the course's solution, the exercises' solutions
    run too) each notebook runs top to bottom within its budget, and every check passes."""
    nb, client, budget = _client(path, monkeypatch, solutions=True)
    waited, ends = [], []                        # the kernel's run-queue wait, read after each cell
    def executed(cell_index, **_):
        waited.append(_run_queue_wait_s(client.km.provisioner.pid))
        ends.append((time.perf_counter(), cell_index))
    client.on_cell_executed = executed
    t0 = time.perf_counter()
    try:
        client.execute()
    finally:                                     # where the time went (the slowest cells), pass or fail
        starts = [t0] + [t for t, _ in ends[:-1]]
        slow = sorted(((t - s, i) for s, (t, i) in zip(starts, ends)), reverse=True)[:4]
        print(f"{path.name} slowest cells: " + ", ".join(f"{i}: {d:.1f} s" for d, i in slow))
    elapsed = time.perf_counter() - t0
    own = elapsed - waited[-1]
    print(f"{path.name}: {elapsed:.1f} s, of which {waited[-1]:.1f} s waiting for a CPU other processes held")
    for i in _check_cells(nb):
        assert "\u2713" in _text(nb.cells[i]), f"{path.name} cell {i}: the check did not report a pass"
    assert own < budget, (f"{path.name} took {own:.0f} s ({elapsed:.0f} s, less {waited[-1]:.0f} s "
                          f"waiting for a CPU), over its {budget:.0f} s budget")


STUB_NOTEBOOKS = [p for p in NOTEBOOKS
                  if any(c["cell_type"] == "code" and "course.check_" in "".join(c["source"])
                         for c in json.loads(p.read_text())["cells"])]


def test_hands_on_notebooks():
    """Every chapter has a piece to write against a check -- 00 the slot timeline, 01 the BPE merge
    loop and the prompt queue's door, 02 the safetensors header parse and the bf16 bit shift, 03
    RMSNorm, RoPE, GQA attention and one decoder layer, 04 two Triton kernels, 05 the decode loop, 06
    the decode kernel's loop, 07 the allocator, 08 the scheduler step, 09 the engine step, 10
    preemption, 11 the stream parser and the core mailbox's two rules, 12 the prefix cache, 13 the sharded layers, 14 FP8, 15 the
    n-gram proposer and the accept rule."""
    assert {p.stem[:2] for p in STUB_NOTEBOOKS} >= {f"{i:02d}" for i in range(0, 16)}


@pytest.mark.parametrize("path", STUB_NOTEBOOKS, ids=[p.stem for p in STUB_NOTEBOOKS])
def test_notebook_stops_at_first_stub(path, monkeypatch):
    """As a learner gets it (stubs untouched, no solutions): Run All stops at the first check, with
    its short message (CheckFailed, no traceback), and not before."""
    import nbclient.exceptions
    nb, client, budget = _client(path, monkeypatch, solutions=False)
    first = _check_cells(nb)[0]
    with pytest.raises(nbclient.exceptions.CellExecutionError) as e:
        client.execute()
    assert e.value.ename == "CheckFailed", (e.value.ename, str(e.value)[-2000:])
    failed = [i for i, c in enumerate(nb.cells) if any(o.get("output_type") == "error" for o in c.get("outputs", []))]
    assert failed == [first], (failed, first)
    err = next(o for o in nb.cells[first].outputs if o.output_type == "error")
    shown = "\n".join(err.traceback)
    assert "not written yet" in shown and "show_solution" in shown
    assert "Traceback" not in shown and "File " not in shown, shown       # the message, not a stack
    assert all(not c.get("outputs") for c in nb.cells[first + 1:] if c.cell_type == "code")


# -- installed, not cloned (Colab installs pagedlab with pip) ---------------------------------------

@pytest.mark.slow
@pytest.mark.network
def test_notebook_runs_from_an_installed_wheel(tmp_path, monkeypatch):
    """pagedlab built as a wheel (pip's isolated build: needs a package index) and installed with
    --target; notebook 07 copied alone to a folder outside the clone and run there with the answers:
    its check finds the solution, the exercise solutions run, its concept figure is embedded, and
    pagedlab comes from the install. Then the other course files a wheel must carry: every piece's
    solution (09's capstone finds all seven), the H200 tables of 06 and 13."""
    import shutil
    import subprocess
    import sys
    src, dist, target, outside = (tmp_path / d for d in ("src", "dist", "site", "elsewhere"))
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".*", "build", "dist", "*.egg-info", "__pycache__", "out", "unused"))     # links followed
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", str(src), "-w", str(dist)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = dist.glob("pagedlab-*.whl")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                        str(target), str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    outside.mkdir()
    path = outside / "07_paged_kv_and_the_block_table.ipynb"
    shutil.copy(NB_DIR / path.name, path)

    nb, client, budget = _client(path, monkeypatch, solutions=True)
    monkeypatch.setenv("PYTHONPATH", str(target))                    # the install, not the clone
    client.resources = {"metadata": {"path": str(outside)}}
    client.execute()
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert f"pagedlab 0.1.0 from {target / 'pagedlab'}" in _text(code[0])
    for i in _check_cells(nb):
        assert "\u2713" in _text(nb.cells[i]), _text(nb.cells[i])
    fig = next(c for c in code if "course.figure(" in c.source)
    assert any("image/png" in o.get("data", {}) for o in fig.outputs), fig.outputs
    last = _text(code[-1])
    assert "# Solutions to notebook 07" in last and "block size  16: paged wastes" in last, last[-800:]

    probe = ("from pagedlab import course\nfrom pagedlab.course import checks, parallel, prefix\n"
             "import pagedlab\n"
             "for f in ('pieces', 'pieces_prefix', 'pieces_serving', 'pieces_parallel', 'pieces_kernels'):\n"
             "    assert str(course.pieces_path(f + '.py')).startswith(pagedlab.__path__[0]), f\n"
             "checks.show_solution('make_room'); prefix.show_solution('block_keys')\n"
             "assert course.load_h200_bench()['meta'] and parallel.load_parallel_bench()\n"
             "import os; os.environ['PAGEDLAB_SOLUTIONS'] = '1'\n"      # 09's capstone: every piece's solution
             "from pagedlab.course import own_engine\n"
             "assert all(callable(f) for f, _ in own_engine.your_pieces(verbose=False).values())\n"
             "print('ok', pagedlab.__file__)\n")
    env = {k: v for k, v in os.environ.items() if k != "PAGEDLAB_SOLUTIONS"}
    r = subprocess.run([sys.executable, "-c", probe], cwd=outside, capture_output=True, text=True, timeout=120,
                       env={**env, "PYTHONPATH": str(target)})
    assert r.returncode == 0 and f"ok {target / 'pagedlab'}" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    assert "def make_room" in r.stdout and "def block_keys" in r.stdout

"""The command line checks every argument before it loads a model: a bad one is ONE line on stderr
naming its flag, exit status 2, no traceback, and the model loader is never called. Also: the
benchmarks behind `python -m pagedlab bench` import on any machine and use public names only."""
import ast
import importlib
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import pagedlab.__main__ as cli
from pagedlab.bench import BENCHMARKS

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_loading(monkeypatch):
    """Any attempt to load a model fails the test."""
    import pagedlab.llm
    import pagedlab.weights

    def boom(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")
    monkeypatch.setattr(pagedlab.weights, "load_checkpoint", boom)
    monkeypatch.setattr(pagedlab.llm, "load_checkpoint", boom, raising=False)
    monkeypatch.setattr(pagedlab.llm, "LLM", boom)


def run_main(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    return e.value.code, err


BAD = [
    (["--temperature", "-1"], "--temperature"),
    (["--temperature", "nan"], "--temperature"),
    (["--top-p", "2"], "--top-p"),
    (["--top-p", "0"], "--top-p"),
    (["--top-k", "-3"], "--top-k"),
    (["--slots", "0"], "--slots"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--seed", "-1"], "--seed"),
    (["--seed", str(2 ** 63)], "--seed"),
    (["--seed", "1.5"], "--seed"),
    (["--device", "banana"], "--device"),
    (["--device", "gpu"], "did you mean 'cuda'?"),
    (["--dtype", "bf"], "--dtype"),
    (["--dtype", "int8"], "--dtype"),
    (["--backend", "jax"], "--backend"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size"),
    (["--data-parallel-size", "-1"], "--data-parallel-size"),
    (["--tensor-parallel-size", "two"], "--tensor-parallel-size"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--max-tokens", "0"], "--max-new-tokens"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization"),
    (["--gpu-memory-utilization", "nan"], "--gpu-memory-utilization"),
]


@pytest.mark.parametrize("args,flag", BAD)
def test_bad_flag_is_one_line_before_loading(args, flag, no_loading, capsys):
    code, err = run_main(["generate", *args, "hi"], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and flag in lines[0], err
    assert "Traceback" not in err


@pytest.mark.parametrize("prompt", ["", "   ", "\t\n"])
def test_empty_prompt(prompt, no_loading, capsys):
    for cmd in ("generate", "demo"):
        code, err = run_main([cmd, "ok", prompt], capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1 and "PROMPT 2 of 2 is empty" in err


def test_cuda_without_cuda(no_loading, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:0", "CUDA"):
        code, err = run_main(["generate", "--device", device, "hi"], capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1
        assert "--device" in err and "is_available() is False" in err


def test_usage_errors_are_one_line(no_loading, capsys):
    for argv in ([], ["generate"], ["fly"], ["generate", "--nope", "hi"], ["bench", "boundaries"]):
        code, err = run_main(argv, capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("error: "), (argv, err)


def test_help_still_works(capsys):
    for argv in (["--help"], ["generate", "--help"], ["bench", "--help"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 0
        assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("model", ["/no/such/model", "random:nope"])
def test_unknown_model_is_one_line(model, capsys):
    code, err = run_main(["generate", "--model", model, "--device", "cpu", "hi"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--model" in err


def test_errors_come_back_fast_and_without_traceback():
    """As a user sees it: a subprocess, errors before any model is loaded (well under the 14-38 s
    a load takes; the bound is loose for slow CI machines)."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "pagedlab", "generate", "--top-p", "2", "hi"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == \
        "error: --top-p must be a finite number in (0, 1] (1 = off), found 2.0"
    assert time.perf_counter() - t0 < 60


def test_good_arguments_generate(capsys):
    assert cli.main(["generate", "--model", "random:tiny", "--device", "cpu", "--dtype", "fp32",
                     "--max-new-tokens", "3", "--seed", str(2 ** 63 - 1), "--temperature", "0.5",
                     "--top-p", "1", "--top-k", "5", "hi"]) == 0
    assert capsys.readouterr().err == "[stopped at 3 tokens (max_tokens); pass --max-tokens N for more]\n"


def test_vllm_flag_names_reach_the_engine(monkeypatch, capsys):
    import pagedlab.llm
    built = {}

    class Recorder(pagedlab.llm.LLM):
        def __init__(self, *a, **kw):
            built.update(kw)
            super().__init__(*a, **kw)
    monkeypatch.setattr(pagedlab.llm, "LLM", Recorder)
    assert cli.main(["generate", "--model", "random:tiny", "--device", "cpu", "--max-num-seqs", "3",
                     "--gpu-memory-utilization", "0.3", "--max-tokens", "2", "hi", "there"]) == 0
    assert built["max_num_seqs"] == 3 and built["memory_fraction"] == 0.3
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 2
    assert err == "[stopped at 2 tokens (max_tokens) (answers 1, 2); pass --max-tokens N for more]\n"


@pytest.mark.parametrize("cmd,shown", [
    ("generate", ["--max-tokens N, --max-new-tokens N", "(default: 64)", ">= 0 (0 = greedy) (default: 0.0)",
                  "(default: 2)", "(default: 0.5"]),
    ("demo", ["(default: 64)", "(default: 0.0)"]),
    ("serve", ["temperature 1.0; max_tokens 16 on /v1/completions", "(default: 8)", "(default: 256)",
               "(default: 8000)"]),
])
def test_help_shows_the_defaults(cmd, shown, capsys):
    from pagedlab import SamplingParams
    assert SamplingParams().max_tokens == 64 and SamplingParams().temperature == 0.0   # the Python door's
    with pytest.raises(SystemExit):
        cli.main([cmd, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for s in shown:
        assert s in text, (cmd, s)


def test_bench_serve_writes_outside_the_repository_by_default():
    from pagedlab.bench import serve as bench_serve
    assert bench_serve.build_parser().parse_args(["--url", "http://x"]).out == "out"


# ------------------------------------------------------------------ benchmarks
@pytest.mark.parametrize("name", BENCHMARKS)
def test_bench_dispatch_without_a_gpu(name, monkeypatch, capsys):
    """`python -m pagedlab bench NAME` reaches pagedlab.bench.NAME, which needs CUDA."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", name, "--out", "unused"])
    assert "needs a CUDA GPU" in str(e.value.code)


def _private_uses(path: Path):
    """Names starting with one underscore that a file takes from other modules."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            found.append(node.attr)
        if isinstance(node, ast.ImportFrom):
            found += [a.name for a in node.names if a.name.startswith("_")]
    return found


@pytest.mark.parametrize("path", sorted((ROOT / "pagedlab" / "bench").glob("*.py")) +
                         [ROOT / "scripts" / "boundaries_experiment.py"], ids=lambda p: p.name)
def test_benchmarks_use_public_names_only(path):
    if path.parent.name == "bench":
        importlib.import_module(f"pagedlab.bench.{path.stem}")
    assert _private_uses(path) == []

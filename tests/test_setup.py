"""The set-up the README promises: environment.yml and pyproject.toml agree, CI runs the README,
the repository's address lives in one setting, the notebooks' install cell checks what it did, and
the package builds as a wheel that installs and runs the demo on its base dependencies alone."""
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def pyproject():
    if sys.version_info >= (3, 11):
        import tomllib
    else:                                     # pragma: no cover
        import tomli as tomllib
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def env_pip_requirements():
    lines = (ROOT / "environment.yml").read_text().splitlines()
    start = next(i for i, l in enumerate(lines) if l.strip() == "- pip:")
    reqs = []
    for l in lines[start + 1:]:
        m = re.match(r"^\s+- (.+)$", l)
        if m:
            reqs.append(m.group(1).strip())
    return reqs


def expand(extras):
    """The requirements of these extras of pagedlab, self-references (pagedlab[a,b]) followed."""
    opt = pyproject()["project"]["optional-dependencies"]
    out = []
    for extra in extras:
        for req in opt[extra]:
            m = re.fullmatch(r"pagedlab\[([\w,\s-]+)\]", req)
            out += expand([e.strip() for e in m.group(1).split(",")]) if m else [req]
    return out


def no_deps_packages():
    return pyproject()["tool"]["pagedlab"]["no-deps"]


def test_environment_yml_matches_pyproject():
    """environment.yml installs what `pip install -e ".[test]"` does (the base dependencies, the
    notebooks, serve and test extras), then the package itself; and it tells the one command it
    cannot run (pip's --no-deps has no place in environment.yml)."""
    proj = pyproject()["project"]
    wanted = set(proj["dependencies"] + expand(["test"]))
    got = [r for r in env_pip_requirements() if r != "-e ."]
    assert len(got) == len(set(got)), "a requirement is listed twice in environment.yml"
    assert set(got) == wanted, (set(got) - wanted, wanted - set(got))
    assert env_pip_requirements()[-1] == "-e .", "environment.yml installs the package last"
    assert {"jupyterlab>=4.0", "ipywidgets>=8.0", "matplotlib>=3.7"} <= wanted
    text = (ROOT / "environment.yml").read_text()
    assert f"pip install --no-deps {' '.join(no_deps_packages())}" in text


def test_base_install_is_lean():
    """The engine's own requirements hold no notebook, server or test tool: those are extras."""
    base = {re.split(r"[<>=;\s\[]", d)[0].lower() for d in pyproject()["project"]["dependencies"]}
    extras = {re.split(r"[<>=;\s\[]", d)[0].lower() for d in expand(["notebooks", "serve", "test"])}
    assert not base & extras, base & extras
    for heavy in ("jupyterlab", "ipywidgets", "matplotlib", "fastapi", "pytest", "accelerate"):
        assert heavy not in base


def test_torch_not_pinned_to_one_version():
    torch_req = next(d for d in pyproject()["project"]["dependencies"] if d.startswith("torch"))
    assert "==" not in torch_req


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- test-command -->\n```bash\n(.+?)\n```\n<!-- /test-command -->", readme, re.S)
    assert block, "README lacks the marked test command"
    assert "pytest" in block.group(1)
    assert "README.md" in (ROOT / ".ci" / "run").read_text()


def test_readme_file_table_matches_the_package():
    """Every module and subpackage of pagedlab has a row in the README's "What is inside" table,
    and every path the table names exists."""
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## What is inside"):readme.index("## How it is checked")]
    named = set(re.findall(r"`([\w/.]+\.py|[\w/]+/)`", table))
    paths = set()
    for name in named:                                   # `viz.py`, `figures.py` share a row
        paths.add(name if name.startswith(("pagedlab/", "scripts/")) else f"pagedlab/{name}")
    for p in paths:
        assert (ROOT / p).exists(), f"README names {p}, which does not exist"
    pkg = ROOT / "pagedlab"
    for f in sorted(pkg.iterdir()):
        if f.name in ("__init__.py", "__main__.py", "__pycache__"):
            continue
        rel = f"pagedlab/{f.name}" + ("/" if f.is_dir() else "")
        if f.suffix == ".py" or f.is_dir():
            assert rel in paths, f"{rel} has no row in the README's file table"


def test_ci_tests_the_declared_transformers_floor():
    """The README's test command reruns the tokenizer and SmolLM2 tests at exactly the transformers
    version pyproject.toml declares as its floor (a floor that is tested, not hoped for)."""
    floor = next(d for d in pyproject()["project"]["dependencies"] if d.startswith("transformers"))
    floor = floor.split(">=")[1]
    readme = (ROOT / "README.md").read_text()
    cmd = re.search(r"<!-- test-command -->\n```bash\n(.+?)\n```", readme, re.S).group(1)
    pinned = re.search(r'transformers==([\d.]+)"? && python -m pytest -q ([^&]+)$', cmd)
    assert pinned, "the test command does not rerun tests at a pinned transformers"
    from packaging.version import Version
    assert Version(pinned.group(1)) == Version(floor), (pinned.group(1), floor)
    for t in ("tests/test_tokenizer.py", "tests/test_smollm2.py"):
        assert t in pinned.group(2)


# ------------------------------------------------------------------ one repository address
def gen_module():
    spec = importlib.util.spec_from_file_location("pagedlab_nb_gen", ROOT / "notebooks" / "_src" / "gen.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    return gen


def repo_url():
    return pyproject()["project"]["urls"]["Repository"].rstrip("/")


def test_notebooks_are_generated_from_their_sources():
    """Each committed notebook is what gen.py makes of its source (run python notebooks/_src/gen.py)."""
    gen = gen_module()
    sources = sorted(p.stem for p in gen.SRC.glob("*.nb"))
    assert sources == sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    for name in sources:
        want = gen.render(name)
        got = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())
        assert [(c.cell_type, c.source) for c in want.cells] == \
               [(c["cell_type"], "".join(c["source"])) for c in got["cells"]], \
            f"notebooks/{name}.ipynb differs from its source: run python notebooks/_src/gen.py"


def test_repository_address_is_one_setting():
    """pyproject's [project.urls] Repository is the only address: every notebook's Colab badge (its
    first markdown cell) and install cell, and the README's notebook table, are made from it."""
    url = repo_url()
    owner_repo = re.fullmatch(r"https://github\.com/([^/]+/[^/]+)", url).group(1)
    readme = (ROOT / "README.md").read_text()
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        nb = json.loads(path.read_text())
        first_md = "".join(next(c for c in nb["cells"] if c["cell_type"] == "markdown")["source"])
        colab = f"https://colab.research.google.com/github/{owner_repo}/blob/main/notebooks/{path.name}"
        assert f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({colab})" \
               in first_md, f"{path.name}: no Colab badge for {colab}"
        assert f"({colab})" in readme, f"README's notebook table has no Colab link to {path.name}"
        assert f"](notebooks/{path.name})" in readme
        text = path.read_text()
        assert "PLACEHOLDER" not in text
        setup = "".join(next(c for c in nb["cells"] if "PAGEDLAB_PIP" in "".join(c["source"]))["source"])
        assert f'PAGEDLAB_PIP = "pagedlab[notebooks] @ git+{url}"' in setup, path.name
        for other in set(re.findall(r"github\.com/([\w.-]+/[\w.-]+)", text)):
            assert other == owner_repo or other.startswith("YOU/"), f"{path.name} names {other}"
    for other in set(re.findall(r"github(?:\.com)?/([\w-]+/[\w-]+)/blob", readme)):
        assert other == owner_repo, f"README links {other}, not {owner_repo}"


def test_changing_the_address_changes_every_link():
    """A fork sets its address once and regenerates: the badge, the pip URL and the table follow."""
    gen = gen_module()
    fork = "https://github.com/someone/pagedlab-fork"
    nb = gen.render("00_overview", url=fork)
    text = json.dumps(nb)
    assert "colab.research.google.com/github/someone/pagedlab-fork/blob/main/notebooks/00_overview.ipynb" in text
    assert f"pagedlab[notebooks] @ git+{fork}" in text
    assert "github.com/pagedlab/pagedlab" not in text.replace(fork, "")
    assert "someone/pagedlab-fork" in gen.readme_table(fork)
    with pytest.raises(SystemExit):
        gen.render("00_overview", url="https://gitlab.com/someone/pagedlab")   # Colab reads GitHub


def test_readme_commands_install_the_no_deps_packages():
    """The demo command, the test command and the environment.yml route each install the packages
    that pyproject's [tool.pagedlab] no-deps names, with --no-deps; so does the notebooks' cell."""
    readme = (ROOT / "README.md").read_text()
    quick = readme[readme.index("## Quick start"):readme.index("## The course")]
    wanted = f"pip install --no-deps {' '.join(no_deps_packages())}"
    commands = re.findall(r"```bash\n(.+?)\n```", quick, re.S)
    demo = next(c for c in commands if "pagedlab demo" in c)
    test = next(c for c in commands if "pytest" in c)
    conda = next(c for c in commands if "environment.yml" in c)
    for cmd in (demo, test, conda):
        assert wanted in cmd, cmd
    assert "conda activate pagedlab" in conda
    assert 'pip install -e ".[test]"' in test and "pip install -e ." in demo
    gen = gen_module()
    for pkg in no_deps_packages():
        assert f'"{pkg}": "{pkg.replace("-", "_")}"' in gen.setup_cell()


# ------------------------------------------------------------------ the install cell
def setup_cell_source():
    nb = json.loads((ROOT / "notebooks" / "00_overview.ipynb").read_text())
    return "".join(next(c for c in nb["cells"] if "PAGEDLAB_PIP" in "".join(c["source"]))["source"])


def test_setup_cell_forces_no_dtype():
    """The cell leaves the dtype to the engine (bf16 on sm80+, fp16 on a T4, fp32 on the CPU)."""
    src = setup_cell_source()
    for word in ("bfloat16", "bf16", "float16", "set_default_dtype"):
        assert word not in src


def test_setup_cell_stops_with_what_to_do_when_pip_fails(tmp_path):
    """Outside a clone, with pagedlab not installed and pip failing (here: an address that does
    not exist), the cell stops with a SetupError that says what to do, before importing torch."""
    src = setup_cell_source().replace(f"git+{repo_url()}", (tmp_path / "no-such-repo").as_uri())
    assert str(tmp_path / "no-such-repo") in src
    script = tmp_path / "setup_cell.py"
    script.write_text(src)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PAGEDLAB_NO_INSTALL")}
    # -S: no site-packages, so pagedlab is not importable (as in a fresh Colab runtime);
    # pip, a child process, still has its own.
    r = subprocess.run([sys.executable, "-S", str(script)], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0
    assert "pip install pagedlab[notebooks] @ file://" in r.stdout                  # it said what it ran
    last = r.stderr.strip().splitlines()
    err = "\n".join(last[last.index(next(l for l in last if l.startswith("SetupError"))):])
    assert "SetupError: pip install failed (exit status 1" in err
    assert f"git clone {repo_url()}" in err and "PAGEDLAB_PIP" in err and "restart the kernel" in err
    assert "Traceback" in r.stderr                    # plain Python shows one; Jupyter shows only the message


def test_setup_error_shows_as_one_message_in_jupyter():
    """In a kernel the SetupError is its message alone, not a traceback through the cell."""
    pytest.importorskip("nbclient")
    import nbclient
    import nbformat
    src = setup_cell_source()
    cls = src[src.index("class SetupError"):src.index("def _pip")]
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(cls + "\nraise SetupError('pip install failed. What to do:\\n  this')")]
    nbclient.NotebookClient(nb, kernel_name="python3", allow_errors=True, timeout=60).execute()
    (out,) = nb.cells[0].outputs
    assert out.output_type == "error" and out.ename == "SetupError"
    assert out.traceback == ["SetupError: pip install failed. What to do:\n  this"]


# ------------------------------------------------------------------ the wheel
BASE_ONLY = """
import runpy, sys
# Only the base install: the extras' packages (present in the test environment) are made absent.
for m in ("matplotlib", "ipywidgets", "IPython", "jupyterlab", "jupyter_server", "notebook",
          "fastapi", "uvicorn", "starlette", "prometheus_client", "openai", "accelerate",
          "pytest", "nbclient", "nbformat", "ipykernel"):
    sys.modules[m] = None
import pagedlab
print("pagedlab from", pagedlab.__file__)
sys.argv = ["pagedlab"] + sys.argv[1:]
runpy.run_module("pagedlab", run_name="__main__", alter_sys=True)
"""


@pytest.mark.network
def test_wheel_builds_installs_and_runs_the_demo(tmp_path):
    """pip builds the wheel (in pip's isolated build environment, which needs a package index);
    it holds every file of the package; installed into a new venv -- which borrows this
    environment's torch and other libraries through a path entry, not its pagedlab -- it runs the
    demo and the `pagedlab` command from outside the clone with none of the extras importable."""
    # build from a copy: no build/ left over from an earlier build can add files to the wheel, and
    # the checkout is left as it is
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".*", "build", "dist", "*.egg-info", "__pycache__", "out"))       # .git, .venv, ...
    dist = tmp_path / "dist"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", str(src), "-w", str(dist)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = dist.glob("pagedlab-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in (ROOT / "pagedlab").rglob("*"):
        if f.is_file() and "__pycache__" not in f.parts and f.suffix != ".pyc":
            rel = f.relative_to(ROOT).as_posix()
            assert rel in names, f"{rel} is not in the wheel (package data must be declared in pyproject.toml)"
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("dist-info/METADATA"))).decode()
    requires = [l.split(": ", 1)[1] for l in meta.splitlines() if l.startswith("Requires-Dist: ")]
    assert not [q for q in requires if "extra ==" not in q and re.match(r"(jupyterlab|ipywidgets|matplotlib)", q)]

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = Path(subprocess.check_output([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                        text=True).strip())
    # this environment's libraries, after the venv's own (a path entry: its .pth files, such as an
    # editable pagedlab's finder, are not run)
    here = [p for p in sys.path if p.endswith("site-packages")]
    (site / "zz_borrow.pth").write_text("\n".join(here) + "\n")
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
                        "--no-index", str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET", "PAGEDLAB_MODEL")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    r = subprocess.run([py, "-c", BASE_ONLY, "demo", "--model", "random:tiny", "--max-new-tokens", "4"],
                       cwd=outside, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert f"pagedlab from {site / 'pagedlab' / '__init__.py'}" in r.stdout
    assert "slot timeline" in r.stdout and "Capital of France?" in r.stdout
    r = subprocess.run([venv / "bin" / "pagedlab", "demo", "--slots", "0"], cwd=outside, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and re.match(r"error: --slots( \(--max-num-seqs\))? must be an integer >= 1", r.stderr), \
        r.stderr[-2000:]


@pytest.mark.parametrize("gpu,cap,dtype", [("Tesla T4", (7, 5), "float16"), ("NVIDIA A100", (8, 0), "bfloat16")])
def test_course_picks_fp16_on_a_t4(monkeypatch, gpu, cap, dtype):
    """The notebooks' device helpers on a (simulated) Colab T4: the engine's fp16 path, and the
    set-up cell's report says so; an sm80 GPU gets bf16."""
    import types

    import torch

    from pagedlab import course
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: cap)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: types.SimpleNamespace(
        name=gpu, total_memory=15 * 2**30, major=cap[0], minor=cap[1]))
    assert course.device_dtype()[1] == getattr(torch, dtype)
    report = course.device_report()
    assert f"compute capability {cap[0]}.{cap[1]}" in report, report
    assert dtype in report and (dtype == "bfloat16" or "bfloat16" not in report), report

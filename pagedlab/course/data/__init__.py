"""The files the course reads, shipped with pagedlab so that it works installed (Colab, a wheel)
as well as cloned: the solutions (solutions/*.py), the concept figures the notebooks show
(figures/*.png) and the lab's committed H200 measurements (kernels_bench.json, parallel_bench.json,
serve_core_*.json, ...: any docs/*.json linked here).

In a clone these are links to notebooks/solutions/, figures/ and docs/; a wheel carries the files
themselves (pyproject.toml's [tool.setuptools.package-data]). `path(rel)` finds one either way
(and in a clone whose checkout has no links, e.g. on Windows without core.symlinks)."""
from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
_CLONE = HERE.parents[2]
# where each file lives in a clone of the repository
_IN_CLONE = {"solutions": _CLONE / "notebooks" / "solutions", "figures": _CLONE / "figures",
             "kernels_bench.json": _CLONE / "docs" / "kernels_bench.json",
             "parallel_bench.json": _CLONE / "docs" / "parallel_bench.json"}


def path(rel: str) -> Path | None:
    """The course file `rel` ("solutions/pieces.py", "figures/paging_concept.png",
    "kernels_bench.json"), or None when neither the package nor a clone has it."""
    p = HERE / rel
    if p.is_file():
        return p
    head, _, tail = rel.partition("/")
    q = _IN_CLONE.get(head) or (_CLONE / "docs" / head if head.endswith(".json") else None)
    if q is not None:
        q = q / tail if tail else q
        if q.is_file():
            return q
    return None


def load_json(name: str, file=None) -> dict | None:
    """A committed measurement, e.g. "fp8_speed.json" (docs/ in a clone), read as a dict -- from
    `file` when given -- or None when this pagedlab does not have it."""
    import json
    p = Path(file) if file is not None else path(name)
    return json.loads(p.read_text()) if p is not None and p.is_file() else None

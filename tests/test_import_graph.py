"""The package's import graph, read from the source with `ast` (every import statement, those inside
functions too): no circle among the engine's modules, and no import from a lower room to a higher
one. The rooms, lowest first, are named here on purpose: a new module must be given its room.

    base < kernels < model/attention < kv/blocks/scheduler < runner/engine < engine_core/llm
         < async_llm/server < bench/CLI (and the package's front, pagedlab/__init__) < course

The course (pagedlab/course/, and the pagedlab.viz shim) is the top room: it may import anything,
nothing of the engine may import it. Dynamic imports (importlib.import_module) are not statements
and are not seen: the CLI picks a benchmark module by name that way.
"""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "pagedlab"

# room -> its modules (names relative to pagedlab; "kernels.*" is every module under kernels/)
ROOMS = [
    ("base", ["version", "validation", "config", "spec.config", "interrupts", "cpu_threads", "conversation", "reference", "tokenizer",
              "weights", "loop_watch"]),
    ("kernels", ["kernels", "kernels.*", "quantization"]),
    ("model/attention", ["attention", "model", "sampling", "parallel", "parallel.shard"]),
    ("kv/blocks/scheduler", ["kv_cache", "prefix_cache", "plugged_allocator", "request", "scheduler", "trace",
                             "spec.accept", "spec.gate", "spec.ngram", "spec.rejection", "spec.shadow",
                             "spec.speculator"]),
    ("runner/engine", ["runner", "cuda_graph", "engine", "plugins", "parallel.group", "spec", "spec.draft"]),
    ("engine_core/llm", ["engine_core", "output_processor", "streaming", "rank", "engine_args", "llm", "warmup",
                         "parallel.data_parallel", "parallel.workers", "parallel.world"]),
    ("async_llm/server", ["async_llm", "core_process", "core_mailbox", "server", "server.*"]),
    ("bench/CLI", ["bench", "bench.*", "__main__", ""]),          # "": the package itself (__init__)
    ("course", ["course", "course.*", "viz"]),
]
COURSE_NAMES = ("course", "checks", "viz", "figures", "kernel_costs")   # before and after the move


def module_name(path: Path) -> str:
    """pagedlab/server/app.py -> "server.app"; pagedlab/__init__.py -> ""."""
    parts = list(path.relative_to(PKG).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts}


def imports_of(name: str, path: Path, modules) -> set[str]:
    """The pagedlab modules `name` imports, anywhere in its file. `from .x import y` is module
    x.y when that is a module, else x."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                if not (node.module or "").startswith("pagedlab"):
                    continue
                mod = node.module.removeprefix("pagedlab").lstrip(".")
            targets = [f"{mod}.{a.name}".lstrip(".") if f"{mod}.{a.name}".lstrip(".") in modules else mod
                       for a in node.names]
            out.update(targets)
            continue
        else:
            continue
        out.update(t.removeprefix("pagedlab").lstrip(".") for t in targets if t.split(".")[0] == "pagedlab")
    out.discard(name)
    return out


def graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imports_of(name, path, modules) & set(modules) for name, path in modules.items()}


def is_course(name: str) -> bool:
    return name.split(".")[0].startswith(COURSE_NAMES)


def room_of(name: str) -> int:
    if is_course(name):
        return len(ROOMS) - 1
    for i, (_, names) in enumerate(ROOMS):
        for pattern in names:
            if name == pattern or (pattern.endswith(".*") and name.startswith(pattern[:-1])):
                return i
    raise AssertionError(f"pagedlab.{name} has no room: add it to ROOMS in {__file__}")


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_the_parser_sees_function_level_and_relative_imports(tmp_path):
    """The reader itself: a relative import inside a function, `from . import module`, `from ..x
    import name` and `import pagedlab.x` are all edges; third-party imports are not."""
    modules = {"a", "b", "pkg", "pkg.c", "pkg.d", "x"}
    src = tmp_path / "pkg" / "c.py"
    src.parent.mkdir()
    src.write_text("import torch\nfrom . import d\nfrom ..x import thing\n"
                   "def f():\n    from ..a import y\n    import pagedlab.b\n")
    assert imports_of("pkg.c", src, modules) == {"pkg.d", "x", "a", "b"}


def test_cycles_are_found():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e", "a"}}
    assert cycles(g) == [["a", "b", "c"]]


def test_every_module_has_a_room():
    for name in all_modules():
        room_of(name)


def test_no_import_runs_from_a_lower_room_to_a_higher_one():
    bad = [f"pagedlab.{a} ({ROOMS[room_of(a)][0]}) imports pagedlab.{b} ({ROOMS[room_of(b)][0]})"
           for a, deps in sorted(graph().items()) for b in sorted(deps) if room_of(b) > room_of(a)]
    assert not bad, "imports against the rooms:\n  " + "\n  ".join(bad)


def test_no_circle_among_the_engine_modules():
    g = graph()
    engine = {a: {b for b in deps if not is_course(b)} for a, deps in g.items() if not is_course(a)}
    assert engine and not cycles(engine), f"import circles: {cycles(engine)}"


def test_the_engine_graph_is_read_whole():
    """A guard against a reader that sees nothing: known edges are there (a module-level one, a
    function-level one, one into a package's module)."""
    g = graph()
    assert "scheduler" in g["engine"] and "validation" in g["sampling"]
    assert "kernels.quant_fp8" in g["quantization"] and "server.app" in g["server"]
    assert any(d.startswith("parallel.") for d in g["llm"])          # imported inside LLM methods

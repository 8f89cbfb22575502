"""What every chapter's checks share: `CheckFailed`, where the course's solutions are, and one
`Chapter` per pieces file that picks the piece to check (the learner's, or with
PAGEDLAB_SOLUTIONS=1 the course's), calls it (a stub or a crash becomes a CheckFailed naming the
input), says what a stub's check says, and prints a pass.

    chapter = Chapter("pieces_prefix.py", "prefix_course")   # the name the notebook imports it as
    fn = chapter.pick(fn, "block_keys")
    keys = chapter.call(fn, "block_keys", tokens, block_size)
    chapter.passed("block_keys", "40 prompts ...")

A failing check raises `CheckFailed`. In Jupyter (IPython) its traceback is replaced by its
message (`_render_traceback_`), so Run All stops at the first unfinished piece with a short,
friendly message instead of a stack.
"""
from __future__ import annotations

import importlib.util
import inspect
import os
from pathlib import Path

from ..kv_cache import OutOfBlocks


class CheckFailed(Exception):
    """A check found a mistake. In IPython only the message is shown, not a traceback."""

    def _render_traceback_(self):
        return [f"\x1b[1;31mCheck failed:\x1b[0m {line}" if i == 0 else line
                for i, line in enumerate(str(self).splitlines())]


def solutions_on() -> bool:
    """PAGEDLAB_SOLUTIONS=1 (CI, or a learner who wants to move on): checks run the course's solutions."""
    return os.environ.get("PAGEDLAB_SOLUTIONS", "0").lower() in ("1", "true", "yes")


def pieces_path(pieces_file: str = "pieces.py") -> Path | None:
    """Where a chapter's piece solutions are: solutions/ beside the notebook (a clone's
    notebooks/), else the copy pagedlab ships (pagedlab.course.data: installed or cloned)."""
    from . import data
    p = Path.cwd() / "solutions" / pieces_file
    return p if p.is_file() else data.path(f"solutions/{pieces_file}")


def load_pieces(pieces_file: str = "pieces.py"):
    """The course's solutions/<pieces_file>, run as a module."""
    path = pieces_path(pieces_file)
    if path is None:
        raise CheckFailed(f"solutions/{pieces_file} is not in this pagedlab ({Path(__file__).parent}): "
                          "reinstall it, or see notebooks/solutions/ in the repository")
    spec = importlib.util.spec_from_file_location(f"pagedlab_course_{Path(pieces_file).stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Chapter:
    """One chapter's hands-on plumbing. pieces_files: where its solutions are (the first that
    defines a piece wins); module: the name the notebook imports the chapter's checks as (the
    "Stuck?" line of a stub's message names it)."""

    def __init__(self, *pieces_files: str, module: str = "course"):
        self.pieces_files = pieces_files or ("pieces.py",)
        self.module = module

    def solution(self, name: str):
        """The course's solution of piece `name`."""
        for f in self.pieces_files:
            mod = load_pieces(f)
            if hasattr(mod, name):
                return getattr(mod, name)
        raise CheckFailed(f"no solution of {name!r} in solutions/{', '.join(self.pieces_files)}")

    def show_solution(self, name: str) -> None:
        """Print the solution of piece `name`, to read (it does not replace yours)."""
        sol = self.solution(name)
        print(inspect.getsource(getattr(sol, "fn", sol)))     # a Triton kernel: the function it wraps

    def pick(self, fn, name: str):
        """The piece to check: the learner's fn, or with PAGEDLAB_SOLUTIONS=1 the course's solution."""
        if solutions_on():
            print(f"PAGEDLAB_SOLUTIONS=1: checking the course's solution of {name}")
            return self.solution(name)
        return fn

    def not_written(self, name: str, e="") -> str:
        """What a stub's check says."""
        return (f"{name} is not written yet ({e or 'NotImplementedError'}).\n"
                f"Fill in the cell above and run it, then this check again. Stuck? "
                f"{self.module}.show_solution({name.split('.')[0]!r}) prints one.")

    def raised(self, name: str, e: BaseException, where: str | None = None, then: str = "") -> CheckFailed:
        """The CheckFailed for an error `e` from the learner's piece `name`: a stub's message for
        NotImplementedError, else "<where> raised <type>: <e>" followed by `then` (the case, a hint)."""
        if isinstance(e, CheckFailed):
            return e
        if isinstance(e, NotImplementedError):
            return CheckFailed(self.not_written(name, e))
        if isinstance(e, OutOfBlocks) and not then:
            then = (".\nHint: it asked the allocator for more blocks than are free. A request's blocks fit when "
                    "blocks_needed(seq.num_tokens, block_size) - len(seq.blocks) <= allocator.num_free: check that "
                    "before allocate (an off-by-one there asks for a block that is not there).")
        return CheckFailed(f"{where or name} raised {type(e).__name__}: {str(e)[:500]}{then}")

    def call(self, fn, name: str, *args, **kwargs):
        """Call the learner's function; a stub or a crash becomes a CheckFailed naming it."""
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise self.raised(name, e) from None

    @staticmethod
    def passed(name: str, what: str) -> None:
        print(f"\u2713 {name}: {what}")

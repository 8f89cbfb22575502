"""Every ```python block of the README runs as written: in order, in one Python process, as a reader
pasting them one after another would (a later block may use what an earlier one made). A block that
cannot run here says so just above its fence, with the reason:

    <!-- readme-test: skip (needs two GPUs) -->

Anything else (a block without a reason, a block that raises) fails, naming the block's line."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
SKIP = re.compile(r"<!-- readme-test: skip \((?P<why>[^)]+)\) -->")
TIMEOUT_S = 900


def python_blocks(text: str) -> list[dict]:
    """[{"line": where the code starts, "code", "skip": the reason or None}] in README order."""
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start, i = i + 1, i + 1
            while lines[i].strip() != "```":
                i += 1
            above = lines[start - 2] if start >= 2 else ""
            m = SKIP.fullmatch(above.strip())
            blocks.append({"line": start + 1, "code": "\n".join(lines[start:i]), "skip": m and m["why"]})
        i += 1
    return blocks


RUNNER = textwrap.dedent("""
    import json, sys, traceback
    blocks = json.load(sys.stdin)
    scope = {"__name__": "__main__"}
    for b in blocks:
        print(f"-- README line {b['line']}", flush=True)
        try:
            exec(compile(b["code"], f"README.md:{b['line']}", "exec"), scope)
        except BaseException:
            traceback.print_exc()
            print(f"FAILED: the block at README line {b['line']}", flush=True)
            sys.exit(1)
    print("ALL BLOCKS RAN", flush=True)
""")


def test_readme_blocks_are_found_and_skips_give_a_reason():
    text = README.read_text()
    blocks = python_blocks(text)
    assert len(blocks) >= 4
    assert len(SKIP.findall(text)) == sum(b["skip"] is not None for b in blocks), \
        "a readme-test marker that is not directly above a ```python fence"
    assert "<!-- readme-test" not in SKIP.sub("", text), "a readme-test marker without '(reason)'"
    assert sum(b["skip"] is None for b in blocks) >= len(blocks) - 1      # nearly everything runs


@pytest.mark.slow
def test_python_blocks_of_the_readme_run_as_written(tmp_path):
    blocks = [b for b in python_blocks(README.read_text()) if b["skip"] is None]
    r = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(blocks), capture_output=True, text=True,
                       timeout=TIMEOUT_S, cwd=tmp_path)
    assert r.returncode == 0 and "ALL BLOCKS RAN" in r.stdout, r.stdout[-3000:] + r.stderr[-6000:]

"""python -m pagedlab.course check CHAPTER [FILE]: a chapter's checks outside Jupyter (on the pieces
FILE defines; without FILE on the course's own solutions); `list` names the chapters and pieces."""
from __future__ import annotations

import os

from . import CheckFailed, limit_cpu_threads


def chapter_checks() -> dict:
    """Chapter -> [(piece name, or the names of pieces checked together, its check)]: what
    `python -m pagedlab.course check` runs. (05's
    decode loop is checked in its notebook only: it drives the notebook's model and helpers.)"""
    from . import checks, parallel, prefix, quant, serving, spec
    return {
        "00": [("timeline", checks.check_timeline)],
        "01": [("bpe_piece", checks.check_bpe_piece), ("admit", checks.check_admit)],
        "02": [("parse_header", checks.check_parse_header), ("bf16_to_fp32", checks.check_bf16_to_fp32),
               ("read_tensor", checks.check_read_tensor)],
        "03": [("rms_norm", checks.check_rms_norm), ("rope", checks.check_rope), ("attention", checks.check_attention),
               ("decoder_layer", checks.check_decoder_layer)],
        "04": [("rmsnorm_kernel", checks.check_rmsnorm_kernel), ("flash_attn_kernel", checks.check_flash_kernel)],
        "06": [("decode_one", checks.check_decode_one)],
        "07": [("Allocator", checks.check_allocator), ("token_slot", checks.check_token_slot)],
        "08": [("schedule_step", checks.check_schedule_step)],
        "09": [("engine_step", checks.check_engine_step)],
        "10": [("make_room", checks.check_make_room)],
        "11": [("sse_events", serving.check_sse_events)],
        "12": [("block_keys", prefix.check_block_keys),
               ("PrefixAllocator", prefix.check_prefix_allocator)],
        "13": [("shard", parallel.check_shard),
               ("column_parallel_linear", parallel.check_column_parallel),
               ("row_parallel_linear", parallel.check_row_parallel),
               ("vocab_parallel_embedding", parallel.check_vocab_embedding)],
        "14": [(("quantize_fp8", "dequantize_fp8"), quant.check_fp8)],
        "15": [("propose_ngram", spec.check_ngram), ("accept", spec.check_accept)],
    }


# pieces the notebook writes for the learner from their own (02's read_tensor is parse_header and
# bf16_to_fp32 together): checked when a file defines them, not missed when it does not
OPTIONAL = {"02": {"read_tensor"}}


def check_chapter(chapter: str, path: str | None = None) -> int:
    """Run a chapter's checks on the pieces a Python file defines (path=None: on the course's
    solutions). Prints each check's verdict; returns how many failed or were missing."""
    import runpy
    table = chapter_checks()
    chapter = f"{int(chapter):02d}" if str(chapter).isdigit() else str(chapter)
    if chapter not in table:
        raise SystemExit(f"no checks for chapter {chapter!r}: chapters with pieces are {', '.join(table)} "
                         "(05's decode loop is checked in its notebook)")
    if path is None:
        os.environ["PAGEDLAB_SOLUTIONS"] = "1"
        pieces = {}
    else:
        pieces = runpy.run_path(str(path), run_name="pagedlab_course_pieces")
    failed = 0
    for names, check in table[chapter]:
        names = (names,) if isinstance(names, str) else names          # a check of several pieces (14)
        missing = [n for n in names if path is not None and n not in pieces]
        if missing and set(missing) <= OPTIONAL.get(chapter, set()):
            print(f"- {' / '.join(names)}: not in {path} (the notebook writes it from the pieces above)")
            continue
        if missing:
            print(f"\u2717 {' / '.join(names)}: {path} defines no {', '.join(missing)}")
            failed += 1
            continue
        try:
            check(*(pieces.get(n) for n in names))
        except CheckFailed as e:
            print(f"\u2717 {' / '.join(names)}: {e}")
            failed += 1
    return failed


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="python -m pagedlab.course", description=(
        "Check a chapter's pieces outside Jupyter: the functions and classes a Python file of yours "
        "defines, under the names the notebook uses (without FILE: the course's own solutions)."))
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="run a chapter's checks")
    c.add_argument("chapter", help="the notebook's number, e.g. 07")
    c.add_argument("file", nargs="?", help="a Python file defining the chapter's pieces")
    sub.add_parser("list", help="the chapters with checks and their pieces")
    args = p.parse_args(argv)
    if args.cmd == "list":
        for ch, items in chapter_checks().items():
            print(ch, ", ".join(n if isinstance(n, str) else " / ".join(n) for n, _ in items))
        return 0
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")        # before any Triton kernel is defined
    limit_cpu_threads()
    return 1 if check_chapter(args.chapter, args.file) else 0


if __name__ == "__main__":
    import sys
    import torch
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        # Triton reads TRITON_INTERPRET when it is imported, and `python -m pagedlab.course` has
        # imported pagedlab (and Triton) before this line: start again with the interpreter on
        os.environ["TRITON_INTERPRET"] = "1"
        os.execv(sys.executable, [sys.executable, "-m", "pagedlab.course", *sys.argv[1:]])
    raise SystemExit(main())

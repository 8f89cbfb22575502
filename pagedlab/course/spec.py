"""Notebook 15's hands-on pieces and their checks: the n-gram proposer and the accept rule.

    propose_ngram = spec_course.check_ngram(propose_ngram)
    accept = spec_course.check_accept(accept)

Each check runs the learner's function and pagedlab's (pagedlab.spec: propose_ngram, emit) on the
same inputs -- edge cases first (no match, a match at the very end, k longer than what follows,
overlapping repeats, n below prompt_lookup_min; a first guess wrong, all right, EOS inside the
guesses, a budget shorter than the guesses), then random ones -- and a mistake raises CheckFailed
with the case, what was expected and found, and a hint naming the likely bug.

The solutions live with the notebooks, in notebooks/solutions/pieces_spec.py; with
PAGEDLAB_SOLUTIONS=1 the checks run them instead of the learner's code.
"""
from __future__ import annotations

import random
from pathlib import Path

from ..spec import emit, propose_ngram
from .chapter import Chapter, CheckFailed

chapter = Chapter("pieces_spec.py", module="spec_course")
solution, show_solution = chapter.solution, chapter.show_solution

NGRAM_EDGES = [
    ("no match", [1, 2, 3, 4], 3, 2, 1),
    ("a match: its continuation", [5, 6, 7, 5, 6], 3, 2, 1),
    ("k shorter than the continuation", [5, 6, 7, 8, 5, 6], 1, 2, 1),
    ("a match at the very end: fewer than k follow", [9, 5, 6, 9], 4, 2, 1),
    ("two earlier matches: the latest wins", [1, 2, 1, 3, 1], 2, 1, 1),
    ("longest n first", [3, 1, 2, 7, 2, 8, 1, 2], 1, 2, 1),
    ("n below prompt_lookup_min: no guess", [1, 2, 3, 1, 2], 2, 3, 3),
    ("an overlapping repeat", [4, 4, 4], 3, 2, 1),
    ("one token: nothing before it", [7], 3, 2, 1),
    ("k = 0", [1, 1, 1], 0, 2, 1),
]
ACCEPT_EDGES = [
    ("no guesses: the target's token", [], [7], (), None),
    ("first guess wrong: the correction only", [1, 2, 3], [9, 2, 3, 4], (), None),
    ("two right, the third wrong", [1, 2, 3], [1, 2, 8, 4], (), None),
    ("all right: k + 1 tokens (the bonus)", [1, 2, 3], [1, 2, 3, 4], (), None),
    ("EOS inside the guesses: stop after it", [1, 2, 3], [1, 2, 3, 4], (2,), None),
    ("EOS as the correction", [1, 2, 3], [1, 5, 3, 4], (5,), None),
    ("budget shorter than what verifies (max_tokens)", [1, 2, 3], [1, 2, 3, 4], (), 2),
    ("budget 1: one token, as a plain step", [1, 2], [1, 2, 3], (), 1),
    ("a wrong guess equal to a later target", [2, 1], [1, 2, 3], (), None),
]


def _ngram_hint(tokens, k, n_max, n_min, got, want) -> str:
    if want and not got:
        return ("a match was missed. Compare the last n tokens with every EARLIER window "
                "tokens[i:i+n] for i from L-n-1 down to 0 (not the suffix itself at i = L-n), for n "
                "from n_max down to n_min")
    if got and not want:
        return ("there is no earlier occurrence here (or n < n_min, or k = 0): return []. Did the "
                "suffix match itself (start i = L - n)?")
    if len(got) > k:
        return "at most k tokens: tokens[i + n : i + n + k]"
    if want and got and len(got) != len(want) and got == want[:len(got)]:
        return "take what follows the match up to k tokens, even if fewer remain before the end"
    return ("longest n first, and for that n the LATEST earlier occurrence (scan i downwards); "
            "propose the tokens right after it: tokens[i + n : i + n + k]")


def check_ngram(fn):
    """Check the learner's propose_ngram(tokens, k, n_max, n_min) against pagedlab.spec's."""
    fn = chapter.pick(fn, "propose_ngram")
    rnd = random.Random(15)
    cases = list(NGRAM_EDGES)
    for i in range(150):
        v = rnd.choice([2, 3, 5, 50])
        t = [rnd.randrange(v) for _ in range(rnd.randint(1, 30))]
        n_max = rnd.randint(1, 4)
        cases.append((f"random case {i}", t, rnd.randint(0, 6), n_max, rnd.randint(1, n_max)))
    for name, tokens, k, n_max, n_min in cases:
        want = propose_ngram(list(tokens), k, n_max, n_min)
        got = chapter.call(fn, "propose_ngram", list(tokens), k, n_max, n_min)
        if list(got) != want:
            raise CheckFailed(f"propose_ngram({tokens}, k={k}, n_max={n_max}, n_min={n_min}) -- {name}: "
                              f"got {list(got)}, expected {want}.\n"
                              f"Hint: {_ngram_hint(tokens, k, n_max, n_min, list(got), want)}")
    chapter.passed("propose_ngram", f"{len(NGRAM_EDGES)} edge cases and {len(cases) - len(NGRAM_EDGES)} "
                   "random sequences give pagedlab's guesses")
    return fn


def _accept_hint(drafts, targets, stop_ids, budget, got, want) -> str:
    if got == list(drafts) or (drafts and got == list(drafts[:len(got)]) and got != want):
        return ("emit the TARGET's tokens, not the guesses: a guess only decides whether we may go on; "
                "after the last kept guess comes targets[a], the target's own token")
    if len(got) == len(want) - 1 and got == want[:-1]:
        return ("one token short: after the kept guesses the step always emits targets[a] too -- the "
                "correction where a guess was wrong, the bonus when all k were right")
    if stop_ids and any(t in stop_ids for t in got[:-1]):
        return "a stop token ends the request: keep it, drop everything after it"
    if budget is not None and len(got) > budget:
        return "never more than `budget` tokens (what max_tokens still allows)"
    return ("count the leading guesses equal to the target's token at their position (stop at the "
            "first mismatch, even if a later guess happens to match), emit targets[:a + 1]")


def check_accept(fn):
    """Check the learner's accept(drafts, targets, stop_ids, budget) against pagedlab.spec.emit."""
    fn = chapter.pick(fn, "accept")
    rnd = random.Random(51)
    cases = list(ACCEPT_EDGES)
    for i in range(200):
        k = rnd.randint(0, 5)
        targets = [rnd.randrange(4) for _ in range(k + 1)]
        drafts = [t if rnd.random() < 0.6 else rnd.randrange(4) for t in targets[:k]]
        stop = tuple(rnd.sample(range(4), rnd.randint(0, 1)))
        cases.append((f"random case {i}", drafts, targets, stop, rnd.choice([None, None, rnd.randint(1, 6)])))
    for name, drafts, targets, stop_ids, budget in cases:
        want = emit(list(drafts), list(targets), stop_ids, budget)
        got = list(chapter.call(fn, "accept", list(drafts), list(targets), stop_ids, budget))
        if got != want:
            raise CheckFailed(f"accept(drafts={drafts}, targets={targets}, stop_ids={stop_ids}, budget={budget}) "
                              f"-- {name}: got {got}, expected {want}.\n"
                              f"Hint: {_accept_hint(drafts, targets, stop_ids, budget, got, want)}")
    chapter.passed("accept", f"{len(ACCEPT_EDGES)} edge cases (EOS inside the guesses, a budget shorter than "
                   f"them, all right, first wrong) and {len(cases) - len(ACCEPT_EDGES)} random ones agree with pagedlab")
    return fn


def load_spec_bench(path: str | Path | None = None) -> dict | None:
    """docs/spec_h200.json (the lab's `bench spec` runs on an H200), or None when it is not here."""
    from .data import load_json
    return load_json("spec_h200.json", path)

"""Notebook 15's checks (pagedlab.course.spec): the solutions pass, and each usual mistake in the
n-gram proposer and the accept rule fails with a hint that names it."""
import pytest

from pagedlab.course import spec as sc
from pagedlab.course.chapter import CheckFailed


@pytest.fixture(autouse=True)
def learner(monkeypatch):
    monkeypatch.delenv("PAGEDLAB_SOLUTIONS", raising=False)


def test_solutions_pass():
    sc.check_ngram(sc.solution("propose_ngram"))
    sc.check_accept(sc.solution("accept"))


def earliest(tokens, k, n_max, n_min=1):          # first occurrence instead of the latest
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        for i in range(0, L - n):
            if tokens[i:i + n] == tokens[L - n:]:
                return tokens[i + n:i + n + k]
    return []


def matches_itself(tokens, k, n_max, n_min=1):    # the suffix found at its own place
    L = len(tokens)
    for n in range(min(n_max, L), n_min - 1, -1):
        for i in range(L - n, -1, -1):
            if tokens[i:i + n] == tokens[L - n:]:
                return tokens[i + n:i + n + k]
    return []


def guesses_returned(drafts, targets, stop_ids=(), budget=None):    # the guesses, not the targets
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return list(drafts[:a])


def no_stop(drafts, targets, stop_ids=(), budget=None):
    return sc.solution("accept")(drafts, targets, (), budget)


@pytest.mark.parametrize("fn, hint", [(earliest, "LATEST"), (matches_itself, "not the suffix itself"),
                                      (lambda *a: (_ for _ in ()).throw(NotImplementedError("x")), "not written yet")])
def test_ngram_mistakes_are_named(fn, hint):
    with pytest.raises(CheckFailed, match=hint):
        sc.check_ngram(fn)


@pytest.mark.parametrize("fn, hint", [(guesses_returned, "one token short|TARGET"), (no_stop, "stop token ends"),
                                      (lambda *a: (_ for _ in ()).throw(NotImplementedError("x")), "not written yet")])
def test_accept_mistakes_are_named(fn, hint):
    with pytest.raises(CheckFailed, match=hint):
        sc.check_accept(fn)

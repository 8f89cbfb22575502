"""n-gram prompt lookup: guess that the text goes on as it went on the last time it said the same.

    tokens = [... A B C x y z ... A B C]      last n = 3 tokens "A B C" seen before
                       ^^^^^ -> propose x y z (up to k tokens)

Longest n first (prompt_lookup_max down to prompt_lookup_min); for that n the most recent earlier
occurrence wins (a quote or an edit copies what was said last). The continuation may be shorter
than k (a match near the end) and may run into the suffix itself (repetitions). No match: no
guesses, the step is a plain decode. Costs nothing on the device: copy-heavy text (quoting,
editing, code) gets many tokens per step for free, free-running text gets none and loses nothing.
"""
from __future__ import annotations

import numpy as np


def propose_ngram(tokens: list[int], k: int, n_max: int, n_min: int = 1) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the sequence's last n tokens,
    for the largest n in [n_min, n_max] that has one; [] if none does (or k <= 0). Plain Python:
    the rule as the chapter builds it; NgramProposer runs the same rule with numpy."""
    L = len(tokens)
    if k <= 0:
        return []
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = tokens[L - n:]
        for start in range(L - n - 1, -1, -1):          # latest first; never the suffix itself
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def propose_ngram_np(tokens: np.ndarray, k: int, n_max: int, n_min: int = 1) -> list[int]:
    """propose_ngram on an int array, in a few vector operations whatever the length: the
    candidates are the earlier positions j holding the last token (a match would end there); the
    match of length n ending at j also needs tokens[j - t] == tokens[L - 1 - t] for t < n, one
    comparison over all candidates per t. The latest j of the longest n wins."""
    L = len(tokens)
    n_top = min(n_max, L - 1)
    if k <= 0 or n_top < n_min:
        return []
    ends = np.flatnonzero(tokens[:L - 1] == tokens[L - 1])       # j <= L - 2: never the suffix itself
    ok = [np.ones(ends.shape[0], dtype=bool)]                    # ok[t]: matches for t + 1 tokens
    for t in range(1, n_top):
        ok.append(ok[-1] & (ends >= t) & (tokens[np.maximum(ends - t, 0)] == tokens[L - 1 - t]))
    for n in range(n_top, n_min - 1, -1):
        hits = ends[ok[n - 1]]
        if hits.size:
            j = int(hits[-1])
            return tokens[j + 1:j + 1 + k].tolist()
    return []


class NgramProposer:
    """method "ngram": propose(requests, ks) -> one list of guesses per request (host only).
    fn: another rule with propose_ngram's signature (the chapter plugs the learner's in)."""
    method = "ngram"

    def __init__(self, n_max: int, n_min: int = 1, fn=None):
        self.n_max, self.n_min, self.fn = n_max, n_min, fn

    def propose(self, requests, ks: list[int]) -> list[list[int]]:
        if self.fn is not None:
            return [list(self.fn(r.all_token_ids, k, self.n_max, self.n_min)) if k > 0 else []
                    for r, k in zip(requests, ks)]
        return [propose_ngram_np(np.asarray(r.all_token_ids, dtype=np.int64), k, self.n_max, self.n_min)
                if k > 0 else [] for r, k in zip(requests, ks)]

    def forget(self, request) -> None:
        """Nothing kept per request."""

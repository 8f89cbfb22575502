"""Notebook 15's pieces: the n-gram proposer and the accept rule (checked by
pagedlab.course.spec.check_ngram / check_accept)."""


def propose_ngram(tokens, k, n_max, n_min=1):
    """Up to k tokens that followed the latest earlier occurrence of the last n tokens, for the
    largest n in [n_min, n_max] that has one; [] if none does."""
    L = len(tokens)
    if k <= 0:
        return []
    for n in range(min(n_max, L - 1), n_min - 1, -1):     # longest n first; the suffix needs a token before it
        suffix = tokens[L - n:]
        for start in range(L - n - 1, -1, -1):            # latest occurrence first, never the suffix itself
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]    # may be fewer than k near the end
    return []


def accept(drafts, targets, stop_ids=(), budget=None):
    """The tokens one verify step emits: the target's tokens while the guesses agree with them,
    then the target's own token (the correction, or the bonus after k right guesses); cut after
    a stop token and to at most `budget` tokens."""
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    out = list(targets[:a + 1])
    for i, t in enumerate(out):
        if t in stop_ids:
            out = out[:i + 1]
            break
    if budget is not None:
        out = out[:max(budget, 0)]
    return out

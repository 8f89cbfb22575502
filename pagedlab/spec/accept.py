"""What a verify step keeps, and how many guesses to ask for next time.

accept_greedy(drafts, targets): targets[i] is the target's token for the position drafts[i]
guesses (targets has one more: the token after the last guess). Guesses are kept while they equal
the target's token; the step emits the target's tokens up to and including the first mismatch
(the correction), or all k + 1 if every guess was right (the last one is a bonus).

emit(...) is the same with the two ways a request can end inside a step: a stop token (the
tokens after it are never emitted) and the token budget (max_tokens).
"""
from __future__ import annotations


def accept_greedy(drafts: list[int], targets: list[int]) -> list[int]:
    """The tokens a verify step emits: targets[:a + 1], a = how many leading guesses equal the
    target's token at their position. len(targets) == len(drafts) + 1."""
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return targets[:a + 1]


def emit(drafts: list[int], targets: list[int], stop_ids=(), budget: int | None = None) -> list[int]:
    """accept_greedy, cut after the first stop token and to at most `budget` tokens."""
    out = accept_greedy(drafts, targets)
    for i, t in enumerate(out):
        if t in stop_ids:
            out = out[:i + 1]
            break
    return out if budget is None else out[:max(budget, 0)]


class AdaptiveK:
    """Acceptance drives k, per request. `rate` is a running mean of kept / proposed (starting
    optimistic), `gain` one of the tokens a verify step emits (1 + kept). A verify step costs
    more than a plain one -- `cost`, the ratio of their measured times (Speculator) -- so when
    the gain does not beat the cost, or fewer than `min_rate` of the guesses are kept, the
    request stops proposing for `pause` steps, then tries again from neutral. A pause that ends a
    short run of guessing (fewer than `paid_run` verify steps: a probe that did not pay) is twice
    as long as the one before (up to `max_pause`), so text where guessing does not pay stops
    paying for the probes too; after a long run the pauses start short again. While it pays, k
    follows the rate (expected run of kept guesses ~ rate / (1 - rate), plus one).

    A proposer that finds nothing (no earlier n-gram) costs no verify row, but it keeps the engine
    from running a step ahead (engine.py: the next proposal needs this step's token): `proposed`
    pauses the request for as many steps as it found nothing in a row (up to `max_miss_pause`:
    short, a copy can start at any token)."""

    def __init__(self, k_max: int, min_rate: float = 0.2, pause: int = 16, weight: float = 0.3,
                 max_pause: int = 256, paid_run: int = 8, max_miss_pause: int = 2):
        self.k_max, self.min_rate, self.pause, self.weight = k_max, min_rate, pause, weight
        self.max_pause, self.paid_run, self.max_miss_pause = max_pause, paid_run, max_miss_pause

    @staticmethod
    def will_propose(req) -> bool:
        """Does the next k() ask this request for guesses (it is not paused)?"""
        return req.spec_pause == 0

    def k(self, req, cost: float = 1.0) -> int:
        if req.spec_pause > 0:
            req.spec_pause -= 1
            if req.spec_pause == 0:                  # try again, from neutral
                req.spec_rate, req.spec_gain, req.spec_run = 0.5, cost + 0.5, 0
            return 0
        return self.k_rate(req)

    def k_rate(self, req) -> int:
        """k from the acceptance rate alone (no pause: with a shadow, shadow.py says who guesses)."""
        r = req.spec_rate
        if r >= 0.8:
            return self.k_max
        return max(1, min(self.k_max, round(r / (1 - r)) + 1))

    def proposed(self, req, found: bool) -> None:
        """The proposer was asked: found guesses, or nothing (then a short pause)."""
        if found:
            req.spec_misses = 0
        else:
            req.spec_misses = min(req.spec_misses + 1, self.max_miss_pause)
            req.spec_pause = req.spec_misses

    def update(self, req, proposed: int, accepted: int, cost: float = 1.0) -> None:
        if proposed <= 0:
            return
        req.spec_run += 1
        req.spec_rate += self.weight * (accepted / proposed - req.spec_rate)
        req.spec_gain += self.weight * (1 + accepted - req.spec_gain)
        if req.spec_rate < self.min_rate or req.spec_gain < cost:
            if req.spec_run >= self.paid_run:        # it paid for a while: start short again
                req.spec_streak = 0
            req.spec_pause = min(self.pause << min(req.spec_streak, 16), self.max_pause)
            req.spec_streak += 1

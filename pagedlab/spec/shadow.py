"""What n-gram guessing WOULD keep, read from the tokens every step emits anyway: no verify step needed.

The batch's gate (gate.py) and each request's AdaptiveK (accept.py) learn whether guessing pays
by guessing: a verify step, and the steps around it that cannot run ahead (engine.py's overlap
loop: a proposal starts from the last token). On free-running text most of that is lost -- the
probes cost more than they find. But prompt lookup is a rule on the tokens alone, so its fate can
be replayed on the tokens the plain steps emit:

    tokens ... A B C | x y z w
                     ^ p: the lookup here (the tokens before p) guesses  x y q ...
                       kept 2 (x y), the step would emit x y z; the next lookup at p + 3

`Shadow.update(req)` walks each request's new tokens through that replay (lookups at the points a
speculating stream would make them, k_max guesses each) and keeps a running mean of the tokens a
verify step would emit (1 + kept; a lookup that finds nothing: 1, a plain step). With greedy
decoding and with the seeded sampler (its draw at a position does not depend on the step that
draws it) this is exactly what guessing would have got, whoever's steps made the tokens.

The lookups run on `NgramIndex`: per request, each n-gram (n_min..n_max) -> where it last ended,
filled as tokens come (n_max dict stores a token), so a lookup is at most n_max dict reads --
propose_ngram's answer (the latest earlier occurrence of the longest suffix) without a scan.
"""
from __future__ import annotations

import numpy as np

from .ngram import propose_ngram_np


class NgramIndex:
    """propose_ngram over one growing token list, incrementally. `tokens` is the caller's list
    (read, never written); add only at its end."""

    def __init__(self, n_max: int, n_min: int = 1):
        self.n_max, self.n_min = n_max, n_min
        self.last_end: dict[tuple, int] = {}      # n-gram -> the latest position it ended at
        self.indexed = 0                          # n-grams ending at positions < this are in

    def _fill(self, tokens, upto: int) -> None:
        """Every n-gram ending before position `upto`."""
        d, lo, hi = self.last_end, self.n_min, self.n_max
        for j in range(self.indexed, upto):
            for n in range(lo, min(hi, j + 1) + 1):
                d[tuple(tokens[j - n + 1:j + 1])] = j
        self.indexed = max(self.indexed, upto)

    def propose(self, tokens, k: int, length: int | None = None) -> list[int]:
        """propose_ngram(tokens[:length], k, n_max, n_min) (length: default all of them)."""
        L = len(tokens) if length is None else length
        if k <= 0 or L < 2:
            return []
        if self.indexed > L - 1:                  # filled past it already: the latest ends are later ones
            return propose_ngram_np(np.asarray(tokens[:L], dtype=np.int64), k, self.n_max, self.n_min)
        self._fill(tokens, L - 1)                 # occurrences ending at <= L - 2: never the suffix itself
        d = self.last_end
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            j = d.get(tuple(tokens[L - n:L]))
            if j is not None:
                return list(tokens[j + 1:min(j + 1 + k, L)])
        return []


class ShadowState:
    """One request's replay: its index, the pending lookup, and what it found so far."""
    __slots__ = ("tokens", "index", "at", "guess", "matched", "gain", "count")

    def __init__(self, n_max: int, n_min: int, start: int):
        self.tokens: list[int] = []     # its known tokens (prompt + output), kept here as they come
        self.index = NgramIndex(n_max, n_min)
        self.at = start                 # where the next (or pending) lookup stands: tokens before it
        self.guess = None               # the pending lookup's guesses (None: none pending)
        self.matched = 0                # of those, how many the tokens since `at` confirmed
        self.gain = None                # running mean of 1 + kept per lookup (None: none finished)
        self.count = 0                  # lookups finished


class Shadow:
    """Per request (by id): the replayed lookups' tokens per verify step. `weight`: the running
    mean's (the first few lookups are averaged plainly: 1, 1/2, 1/3, then `weight`)."""

    def __init__(self, k: int, n_max: int, n_min: int = 1, weight: float = 0.3):
        self.k, self.n_max, self.n_min, self.weight = k, n_max, n_min, weight
        self.states: dict[int, ShadowState] = {}
        self.num_lookups = 0            # replayed lookups (tests, bench)

    def state(self, req) -> ShadowState:
        s = self.states.get(req.request_id)
        if s is None:                   # the first decode step's lookup: after the prefill's token
            s = self.states[req.request_id] = ShadowState(self.n_max, self.n_min, len(req.prompt_token_ids) + 1)
            s.tokens.extend(req.prompt_token_ids)
        return s

    def gain(self, req) -> float | None:
        """Tokens a verify step of this request would emit now (running mean; None: not known). A
        pending lookup whose first guesses the tokens confirmed counts as kept that far already
        (it can only keep more): a copy shows after two tokens, not after k + 1."""
        s = self.states.get(req.request_id)
        if s is None:
            return None
        if s.guess and s.matched:           # the pending lookup keeps at least `matched`: count it so
            g = 1 + s.matched
            now = g if s.gain is None else s.gain + max(self.weight, 1.0 / (s.count + 1)) * (g - s.gain)
            if s.gain is None or now > s.gain:
                return now
        return s.gain

    def propose(self, req, k: int) -> list[int]:
        """The lookup a verify step asks for now (its known tokens): propose_ngram's guesses."""
        s = self.state(req)
        self._catch_up(req, s)
        return s.index.propose(s.tokens, k)

    def _catch_up(self, req, s: ShadowState) -> None:
        n = len(req.prompt_token_ids)
        if len(s.tokens) < n + len(req.output_token_ids):
            s.tokens.extend(req.output_token_ids[len(s.tokens) - n:])

    def _finish(self, s: ShadowState, kept: int) -> None:
        g = 1 + kept
        s.count += 1
        w = max(self.weight, 1.0 / s.count)
        s.gain = g if s.gain is None else s.gain + w * (g - s.gain)
        s.at += kept + 1
        s.guess, s.matched = None, 0

    def update(self, req) -> None:
        """Replay the lookups over the request's tokens known now (output read back so far)."""
        s = self.state(req)
        self._catch_up(req, s)
        toks, L = s.tokens, len(s.tokens)
        while s.at <= L:                    # a lookup at `at` reads the tokens before it
            if s.guess is None:
                s.guess, s.matched = s.index.propose(toks, self.k, s.at), 0
                self.num_lookups += 1
                if not s.guess:             # nothing to guess: a plain step there, one token
                    self._finish(s, 0)
                    continue
            pos = s.at + s.matched          # the next token to compare
            if pos >= L:
                break
            if s.matched < len(s.guess) and toks[pos] == s.guess[s.matched]:
                s.matched += 1
                continue
            self._finish(s, s.matched)      # a mismatch (the correction) or the bonus after all k

    def forget_except(self, keep_ids) -> None:
        for rid in [rid for rid in self.states if rid not in keep_ids]:
            del self.states[rid]

"""Stop strings: a request stops when its text contains one of `SamplingParams.stop`.

A stop string is text, and text is not tokens: "\\n\\nUser:" may arrive as one token, as three, or
inside a token that also holds the text before it. So each new token is detokenized incrementally
(streaming.IncrementalDetokenizer, a window of recent tokens, never the whole output again), and
only the new text -- plus the few characters before it that a stop string could straddle -- is
searched. When a stop string appears the request finishes with finish_reason "stop", and
`req.text_end` marks where its text ends: the stop string and anything after it are not returned.
"""
from __future__ import annotations

from .streaming import IncrementalDetokenizer


class StopStringState:
    """One request's text so far and how much of it has been searched."""

    def __init__(self, tokenizer):
        self.detok = IncrementalDetokenizer(tokenizer)
        self.text = ""
        self.searched = 0          # text[:searched] holds no stop string


class StopStrings:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def check(self, req, i: int) -> bool:
        """Does the text of req's output tokens 0..i contain one of its stop strings? If so, record
        which one (req.stop_string) and where the returned text ends (req.text_end)."""
        state = req.detok
        if state is None:
            state = req.detok = StopStringState(self.tokenizer)
        state.text += state.detok.feed(req.output_token_ids, end=i + 1)
        stops = req.params.stop
        start = max(0, state.searched - max(len(s) for s in stops) + 1)
        found = [(k, s) for s in stops if (k := state.text.find(s, start)) >= 0]
        state.searched = len(state.text)
        if not found:
            return False
        req.text_end, req.stop_string = min(found)          # the earliest one in the text
        return True

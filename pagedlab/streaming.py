"""Streaming: a request's new text as its tokens arrive, step by step.

Token ids do not split text at character boundaries: a byte-level BPE token can hold half of a
multi-byte UTF-8 character (an emoji, an accented letter), and decoding it alone gives the
replacement character U+FFFD. `IncrementalDetokenizer` decodes a short window of recent tokens
(not the whole output again each step) and holds text back until it is complete, so the deltas it
gives, joined, are exactly `tokenizer.decode(all tokens)` -- and no delta shows a broken character.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .request import PENDING

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """feed(all token ids so far) -> the new text since the last call (possibly "")."""

    def __init__(self, tokenizer, skip_special: bool = True):
        self.tokenizer, self.skip_special = tokenizer, skip_special
        self.prefix = 0        # tokens [prefix, read) were decoded last time as the context ...
        self.read = 0          # ... and text up to `read` has been handed out

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special=self.skip_special)

    def feed(self, ids: list[int], final: bool = False, end: int | None = None) -> str:
        """ids[:end] are the tokens so far (end: default all of them; a caller can pass a longer list
        without copying it)."""
        end = len(ids) if end is None else end
        # Decode the new tokens together with a few before them: some tokenizers' text for a token
        # depends on its neighbours (leading spaces), so the difference of two decodes is the delta.
        before = self._decode(ids[self.prefix:self.read])
        now = self._decode(ids[self.prefix:end])
        if len(now) <= len(before) or (now.endswith(REPLACEMENT) and not final):
            return ""                   # nothing new, or a character not complete yet: wait
        delta = now[len(before):]
        self.prefix, self.read = self.read, end
        return delta


@dataclass
class StreamDelta:
    """What one step added to a streamed request."""
    request_id: int
    text: str                                        # new text (may be "" while a character is incomplete)
    token_ids: list[int] = field(default_factory=list)   # new tokens
    finished: bool = False
    finish_reason: str | None = None
    output: object = None                            # the RequestOutput, with the last delta
    logprobs: list | None = None                     # a TokenLogprob per new token (SamplingParams.logprobs)


class RequestStream:
    """How much of one request has been streamed. After each engine step, `delta()` gives what
    the step added (read tokens only: a PENDING placeholder of the overlap loop waits), or None.

    With stop strings, the last (longest stop string - 1) characters are held back until the next
    token shows whether they begin a stop string: a streamed text never shows a stop string."""

    def __init__(self, req, tokenizer, make_output):
        self.req, self.make_output = req, make_output
        self.detok, self.sent = IncrementalDetokenizer(tokenizer), 0
        self.text, self.text_sent = "", 0
        self.holdback = max((len(s) for s in req.params.stop), default=1) - 1

    def delta(self) -> StreamDelta | None:
        req, ids = self.req, self.req.output_token_ids
        n = len(ids)
        while n and ids[n - 1] == PENDING:
            n -= 1
        done = req.finish_reason is not None
        if n == self.sent and not done:
            return None
        self.text += self.detok.feed(ids, final=done, end=n)
        if done:
            upto = len(self.text) if req.text_end is None else min(req.text_end, len(self.text))
        else:
            upto = max(self.text_sent, len(self.text) - self.holdback)
        delta = StreamDelta(req.request_id, self.text[self.text_sent:upto], ids[self.sent:n])
        if req.params.logprobs is not None:
            delta.logprobs = req.logprobs[self.sent:n]
        self.sent, self.text_sent = n, upto
        if done:
            delta.finished, delta.finish_reason, delta.output = True, req.finish_reason, self.make_output(req)
        return delta

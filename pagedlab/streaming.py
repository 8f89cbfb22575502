"""Streaming: a request's new text as its tokens arrive, step by step.

Token ids do not split text at character boundaries: a byte-level BPE token can hold half of a
multi-byte UTF-8 character (an emoji, an accented letter), and decoding it alone gives the
replacement character U+FFFD. `IncrementalDetokenizer` decodes a short window of recent tokens
(not the whole output again each step) and holds text back until it is complete, so the deltas it
gives, joined, are exactly `tokenizer.decode(all tokens)` -- and no delta shows a broken character.
Each request has one, in the front end's output_processor.RequestState: stop strings, stream deltas
and the final text all come from it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """feed(all token ids so far) -> the new text since the last call (possibly "")."""

    def __init__(self, tokenizer, skip_special: bool = True):
        self.tokenizer, self.skip_special = tokenizer, skip_special
        self.prefix = 0        # tokens [prefix, read) were decoded last time as the context ...
        self.read = 0          # ... and text up to `read` has been handed out
        # The text held back with an unfinished character that is final already: " " while the token
        # " \xf0\x9f" (a space and half of an emoji) waits for the rest of its character. Not
        # handed out (a delta ends at a token boundary), but stop strings are looked for in it.
        self.pending = ""

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
            # nothing new, or a character not complete yet: wait (its replacement marks at the end,
            # one per byte with byte-fallback tokens, are not text yet; what is before them is)
            self.pending = now.rstrip(REPLACEMENT)[len(before):]
            return ""
        self.pending = ""
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

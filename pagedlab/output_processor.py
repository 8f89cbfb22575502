"""The output path: what the engine core hands out per step -> text, stream deltas, RequestOutputs.

The engine core knows tokens, never text. After every step it hands out one `StepOutput`: for each
request that moved, its new token ids (and logprobs), and for each request that ended, how it ended
(`Finished`). The front end (LLM in this process, AsyncLLM in front of a core process) feeds that to
one `OutputProcessor`, which keeps one `RequestState` per request, with ONE incremental
detokenizer, and from it derives everything a caller sees:

    stop strings   the text is searched as it grows; a request whose text holds one of its stop
                   strings ends here ("stop") and the core is told to abort it (`to_abort`)
    stream deltas  new text since the last delta (a stop string is never shown: the last few
                   characters are held back until the next token says whether they begin one)
    RequestOutput  the final text, tokens, finish reason, timings

Text costs nothing until someone needs it: a request that is not streamed and has no stop strings is
decoded once, when it finishes.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

from .sampling import SamplingParams
from .streaming import IncrementalDetokenizer, StreamDelta


# -- what crosses from the core, once per step ---------------------------------------------------

class Finished(NamedTuple):
    """How a request ended, as the core saw it."""
    reason: str                      # "stop" (a stop token), "length", "abort" or "error"
    stop_token_id: int | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_spec_proposed: int = 0       # speculative decoding: guesses verified, and kept
    num_spec_accepted: int = 0


@dataclass
class StepOutput:
    """Everything one engine step hands to the front end: one message, whatever the batch size.
    Column by column (lists of ints pickle ten times faster than a list of small objects): the
    requests that moved, their new tokens, the logprobs of those that asked, the ones that ended."""
    request_ids: list[int] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: dict[int, list] = field(default_factory=dict)
    finished: dict[int, Finished] = field(default_factory=dict)
    stats: dict = field(default_factory=dict)      # requests running/waiting, KV blocks (for /metrics)

    def add(self, request_id: int, token_ids: list[int], logprobs=None, finished: Finished | None = None):
        self.request_ids.append(request_id)
        self.token_ids.append(token_ids)
        if logprobs is not None:
            self.logprobs[request_id] = logprobs
        if finished is not None:
            self.finished[request_id] = finished

    def extend(self, other: "StepOutput") -> None:
        self.request_ids += other.request_ids
        self.token_ids += other.token_ids
        self.logprobs.update(other.logprobs)
        self.finished.update(other.finished)


# -- what a caller gets --------------------------------------------------------------------------

@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str            # "stop", "length", "abort" or "error"
    ttft_s: float                 # time to first token (from the request's arrival)
    itl_s: list[float]            # inter-token latencies
    num_preemptions: int
    stop_reason: str | None = None   # finish_reason "stop": which token (from which source) or string
    error: str | None = None         # finish_reason "error": what went wrong
    num_cached_tokens: int = 0       # prompt tokens taken from the prefix cache (not computed)
    num_spec_proposed: int = 0       # speculative decoding: guessed tokens verified ...
    num_spec_accepted: int = 0       # ... and of those, kept (emitted without a step of their own)
    logprobs: list | None = None     # SamplingParams.logprobs: a TokenLogprob per output token
    outputs: list | None = None      # SamplingParams.n > 1: every sample's RequestOutput (this is [0])
    # moments on time.perf_counter's clock (on Linux CLOCK_MONOTONIC: one clock for every process of
    # the machine): when the request reached its front end / LLM, when its first token came back
    arrival_t: float | None = None
    first_token_t: float | None = None

    @property
    def usage(self) -> dict:
        """Token counts as OpenAI's API reports them."""
        n_out = sum(len(o.token_ids) for o in self.outputs) if self.outputs else len(self.token_ids)
        return dict(prompt_tokens=len(self.prompt_token_ids), completion_tokens=n_out,
                    total_tokens=len(self.prompt_token_ids) + n_out,
                    prompt_tokens_details=dict(cached_tokens=self.num_cached_tokens))


# -- one request's state in the front end --------------------------------------------------------

class RequestState:
    """A request as the front end follows it: tokens so far, their text (one detokenizer), how much
    of both has been streamed, and -- once it ends -- its RequestOutput."""

    def __init__(self, request_id: int, prompt_token_ids: list[int], prompt: str | None,
                 params: SamplingParams, tokenizer, stream: bool, arrival: float | None = None):
        self.request_id, self.prompt_token_ids, self.prompt = request_id, prompt_token_ids, prompt
        self.params, self.tokenizer, self.stream = params, tokenizer, stream
        self.arrival = time.perf_counter() if arrival is None else arrival
        self.token_ids: list[int] = []
        self.token_times: list[float] = []
        self.logprobs: list = []
        self.detok = IncrementalDetokenizer(tokenizer)
        self.text = ""                     # text of token_ids[:self.decoded]
        self.decoded = 0
        self.searched = 0                  # text[:searched] holds no stop string
        self.longest_stop = max((len(s) for s in params.stop), default=0)
        self.sent_tokens = self.sent_text = 0
        self.output: RequestOutput | None = None

    def _decode(self, end: int, final: bool = False) -> None:
        self.text += self.detok.feed(self.token_ids, final=final, end=end)
        self.decoded = end

    def _find_stop(self) -> tuple[int, str] | None:
        # The text held back with an unfinished character is searched too (the detokenizer's
        # `pending`: the " " of a token " \xf0\x9f"), so the request stops at the token that
        # completes a stop string, not at the end of the character after it; it is searched again
        # once it is text.
        text = self.text + self.detok.pending if self.detok.pending else self.text
        start = max(0, self.searched - self.longest_stop + 1)
        found = [(k, s) for s in self.params.stop if (k := text.find(s, start)) >= 0]
        self.searched = len(self.text)
        return min(found) if found else None

    def add_tokens(self, ids: list[int], logprobs, now: float, final: bool = False) -> tuple[int, str] | None:
        """Append a step's tokens. With stop strings, each token's text is searched as it lands:
        returns (where the text ends, the stop string) at the first token that completes one (the
        tokens after it are dropped), else None. final: the request ends with these tokens (the
        last one's text is then final, an unfinished character's replacement mark included)."""
        self.token_times += [now] * len(ids)
        if logprobs is not None and self.params.logprobs is not None:
            self.logprobs += logprobs
        if not self.params.stop:
            self.token_ids += ids
            return None
        last = len(self.token_ids) + len(ids)
        for tok in ids:
            self.token_ids.append(tok)
            self._decode(len(self.token_ids), final=final and len(self.token_ids) == last)
            hit = self._find_stop()
            if hit is not None:
                del self.token_times[len(self.token_ids):], self.logprobs[len(self.token_ids):]
                return hit
        return None

    def finish(self, reason: str, stop_sources: dict, *, text_end: int | None = None,
               stop_string: str | None = None, done: Finished | None = None) -> RequestOutput:
        self._decode(len(self.token_ids), final=True)
        if stop_string is None and self.params.stop:
            # The text flushed just now (an unfinished character's replacement mark, held back
            # until the end) is searched too, whoever ended the request: the text never shows a
            # stop string.
            hit = self._find_stop()
            if hit is not None:
                text_end = hit[0]
                if reason in ("length", "stop"):
                    reason, stop_string = "stop", hit[1]
        stop_reason = None
        if stop_string is not None:
            stop_reason = stop_string
        elif reason == "stop" and done is not None and done.stop_token_id is not None:
            t = done.stop_token_id
            source = stop_sources.get(t) if t not in self.params.stop_token_ids else "stop_token_ids"
            stop_reason = f"{self.tokenizer.decode([t])!r} (id {t}): {source or 'stop token'}"
        times = self.token_times
        self.output = RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=list(self.prompt_token_ids),
            text=self.text[:text_end], token_ids=list(self.token_ids), finish_reason=reason,
            ttft_s=times[0] - self.arrival if times else float("nan"),
            itl_s=[b - a for a, b in zip(times, times[1:])],
            num_preemptions=done.num_preemptions if done else 0, stop_reason=stop_reason,
            error=done.error if done else None, num_cached_tokens=done.num_cached_tokens if done else 0,
            num_spec_proposed=done.num_spec_proposed if done else 0,
            num_spec_accepted=done.num_spec_accepted if done else 0,
            logprobs=list(self.logprobs) if self.params.logprobs is not None else None,
            arrival_t=self.arrival, first_token_t=times[0] if times else None)
        return self.output

    def delta(self) -> StreamDelta | None:
        """What was added since the last delta (None: nothing). A finished request's last delta
        carries its RequestOutput."""
        n, done = len(self.token_ids), self.output is not None
        if n == self.sent_tokens and not done:
            return None
        if done:
            upto = len(self.output.text)
        else:
            if self.decoded < n:
                self._decode(n)
            hold = max(self.longest_stop - 1, 0)
            upto = max(self.sent_text, len(self.text) - hold)
        d = StreamDelta(self.request_id, self.text[self.sent_text:upto], self.token_ids[self.sent_tokens:n])
        if self.params.logprobs is not None:
            d.logprobs = self.logprobs[self.sent_tokens:n]
        self.sent_tokens, self.sent_text = n, upto
        if done:
            d.finished, d.finish_reason, d.output = True, self.output.finish_reason, self.output
        return d


class OutputProcessor:
    """Every request the front end follows, fed one StepOutput per engine step."""

    def __init__(self, tokenizer, stop_sources: dict | None = None):
        self.tokenizer, self.stop_sources = tokenizer, dict(stop_sources or {})
        self.states: dict[int, RequestState] = {}

    def add(self, request_id: int, prompt_token_ids, prompt, params, stream: bool = False,
            arrival: float | None = None) -> RequestState:
        state = RequestState(request_id, prompt_token_ids, prompt, params, self.tokenizer, stream, arrival)
        self.states[request_id] = state
        return state

    def process(self, step: StepOutput) -> tuple[list[RequestState], list[int]]:
        """Apply one step. Returns (the states that changed, the request ids the core must abort:
        their text reached a stop string). Finished states leave `states` (each ends once);
        updates for requests nobody follows (ended here already) are dropped."""
        now = time.perf_counter()
        changed, to_abort = [], []
        states, logprobs, finished = self.states, step.logprobs, step.finished
        for rid, ids in zip(step.request_ids, step.token_ids):
            state = states.get(rid)
            if state is None:
                continue
            done = finished.get(rid)
            hit = state.add_tokens(ids, logprobs.get(rid), now, final=done is not None) if ids else None
            if hit is not None:
                state.finish("stop", self.stop_sources, text_end=hit[0], stop_string=hit[1])
                if done is None:
                    to_abort.append(rid)
            elif done is not None:
                state.finish(done.reason, self.stop_sources, done=done)
            if state.output is not None:
                del states[rid]
            changed.append(state)
        return changed, to_abort

    def abort_all(self, reason: str, error: str | None = None) -> list[RequestState]:
        """End every followed request at once (the core is gone): each gets `reason`."""
        ended = []
        for rid, state in list(self.states.items()):
            state.finish(reason, self.stop_sources, done=Finished(reason, error=error))
            ended.append(state)
        self.states.clear()
        return ended

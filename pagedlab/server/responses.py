"""OpenAI's response bodies: what a client reads back, whole or streamed.

Without streaming, one JSON object:

    {"id": "chatcmpl-...", "object": "chat.completion", "created": 1700000000, "model": "smollm2",
     "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello!"},
                  "logprobs": null, "finish_reason": "stop"}],
     "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}}

With `"stream": true`, server-sent events: each event is a line `data: <json>` and a blank line, and
the last is `data: [DONE]`. A chat stream's chunks ("chat.completion.chunk") carry *deltas*: first
`{"role": "assistant", "content": ""}`, then pieces of text, then an empty delta with the
finish_reason. With `stream_options: {"include_usage": true}` every chunk has `"usage": null` and one
more chunk, with no choices, brings the usage. Completions stream the same way with "text_completion"
chunks whose choices have "text".

Only JSON shapes here: no HTTP, no engine.
"""
from __future__ import annotations

import json
import time
import uuid

SSE_DONE = "data: [DONE]\n\n"
# a comment line (SSE clients skip it): written to a stream that has had nothing new for
# AsyncLLM.keepalive_s (15 s; PAGEDLAB_SSE_KEEPALIVE_S), so that a proxy's or a client's idle
# timeout does not cut a request that waits in the queue or on a silent engine core
SSE_KEEPALIVE = ": keep-alive\n\n"


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def sse(obj) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class Envelope:
    """What every chunk / response of one request shares: id, object, created, model."""

    def __init__(self, kind: str, model: str):
        self.kind, self.model = kind, model
        self.id, self.created = new_id(kind), int(time.time())

    def text_event(self, index: int, text: str, include_usage: bool = False) -> str:
        """sse(chunk(self, index, text, include_usage=include_usage)), the same characters, from a
        template made once per request: only the text is encoded per token. (Building the chunk's
        dicts and encoding them whole took ~4.5 us a token on the lab's CPU, the template ~0.3:
        a 512-request burst of 144 tokens each is 74k events.)"""
        t = self._templates.get(include_usage) if hasattr(self, "_templates") else None
        if t is None:
            mark = f"\x00{uuid.uuid4().hex}"  # a text no chunk holds, split out of a chunk built once
            whole = sse(chunk(self, 0, mark, include_usage=include_usage))
            head, tail = whole.split(json.dumps(mark), 1)
            cut = head.rindex('"index":0') + len('"index":')
            t = (head[:cut], head[cut + 1:], tail)
            self.__dict__.setdefault("_templates", {})[include_usage] = t
        return f"{t[0]}{index}{t[1]}{json.dumps(text)}{t[2]}"

    def head(self, streamed: bool) -> dict:
        obj = {"chat": "chat.completion", "completion": "text_completion"}[self.kind]
        if streamed and self.kind == "chat":
            obj = "chat.completion.chunk"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}


# -- usage and logprobs --------------------------------------------------------------------------

def usage(prompt_lengths: list[int], outputs: list) -> dict:
    """Token counts: every prompt once, every sample's tokens; cached prompt tokens (prefix cache)."""
    completion = sum(len(o.token_ids) for o in outputs)
    prompt = sum(prompt_lengths)
    cached = sum(getattr(o, "num_cached_tokens", 0) or 0 for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _token(tokenizer, token_id: int) -> tuple[str, list[int]]:
    text = tokenizer.decode([int(token_id)])
    return text, list(text.encode("utf-8"))


def chat_logprobs(entries, tokenizer) -> dict | None:
    """A list of TokenLogprob(token_id, logprob, top=[(id, logprob), ...]) in chat's shape."""
    if entries is None:
        return None
    content = []
    for e in entries:
        text, raw = _token(tokenizer, e.token_id)
        top = []
        for tid, lp in e.top:
            t, b = _token(tokenizer, tid)
            top.append({"token": t, "logprob": float(lp), "bytes": b})
        content.append({"token": text, "logprob": float(e.logprob), "bytes": raw, "top_logprobs": top})
    return {"content": content}


def completion_logprobs(entries, tokenizer, text_offset: int = 0) -> dict | None:
    """The same in the legacy completions shape: parallel lists, and top alternatives as dicts."""
    if entries is None:
        return None
    tokens, lps, tops, offsets = [], [], [], []
    pos = text_offset
    for e in entries:
        text, _ = _token(tokenizer, e.token_id)
        tokens.append(text)
        lps.append(float(e.logprob))
        tops.append({_token(tokenizer, tid)[0]: float(lp) for tid, lp in e.top})
        offsets.append(pos)
        pos += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


# -- whole responses -----------------------------------------------------------------------------

def chat_response(env: Envelope, outputs: list, prompt_lengths: list[int], logprobs_of) -> dict:
    choices = [{"index": i, "message": {"role": "assistant", "content": o.text},
                "logprobs": logprobs_of(o), "finish_reason": o.finish_reason}
               for i, o in enumerate(outputs)]
    return env.head(False) | {"choices": choices, "usage": usage(prompt_lengths, outputs)}


def completion_response(env: Envelope, outputs: list, prompt_lengths: list[int], logprobs_of) -> dict:
    choices = [{"index": i, "text": o.text, "logprobs": logprobs_of(o), "finish_reason": o.finish_reason}
               for i, o in enumerate(outputs)]
    return env.head(False) | {"choices": choices, "usage": usage(prompt_lengths, outputs)}


# -- streamed chunks -----------------------------------------------------------------------------

def chunk(env: Envelope, index: int, text: str | None, finish_reason: str | None = None,
          logprobs=None, first: bool = False, include_usage: bool = False) -> dict:
    """One choice's piece. Chat: a delta (the first one gives the role); completions: text."""
    if env.kind == "chat":
        delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
    out = env.head(True) | {"choices": [choice]}
    if include_usage:
        out["usage"] = None
    return out


def usage_chunk(env: Envelope, prompt_lengths: list[int], outputs: list, timing: bool = False) -> dict:
    """The last chunk of a stream with stream_options.include_usage: no choices, the usage.
    timing (stream_options.pagedlab_timing): and per choice when its request reached the front end
    and when its first token came back from the engine (seconds on the machine's monotonic clock,
    time.perf_counter in Python on Linux): what `bench serve` splits a client's TTFT with."""
    out = env.head(True) | {"choices": [], "usage": usage(prompt_lengths, outputs)}
    if timing:
        out["pagedlab_timing"] = [{"arrival": o.arrival_t, "first_token": o.first_token_t} for o in outputs]
    return out

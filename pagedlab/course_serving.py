"""Notebook 11's hands-on piece and its check: reading a server-sent event stream.

    sse_events = serving_course.check_sse_events(sse_events)

`check_sse_events` builds streams the way pagedlab's server writes them (pagedlab.server.responses:
`chunk`, `sse`, `usage_chunk`, `SSE_DONE`), cuts their bytes into network chunks at random places
(inside an event, inside a multi-byte UTF-8 character, one byte at a time), adds what other servers
send (keep-alive comments, `\\r\\n` line ends, a payload over two `data:` lines, an `event:` field),
and checks that the learner's parser gives back exactly the JSON objects that were sent, stops at
`[DONE]`, and hands each event out as soon as its blank line has arrived (streaming, not reading
the whole body first). A mistake raises `CheckFailed` (pagedlab.checks) naming the input, what was
expected and what came back, with a hint.

The solution lives with the notebooks, in notebooks/solutions/pieces_serving.py; with
PAGEDLAB_SOLUTIONS=1 the check runs it instead of the learner's function.
"""
from __future__ import annotations

import inspect
import json
import random

from .checks import CheckFailed, solutions_on
from .checks import solution as checks_solution

PIECES_FILE = "pieces_serving.py"
TEXTS = ["Hello", " world", "!", " Paris", "\n", "2 + 2 = 4", " caf\u00e9", " na\u00efve", " \u00fcber",
         " \u65e5\u672c\u8a9e", " \U0001F600", " \U0001F44D\U0001F3FD", ' "quoted"', " back\\slash",
         " tab\there", "data: not an event", "\n\n", " [DONE]", " \u20ac5", ""]


# -- the solution, read from notebooks/solutions/pieces_serving.py ------------------------------------

def solution(name: str):
    return checks_solution(name, PIECES_FILE)


def show_solution(name: str = "sse_events") -> None:
    """Print the solution of piece `name`, to read (it does not replace yours)."""
    print(inspect.getsource(solution(name)))


# -- streams as pagedlab's server writes them, and as others do -------------------------------------

def _events(rng) -> list[dict]:
    """One request's chunks: a chat or completion stream, 1-2 choices, maybe a usage chunk."""
    from .server.responses import Envelope, chunk, usage_chunk
    kind = rng.choice(["chat", "completion"])
    env = Envelope(kind, rng.choice(["smollm2", "random:tiny", "meta-llama/Llama-3.2-1B-Instruct"]))
    n = rng.choice([1, 1, 1, 2])
    usage = rng.random() < 0.4
    out = [chunk(env, i, None, first=True, include_usage=usage) for i in range(n)] if kind == "chat" else []
    for _ in range(rng.randint(0, 8)):
        out.append(chunk(env, rng.randrange(n), rng.choice(TEXTS), include_usage=usage))
    for i in range(n):
        out.append(chunk(env, i, None, finish_reason=rng.choice(["stop", "length"]), include_usage=usage))
    if usage:
        class _Out:                      # what usage_chunk reads from a finished request
            token_ids = [1] * rng.randint(1, 9)
            num_cached_tokens = 0
        out.append(usage_chunk(env, [rng.randint(1, 50)], [_Out() for _ in range(n)]))
    return out


def _wire(objs: list[dict], rng, crlf=False, comments=False, split_data=False, fields=False,
          after_done=False) -> bytes:
    """The bytes of a stream of `objs`, then [DONE]; with the variations other servers use."""
    from .server.responses import SSE_DONE, sse
    parts = [": keep-alive\n\n"] if comments else []
    for obj in objs:
        ev = sse(obj)
        if split_data:                      # one payload over two data: lines (joined with "\n")
            payload = json.dumps(obj, separators=(",", ":"), ensure_ascii=rng.random() < 0.5)
            cut = payload.index(",") + 1 if "," in payload else len(payload)
            ev = f"data: {payload[:cut]}\ndata:{payload[cut:]}\n\n"
        elif rng.random() < 0.5:            # json.dumps's default escapes non-ASCII; send UTF-8 too
            ev = "data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n\n"
        if fields:
            ev = "event: message\nid: %d\n" % len(parts) + ev
        parts.append(ev)
        if comments and rng.random() < 0.5:
            parts.append(": ping\n\n")
    parts.append(SSE_DONE)
    if after_done:
        parts.append(sse({"choices": [{"index": 0, "text": "AFTER [DONE]: must not be read"}]}))
    text = "".join(parts)
    if crlf:
        text = text.replace("\n", "\r\n")
    return text.encode("utf-8")


def _cut(data: bytes, rng, how: str) -> list[bytes]:
    """Network chunks: whole events, random cuts, single bytes, or cuts inside UTF-8 characters."""
    if how == "events":
        cuts = [i + 2 for i in range(len(data) - 1) if data[i:i + 2] == b"\n\n"]
    elif how == "bytes":
        cuts = list(range(1, len(data)))
    elif how == "utf8":                     # every cut inside a multi-byte character
        cuts = [i for i in range(1, len(data)) if 0x80 <= data[i] < 0xC0]
    else:
        cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(1, 12))))
    bounds = [0] + [c for c in cuts if 0 < c < len(data)] + [len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


CASES = [  # (what, how the bytes are cut, variations)
    ("one network chunk per event", "events", {}),
    ("events cut at random places", "random", {}),
    ("one byte at a time", "bytes", {}),
    ("cuts inside multi-byte UTF-8 characters", "utf8", {}),
    ("keep-alive comment lines (': ping')", "random", {"comments": True}),
    ("something after data: [DONE]", "random", {"after_done": True}),
    ("\\r\\n line ends", "random", {"crlf": True}),
    ("a payload over two data: lines", "random", {"split_data": True}),
    ("event: and id: fields before data:", "random", {"fields": True}),
]

HINTS = {
    "events": "each event is 'data: <json>' then a blank line; yield json.loads(<json>) for each, in order.",
    "random": "a network chunk can end anywhere, also in the middle of an event: keep the unfinished "
              "rest in a buffer and finish it with the next chunk.",
    "bytes": "a network chunk can end anywhere, also in the middle of an event: keep the unfinished "
             "rest in a buffer and finish it with the next chunk.",
    "utf8": "a chunk can end inside a character (an emoji is 4 bytes): decode complete lines, not "
            "chunks (split the bytes on b'\\n' first, then .decode('utf-8') each line).",
    "comments": "a line that starts with ':' is a comment (servers send them to keep a connection "
                "open): skip it.",
    "after_done": "data: [DONE] ends the stream: return there, whatever comes after.",
    "crlf": "the SSE format allows '\\r\\n' line ends: strip a trailing '\\r' from every line.",
    "split_data": "an event's data can span several 'data:' lines: join their values with '\\n', and "
                  "parse the JSON when the blank line ends the event. 'data:' may be followed by no space.",
    "fields": "only 'data:' lines carry the payload: ignore other fields (event:, id:, retry:).",
}


class _Feed:
    """The network: hands out chunks one by one and remembers how many were taken."""

    def __init__(self, chunks):
        self.chunks, self.taken = chunks, 0

    def __iter__(self):
        for c in self.chunks:
            self.taken += 1
            yield c


def _short(x, n=300) -> str:
    s = repr(x)
    return s if len(s) <= n else s[:n] + f"... ({len(s)} characters)"


def check_sse_events(fn, trials: int = 12, seed: int = 0):
    """fn(byte_chunks) -> an iterator of the JSON objects of a server-sent event stream (until
    data: [DONE]), on streams cut into network chunks in every way. Returns the function that passed."""
    name = "sse_events"
    if solutions_on():
        print(f"PAGEDLAB_SOLUTIONS=1: checking the course's solution of {name}")
        fn = solution(name)
    rng = random.Random(seed)
    count = 0
    for what, how, var in CASES:
        for trial in range(trials):
            objs = _events(rng)
            chunks = _cut(_wire(objs, rng, **var), rng, how)
            feed = _Feed(chunks)
            got, first_at = [], None
            try:
                for obj in fn(iter(feed)):
                    if first_at is None:
                        first_at = feed.taken
                    got.append(obj)
            except CheckFailed:
                raise
            except NotImplementedError as e:
                raise CheckFailed(f"{name} is not written yet ({e or 'NotImplementedError'}).\n"
                                  "Fill in the cell above and run it, then this check again. Stuck? "
                                  f"serving_course.show_solution({name!r}) prints one.") from None
            except Exception as e:
                raise CheckFailed(f"{name} raised {type(e).__name__}: {e}\n  case: {what}\n"
                                  f"  chunks: {_short(chunks)}\n"
                                  f"Hint: {HINTS[next(iter(var), how)]}") from None
            if got != objs:
                bad = next((i for i, (a, b) in enumerate(zip(got, objs)) if a != b), min(len(got), len(objs)))
                raise CheckFailed(
                    f"{name} gave {len(got)} events, {len(objs)} were sent; the first difference is "
                    f"event {bad}.\n  case: {what}\n  chunks: {_short(chunks)}\n"
                    f"  expected: {_short(objs[bad] if bad < len(objs) else '(no more events)')}\n"
                    f"  got:      {_short(got[bad] if bad < len(got) else '(no more events)')}\n"
                    f"Hint: {HINTS[next(iter(var), how)]}")
            # streaming: the first event must come out once the chunk that completes it is read
            need = _first_complete(chunks)
            if objs and first_at is not None and first_at > need:
                raise CheckFailed(
                    f"{name} read {first_at} network chunks before giving the first event, which was "
                    f"complete after {need}.\n  case: {what}\nHint: yield each event as soon as its blank "
                    "line has arrived -- a client that reads the whole body first shows nothing until "
                    "the answer is over (that is not streaming).")
            count += 1
    print(f"\u2713 {name}: {count} streams ({len(CASES)} kinds of cuts and variations), every event "
          "back as sent, each as soon as it was complete, nothing after [DONE]")
    return fn


def _first_complete(chunks) -> int:
    """How many chunks hold the first event's blank line (past any leading comments)."""
    data = b""
    for i, c in enumerate(chunks, 1):
        data += c
        norm = data.replace(b"\r\n", b"\n")
        for ev in norm.split(b"\n\n")[:-1]:
            if any(line.startswith(b"data:") for line in ev.split(b"\n")):
                return i
    return len(chunks)

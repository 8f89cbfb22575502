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

import json
import random

from .chapter import Chapter, CheckFailed

# the solution: notebooks/solutions/pieces_serving.py ("sse_events")
chapter = Chapter("pieces_serving.py", module="serving_course")
solution = chapter.solution
TEXTS = ["Hello", " world", "!", " Paris", "\n", "2 + 2 = 4", " caf\u00e9", " na\u00efve", " \u00fcber",
         " \u65e5\u672c\u8a9e", " \U0001F600", " \U0001F44D\U0001F3FD", ' "quoted"', " back\\slash",
         " tab\there", "data: not an event", "\n\n", " [DONE]", " \u20ac5", ""]


def show_solution(name: str = "sse_events") -> None:
    """Print the solution of piece `name`, to read (it does not replace yours)."""
    chapter.show_solution(name)


# -- streams as pagedlab's server writes them, and as others do -------------------------------------

def _events(rng) -> list[dict]:
    """One request's chunks: a chat or completion stream, 1-2 choices, maybe a usage chunk."""
    from ..server.responses import Envelope, chunk, usage_chunk
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
    from ..server.responses import SSE_DONE, sse
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
    fn = chapter.pick(fn, name)
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
            except Exception as e:
                raise chapter.raised(name, e, then=f"\n  case: {what}\n  chunks: {_short(chunks)}\n"
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


# -- the engine core: a thread of this process, or a process of its own ---------------------------

def core_steps_per_second(core, seconds: float, busy: bool) -> float:
    """Engine steps per second of `core` (a core_process.CoreProcess or async_llm.CoreThread, kept
    busy with long requests) over `seconds`, while this thread sleeps (busy=False) or runs pure
    Python the way a server's front end does: JSON, over and over (busy=True). Read from the step
    counters the core sends with every step (stats["t"]: the core's clock, shared by processes)."""
    import time
    last = {}

    def drain():
        for msg in core.messages():
            if msg[0] in ("step", "stats"):
                stats = msg[1].stats if msg[0] == "step" else msg[1]
                last.setdefault("first", stats)
                if stats["t"] <= t1:
                    last["end"] = stats
    t1 = float("inf")
    time.sleep(0.3)
    drain()
    last.clear()
    t0 = time.perf_counter()
    t1 = t0 + seconds
    doc = {"id": "cmpl-1", "choices": [{"index": 0, "text": "token " * 8, "finish_reason": None}]}
    while time.perf_counter() < t1:
        if busy:
            json.loads(json.dumps(doc))
        else:
            time.sleep(0.005)
    time.sleep(0.3)
    drain()
    a, b = last.get("first"), last.get("end")
    if a is None or b is None or b["t"] <= a["t"]:
        return float("nan")
    return (b["steps"] - a["steps"]) / (b["t"] - a["t"])


def gil_effect(model: str = "random:tiny", seconds: float = 1.0, **llm_kwargs) -> dict:
    """The engine's steps per second with its core on a thread of this process and in a process of
    its own, each while this process is idle and while it is busy with Python (the GIL at work:
    only one thread of a process runs Python at a time). Returns {(where, busy): steps/s}."""
    from ..async_llm import CoreThread
    from ..core_process import CoreProcess
    from ..llm import LLM
    from ..sampling import SamplingParams
    llm_kwargs = dict(dict(device="cpu", dtype="float32", max_num_seqs=4, show_progress=False), **llm_kwargs)
    llm = LLM(model, **llm_kwargs)
    long = SamplingParams(max_tokens=llm.engine.max_model_len - 8, ignore_eos=True)
    out, next_id = {}, 1000
    cores = {"thread": CoreThread(llm), "process": None}
    try:
        proc = CoreProcess(dict(llm_kwargs, model=model))
        proc.wait_ready()
        cores["process"] = proc
        for where, core in cores.items():
            for busy in (False, True):        # fresh work each time: 4 slots, 16 long requests
                work = [(next_id + i, [5 + i % 50, 6, 7], None, long) for i in range(16)]
                next_id += len(work)
                core.send(("add", work))
                out[where, busy] = core_steps_per_second(core, seconds, busy)
                core.send(("abort", [rid for rid, *_ in work]))
    finally:
        cores["thread"].stop()
        if cores["process"] is not None:
            cores["process"].stop()
    return out


def draw_core_split():
    """The two processes of `python -m pagedlab serve` and what crosses between them per step."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch
    fig, ax = plt.subplots(figsize=(10, 3.4))
    ax.set(xlim=(0, 10), ylim=(0, 4))
    ax.axis("off")
    boxes = [(0.2, "front end: the server's process",
              "uvicorn's event loop:\nHTTP, JSON, check + tokenize\nOutputProcessor: detokenize,\n"
              "stop strings, SSE chunks", "#dbe9f6"),
             (6.3, "engine core: a process of its own",
              "loop: schedule -> run -> accept\n(nothing else on its interpreter,\nits own GIL)\n"
              "writer thread: step outputs out", "#fde3c8")]
    for x, title, body, color in boxes:
        ax.add_patch(FancyBboxPatch((x, 0.4), 3.5, 3.0, boxstyle="round,pad=0.05", fc=color, ec="0.3"))
        ax.text(x + 1.75, 3.1, title, ha="center", va="center", fontsize=10, weight="bold")
        ax.text(x + 1.75, 1.75, body, ha="center", va="center", fontsize=9)
    arrows = [(2.75, "add: (id, token ids, params)  -- per request"),
              (1.85, "abort: ids  -- a client left, a stop string"),
              (0.95, "step: ids, new token ids, endings, stats  -- ONE per step")]
    for i, (y, label) in enumerate(arrows):
        x0, x1 = (3.75, 6.25) if i < 2 else (6.25, 3.75)
        ax.annotate("", xy=(x1, y), xytext=(x0, y), arrowprops=dict(arrowstyle="->", lw=1.6))
        ax.text(5.0, y + 0.18, label, ha="center", fontsize=8)
    fig.tight_layout()
    return fig


def admit_group_table() -> list[dict]:
    """The committed H200 measurement of admit groups (docs/serving.md, session 11: the same
    512-request burst, twice, through a server admitting prompts one at a time and in groups of 8;
    docs/serve_s11_admit*.json): one row per group and burst."""
    from .data import load_json
    rows = []
    for group in (1, 8):
        d = load_json(f"serve_s11_admit{group}.json")
        if d is None:
            continue
        for burst, r in enumerate(d["results"], 1):
            rows.append(dict(group=group, burst=burst, tokens_per_s=r["output_throughput"],
                             ttft_p50_ms=r["ttft_ms"]["p50"], ttft_p99_ms=r["ttft_ms"]["p99"],
                             prompt_steps=r.get("prompt_steps"), prompt_step_ms=r.get("prompt_step_ms"),
                             decode_steps=r.get("decode_steps"), decode_step_ms=r.get("decode_step_ms")))
    return rows


def served_table() -> list[dict]:
    """The committed H200 measurement of docs/serving.md: the same 512-request workload through
    four servers and offline (docs/serve_core_*.json): one row per server and rate."""
    from .data import load_json
    rows = []
    for name, label in (("before_stream", "before: engine thread, SSE"),
                        ("thread_stream", "engine thread + new output path, SSE"),
                        ("process_stream", "engine core process, SSE"),
                        ("process_whole", "engine core process, whole answers")):
        d = load_json(f"serve_core_{name}.json")
        if d is None:
            continue
        for r in d["results"]:
            rows.append(dict(server=label, rate=r["rate"], tokens_per_s=r["output_throughput"],
                             ttft_p99_ms=r["ttft_ms"]["p99"], tpot_p50_ms=r["tpot_ms"]["p50"]))
        if d.get("offline"):
            o = d["offline"]
            rows.append(dict(server="offline: LLM.generate (second pass)", rate="all at once",
                             tokens_per_s=o["output_throughput"], ttft_p99_ms=o["ttft_ms"]["p99"],
                             tpot_p50_ms=None))
    return rows


HOST_ARMS = (("alone", "nothing else running"), ("burn3", "3 processes spinning beside it"),
             ("burn8", "8 processes spinning beside it"))


def host_contention_table() -> list[dict]:
    """The committed H200-host measurement of docs/serving.md, session 15 (scripts/host_contention.py,
    docs/host_contention_s15.json): the 512-request burst through LLM.generate in one process, pass
    after pass, alone and with busy processes beside it -- the median of each arm's passes, per run."""
    import statistics

    from .data import load_json
    d = load_json("host_contention_s15.json")
    if d is None:
        return []
    rows = []
    for run in ("run1", "run2"):
        for arm, label in HOST_ARMS:
            passes = d[run].get(arm)
            if not passes:
                continue
            med = lambda key: statistics.median(x[key] for x in passes)      # noqa: E731
            rows.append(dict(run=int(run[-1]), arm=arm, label=label, passes=len(passes),
                             tokens_per_s=med("tok_s"), decode_step_ms=med("decode_step_ms"),
                             ttft_p99_ms=med("ttft_p99_ms")))
    return rows

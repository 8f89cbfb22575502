"""Notebook 11's hands-on pieces and their checks: reading a server-sent event stream, and the two
rules by which several front ends share one engine core (`serve --api-servers N`, core_mailbox.py).

    sse_events = serving_course.check_sse_events(sse_events)
    frontend_ids, owner = serving_course.check_numbering(frontend_ids, owner)
    split_step = serving_course.check_split_step(split_step)

`check_sse_events` builds streams the way pagedlab's server writes them (pagedlab.server.responses:
`chunk`, `sse`, `usage_chunk`, `SSE_DONE`), cuts their bytes into network chunks at random places
(inside an event, inside a multi-byte UTF-8 character, one byte at a time), adds keep-alive
comments (`SSE_KEEPALIVE`: pagedlab's server writes one to a stream idle for 15 s) and what other
servers send (`\\r\\n` line ends, a payload over two `data:` lines, an `event:` field), and checks
that the learner's parser gives back exactly the JSON objects that were sent, stops at `[DONE]`,
and hands each event out as soon as its blank line has arrived (streaming, not reading the whole
body first). A mistake raises `CheckFailed` (pagedlab.checks) naming the input, what was
expected and what came back, with a hint.

`check_numbering` and `check_split_step` compare the learner's request numbering (front end f of N:
f, f + N, ...), owner rule (id % N) and cut of a step's columns by owner with the server's own
(core_mailbox.request_ids, owner, split) on every front end of up to 7, empty steps, N = 1, one
front end's requests only and random steps; a wrong one fails naming the case, with a hint.

Besides: the engine core on a thread or in a process (gil_effect), the drawings of the processes
(draw_core_split, draw_frontends), and the committed H200 measurements the notebook prints
(served_table, host_contention_table, admit_group_table, first_answer_table).

The solutions live with the notebooks, in notebooks/solutions/pieces_serving.py; with
PAGEDLAB_SOLUTIONS=1 the checks run them instead of the learner's functions.
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
    from ..server.responses import SSE_DONE, SSE_KEEPALIVE, sse
    parts = [SSE_KEEPALIVE] if comments else []
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


def _box(ax, x, y, w, h, title, body, color, size=9):
    """A rounded box with a bold title at its top and a body in its middle (the process drawings)."""
    from matplotlib.patches import FancyBboxPatch
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.05", fc=color, ec="0.3"))
    ax.text(x + w / 2, y + h - 0.3, title, ha="center", va="center", fontsize=size + 1, weight="bold")
    if body:
        ax.text(x + w / 2, y + (h - 0.3) / 2, body, ha="center", va="center", fontsize=size)


def _arrow(ax, x0, y0, x1, y1, label="", size=8, style="->", ls="-"):
    ax.annotate("", xy=(x1, y1), xytext=(x0, y0), arrowprops=dict(arrowstyle=style, lw=1.4, ls=ls))
    if label:
        ax.text((x0 + x1) / 2, (y0 + y1) / 2 + 0.12, label, ha="center", va="bottom", fontsize=size)


def draw_core_split():
    """The two processes of `python -m pagedlab serve` and what crosses between them per step."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 3.4))
    ax.set(xlim=(0, 10), ylim=(0, 4))
    ax.axis("off")
    _box(ax, 0.2, 0.4, 3.5, 3.0, "front end: the server's process",
         "uvicorn's event loop:\nHTTP, JSON, check + tokenize\nOutputProcessor: detokenize,\n"
         "stop strings, SSE chunks", "#dbe9f6")
    _box(ax, 6.3, 0.4, 3.5, 3.0, "engine core: a process of its own",
         "loop: schedule -> run -> accept\n(nothing else on its interpreter,\nits own GIL)\n"
         "writer thread: step outputs out", "#fde3c8")
    _arrow(ax, 3.75, 2.75, 6.25, 2.75, "add: (id, token ids, params)  -- per request")
    _arrow(ax, 3.75, 1.85, 6.25, 1.85, "abort: ids  -- a client left, a stop string")
    _arrow(ax, 6.25, 0.95, 3.75, 0.95, "step: ids, new token ids, endings, stats  -- ONE per step")
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


# -- several front ends in front of one core (serve --api-servers N) -------------------------------

FIRST_ANSWER_RUNS = (("serve_s15_phases.json", "serve_s15_phases"),
                     ("serve_s15_decode_phases.json", "serve_s15_decode_phases (py-spy on)"))


def first_answer_table() -> list[dict]:
    """The committed H200 measurement behind `serve --api-servers N` (docs/serving.md, session 15:
    docs/serve_s15_phases.json and serve_s15_decode_phases.json): for each 512-request burst, when
    its FIRST request got its first token (TTFT min), how many client processes sent it, its TTFT
    p99; and the same requests offline (LLM.generate), once per file. One row per burst."""
    from .data import load_json
    rows = []
    for name, label in FIRST_ANSWER_RUNS:
        d = load_json(name)
        if d is None:
            continue
        off = d["offline"]["ttft_ms"]
        for i, r in enumerate(d["results"], 1):
            if r["rate"] != "inf":                   # bursts only (the Poisson rate is not a burst)
                continue
            rows.append(dict(file=name, run=label, burst=i, client_procs=r.get("client_procs", 1),
                             ttft_min_ms=r["ttft_ms"]["min"], ttft_p99_ms=r["ttft_ms"]["p99"],
                             offline_ttft_min_ms=off["min"], offline_ttft_p99_ms=off["p99"]))
    return rows


# Session 17's H200 runs of `serve --api-servers N` (scripts/serve_bench_h200.sh api1 api4 api1c4
# api4c4; docs/serving.md, session 17): one front end and four, each burst from 1 or 4 client processes.
FRONT_END_RUNS = ("serve_s17_api1.json", "serve_s17_api4.json", "serve_s17_api1c4.json", "serve_s17_api4c4.json")


def front_ends_table() -> list[dict]:
    """The committed H200 measurement of `serve --api-servers N` (docs/serve_s17_api*.json): one row
    per 512-request burst -- front ends, client processes, output tokens/s and served/offline, the
    first answer (TTFT min) and TTFT p99 -- with the same command's offline passes (LLM.generate on
    the same requests: their median tokens/s, the first answer, the median of their TTFT p99)."""
    import re
    from .data import load_json
    rows = []
    for name in FRONT_END_RUNS:
        d = load_json(name)
        if d is None:
            continue
        m = re.search(r"--api-servers\s+(\d+)", d["config"].get("serve") or "")
        off = d["offline"]
        for i, r in enumerate(d["results"], 1):
            rows.append(dict(file=name, front_ends=int(m.group(1)) if m else 1, burst=i,
                             client_procs=r.get("client_procs", 1), tokens_per_s=r["output_throughput"],
                             served_over_offline=r["served_over_offline"], ttft_min_ms=r["ttft_ms"]["min"],
                             ttft_p99_ms=r["ttft_ms"]["p99"], offline_tokens_per_s=off["output_throughput"],
                             offline_ttft_min_ms=off["ttft_ms"]["min"],
                             offline_ttft_p99_ms=off["ttft_p99_ms_median"]))
    return rows


# the same burst, server and engine, before and after the benchmark's clock was fixed (session 20)
CLOCK_RUNS = (("serve_s19_run_ahead_on.json", "clients built after the start"),
              ("serve_s20_direct_off.json", "clients ready before the start"))


def clock_table() -> list[dict]:
    """The committed H200 bursts of docs/serving.md sessions 19 and 20 (the same 512 requests, one
    front end, four client processes, the core writing through its writer thread): one row per
    burst -- served/offline, TTFT p99 against the same command's offline passes, and (session 20)
    when the core started after the first request. Until session 20 each client process imported
    its HTTP library and built its client after the common start, and the burst's clock counted it."""
    from .data import load_json
    rows = []
    for name, clock in CLOCK_RUNS:
        d = load_json(name)
        if d is None:
            continue
        off = d["offline"]
        for i, r in enumerate(d["results"], 1):
            busy = r.get("busy") or {}
            rows.append(dict(file=name, clock=clock, burst=i, tokens_per_s=r["output_throughput"],
                             served_over_offline=r["served_over_offline"], ttft_p99_ms=r["ttft_ms"]["p99"],
                             offline_ttft_p99_ms=off["ttft_p99_ms_median"],
                             core_start_ms=1e3 * busy["start_s"] if "start_s" in busy else None))
    return rows


# the same burst (one front end, four client processes) before and after a token whose text is
# held back got its own stream chunk (docs/serving.md, sessions 25 and 27; c4c867f)
SPLIT_RUNS = (("serve_s25_h_api1_split.json", "held-back text made no chunk"),
              ("serve_s27_a_api1.json", "every token makes a chunk"),
              ("serve_s27_b_api1.json", "every token makes a chunk"))


def ttft_split_table() -> list[dict]:
    """The committed H200 bursts of docs/serving.md sessions 25 and 27 with each request's TTFT cut
    in three (way in: sent -> the front end has it; engine: -> its first token is back in the front
    end; way out: -> the client read it): one row per burst -- TTFT p99 and each part's p99, against
    the median TTFT p99 of the same command's offline passes."""
    from .data import load_json
    rows = []
    for name, chunks in SPLIT_RUNS:
        d = load_json(name)
        if d is None:
            continue
        for i, r in enumerate(d["results"], 1):
            split = r["ttft_split_ms"]
            rows.append(dict(file=name, chunks=chunks, burst=i, ttft_p99_ms=r["ttft_ms"]["p99"],
                             offline_ttft_p99_ms=d["offline"]["ttft_p99_ms_median"],
                             way_in_p99_ms=split["way_in"]["p99"], engine_p99_ms=split["engine"]["p99"],
                             way_out_p99_ms=split["way_out"]["p99"]))
    return rows


def draw_frontends(n: int = 3):
    """`python -m pagedlab serve --api-servers n`: the parent, n front ends on one port, one engine
    core, and what crosses each front end's pipes: adds and aborts in, one step message out (only
    to a front end with requests in that step)."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(11, 1.6 + 1.25 * n))
    top = 1.25 * n + 0.2
    ax.set(xlim=(0, 11), ylim=(-0.4, top + 1.2))
    ax.axis("off")
    _box(ax, 0.6, top + 0.25, 4.4, 0.85, "parent (python -m pagedlab serve)", "", "#eeeeee")
    ax.text(2.8, top + 0.35, "starts, watches, stops -- serves nothing", ha="center", fontsize=8)
    core_h = 1.25 * n - 0.35
    _box(ax, 7.6, 0.1, 3.2, core_h, "engine core", "its mailbox: an inbox, an outbox\nand a writer thread "
         "per front end;\ntakes every inbox between\ntwo steps; cuts each step\nby owner: id % N", "#fde3c8")
    ax.plot([1.0, 1.0], [top + 0.2, 0.85], ls=":", c="0.3", lw=1.2)            # the parent's lifelines
    ax.plot([5.0, 9.2, 9.2], [top + 0.6, top + 0.6, core_h + 0.2], ls=":", c="0.3", lw=1.2)
    for f in range(n):
        y = 0.1 + 1.25 * (n - 1 - f)
        _box(ax, 1.3, y, 2.6, 0.9, f"front end {f}", f"ids {f}, {f + n}, {f + 2 * n}, ...", "#dbe9f6", size=8)
        ax.plot([1.0, 1.25], [y + 0.75, y + 0.75], ls=":", c="0.3", lw=1.2)
        _arrow(ax, 0.1, y + 0.3, 1.25, y + 0.3)                         # connections, from the port
        _arrow(ax, 3.95, y + 0.62, 7.55, y + 0.62, "add / abort: its own ids", size=7)
        _arrow(ax, 7.55, y + 0.22, 3.95, y + 0.22, "step: its requests' columns, ONE message", size=7)
    ax.text(0.05, -0.05, "one port (SO_REUSEPORT): the kernel spreads the connections", ha="left", va="top",
            fontsize=8)
    fig.tight_layout()
    return fig


def _pairs(parts, what):
    """The learner's {front end: (ids, token lists)}, as plain lists; a wrong shape -> CheckFailed."""
    if not isinstance(parts, dict):
        raise CheckFailed(f"split_step returned a {type(parts).__name__}, not a dict.\n  case: {what}\n"
                          "Hint: return {front end: (its request ids, their token id lists)}.")
    out = {}
    for f, part in parts.items():
        try:
            ids, toks = part
            out[f] = (list(ids), [list(t) for t in toks])
        except (TypeError, ValueError):
            raise CheckFailed(f"split_step's part for front end {f!r} is {_short(part, 120)}, not a pair.\n"
                              f"  case: {what}\nHint: each part is (request ids, token id lists): two lists "
                              "of the same length, the step's two columns cut down to that front end's "
                              "requests.") from None
    return out


def check_numbering(frontend_ids, owner):
    """frontend_ids(f, n, count) -> the first `count` request ids front end f of n gives out;
    owner(rid, n) -> the front end that numbered request rid. Checked against the rules the server
    runs (pagedlab.core_mailbox.request_ids and owner): every front end f < n for n up to 7, and
    owner on those ids and on random large ones. Returns the two functions that passed."""
    import itertools

    from .. import core_mailbox
    frontend_ids, owner = chapter.pick(frontend_ids, "frontend_ids"), chapter.pick(owner, "owner")
    rng = random.Random(0)
    for n in (2, 3, 1, 4, 7):
        for f in range(n):
            for count in (0, 1, 5, 13):
                want = list(itertools.islice(core_mailbox.request_ids(f, n), count))
                got = chapter.call(frontend_ids, "frontend_ids", f, n, count)
                got = list(got) if not isinstance(got, (int, str)) else got
                if got == want:
                    continue
                if isinstance(got, list) and got[:1] == [f] and len(got) > 1 and got[1] == f + 1:
                    hint = (f"after f comes f + n, not f + 1: with ids f, f + 1, ... front end 0's second "
                            f"request and front end 1's first would both be 1")
                elif isinstance(got, list) and got[:1] and got[0] != f:
                    hint = "front end f's first id is f itself (front end 0 starts at 0, front end 1 at 1, ...)"
                else:
                    hint = ("front end f of n gives f, f + n, f + 2n, ...: the n front ends' ids interleave "
                            "and never meet, however many requests each has sent")
                raise CheckFailed(f"frontend_ids({f}, {n}, {count}) gave {_short(got, 200)}\n  expected: {want}\n"
                                  f"Hint: {hint}")
    for n in (2, 3, 4, 7, 16, 1):
        rids = [r for f in range(n) for r in itertools.islice(core_mailbox.request_ids(f, n), 20)]
        rids += [rng.randrange(2 ** 40) for _ in range(50)]
        for rid in rids:
            want = core_mailbox.owner(rid, n)
            got = chapter.call(owner, "owner", rid, n)
            if got == want:
                continue
            if got == rid // n:
                hint = (f"rid // n counts how many rounds of n ids came before rid, not whose it is: the owner is "
                        f"the remainder, rid % n (front end f's ids are f + k n, and (f + k n) % n == f)")
            else:
                hint = "owner undoes the numbering: owner(f + k * n, n) must be f for every k"
            raise CheckFailed(f"owner({rid}, {n}) gave {got!r}, expected {want}: request {rid} was numbered by "
                              f"front end {want} of {n}.\nHint: {hint}")
    chapter.passed("frontend_ids and owner", "every front end of 1 to 7, ids as the server numbers them; "
                   "owner gives each id back to the front end that numbered it")
    return frontend_ids, owner


def _step_cases(rng):
    """(what, n, request ids, token id lists) of steps the core could hand out."""
    def step(n, owners, k):
        rids = rng.sample([f + j * n for f in owners for j in range(40)], k)
        toks = [[rng.randrange(32000) for _ in range(rng.choice([1, 1, 1, 2, 4]))] for _ in rids]
        if toks and rng.random() < 0.5:            # a request that ended without a new token (aborted)
            toks[rng.randrange(len(toks))] = []
        return rids, toks
    yield ("an empty step (nothing ran)", 3, [], [])
    yield ("only front end 2's requests, n = 4", 4, *step(4, [2], 6))
    yield ("one front end (n = 1)", 1, *step(1, [0], 9))
    yield ("one request, n = 5", 5, *step(5, [3], 1))
    yield ("more front ends than requests, n = 8", 8, *step(8, range(8), 3))
    for trial in range(40):
        n = rng.randint(2, 6)
        owners = rng.sample(range(n), rng.randint(1, n))
        yield (f"random step {trial}: n = {n}, requests of front ends {sorted(owners)}", n,
               *step(n, owners, rng.randint(1, 24)))


def check_split_step(split_step):
    """split_step(request_ids, token_ids, n) -> {front end: (its request ids, their token id lists)}:
    one step's columns cut by owner (request id % n), in the step's order, and a part ONLY for a front
    end with a request in the step. Checked against the core's own (pagedlab.core_mailbox.split) on
    empty steps, n = 1, one front end's requests only, and random steps. Returns the function that passed."""
    from .. import core_mailbox
    from ..output_processor import StepOutput
    name = "split_step"
    fn = chapter.pick(split_step, name)
    count = 0
    for what, n, rids, toks in _step_cases(random.Random(1)):
        ref = core_mailbox.split(StepOutput(request_ids=list(rids), token_ids=[list(t) for t in toks]), n)
        want = {f: (p.request_ids, p.token_ids) for f, p in ref.items()}
        args = (list(rids), [list(t) for t in toks])
        got = _pairs(chapter.call(fn, name, *args, n), what)
        if args != (rids, toks):
            raise CheckFailed(f"{name} changed the step's lists it was given.\n  case: {what}\n"
                              "Hint: build new lists for the parts; the step's columns are the core's.")
        if got == want:
            count += 1
            continue
        case = (f"\n  case: {what}\n  request_ids: {_short(rids, 200)}\n  token_ids: {_short(toks, 200)}\n"
                f"  expected: {_short(want, 300)}\n  got:      {_short(got, 300)}\n")
        empty = [f for f in got if f not in want and not got[f][0]]
        astray = [(rid, f) for f, (ids, _) in got.items() for rid in ids if rid % n != f]
        if empty:
            hint = (f"front end {empty[0]} has no request in this step, yet it got a part: the core would "
                    "send it an empty message every step (N pickles and pipe writes a step, for nothing). "
                    "Make a part only for a front end that owns a request of the step.")
        elif astray:
            rid, f = astray[0]
            how = " (rid // n?)" if rid // n == f else ""
            hint = (f"request {rid} is in front end {f}'s part{how}: its owner is {rid} % {n} = {rid % n}, the "
                    "front end that numbered it.")
        elif sorted(got) == sorted(want) and all(sorted(got[f][0]) == sorted(want[f][0]) for f in want):
            if all(got[f][0] == want[f][0] for f in want):
                hint = ("the ids are right, their tokens are not: token_ids[i] are request_ids[i]'s tokens; "
                        "move them together (zip the columns), and keep an empty list as it is.")
            else:
                hint = "keep the step's order within each part (the front end applies the tokens as they come)."
        else:
            hint = ("every request of the step goes to exactly one part, its owner's (request id % n); "
                    "a request with no new token (it ended) is a request too.")
        raise CheckFailed(f"{name} cut the step differently from the core.{case}Hint: {hint}")
    chapter.passed(name, f"{count} steps cut exactly as the core cuts them (core_mailbox.split): empty steps, n = 1, "
                   "one front end's requests only, random steps; no part for a front end without requests")
    return fn

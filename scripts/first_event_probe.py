"""Where a streamed request's first token spends its way out of the front end (docs/serving.md,
session 25). An experiment, not part of the package.

The server runs in this process (pagedlab.server.serve, its engine core in a process of its own),
patched to note per stream: the front end's moment of its first token (state.token_times[0]),
when that delta left `one_stream`, whether it had text, and when EventStream's first body send
returned. `bench serve` sends a burst at it from two client processes. Printed: the two front-end
intervals (p50 / p99 / max), the slowest first sends with their first token ids, and how many first
deltas had no text.

    python scripts/first_event_probe.py [slots]      # CPU, random:tiny, ~30 s

Session 25, before the change that makes tokens without text send a chunk: 50 of 132 first deltas
had no text, and the first body send came p99 139 / max 245 ms after the first delta, the slowest
all behind a first delta without text; after it (same command, 2-core CPU): p99 0.7 / max 2.8 ms.
"""
from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time

import pagedlab.server.app as app
from pagedlab.bench import serve as bench
from pagedlab.server import serve

NOTES: dict = {}            # the stream's task -> its moments


def patch() -> None:
    one_stream, call = app.one_stream, app.EventStream.__call__

    async def noted_one_stream(request, metrics, arrival, stream):
        task, first = asyncio.current_task(), True
        async for i, delta in one_stream(request, metrics, arrival, stream):
            if first and delta is not None and delta.token_ids:
                state = request.caller.state
                NOTES[task] = {"first_token": state.token_times[0], "yielded": time.perf_counter(),
                               "text": bool(delta.text), "ids": state.token_ids[:4]}
                first = False
            yield i, delta

    async def noted_call(self, scope, receive, send):
        task = asyncio.current_task()

        async def noted_send(msg):
            await send(msg)
            note = NOTES.get(task)
            if msg["type"] == "http.response.body" and msg.get("body") and note and "sent" not in note:
                note["sent"] = time.perf_counter()
        return await call(self, scope, receive, noted_send)
    app.one_stream, app.EventStream.__call__ = noted_one_stream, noted_call


def spread(xs: list[float]) -> str:
    xs = sorted(xs)
    return f"p50 {statistics.median(xs):.1f} / p99 {xs[int(0.99 * (len(xs) - 1))]:.1f} / max {xs[-1]:.1f} ms"


def main() -> None:
    patch()
    slots = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    s = serve("random:tiny", model_name="random:tiny", port=0, device="cpu", max_num_seqs=slots)
    out = "/tmp/first_event_probe"
    try:
        bench.main(["--url", s.url, "--server-timing", "--rate", "inf", "--client-procs", "2", "--input-len", "32",
                    "--output-len", "48", "--range-ratio", "0.5", "--ignore-eos", "--num-prompts", "128",
                    "--warmup", "4", "--client", "raw", "--preconnect", "--no-progress", "--out", out])
    finally:
        s.stop()
    notes = [n for n in NOTES.values() if "sent" in n]
    print(f"{len(notes)} streams; in the front end: first token -> its delta out of one_stream "
          + spread([1e3 * (n["yielded"] - n["first_token"]) for n in notes])
          + "; -> the first body sent " + spread([1e3 * (n["sent"] - n["yielded"]) for n in notes]))
    for n in sorted(notes, key=lambda n: n["yielded"] - n["sent"])[:8]:
        print(f"  first send {1e3 * (n['sent'] - n['yielded']):6.1f} ms after the first delta "
              f"(text: {n['text']}), first ids {n['ids']}")
    print(f"first deltas without text: {sum(not n['text'] for n in notes)} of {len(notes)}")
    split = json.load(open(f"{out}/serve_bench.json"))["results"][0]["ttft_split_ms"]["way_out"]
    print(f"bench serve's way out: p50 {split['p50']:.1f} / p99 {split['p99']:.1f} ms")


if __name__ == "__main__":
    main()

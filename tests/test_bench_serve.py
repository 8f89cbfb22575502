"""bench serve against a real server (the tiny random model on 127.0.0.1): the JSON and the plot,
numbers that hold together, the Poisson arrivals, and one-line errors for bad flags."""
from __future__ import annotations

import json
import math
import random

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import tiny_llm
from pagedlab.bench import serve as bench

MODEL = "tiny-bench"


@pytest.fixture(scope="module")
def server():
    from pagedlab.server import serve
    s = serve(tiny_llm(max_num_seqs=4, num_blocks=96, dtype="float32"), model_name=MODEL, port=0)
    yield s
    s.stop()


def generated_tokens(server) -> float:
    text = httpx.get(server.url + "/metrics").text
    return next(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                if s.name == "pagedlab_generation_tokens_total")


def run(argv, capsys):
    assert bench.main(argv) == 0
    return capsys.readouterr().out


def check_ordered(stats: dict):
    assert 0 <= stats["min"] <= stats["p50"] <= stats["p90"] <= stats["p99"]
    assert stats["mean"] > 0


def test_two_rates_give_json_and_plot(server, tmp_path, capsys):
    argv = ["--url", server.url, "--rate", "6,inf", "--num-prompts", "7", "--input-len", "12",
            "--output-len", "6", "--range-ratio", "0.5", "--ignore-eos", "--seed", "3", "--warmup", "1",
            "--out", str(tmp_path), "--no-progress"]
    tokens_before = generated_tokens(server)
    out = run(argv, capsys)
    data = json.loads((tmp_path / "serve_bench.json").read_text())
    assert (tmp_path / "serve_bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    meta = data["metadata"]
    assert meta["command"].endswith(" ".join(argv)) and meta["date"] and meta["httpx"]
    assert meta["server_models"]["data"][0]["id"] == MODEL == data["config"]["model"]
    args = bench.build_parser().parse_args(argv)
    jobs = bench.make_workload(args)
    want_tokens = sum(j.output_len for j in jobs)      # ignore_eos: each request its max_tokens exactly
    assert [r["rate"] for r in data["results"]] == [6.0, "inf"]
    for r in data["results"]:
        assert r["requested"] == r["completed"] == 7 and r["failed"] == 0 and r["errors"] == []
        assert r["total_output_tokens"] == want_tokens
        assert r["total_prompt_tokens"] == sum(len(j.prompt) for j in jobs)
        for key in ("ttft_ms", "e2e_latency_ms", "tpot_ms"):
            check_ordered(r[key])
        # inter-token latencies come from the gaps between a stream's events: on a loaded CPU the
        # front end may read several steps at once and send a short answer whole (one event, no gap;
        # seen once in a suite run, session 20) -- then there are none, and they are None
        if r["itl_ms"]["min"] is not None:
            check_ordered(r["itl_ms"])
        else:
            assert all(v is None for v in r["itl_ms"].values())
        assert r["ttft_ms"]["p99"] <= r["e2e_latency_ms"]["p99"]
        assert math.isclose(r["request_throughput"], 7 / r["duration_s"])
        assert math.isclose(r["output_throughput"], want_tokens / r["duration_s"])
        assert 0 <= r["goodput"] <= r["request_throughput"] and 0 <= r["goodput_fraction"] <= 1
        # the core's steps, split: each of the 7 prompts (12 tokens, no chunking) is prefilled in a
        # step of its own or shares one; the rest are decode-only steps
        assert 1 <= r["prompt_steps"] <= 7 and r["decode_steps"] >= 1, r
        assert r["prompt_step_ms"] > 0 and r["decode_step_ms"] > 0
        # the host's phases of those steps (engine.PhaseTimer, through /metrics): inside the steps
        host = r["host_ms_per_step"]
        assert set(host) == {"schedule", "launch", "read", "accept"} and min(host.values()) >= 0
        assert host["launch"] > 0 and sum(host.values()) <= r["engine_step_ms"] * (1 + 1e-9), (host, r)
        # the front end's CPU over the run (its process: here this one), printed per request
        cpu = r["seconds"]["frontend_cpu_seconds"]
        assert 0 < cpu and f"{1e3 * cpu / 7:.2f} ms per request" in out
    # the server counted what the client counted (+ the warm-up request)
    assert generated_tokens(server) - tokens_before == 2 * want_tokens + jobs[0].output_len
    assert "inf" in out and "goodput" in out


def test_a_burst_from_client_processes(server, tmp_path, capsys):
    """--client-procs: the second burst is dealt to 2 spawned client processes; every request is
    answered in full, in the jobs' order, and the server counted each token once."""
    argv = ["--url", server.url, "--rate", "inf,inf", "--client-procs", "1,2", "--num-prompts", "7",
            "--input-len", "9", "--output-len", "5", "--range-ratio", "0.5", "--ignore-eos", "--seed", "5",
            "--warmup", "0", "--out", str(tmp_path), "--no-progress"]
    tokens_before = generated_tokens(server)
    out = run(argv, capsys)
    one, two = json.loads((tmp_path / "serve_bench.json").read_text())["results"]
    jobs = bench.make_workload(bench.build_parser().parse_args(argv))
    want = sum(j.output_len for j in jobs)
    assert (one["client_procs"], two["client_procs"]) == (1, 2)
    for r in (one, two):
        assert r["requested"] == r["completed"] == 7 and r["failed"] == 0
        assert r["total_output_tokens"] == want and r["total_prompt_tokens"] == sum(len(j.prompt) for j in jobs)
        check_ordered(r["ttft_ms"])
        assert r["ttft_ms"]["p99"] <= r["e2e_latency_ms"]["p99"] <= 1e3 * r["duration_s"]
    assert generated_tokens(server) - tokens_before == 2 * want
    assert "clients" in out
    # each client process's own CPU over its burst: one number per process, none negative
    assert len(one["client_cpu_s"]) == 1 and len(two["client_cpu_s"]) == 2
    assert min(one["client_cpu_s"] + two["client_cpu_s"]) >= 0
    # and each one's stalls: its loop's longest lag and its collector's pauses, one dict per process
    assert len(one["client_stalls"]) == 1 and len(two["client_stalls"]) == 2
    for st in one["client_stalls"] + two["client_stalls"]:
        assert st["longest_stall_s"] >= 0 and st["gc_s"] >= 0 and st["gcs"] >= 0
    assert "longest loop lag" in out


@pytest.mark.parametrize("client,extra", [("raw", []), ("raw", ["--preconnect"]), ("raw", ["--no-stream"]),
                                          ("httpx", ["--preconnect"])])
def test_bench_serve_through_each_client(server, tmp_path, capsys, client, extra):
    """Streams, whole answers, fresh and pre-opened connections, one and two client processes:
    every request answered in full, the server's own token count equal to the client's."""
    argv = ["--url", server.url, "--client", client, "--rate", "inf,5", "--client-procs", "2,1",
            "--num-prompts", "6", "--input-len", "10", "--output-len", "5", "--range-ratio", "0.5",
            "--ignore-eos", "--seed", "4", "--warmup", "0", "--out", str(tmp_path), "--no-progress", *extra]
    before = generated_tokens(server)
    assert bench.main(argv) == 0
    capsys.readouterr()
    data = json.loads((tmp_path / "serve_bench.json").read_text())
    jobs = bench.make_workload(bench.build_parser().parse_args(argv))
    want = sum(j.output_len for j in jobs)
    assert data["metadata"]["client"] == client
    for r in data["results"]:
        assert r["completed"] == 6 and r["failed"] == 0 and r["errors"] == [], r["errors"]
        assert r["total_output_tokens"] == want
        assert r["total_prompt_tokens"] == sum(len(j.prompt) for j in jobs)
        assert 0 < r["ttft_ms"]["p50"] <= r["e2e_latency_ms"]["p99"]
    assert generated_tokens(server) - before == 2 * want


def test_a_client_process_that_dies_is_an_error_not_a_wait():
    import queue
    from types import SimpleNamespace as NS
    q = queue.Queue()
    q.put("ready")
    alive, done, died = NS(exitcode=None), NS(exitcode=0), NS(exitcode=-9)
    assert bench._from_clients(q, [alive, done]) == "ready"          # a message: at once
    with pytest.raises(RuntimeError, match="exit code -9"):            # none, and a client is gone
        bench._from_clients(q, [alive, done, died])


def test_failed_requests_are_counted_and_named_under_the_table():
    from types import SimpleNamespace as NS
    args = NS(slo_ttft_ms=1e9, slo_tpot_ms=1e9)
    ok = bench.Result(ok=True, ttft_s=0.1, latency_s=0.5, output_tokens=5, prompt_tokens=3, itl_s=[0.1] * 4)
    bad = [bench.Result(error="HTTPError: not an HTTP/1.x status line: b''"), bench.Result(error="timeout")]
    rows = [bench.summarize(16.0, [ok, ok, *bad], 2.0, args), bench.summarize(math.inf, [ok], 1.0, args)]
    assert (rows[0]["completed"], rows[0]["failed"]) == (2, 2)
    text = bench.table(rows)
    assert " 2/4 " in text and " 1/1 " in text
    failed = [line for line in text.splitlines() if "failed" in line]
    assert failed == ["rate 16.0: 2 of 4 requests failed: HTTPError: not an HTTP/1.x status line: b''; timeout"]


def test_word_prompts_and_a_trace(server, tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    pairs = [(5, 3), (17, 2), (9, 4)]
    trace.write_text("\n".join(json.dumps({"input_len": a, "output_len": b}) for a, b in pairs) + "\n")
    run(["--url", server.url + "/", "--rate", "inf", "--num-prompts", "5", "--trace", str(trace), "--warmup", "0",
         "--out", str(tmp_path), "--no-progress"], capsys)
    (r,) = json.loads((tmp_path / "serve_bench.json").read_text())["results"]
    assert r["completed"] == r["requested"] == 5
    cycled = [pairs[i % 3] for i in range(5)]
    assert 5 <= r["total_output_tokens"] <= sum(b for _, b in cycled)    # words: EOS may stop one early
    assert r["total_prompt_tokens"] > sum(a for a, _ in cycled)            # words are several bytes each


def test_poisson_arrivals_are_seeded():
    rng_rate = 7.5
    t = bench.arrival_times(20000, rng_rate, seed=11)
    assert t == bench.arrival_times(20000, rng_rate, seed=11) and t != bench.arrival_times(20000, rng_rate, seed=12)
    gaps = np.diff(t)
    assert t[0] == 0 and (gaps >= 0).all()
    assert abs(gaps.mean() * rng_rate - 1) < 0.05            # exponential gaps of mean 1/rate ...
    assert abs(gaps.std() / gaps.mean() - 1) < 0.05          # ... whose std equals their mean
    slow = bench.arrival_times(100, 2.0, seed=11)
    fast = bench.arrival_times(100, 8.0, seed=11)
    assert np.allclose(np.array(slow) / 4, fast)             # one workload, scaled by the rate
    assert bench.arrival_times(5, math.inf, seed=0) == [0.0] * 5


@pytest.mark.parametrize("argv,flag", [
    (["--rate", "0"], "--rate"), (["--rate", "1,abc"], "--rate"), (["--rate", "nan"], "--rate"),
    (["--num-prompts", "0"], "--num-prompts"), (["--range-ratio", "1"], "--range-ratio"),
    (["--slo-ttft-ms", "-5"], "--slo-ttft-ms"), (["--url", "localhost:8000"], "--url"),
    (["--trace", "/nonexistent/trace.jsonl"], "--trace"), (["--offline-passes", "1"], "--offline-passes"),
    (["--client-procs", "0"], "--client-procs"), (["--client-procs", "2,x"], "--client-procs"),
    (["--temperature", "-0.5"], "--temperature"), (["--temperature", "3"], "--temperature"),
    (["--client-cpus", "x"], "--client-cpus"), (["--client-cpus", "0-4096"], "--client-cpus"),
])
def test_bad_flags_are_one_line(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and flag in err


def test_no_server_is_one_line(capsys):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]                 # bound, not listening: nothing answers there
        with pytest.raises(SystemExit) as e:
            bench.main(["--url", f"http://127.0.0.1:{port}", "--no-progress"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "--url" in err


@pytest.mark.parametrize("done_line,ok", [(True, True), (False, True)])
def test_a_stream_that_ends_after_its_finish_reason_counts(done_line, ok):
    """OpenAI ends a stream with `data: [DONE]`; some servers (transformers serve) just close it
    after the chunk with the finish_reason. Both are complete requests; a stream cut off before any
    finish_reason is not."""
    import asyncio

    def sse(chunks, done):
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + ("data: [DONE]\n\n" if done else "")
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    texts = [{"choices": [{"index": 0, "text": t}]} for t in ("a", " b", " c")]
    final = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}

    async def run(chunks, done):
        transport = httpx.MockTransport(lambda req: sse(chunks, done))
        async with httpx.AsyncClient(transport=transport) as client:
            return await bench.send(client, "http://x", "m", bench.Job(prompt="p", input_len=1, output_len=3), False)

    r = asyncio.run(run(texts + [final], done_line))
    assert r.ok == ok and r.error is None and r.output_tokens == 3 and len(r.itl_s) == 2
    cut = asyncio.run(run(texts[:2], False))             # closed mid-answer: a failure, and said so
    assert not cut.ok and "[DONE]" in cut.error
    # a token whose text is held back comes as text "": it is the first token (TTFT) and a token
    # of the ITLs; the finish chunk's "" is not a token
    held = [{"choices": [{"index": 0, "text": ""}]}] + texts
    r = asyncio.run(run(held + [final], done_line))
    assert r.ok and r.output_tokens == 4 and len(r.itl_s) == 3


def test_serve_and_offline_in_one_command(tmp_path, capsys):
    """--serve starts `python -m pagedlab serve ARGS` (engine core process), --offline runs the same
    requests through LLM.generate in a fresh process: served/offline is that ratio, the offline
    passes count the same tokens, and both split their steps into prompt and decode-only steps."""
    argv = ["--serve", "--model random:tiny --device cpu --slots 4 --max-model-len 256", "--offline",
            "--rate", "inf", "--num-prompts", "6", "--input-len", "10", "--output-len", "5",
            "--range-ratio", "0.5", "--ignore-eos", "--warmup", "0", "--out", str(tmp_path), "--no-progress",
            "--offline-passes", "3"]
    out = run(argv, capsys)
    data = json.loads((tmp_path / "serve_bench.json").read_text())
    [r] = data["results"]
    off = data["offline"]
    want = sum(j.output_len for j in bench.make_workload(bench.build_parser().parse_args(argv)))
    assert r["completed"] == 6 and r["total_output_tokens"] == want
    assert off["total_output_tokens"] == off["first_pass"]["total_output_tokens"] == want
    assert math.isclose(r["served_over_offline"], r["output_throughput"] / off["output_throughput"])
    passes = off["pass_throughputs"]                   # three passes; the median of the last two
    assert len(passes) == 3 and passes[0] == off["first_pass"]["output_throughput"]
    assert math.isclose(off["output_throughput"], sum(passes[1:]) / 2)   # two later passes: their mean
    for x in (r, off, off["first_pass"]):
        assert 1 <= x["prompt_steps"] <= 6 and x["decode_steps"] >= 1, x
        # the host's phases per step, served (the core's, through /metrics) and offline alike: inside the steps
        host, steps = x["host_ms_per_step"], x["prompt_steps"] + x["decode_steps"]
        step_ms = (x["prompt_steps"] * x["prompt_step_ms"] + x["decode_steps"] * x["decode_step_ms"]) / steps
        assert set(host) == {"schedule", "launch", "read", "accept"} and min(host.values()) >= 0
        assert 0 < sum(host.values()) <= step_ms * (1 + 1e-9), (host, step_ms)
        # and over the decode-only steps alone: inside those steps
        dec = x["host_ms_per_decode_step"]
        assert set(dec) == set(host) and min(dec.values()) >= 0
        assert 0 < sum(dec.values()) <= x["decode_step_ms"] * (1 + 1e-9), (dec, x["decode_step_ms"])
    assert "the host per step (ms): schedule" in out and "per decode-only step: schedule" in out
    # the core's busy window against the burst (one clock, time.monotonic): the way in, the busy
    # span with every step inside it, the way out -- adding up to the client's wall time
    b = r["busy"]
    assert b["periods"] >= 1 and b["start_s"] >= 0 and b["end_s"] >= 0 and b["span_s"] > 0
    assert math.isclose(b["start_s"] + b["span_s"] + b["end_s"], r["duration_s"], rel_tol=1e-6)
    if b["periods"] == 1:
        assert r["seconds"]["engine_step_seconds"] <= b["span_s"]
    assert f"the core started {1e3 * b['start_s']:.0f} ms after the first request" in out
    assert "the client's CPU" in out and len(r["client_cpu_s"]) == 1
    assert "served/offline" in out and "decode-only" in out
    assert f"offline {off['ttft_ms']['min']:.1f} ms" in out and f"{r['ttft_ms']['min']:.1f} ms" in out
    # TTFT p99: every pass's kept; the burst against the median of the passes after the first
    ttfts = off["pass_ttft_p99_ms"]
    assert len(ttfts) == 3 and ttfts[0] == off["first_pass"]["ttft_ms"]["p99"]
    assert math.isclose(off["ttft_p99_ms_median"], sum(ttfts[1:]) / 2)
    b = off["bursts"]
    assert b["bursts"] == 1 and b["served_ttft_p99_ms"] == r["ttft_ms"]["p99"]
    assert math.isclose(b["ttft_p99_ratio"], r["ttft_ms"]["p99"] / off["ttft_p99_ms_median"])
    assert math.isclose(b["tok_s_ratio"], r["served_over_offline"])
    assert f"TTFT p99 {b['served_ttft_p99_ms']:.0f} vs {b['offline_ttft_p99_ms']:.0f} ms" in out
    # request by request: each job's TTFT served and offline (the middle pass), by offline TTFT
    assert len(r["ttft_ms_each"]) == len(off["ttft_ms_each"]) == 6 and None not in r["ttft_ms_each"]
    each = sorted(r["ttft_ms_each"])
    assert each[-2] - 0.01 <= r["ttft_ms"]["p99"] <= each[-1] + 0.01
    waves = r["ttft_by_wave"]
    assert [w["offline_ms"] for w in waves] == sorted(off["ttft_ms_each"])
    by_offline = sorted(zip(off["ttft_ms_each"], r["ttft_ms_each"]))
    assert [w["served_ms"] for w in waves] == [s for _, s in by_offline]
    assert "TTFT served - offline, request by request" in out
    # the TTFT split by the server's own moments (--serve asks for them): one clock for the
    # machine's processes, so each part is >= 0 for every request, and the parts add up to the TTFT
    sp = r["ttft_split_ms"]
    assert set(sp) == {"way_in", "engine", "way_out"} and all(sp[k]["min"] >= 0 for k in sp), sp
    assert sp["engine"]["p50"] > 0
    assert abs(sum(sp[k]["mean"] for k in sp) - r["ttft_ms"]["mean"]) < 0.01 * r["ttft_ms"]["mean"]
    assert set(r["ttft_split_slowest_ms"]) == set(sp) and "TTFT split (ms, p50 / p99" in out
    each = r["ttft_split_each_ms"]                      # per request, in the jobs' order
    assert len(each) == 6 and all(len(e) == 4 for e in each)
    for e, ttft in zip(each, r["ttft_ms_each"]):
        assert abs(sum(e[:3]) - ttft) < 0.01 and e[3] >= e[0] + e[1] - 0.01   # its token came after it arrived
    # the front end's own stalls over the burst (loop_watch.py, through /metrics): counters, >= 0
    st = r["frontend_stalls"]
    assert set(st) == set(bench.FRONTEND_STALLS) and min(st.values()) >= 0, st
    assert st["frontend_stall_seconds"] >= st["frontend_long_stall_seconds"]
    assert "its loop stood still" in out and "frontend_stall" not in out.split("rate inf:")[1].split(";")[0]


def test_ttft_by_wave_finds_where_the_served_time_is_lost():
    """Served = offline + 3 ms for the requests answered first, + 40 ms for the later ones (shuffled
    job order, a failed request on each side): the groups by offline TTFT say so, in order."""
    rnd = random.Random(5)
    offline = [rnd.uniform(30, 1400) for _ in range(203)]
    cut = sorted(offline)[120]
    served = [o + (3.0 if o < cut else 40.0) + rnd.uniform(-0.5, 0.5) for o in offline]
    served[7], offline[11] = None, None
    waves = bench.ttft_by_wave(served, offline, groups=4)
    assert len(waves) == 4
    assert [w["offline_ms"] for w in waves] == sorted(w["offline_ms"] for w in waves)
    diffs = [w["served_minus_offline_ms"] for w in waves]
    assert abs(diffs[0] - 3) < 1 and abs(diffs[1] - 3) < 1 and abs(diffs[3] - 40) < 1, diffs
    assert all(w["served_ms"] > w["offline_ms"] for w in waves)
    assert bench.ttft_by_wave([None], [5.0]) == []


def test_temperature_reaches_every_request():
    """--temperature: each job carries it into its request body (greedy 0 by default)."""
    args = bench.build_parser().parse_args(["--num-prompts", "3", "--ignore-eos", "--temperature", "0.7"])
    jobs = bench.make_workload(args)
    assert [bench.request_body("m", j, True, True)["temperature"] for j in jobs] == [0.7] * 3
    greedy = bench.make_workload(bench.build_parser().parse_args(["--num-prompts", "2"]))
    assert [bench.request_body("m", j, False, False)["temperature"] for j in greedy] == [0.0, 0.0]

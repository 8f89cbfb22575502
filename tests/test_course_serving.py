"""Notebook 11's check (pagedlab/course/serving.py): the course's solution passes and is returned;
a stub, a parser that decodes chunks, and one that reads the whole body first each fail with a
message that names the case and gives a hint."""
import json

import pytest

from pagedlab.course import serving as course_serving
from pagedlab.course import CheckFailed


@pytest.fixture(autouse=True)
def _no_solutions(monkeypatch):
    monkeypatch.delenv("PAGEDLAB_SOLUTIONS", raising=False)


def test_solution_passes_and_is_returned(capsys):
    sol = course_serving.solution("sse_events")
    assert course_serving.check_sse_events(sol) is sol
    assert "\u2713 sse_events" in capsys.readouterr().out


def test_solutions_switch_uses_the_course_solution(monkeypatch):
    monkeypatch.setenv("PAGEDLAB_SOLUTIONS", "1")
    got = course_serving.check_sse_events(lambda chunks: iter(()))
    assert got.__name__ == "sse_events"


def test_stub_says_not_written():
    def stub(chunks):
        raise NotImplementedError("parse the event stream")
    with pytest.raises(CheckFailed, match="not written yet") as e:
        course_serving.check_sse_events(stub)
    assert "show_solution" in str(e.value)


def per_chunk(chunks):                   # decodes each network read on its own: cut events break it
    for c in chunks:
        for ev in c.decode("utf-8").split("\n\n"):
            if ev.startswith("data: ") and ev[6:] != "[DONE]":
                yield json.loads(ev[6:])


def whole_body(chunks):                  # right events, but nothing until the stream is over
    body = b"".join(chunks).decode("utf-8")
    for ev in body.split("\n\n"):
        if ev.startswith("data: "):
            if ev[6:] == "[DONE]":
                return
            yield json.loads(ev[6:])


@pytest.mark.parametrize("fn, words", [(per_chunk, "keep the unfinished rest in a buffer"), (whole_body, "as soon as")])
def test_wrong_parsers_fail_with_a_hint(fn, words):
    with pytest.raises(CheckFailed) as e:
        course_serving.check_sse_events(fn)
    assert "case:" in str(e.value) and words in str(e.value)


def test_admit_group_table_is_read_from_the_committed_measurement():
    """Notebook 11's admit-group table: every row is a burst of docs/serve_s11_admit{1,8}.json (the
    files the course ships), both groups are there (the notebook compares their first bursts)."""
    import json
    from pathlib import Path

    from pagedlab.course import serving as serving_course
    docs = Path(__file__).resolve().parent.parent / "docs"
    rows = serving_course.admit_group_table()
    assert {r["group"] for r in rows} == {1, 8} and {(r["group"], r["burst"]) for r in rows} >= {(1, 1), (8, 1)}
    for r in rows:
        res = json.loads((docs / f"serve_s11_admit{r['group']}.json").read_text())["results"][r["burst"] - 1]
        assert r["tokens_per_s"] == res["output_throughput"] and r["prompt_steps"] == res["prompt_steps"]
        assert r["ttft_p99_ms"] == res["ttft_ms"]["p99"] and r["decode_step_ms"] == res["decode_step_ms"]


def test_host_contention_table_is_read_from_the_committed_measurement():
    """Notebook 11's host table: each row is the median of an arm's passes in
    docs/host_contention_s15.json, both runs, the arms the notebook compares (alone and 8 spinners)."""
    import json
    import statistics
    from pathlib import Path

    from pagedlab.course import serving as serving_course
    data = json.loads((Path(__file__).resolve().parent.parent / "docs" / "host_contention_s15.json").read_text())
    rows = serving_course.host_contention_table()
    assert {(r["run"], r["arm"]) for r in rows} >= {(1, "alone"), (1, "burn8"), (2, "alone"), (2, "burn8")}
    for r in rows:
        passes = data[f"run{r['run']}"][r["arm"]]
        assert r["passes"] == len(passes) >= 3
        assert r["tokens_per_s"] == statistics.median(x["tok_s"] for x in passes)
        assert r["ttft_p99_ms"] == statistics.median(x["ttft_p99_ms"] for x in passes)
        assert r["decode_step_ms"] == statistics.median(x["decode_step_ms"] for x in passes)


# -- several front ends (serve --api-servers N): the mailbox's two rules -------------------------

def test_numbering_and_split_solutions_pass_and_are_the_servers_rules(capsys):
    """The course's frontend_ids / owner / split_step pass, and the rules they are checked against are
    the ones the server runs: AsyncLLM numbers with core_mailbox.request_ids, the mailbox cuts with split."""
    import itertools

    from pagedlab import core_mailbox
    ids, own = course_serving.solution("frontend_ids"), course_serving.solution("owner")
    assert course_serving.check_numbering(ids, own) == (ids, own)
    split = course_serving.solution("split_step")
    assert course_serving.check_split_step(split) is split
    out = capsys.readouterr().out
    assert "\u2713 frontend_ids and owner" in out and "\u2713 split_step" in out
    assert list(itertools.islice(core_mailbox.request_ids(2, 3), 4)) == [2, 5, 8, 11]
    assert [core_mailbox.owner(r, 3) for r in (2, 5, 8, 9, 10)] == [2, 2, 2, 0, 1]


def test_numbering_stubs_say_not_written():
    def stub(*a):
        raise NotImplementedError("number")
    with pytest.raises(CheckFailed, match="frontend_ids is not written yet"):
        course_serving.check_numbering(stub, course_serving.solution("owner"))
    with pytest.raises(CheckFailed, match="owner is not written yet"):
        course_serving.check_numbering(course_serving.solution("frontend_ids"), stub)
    with pytest.raises(CheckFailed, match="split_step is not written yet"):
        course_serving.check_split_step(stub)


@pytest.mark.parametrize("ids, own, words", [
    (lambda f, n, c: [f + k for k in range(c)], None, "after f comes f + n"),
    (lambda f, n, c: [f * n + k for k in range(1, c + 1)], None, "first id is f itself"),
    (None, lambda rid, n: rid // n, "rid // n counts how many rounds"),
    (None, lambda rid, n: rid % (n + 1), "owner(f + k * n, n) must be f"),
])
def test_wrong_numbering_fails_with_a_hint(ids, own, words):
    ids = ids or course_serving.solution("frontend_ids")
    own = own or course_serving.solution("owner")
    with pytest.raises(CheckFailed) as e:
        course_serving.check_numbering(ids, own)
    assert words in str(e.value)


def parts_for_all(rids, toks, n):             # an (empty) part for every front end: empty messages
    parts = {f: ([], []) for f in range(n)}
    for r, t in zip(rids, toks):
        parts[r % n][0].append(r)
        parts[r % n][1].append(t)
    return parts


def by_quotient(rids, toks, n):               # rid // n: the round, not the owner
    parts = {}
    for r, t in zip(rids, toks):
        ids, cols = parts.setdefault(r // n, ([], []))
        ids.append(r)
        cols.append(t)
    return parts


def tokens_sorted(rids, toks, n):             # the ids right, the token column out of line with them
    parts = {}
    for r, t in zip(rids, sorted(toks)):
        ids, cols = parts.setdefault(r % n, ([], []))
        ids.append(r)
        cols.append(t)
    return parts


def ids_sorted(rids, toks, n):                # each part's requests in id order, not the step's
    parts = {}
    for r, t in sorted(zip(rids, toks)):
        ids, cols = parts.setdefault(r % n, ([], []))
        ids.append(r)
        cols.append(t)
    return parts


def drops_empty(rids, toks, n):               # a request that ended without a token is left out
    parts = {}
    for r, t in zip(rids, toks):
        if t:
            ids, cols = parts.setdefault(r % n, ([], []))
            ids.append(r)
            cols.append(t)
    return parts


def mutates(rids, toks, n):                   # right parts, but the step's lists emptied on the way
    parts = {}
    while rids:
        r, t = rids.pop(0), toks.pop(0)
        ids, cols = parts.setdefault(r % n, ([], []))
        ids.append(r)
        cols.append(t)
    return parts


@pytest.mark.parametrize("fn, words", [
    (parts_for_all, "empty message"), (by_quotient, "(rid // n?)"), (tokens_sorted, "move them together"),
    (ids_sorted, "the step's order"), (drops_empty, "a request with no new token"),
    (mutates, "changed the step's lists"), (lambda r, t, n: [], "not a dict"),
    (lambda r, t, n: {0: r} if r else {}, "not a pair"),
])
def test_wrong_splits_fail_with_a_hint(fn, words):
    with pytest.raises(CheckFailed) as e:
        course_serving.check_split_step(fn)
    assert "case:" in str(e.value) and words in str(e.value)


def test_first_answer_table_is_read_from_the_committed_measurement():
    """Notebook 11's "several front ends" table: one row per burst (rate inf) of
    docs/serve_s15_phases.json and serve_s15_decode_phases.json, with each file's offline TTFT."""
    import json
    from pathlib import Path

    docs = Path(__file__).resolve().parent.parent / "docs"
    rows = course_serving.first_answer_table()
    assert {r["file"] for r in rows} == {"serve_s15_phases.json", "serve_s15_decode_phases.json"}
    for name in {r["file"] for r in rows}:
        d = json.loads((docs / name).read_text())
        bursts = [r for r in d["results"] if r["rate"] == "inf"]
        mine = [r for r in rows if r["file"] == name]
        assert [r["ttft_min_ms"] for r in mine] == [b["ttft_ms"]["min"] for b in bursts]
        assert [r["client_procs"] for r in mine] == [b["client_procs"] for b in bursts]
        assert all(r["offline_ttft_min_ms"] == d["offline"]["ttft_ms"]["min"] for r in mine)


def test_front_ends_table_is_read_from_the_committed_measurement():
    """Notebook 11's measured answer to `--api-servers`: one row per burst of docs/serve_s17_api*.json,
    the front ends read from each file's serve command, the numbers the file's own."""
    import json
    from pathlib import Path

    docs = Path(__file__).resolve().parent.parent / "docs"
    rows = course_serving.front_ends_table()
    assert {r["file"] for r in rows} == set(course_serving.FRONT_END_RUNS)
    for name in course_serving.FRONT_END_RUNS:
        d = json.loads((docs / name).read_text())
        mine = [r for r in rows if r["file"] == name]
        want_n = 4 if name.startswith("serve_s17_api4") else 1
        want_clients = 4 if name.endswith("c4.json") else 1
        assert [r["front_ends"] for r in mine] == [want_n] * len(d["results"])
        assert [r["client_procs"] for r in mine] == [want_clients] * len(d["results"])
        assert [r["tokens_per_s"] for r in mine] == [b["output_throughput"] for b in d["results"]]
        assert [r["ttft_p99_ms"] for r in mine] == [b["ttft_ms"]["p99"] for b in d["results"]]
        for r in mine:       # served/offline as the file computed it, against its own offline passes
            assert r["offline_ttft_p99_ms"] == d["offline"]["ttft_p99_ms_median"]
            assert abs(r["served_over_offline"] - r["tokens_per_s"] / r["offline_tokens_per_s"]) < 1e-6


def test_clock_table_is_read_from_the_committed_bursts():
    """Notebook 11's before/after of the benchmark's clock: one row per burst of each file, in the
    files' order, the numbers the files' own; only session 20's bursts know the core's start."""
    import json
    from pathlib import Path

    docs = Path(__file__).resolve().parent.parent / "docs"
    rows = course_serving.clock_table()
    names = [name for name, _ in course_serving.CLOCK_RUNS]
    assert [r["file"] for r in rows] == [n for n in names
                                         for _ in json.loads((docs / n).read_text())["results"]]
    for name in names:
        d = json.loads((docs / name).read_text())
        mine = [r for r in rows if r["file"] == name]
        assert [r["tokens_per_s"] for r in mine] == [b["output_throughput"] for b in d["results"]]
        assert [r["served_over_offline"] for r in mine] == [b["served_over_offline"] for b in d["results"]]
        assert all(r["offline_ttft_p99_ms"] == d["offline"]["ttft_p99_ms_median"] for r in mine)
        starts = [r["core_start_ms"] for r in mine]
        if name.startswith("serve_s19"):
            assert starts == [None] * len(mine)
        else:
            assert starts == [1e3 * b["busy"]["start_s"] for b in d["results"]] and all(0 < s < 1e3 for s in starts)


def test_ttft_split_table_is_read_from_the_committed_bursts():
    """Notebook 11's way in / engine / way out of a burst's TTFT: one row per burst of each file,
    in the files' order, every number the file's own (the parts' p99s, the offline passes' median
    TTFT p99)."""
    import json
    from pathlib import Path

    docs = Path(__file__).resolve().parent.parent / "docs"
    rows = course_serving.ttft_split_table()
    names = [name for name, _ in course_serving.SPLIT_RUNS]
    files = {n: json.loads((docs / n).read_text()) for n in names}
    assert [r["file"] for r in rows] == [n for n in names for _ in files[n]["results"]]
    for name, d in files.items():
        mine = [r for r in rows if r["file"] == name]
        assert [r["burst"] for r in mine] == list(range(1, len(d["results"]) + 1))
        for r, b in zip(mine, d["results"]):
            assert r["ttft_p99_ms"] == b["ttft_ms"]["p99"]
            assert r["offline_ttft_p99_ms"] == d["offline"]["ttft_p99_ms_median"]
            assert (r["way_in_p99_ms"], r["engine_p99_ms"], r["way_out_p99_ms"]) == tuple(
                b["ttft_split_ms"][k]["p99"] for k in ("way_in", "engine", "way_out"))
            # the parts are of the same requests: none is above the whole's slowest
            assert max(r["way_in_p99_ms"], r["engine_p99_ms"], r["way_out_p99_ms"]) <= max(b["ttft_ms_each"])

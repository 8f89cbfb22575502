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

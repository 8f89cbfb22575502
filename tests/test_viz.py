"""pagedlab.viz and pagedlab.figures: the drawings work on real traces, headless."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from pagedlab import LLM, course, viz  # noqa: E402


@pytest.fixture(scope="module")
def trace():
    llm = LLM("random:tiny", device="cpu", max_num_seqs=3, num_blocks=10, trace=True,
              show_progress=False, attention_backend="torch")
    prompts, params = course.toy_workload(6, prompt_len=(10, 30), new_tokens=(10, 30), seed=3)
    llm.generate(prompts, params)
    return llm.trace


def test_toy_workload_is_deterministic():
    a, b = course.toy_workload(5, seed=7), course.toy_workload(5, seed=7)
    assert a[0] == b[0] and [p.max_new_tokens for p in a[1]] == [p.max_new_tokens for p in b[1]]
    assert all(3 <= t < 500 for p in a[0] for t in p)


def test_choose_model_small(monkeypatch):
    monkeypatch.delenv("PAGEDLAB_MODEL", raising=False)
    assert course.choose_model(small=True, verbose=False) == "random:tiny"
    monkeypatch.setenv("PAGEDLAB_MODEL", "random:llama-3.2-1b")
    assert course.choose_model(small=True, verbose=False) == "random:llama-3.2-1b"


def test_drawings(trace):
    figs = [viz.draw_timeline(trace), viz.draw_timelines({"a": trace, "b": trace}),
            viz.draw_utilization({"a": trace}), viz.draw_pool_usage(trace),
            viz.draw_block_table(trace[5].block_table, trace[5].slot_request),
            viz.draw_step(trace, 0), viz.draw_step(trace, len(trace) - 1),
            viz.draw_bars({"x": 1.0, "y": 2.0}, "units"),
            viz.draw_fragmentation({"c": 10, "p": 10}, {"c": 40, "p": 12}),
            viz.draw_bandwidth({"gqa": {"1x64": 10.0}, "naive": {"1x64": 2.0}}, 20.0),
            viz.draw_lines({"a": ([1, 2], [3, 4])}, "x", "y"),
            viz.draw_safetensors_layout(100, [("a", 0, 50), ("b", 50, 80)], 188),
            viz.draw_overlap(0.13, 0.91)]
    for f in figs:
        assert len(viz.fig_to_png(f)) > 1000
        plt.close(f)


def test_pool_owners_match_pool_used(trace):
    for s in trace.steps:
        owners = viz.pool_owners(s.block_table, s.slot_request, s.pool_total)
        assert sum(o is not None for o in owners) == s.pool_used


def test_explore_trace_static_fallback(trace, monkeypatch):
    monkeypatch.setenv("PAGEDLAB_STATIC", "1")
    fig = viz.explore_trace(trace, start=3)
    assert fig is not None
    plt.close(fig)
    with pytest.raises(ValueError):
        viz.explore_trace(type(trace)(2, 16, 4))


def test_figures_command(tmp_path):
    from pagedlab import figures
    paths = figures.make_all(tmp_path)
    assert {p.name for p in paths} >= {"slot_timeline.png", "static_vs_continuous.png",
                                        "block_table.png", "trace_step.png", "preemption_pool.png",
                                        "paging_concept.png", "slot_states.png", "preemption_cycle.png",
                                        "gqa_heads.png", "online_softmax.png", "llama_layer.png"}
    assert all(p.stat().st_size > 5000 for p in paths)


@pytest.mark.parametrize("host,gpu", [(0.13, 0.91), (0.5, 0.3), (0.2, 0.2)])
def test_overlap_schedule(host, gpu):
    n = 7
    seq = viz.overlap_schedule(host, gpu, n, overlap=False)
    ovl = viz.overlap_schedule(host, gpu, n, overlap=True)
    assert max(s[3] for s in seq) == pytest.approx(n * (host + gpu))
    # overlapped: bound by the slower side, plus one of the other to fill the pipe
    assert max(s[3] for s in ovl) == pytest.approx(min(host, gpu) + n * max(host, gpu))
    for spans in (seq, ovl):
        gpu_spans = sorted((a, b) for lane, _, a, b in spans if lane == "GPU")
        host_spans = sorted((a, b) for lane, _, a, b in spans if lane == "host")
        for lane in (gpu_spans, host_spans):           # a lane does one thing at a time
            assert all(b0 <= a1 + 1e-12 for (_, b0), (a1, _) in zip(lane, lane[1:]))
        for k in range(n):                              # a step runs after its host work
            h = [s for s in spans if s[0] == "host" and s[1] == k][0]
            g = [s for s in spans if s[0] == "GPU" and s[1] == k][0]
            assert g[2] >= h[3] - 1e-12
            if k >= 2:       # the host reads step k-2's token before its work for step k ends
                assert h[3] >= [s for s in spans if s[0] == "GPU" and s[1] == k - 2][0][3]


# ----------------------------------------------------------------------------- the explorer's promises
def test_palette_distinct_for_64_requests():
    colors = [viz.request_color(r) for r in range(64)]
    assert len(set(colors)) == 64
    assert viz.IDLE not in colors and viz.FREE not in colors and viz.SHARED not in colors
    assert viz.request_color(64) == viz.request_color(0)          # then it repeats, by id modulo 64
    assert viz.req_name(7) == "req 7"


@pytest.fixture(scope="module")
def tight_trace():
    llm = LLM("random:tiny", device="cpu", max_num_seqs=4, num_blocks=9, trace=True,
              show_progress=False, attention_backend="torch")
    prompts, params = course.toy_workload(8, seed=3, prompt_len=(10, 30), new_tokens=(20, 40))
    outs = llm.generate(prompts, params)
    assert sum(o.num_preemptions for o in outs) > 0                  # the fixture must preempt
    return llm.trace


def test_timeline_marks_preemptions_where_the_trace_records_them(tight_trace):
    t = tight_trace
    fig = viz.draw_timeline(t)
    ax = fig.axes[0]
    marks = [c for c in ax.collections if c.get_gid() == "preemption"]
    assert len(marks) == 1
    xs = sorted(round(float(x)) for x, _ in marks[0].get_offsets())
    want = sorted(i for i, s in enumerate(t.steps) for _ in s.preempted)
    assert xs == want and want
    for x, y in marks[0].get_offsets():             # in the row of the slot the victim held just before
        x, row = round(float(x)), int(y)
        assert any(t.steps[x - 1].slot_request[row] == rid for rid in t.steps[x].preempted)
    assert ax.get_legend() is not None and any("preempted" in tx.get_text() for tx in ax.get_legend().get_texts())
    plt.close(fig)


def test_step_has_legend_naming_requests_and_colours_them_apart(tight_trace):
    t = tight_trace
    i = next(i for i, s in enumerate(t.steps) if s.preempted)
    fig = viz.draw_step(t, i, show_time=False)
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    texts = [tx.get_text() for lg in legends for tx in lg.get_texts()]
    s = t.steps[i]
    in_view = {r for r in list(s.slot_request) + list(s.queue) if r is not None}
    assert {f"req {r}" for r in in_view} <= set(texts)
    assert "free block" in texts and "past the pool" in texts and "preempted" in texts
    swatches = {tx.get_text(): h.get_facecolor() for lg in legends
                for tx, h in zip(lg.get_texts(), lg.legend_handles) if tx.get_text().startswith("req ")}
    assert len({tuple(c) for c in swatches.values()}) == len(swatches)   # distinct requests, distinct colours
    plt.close(fig)


@pytest.mark.parametrize("n", [9, 64, 100, 1000])
def test_pool_panel_any_size(n):
    owners = [None] * n
    for b in range(0, n, 3):
        owners[b] = b % 5
    fig = viz.draw_pool(owners)
    ax = fig.axes[0]
    if n <= viz.SMALL_POOL:                 # numbered grid; the cells past the pool are not "free"
        free = [p for p in ax.patches if p.get_gid() == "free"]
        missing = [p for p in ax.patches if p.get_gid() == "missing"]
        assert len(free) == sum(o is None for o in owners)
        ncols = round(ax.get_xlim()[1])
        assert len(missing) == (-n) % ncols
        assert all(p.get_facecolor() != free[0].get_facecolor() for p in missing)
        assert {tx.get_text().split("\n")[0] for tx in ax.texts} == {str(b) for b in range(n)}
    else:                                   # a compact bar, one column per block
        assert ax.images and ax.images[0].get_array().shape[1] == n and not ax.texts
    assert len(viz.fig_to_png(fig)) > 1000
    plt.close(fig)

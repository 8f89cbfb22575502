"""cuda_graph.collector_paused: no garbage collection inside graph captures (a dropped engine kept
alive by a reference cycle must not be torn down while another engine's stream captures), and
what is already dead is collected before they start."""
import contextlib
import gc
import weakref

import torch

from helpers import tiny_llm
from pagedlab import cuda_graph
from pagedlab.cuda_graph import collector_paused


class Engineish:
    pass


def test_dead_cycles_go_first_and_nothing_is_collected_inside():
    was = gc.isenabled()
    try:
        gc.enable()
        a = Engineish()
        a.me = a                          # a cycle: only the collector frees it
        dead = weakref.ref(a)
        del a
        with collector_paused():
            assert dead() is None         # collected on entry
            assert not gc.isenabled()     # ... and no automatic collection inside
            b = Engineish()
            b.me = b
            later = weakref.ref(b)
            del b
            for _ in range(3 * gc.get_threshold()[0]):     # far past the young generation's threshold
                Engineish().me = None
            assert later() is not None    # still there: nothing ran
        assert gc.isenabled()
        gc.collect()
        assert later() is None
        gc.disable()                      # a caller that had it off keeps it off
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()


def test_every_capture_runs_with_the_collector_paused(monkeypatch):
    """DecodeGraphs._capture_all (CUDA only) with CUDA's stream and graph calls stood in for: each
    warm-up and captured step runs with the collector off, and it is on again afterwards; every
    capture in capture_error_mode "thread_local" (another thread's engine may step meanwhile)."""
    llm = tiny_llm(cuda_graphs="eager", max_num_seqs=4)
    graphs = llm.engine.runner.graphs
    seen = []
    monkeypatch.setattr(graphs, "_run", lambda b: seen.append((b, gc.isenabled())) or (None, None))

    class Stream:
        def wait_stream(self, other):
            pass

    class Graph:
        def pool(self):
            return "pool"

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    modes = []           # and each capture forbids CUDA calls to its own thread only
    monkeypatch.setattr(torch.cuda, "graph", lambda g, pool=None, stream=None, capture_error_mode="global":
                        modes.append(capture_error_mode) or contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    was = gc.isenabled()
    gc.enable()
    try:
        graphs._capture_all()
        assert gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
    assert {b for b, _ in seen} == set(graphs.sizes) and len(seen) == 3 * len(graphs.sizes)
    assert not any(on for _, on in seen)
    assert modes == ["thread_local"] * len(graphs.sizes)
    assert cuda_graph.collector_paused is collector_paused

"""bench/timeline.py's phases(): a profiler trace cut into the prompt step, the graph replays, the
gaps between them (and what ran there) and the tail -- on a hand-made trace with known answers."""
from pagedlab.bench.timeline import _busy, phases


def ev(cat, name, ts, dur, corr=None):
    e = dict(ph="X", cat=cat, name=name, ts=ts, dur=dur)
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def test_phases_of_a_made_up_run():
    events = [ev("user_annotation", "run", 0, 1000),
              ev("cuda_runtime", "cudaLaunchKernel", 5, 2, 1), ev("kernel", "prefill_a", 10, 30, 1),
              ev("cuda_runtime", "cudaLaunchKernel", 8, 2, 2), ev("kernel", "prefill_b", 50, 40, 2),
              ev("cuda_runtime", "cudaStreamSynchronize", 20, 75),
              ev("cuda_runtime", "cudaGraphLaunch", 100, 5, 3),
              ev("kernel", "g1", 110, 100, 3), ev("kernel", "g2", 215, 85, 3),       # replay 1: 110-300
              ev("cuda_runtime", "cudaMemcpyAsync", 150, 3, 4), ev("gpu_memcpy", "Memcpy HtoD", 304, 2, 4),
              ev("cuda_runtime", "cudaGraphLaunch", 200, 5, 5),
              ev("kernel", "g1", 310, 100, 5), ev("kernel", "g2", 410, 90, 5),       # replay 2: 310-500
              ev("cuda_runtime", "cudaGraphLaunch", 480, 5, 6),
              ev("kernel", "g1", 520, 200, 6),                                        # replay 3: 520-720
              ev("cuda_runtime", "cudaEventSynchronize", 600, 121),
              ev("kernel", "outside", 2000, 5, 7)]                                    # after the window
    p = phases(events, "run")
    assert p["wall_us"] == 1000 and p["replays"] == 3
    assert p["before_first_replay"] == dict(host_us=110, gpu_busy_us=70, gpu_ops=2, kernels=2)
    assert p["first_replay_us"] == 190 and p["replay_us"]["n"] == 2 and p["replay_us"]["median"] == 195
    assert p["gaps_us"]["sum"] == 30 and p["gaps_us"]["max"] == 20    # 300->310, 500->520
    assert p["idle_us"]["sum"] == 28                                  # the copy ran 2 of the first 10
    assert p["between_replays_gpu_us"] == {"gpu_memcpy: Memcpy HtoD": 2}
    assert p["ahead_us"]["min"] == 40 and p["ahead_us"]["max"] == 110  # 310-200, 520-480
    assert p["after_last_gpu_us"] == 280
    assert p["host_sync"] == {"decode: cudaEventSynchronize": dict(calls=1, us=121),
                              "decode: cudaMemcpyAsync": dict(calls=1, us=3),
                              "prompt: cudaStreamSynchronize": dict(calls=1, us=75)}


def test_busy_merges_overlaps():
    assert _busy([(0, 10), (5, 12), (20, 21)]) == 13
    assert _busy([]) == 0

"""Tensor and data parallelism on CPU (gloo, worker processes): the same tokens as one process,
the randomized-stream invariants, failures and interrupts handled, no process left behind."""
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from helpers import random_prompts, tiny_llm
from pagedlab import SamplingParams, tiny_config
from pagedlab.parallel.data_parallel import assign
from pagedlab.parallel.group import WorkerFailed
from pagedlab.parallel.shard import (check_split, column_parallel_linear, row_parallel_linear,
                                     shard, shard_checkpoint, vocab_parallel_embedding,
                                     vocab_parallel_logits)
from test_scheduler import check_invariants, run_stream

CONFIG = tiny_config(tie_word_embeddings=False)        # a separate LM head: both vocab cuts run


def workload(n=7, seed=3):
    rng = torch.Generator().manual_seed(seed)
    prompts = random_prompts(n, 512, rng, lo=1, hi=60)
    rnd = random.Random(seed)
    greedy = [SamplingParams(max_new_tokens=rnd.randint(1, 20), ignore_eos=rnd.random() < 0.5) for _ in prompts]
    sampled = [SamplingParams(max_new_tokens=rnd.randint(1, 20), temperature=0.9, top_p=0.9,
                              seed=None if i % 2 else rnd.randrange(100)) for i in range(n)]
    return prompts, greedy, sampled


@pytest.fixture(scope="module")
def reference():
    prompts, greedy, sampled = workload()
    llm = tiny_llm(config=CONFIG, max_num_seqs=3)
    return [o.token_ids for o in llm.generate(prompts, greedy)], [o.token_ids for o in llm.generate(prompts, sampled)]


def no_children():
    for _ in range(100):
        if not multiprocessing.active_children():
            return True
        time.sleep(0.1)
    return False


# -- the arithmetic --------------------------------------------------------------------------
def test_sharded_layers_equal_the_whole_layer():
    """Column-then-row parallel, vocab-parallel embedding and logits, with N simulated ranks."""
    g = torch.Generator().manual_seed(0)
    for n in (2, 3):
        x = torch.randn(5, 12, generator=g, dtype=torch.float64)
        w1, w2 = torch.randn(18, 12, generator=g, dtype=torch.float64), torch.randn(7, 18, generator=g, dtype=torch.float64)
        partials = [row_parallel_linear(column_parallel_linear(x, shard(w1, "rows", r, n)), shard(w2, "cols", r, n),
                                        lambda t: None) for r in range(n)]
        torch.testing.assert_close(sum(partials), x @ w1.t() @ w2.t())
        emb = torch.randn(30, 4, generator=g, dtype=torch.float64)
        ids = torch.tensor([0, 29, 10, 11, 19, 20, 5])
        parts = [vocab_parallel_embedding(ids, shard(emb, "rows", r, n), r, lambda t: None) for r in range(n)]
        torch.testing.assert_close(sum(parts), emb[ids])
        logit_parts = [x[:, :4] @ shard(emb, "rows", r, n).t() for r in range(n)]
        full = vocab_parallel_logits(x[:, :4], shard(emb, "rows", 0, n), lambda t: torch.cat(logit_parts, -1))
        torch.testing.assert_close(full, x[:, :4] @ emb.t())


def test_indivisible_split_is_refused_naming_the_dimension():
    smol = tiny_config(num_heads=9, num_kv_heads=3, hidden_size=576, head_dim=64, intermediate_size=1536,
                       vocab_size=49152, name="smollm2-shaped")
    check_split(smol, 3)
    with pytest.raises(ValueError, match=r"num_heads \(query heads\) = 9.*num_kv_heads \(KV heads\) = 3.*sizes that work: \[1, 3\]"):
        check_split(smol, 2)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="integer >= 1"):
            check_split(smol, bad)
    ck = shard_checkpoint({"model.layers.0.self_attn.o_proj.weight": torch.zeros(4, 6)}, 1, 2)
    assert ck["model.layers.0.self_attn.o_proj.weight"].shape == (4, 3)


def test_router_balances_by_estimated_work():
    assert assign([10, 10, 10, 10], 2) == [0, 1, 0, 1]
    assert assign([100, 1, 1, 1, 1], 2) == [0, 1, 1, 1, 1]
    where = assign([random.Random(1).randint(1, 50) for _ in range(200)], 3)
    assert set(where) == {0, 1, 2}


def test_bad_sizes_and_plugins_fail_before_any_process_starts():
    for kw in (dict(tensor_parallel_size=0), dict(data_parallel_size=-2), dict(tensor_parallel_size=1.5),
               dict(data_parallel_size=True)):
        with pytest.raises(ValueError, match="must be an integer >= 1"):
            tiny_llm(config=CONFIG, **kw)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 does not divide"):
        tiny_llm(config=CONFIG, tensor_parallel_size=4)        # 2 KV heads
    with pytest.raises(ValueError, match="cannot be combined"):
        tiny_llm(config=CONFIG, tensor_parallel_size=2, decode_kernel=lambda *a: None)
    assert no_children()


# -- same tokens as one process --------------------------------------------------------------
@pytest.mark.parametrize("tp,dp", [(2, 1), (1, 2)])
def test_parallel_gives_the_one_process_tokens(tp, dp, reference):
    prompts, greedy, sampled = workload()
    with tiny_llm(config=CONFIG, max_num_seqs=3, tensor_parallel_size=tp, data_parallel_size=dp) as llm:
        assert [o.token_ids for o in llm.generate(prompts, greedy)] == reference[0]
        if dp > 1:              # the router draws seeds as one engine would: sampling matches too
            assert [o.token_ids for o in llm.generate(prompts, sampled)] == reference[1]
            with pytest.raises(ValueError, match="data_parallel_size > 1"):
                next(llm.stream(prompts[0]))
            from pagedlab.async_llm import AsyncLLM
            with pytest.raises(ValueError, match="data_parallel_size > 1"):
                AsyncLLM(llm)
        else:                   # TP sums in another order: sampling may part at near-ties only
            out = llm.generate(prompts, sampled)
            assert sum(o.token_ids == r for o, r in zip(out, reference[1])) >= len(prompts) - 1
            assert sum(len(o.token_ids) for o in out) > 0
    assert no_children()
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(prompts[0])


def test_tensor_parallel_randomized_stream_keeps_every_invariant():
    """Requests joining a running TP=2 engine, a pool small enough to preempt: every invariant holds
    on rank 0 after every step, and the tokens equal the single-process run of the same stream."""
    rng = torch.Generator().manual_seed(11)
    prompts = random_prompts(12, 512, rng, lo=1, hi=50)
    params = [SamplingParams(max_new_tokens=int(torch.randint(1, 25, (1,), generator=rng))) for _ in prompts]
    arrivals = [int(torch.randint(0, 12, (1,), generator=rng)) for _ in prompts]
    kw = dict(config=CONFIG, max_num_seqs=4, block_size=4, num_blocks=24)
    want = run_stream(tiny_llm(**kw), prompts, params, arrivals)
    with tiny_llm(tensor_parallel_size=2, **kw) as llm:
        got = run_stream(llm, prompts, params, arrivals)
        assert sum(r.num_preemptions for r in llm.engine.scheduler.requests.values()) >= 0
        check_invariants(llm.engine)
    assert got == want


def test_smollm2_tp3_and_dp2_match_one_process(smollm2, smollm2_llm):
    """SmolLM2's 9 query / 3 KV heads: TP=3 splits it, TP=2 is refused naming the heads."""
    from pagedlab import LLM
    from conftest import DEMO_PROMPTS
    sp = SamplingParams(max_new_tokens=16)
    want = [o.token_ids for o in smollm2_llm.chat(DEMO_PROMPTS[:3], sp)]
    kw = dict(checkpoint=smollm2, device="cpu", max_num_seqs=4, max_model_len=512, show_progress=False)
    with pytest.raises(ValueError, match=r"num_kv_heads \(KV heads\) = 3"):
        LLM(tensor_parallel_size=2, **kw)
    for tp, dp in ((3, 1), (1, 2)):
        with LLM(tensor_parallel_size=tp, data_parallel_size=dp, **kw) as llm:
            outs = llm.chat(DEMO_PROMPTS[:3], sp)
            assert [o.token_ids for o in outs] == want, (tp, dp)
            assert all(o.finish_reason in ("stop", "length") for o in outs)
    assert no_children()


# -- failures, interrupts, shutdown ------------------------------------------------------------
@pytest.mark.parametrize("tp,dp,at", [(2, 1, "1:3"), (1, 2, "1:1")])
def test_a_rank_that_raises_stops_the_engine_cleanly(tp, dp, at, monkeypatch, reference):
    monkeypatch.setenv("PAGEDLAB_TEST_FAIL_RANK", at)
    prompts, greedy, _ = workload()
    llm = tiny_llm(config=CONFIG, max_num_seqs=3, tensor_parallel_size=tp, data_parallel_size=dp)
    with pytest.raises(WorkerFailed, match=r"rank 1 failed(.|\n)*injected failure on rank 1(.|\n)*create a new LLM"):
        llm.generate(prompts, greedy)
    assert no_children(), "a worker outlived the failure"
    with pytest.raises(RuntimeError, match="create a new LLM"):
        llm.generate(prompts, greedy)
    llm.close()                                                 # a second close is harmless
    monkeypatch.delenv("PAGEDLAB_TEST_FAIL_RANK")
    with tiny_llm(config=CONFIG, max_num_seqs=3, tensor_parallel_size=tp, data_parallel_size=dp) as again:
        assert [o.token_ids for o in again.generate(prompts, greedy)] == reference[0]


def test_ctrl_c_during_a_tensor_parallel_run_loses_nothing():
    """SIGINT arrives while rank 0 and its worker are mid-run: generate() stops with
    KeyboardInterrupt, nothing is left running, and the next generate gives the right tokens."""
    rng = torch.Generator().manual_seed(5)
    prompts = random_prompts(10, 512, rng, lo=20, hi=60)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    want = [o.token_ids for o in tiny_llm(config=CONFIG, max_num_seqs=3).generate(prompts, params)]
    landed = 0
    with tiny_llm(config=CONFIG, max_num_seqs=3, tensor_parallel_size=2) as llm:
        t0 = time.perf_counter()
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
        run_s = time.perf_counter() - t0
        for frac in (0.05, 0.3, 0.6):
            timer = threading.Timer(run_s * frac, os.kill, (os.getpid(), signal.SIGINT))
            timer.start()
            try:
                llm.generate(prompts, params)
            except KeyboardInterrupt:
                landed += 1
            timer.join()
            s = llm.engine.scheduler
            assert s.allocator.num_used == 0 and not s.admitted and not s.waiting
            check_invariants(llm.engine)
            assert [o.token_ids for o in llm.generate(prompts, params)] == want
        assert len(multiprocessing.active_children()) == 1
    assert landed == 3, "an interrupt arrived after its generate() had finished"
    assert no_children()


def test_workers_do_not_outlive_a_killed_rank_0(tmp_path):
    """rank 0 SIGKILLed (no clean-up runs at all): its workers notice the broken link and exit."""
    script = tmp_path / "victim.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from helpers import tiny_llm
        from pagedlab import tiny_config
        if __name__ == "__main__":
            llm = tiny_llm(config=tiny_config(), tensor_parallel_size=2, data_parallel_size=2)
            llm.generate([[5, 6, 7]])
            print(" ".join(str(p.pid) for p in llm._workers.procs), flush=True)
            time.sleep(120)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    pids = [int(x) for x in proc.stdout.readline().split()]
    assert len(pids) == 3
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if pid_alive(p)]
        time.sleep(0.2)
    assert not alive, f"workers {alive} outlived their rank 0"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:                                    # a zombie (exited, not reaped by its dead parent) is gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_cli_generate_with_two_ranks_and_serve_checks_replicas():
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    base = [sys.executable, "-m", "pagedlab", "generate", "--model", "random:tiny", "--device", "cpu",
            "--backend", "torch", "--raw", "--max-new-tokens", "6", "hello", "there"]
    one = subprocess.run(base, capture_output=True, text=True, env=env, timeout=300)
    two = subprocess.run(base + ["--tensor-parallel-size", "2", "--data-parallel-size", "2"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert one.returncode == two.returncode == 0, two.stderr[-2000:]
    assert two.stdout == one.stdout and len(one.stdout.splitlines()) == 2
    # serve runs N engine cores for --data-parallel-size N (tests/test_engine_core.py); a bad N is
    # refused before anything loads
    r = subprocess.run([sys.executable, "-m", "pagedlab", "serve", "--data-parallel-size", "0"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: --data-parallel-size must be an integer >= 1, found 0"]


def test_an_error_on_rank_0_mid_step_stops_the_workers(monkeypatch):
    """Rank 0 raises inside a step after the others started it: the ranks are out of step, so the
    LLM stops every process and says so, instead of retrying through a broken group."""
    prompts, greedy, _ = workload()
    llm = tiny_llm(config=CONFIG, max_num_seqs=3, tensor_parallel_size=2)
    llm.generate(prompts[:2], greedy[:2])
    calls = [0]
    real = llm.model.forward

    def flaky(*a, **k):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("planted failure in rank 0's forward")
        return real(*a, **k)
    monkeypatch.setattr(llm.model, "forward", flaky)
    with pytest.raises(WorkerFailed, match="rank 0 failed during a step: RuntimeError: planted failure"):
        llm.generate(prompts, greedy)
    assert no_children()
    with pytest.raises(RuntimeError, match="planted failure"):
        llm.generate(prompts, greedy)


def test_a_script_without_a_main_guard_gets_told_not_hung(tmp_path):
    """spawn re-imports the __main__ script in each worker; without `if __name__ == "__main__":`
    the worker dies while starting. Rank 0 must say so at once, not wait for it to join."""
    script = tmp_path / "noguard.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from helpers import tiny_llm
        from pagedlab import tiny_config
        llm = tiny_llm(config=tiny_config(), tensor_parallel_size=2)
    """))
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and time.monotonic() - t0 < 60
    assert "exited with code 1 before it started" in r.stderr and '__name__ == "__main__"' in r.stderr


def test_a_failed_connection_mesh_is_tried_again(monkeypatch, reference):
    """gloo's loopback mesh set-up fails now and then (seen about once in a few hundred starts):
    the LLM starts its processes again instead of failing; the old ones are ended at once (killed,
    no timeout waited out) and gone."""
    import pagedlab.parallel.workers as W
    real, calls, ended = W.init_world, [0], []

    def flaky(rank, spec):
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("planted: Connection closed by peer (connectFullMesh)")
        return real(rank, spec)
    real_shutdown = W.Workers.shutdown

    def timed_shutdown(self, say_goodbye=None):
        t0 = time.monotonic()
        real_shutdown(self, say_goodbye)
        ended.append((time.monotonic() - t0, [p.exitcode for p in self.procs]))
    monkeypatch.setattr(W, "init_world", flaky)
    monkeypatch.setattr(W.Workers, "shutdown", timed_shutdown)
    prompts, greedy, _ = workload()
    with tiny_llm(config=CONFIG, max_num_seqs=3, tensor_parallel_size=2) as llm:
        assert calls[0] == 2 and len(ended) == 1
        # (the time of the whole start is the machine's load, not the retry's: only the ending of
        # the failed world is timed, against the join timeout a polite shutdown would wait out)
        seconds, exitcodes = ended[0]
        assert exitcodes == [-signal.SIGTERM] and seconds < W.JOIN_TIMEOUT_S, ended
        assert len(multiprocessing.active_children()) == 1
        assert [o.token_ids for o in llm.generate(prompts, greedy)] == reference[0]
    assert no_children()


def test_tensor_parallel_behind_asyncllm_streams_the_same_tokens(reference):
    """The server's engine thread drives a TP=2 engine: concurrent streams give generate()'s tokens
    (collectives from a non-main thread; the Ctrl-C hold only applies on the main thread)."""
    import asyncio
    from pagedlab.async_llm import AsyncLLM
    prompts, greedy, _ = workload()
    with tiny_llm(config=CONFIG, max_num_seqs=3, tensor_parallel_size=2) as llm:
        front = AsyncLLM(llm)

        async def one(p, sp):
            ids = []
            async for d in front.generate(p, sp):
                ids += d.token_ids
            return ids

        async def all_of_them():
            return await asyncio.gather(*(one(p, sp) for p, sp in zip(prompts, greedy)))
        try:
            assert asyncio.run(all_of_them()) == reference[0]
        finally:
            front.shutdown()
    assert no_children()


def test_tensor_parallel_with_prefix_caching_keeps_every_invariant():
    """Prompts sharing prefixes, chunked prefill and preemption, prefix caching on, TP=2: the shared-
    block invariants hold on rank 0 after every step (test_prefix_cache.drive), blocks are shared,
    and the tokens equal one process's."""
    from test_prefix_cache import drive, shared_prefix_prompts
    rnd = random.Random(5)
    prompts = shared_prefix_prompts(rnd, 14, 4)
    params = [SamplingParams(max_new_tokens=rnd.randint(1, 12), ignore_eos=True) for _ in prompts]
    arrival = [rnd.randint(0, 10) for _ in prompts]
    kw = dict(config=CONFIG, prefix_caching=True, max_num_seqs=5, block_size=4, num_blocks=22,
              max_num_batched_tokens=9)
    one = drive(tiny_llm(**kw), prompts, params, arrival)
    with tiny_llm(tensor_parallel_size=2, **kw) as llm:
        two = drive(llm, prompts, params, arrival)
        assert llm.engine.scheduler.allocator.prefix_hits > 0
    assert {i: r.output_token_ids for i, r in two.items()} == {i: r.output_token_ids for i, r in one.items()}

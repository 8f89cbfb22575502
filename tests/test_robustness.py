"""Nothing a request, an interrupt or a failing step does may wedge the engine, leak a block, lose a
request or change another request's output.

* abort: a queued, prefilling, decoding or preempted request is removed, its blocks freed, and it
  is handed out once with finish_reason "abort"; the others finish as if it had never been there;
* a KeyboardInterrupt injected at EVERY call of every engine function (each step is retried after
  an interrupt at its 1st call, then its 2nd, ... until it completes) over whole randomized runs,
  plain and overlapped: every request finishes exactly once, no placeholder token, no leaked block,
  outputs equal to the uninterrupted run;
* a step that raises fails only the request that raises alone (finish_reason "error");
* generate(): interrupted -> its own requests aborted, others' results handed back; a refused
  generate() does not shift later unseeded outputs;
* bad input at the doors is an error naming the argument or the field, never a crash or a wrong
  request: the server's body reader (lone surrogates, deep nesting), LLM.abort / generate / LLM().
(Real SIGINTs, deferred by the bookkeeping's sections: test_interrupts.py.)
"""
import json
import os
import random
import sys

import pytest
import torch

from helpers import interrupts_in_finalizers_dropped, random_prompts, tiny_llm
from pagedlab import LLM, SamplingParams, tiny_config
from pagedlab.request import RequestStatus
from test_scheduler import check_invariants

PAGEDLAB = os.path.dirname(__import__("pagedlab").__file__)
# the files whose functions get interrupted: the engine's bookkeeping and its device side
ENGINE_FILES = {os.path.join(PAGEDLAB, f) for f in (
    "engine.py", "scheduler.py", "runner.py", "kv_cache.py", "cuda_graph.py", "request.py",
    "model.py", "sampling.py", "llm.py")}


def make_stream(seed, n=10):
    rng = torch.Generator().manual_seed(seed)
    prompts = random_prompts(n, 512, rng, lo=1, hi=30)
    r = random.Random(seed)
    params = [SamplingParams(max_new_tokens=r.randint(1, 14), ignore_eos=r.random() < 0.5) for _ in prompts]
    arrival = [r.randint(0, 12) for _ in prompts]
    return prompts, params, arrival


def engine(overlap: bool, **kw):
    kw = dict(max_num_seqs=3, block_size=4, num_blocks=24, max_num_batched_tokens=24) | kw
    if overlap:
        kw["cuda_graphs"] = "eager"
    llm = tiny_llm(**kw)
    assert llm.engine.overlap == overlap
    return llm


def drive(llm, prompts, params, arrival, step=None):
    """Feed prompts at their arrival steps; returns prompt index -> finished Request."""
    eng, step = llm.engine, step or llm.engine.step
    order = sorted(range(len(prompts)), key=lambda i: arrival[i])
    ids, done, n, k = {}, {}, 0, 0
    while k < len(order) or eng.has_work():
        while k < len(order) and arrival[order[k]] <= n:
            ids[eng.add_request(prompts[order[k]], params[order[k]])] = order[k]
            k += 1
        for r in step():
            assert r.request_id not in done, "a request handed out twice"
            done[r.request_id] = r
        n += 1
    assert len(done) == len(prompts), "a request was lost"
    assert eng.scheduler.allocator.num_used == 0, "a block leaked"
    assert not any(eng.scheduler.slots) and not eng.scheduler.requests
    for r in done.values():
        assert min(r.output_token_ids, default=0) >= 0 and r.num_in_flight == 0
        assert r.status is RequestStatus.FINISHED
    return {ids[rid]: r for rid, r in done.items()}


class Interrupter:
    """sys.settrace hook: raises KeyboardInterrupt at the call of the `at`-th engine function
    (counted from arm()). Raising in a trace function makes the called function raise at once.
    Comprehensions and generator expressions are functions too (Python 3.11), so an interrupt can
    land inside them."""

    def __init__(self):
        self.calls, self.at = 0, None

    def __call__(self, frame, event, arg):
        if event == "call" and frame.f_code.co_filename in ENGINE_FILES:
            self.calls += 1
            if self.calls == self.at:
                self.at = None
                raise KeyboardInterrupt(f"injected at {frame.f_code.co_name}")
        return None

    def arm(self, at):
        self.calls, self.at = 0, at


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("seed,mode", [(0, "every"), (1, "every"), (2, "random")])
def test_interrupt_at_every_call(overlap, seed, mode):
    """mode "every": each step is interrupted at its 1st call, retried, interrupted at its 2nd call,
    ... until it completes. (A step retried after an interrupted launch never runs ahead, so with
    overlap this mode checks the recovery; mode "random" interrupts a step at a random one of its
    first 40 calls, at most 3 times, so steps also complete overlapped with interrupts around them.)"""
    prompts, params, arrival = make_stream(seed)
    want = {i: r.output_token_ids for i, r in drive(engine(overlap), prompts, params, arrival).items()}
    llm = engine(overlap)
    eng, hook = llm.engine, Interrupter()
    stats = dict(interrupts=0, names=set())
    rnd = random.Random(seed)

    def step_with_interrupts():
        at = 1
        while True:
            hook.arm(at if mode == "every" else rnd.randint(1, 40) if at < 4 else None)
            sys.settrace(hook)
            try:
                return eng.step()
            except KeyboardInterrupt as e:
                stats["interrupts"] += 1
                stats["names"].add(str(e))
                check_invariants(eng)
                at += 1
            finally:
                sys.settrace(None)

    with interrupts_in_finalizers_dropped():
        got = drive(llm, prompts, params, arrival, step=step_with_interrupts)
    assert {i: r.output_token_ids for i, r in got.items()} == want
    assert stats["interrupts"] > 50, stats["interrupts"]
    if mode == "every":
        for name in ("schedule", "launch", "settle", "free", "allocate", "forward"):
            assert any(name in n for n in stats["names"]), f"no interrupt landed in {name}"
    if overlap and mode == "random":
        assert eng.num_overlapped > 0


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_anywhere(overlap):
    """Abort requests while queued, mid chunked prefill, decoding and preempted."""
    rng = torch.Generator().manual_seed(3)
    lengths = [12, 38, 9, 20, 30, 7, 33, 15]          # the victims (1, 4, 6) prefill in chunks
    prompts = [torch.randint(3, 512, (n,), generator=rng).tolist() for n in lengths]
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True)] * len(prompts)
    keep = [0, 2, 3, 5, 7]
    ref = tiny_llm(max_num_seqs=3, block_size=4, num_blocks=64).generate(
        [prompts[i] for i in keep], params[:len(keep)])
    llm = engine(overlap, num_blocks=16, max_num_batched_tokens=16)     # chunked prefill, preemption
    eng = llm.engine
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    done, aborted_in = {}, {}
    victims = [i for i in range(len(prompts)) if i not in keep]
    n = 0
    while eng.has_work():
        for r in eng.step():
            assert r.request_id not in done
            done[r.request_id] = r
        check_invariants(eng)
        n += 1
        for v in list(victims):        # abort one victim per step, in a state not seen yet
            req = eng.scheduler.requests.get(ids[v])
            state = ("queued" if req.status is RequestStatus.WAITING else
                     "preempted" if req.status is RequestStatus.PREEMPTED else
                     "prefill" if req.num_tokens - req.num_computed > 1 else "decode")
            if state not in aborted_in.values() or n > 40:
                assert eng.abort(ids[v])
                assert not eng.abort(ids[v]), "aborted twice"
                aborted_in[v] = state
                victims.remove(v)
                break
    assert not victims
    assert eng.scheduler.allocator.num_used == 0
    assert len(done) == len(prompts)
    for i, v in enumerate(ids):
        r = done[v]
        if i in aborted_in:
            assert r.finish_reason == "abort" and min(r.output_token_ids, default=0) >= 0
    for o, i in zip(ref, keep):
        assert done[ids[i]].output_token_ids == o.token_ids
    assert {"queued", "prefill", "decode"} <= set(aborted_in.values()), aborted_in


def test_abort_unknown_and_finished():
    llm = tiny_llm(max_num_seqs=2, num_blocks=32)
    assert not llm.abort(12345)
    out = llm.generate([[3, 4]], SamplingParams(max_new_tokens=2))[0]
    assert not llm.abort(out.request_id)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_failing_request_fails_alone(overlap, monkeypatch, caplog):
    poison = 444
    rng = torch.Generator().manual_seed(4)
    prompts = random_prompts(6, 400, rng, lo=3, hi=20)
    params = [SamplingParams(max_new_tokens=10, ignore_eos=True)] * len(prompts)
    want = [o.token_ids for o in tiny_llm(max_num_seqs=3, num_blocks=64).generate(prompts, params)]
    llm = engine(overlap, num_blocks=64)
    forward = llm.model.forward

    def flaky(input_ids, *a, **kw):
        if (input_ids == poison).any():
            raise IndexError("index 444 is out of bounds (injected)")
        return forward(input_ids, *a, **kw)

    monkeypatch.setattr(llm.model, "forward", flaky)
    bad = prompts[:2] + [[5, 6, poison, 7]] + prompts[2:]
    with caplog.at_level("WARNING", logger="pagedlab.engine"):
        outs = llm.generate(bad, [params[0]] * len(bad))
    assert outs[2].finish_reason == "error" and "IndexError" in outs[2].error and outs[2].token_ids == []
    assert llm.engine.num_isolated_steps >= 1        # each such step is counted and said in the log
    said = [r.getMessage() for r in caplog.records if r.name == "pagedlab.engine"]
    assert len(said) == llm.engine.num_isolated_steps and all("index 444" in m for m in said), said
    assert [o.token_ids for o in outs[:2] + outs[3:]] == want
    assert llm.engine.scheduler.allocator.num_used == 0
    # and the engine keeps serving
    assert llm.generate(prompts[:1], params[0])[0].token_ids == want[0]


@pytest.mark.parametrize("prompt,where", [
    ([3, 4.7], "element 1"), (b"abc", "bytes"), ([3, "5"], "element 1"), ([True, 3], "element 0"),
    (torch.tensor([1.0, 2.0]), "integer dtype"), ({3: 4}, "dict"), (7, "int"),
])
def test_prompt_ids_must_be_integers(prompt, where):
    llm = tiny_llm(max_num_seqs=2, num_blocks=32)
    with pytest.raises(ValueError, match=where):
        llm.engine.add_request(prompt)
    assert not llm.engine.has_work()


def test_tensor_and_numpy_prompts_work():
    import numpy as np
    llm = tiny_llm(max_num_seqs=2, num_blocks=32)
    sp = SamplingParams(max_new_tokens=3, ignore_eos=True)
    a = llm.generate([[3, 4, 5]], sp)[0].token_ids
    assert llm.generate([torch.tensor([3, 4, 5])], sp)[0].token_ids == a
    assert llm.generate([list(np.array([3, 4, 5]))], sp)[0].token_ids == a


def test_generate_interrupted_aborts_its_own_and_keeps_others():
    llm = tiny_llm(max_num_seqs=2, num_blocks=64)
    eng = llm.engine
    other = eng.add_request([9, 8, 7], SamplingParams(max_new_tokens=2, ignore_eos=True))
    seen = []

    def on_finish(out):
        seen.append(out.request_id)
        raise RuntimeError("user callback failed")

    with pytest.raises(RuntimeError, match="user callback"):
        llm.generate([[3, 4], [5, 6, 7], [8]], SamplingParams(max_new_tokens=30, ignore_eos=True),
                     on_finish=on_finish)
    assert eng.scheduler.allocator.num_used == 0 or eng.scheduler.has_work()
    back = {r.request_id: r for r in eng.run()}
    assert other in back and back[other].finish_reason == "length", "another caller's result was lost"
    assert not (set(back) - {other}), "generate's own aborted requests came back to someone else"
    assert eng.scheduler.allocator.num_used == 0 and not eng.has_work()
    # the next generate() computes only its own requests
    outs = llm.generate([[3, 4]], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert len(outs[0].token_ids) == 3


def test_generate_hands_back_requests_it_does_not_own():
    llm = tiny_llm(max_num_seqs=3, num_blocks=64)
    eng = llm.engine
    other = eng.add_request([9, 8, 7], SamplingParams(max_new_tokens=2, ignore_eos=True))
    outs = llm.generate([[3, 4, 5]], SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert len(outs) == 1 and outs[0].request_id != other
    back = eng.step()
    assert [r.request_id for r in back] == [other]


def test_refused_generate_does_not_shift_unseeded_outputs():
    sp = SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True)
    fresh = tiny_llm(max_num_seqs=2, num_blocks=64).generate([[3, 4, 5]], sp)[0].token_ids
    llm = tiny_llm(max_num_seqs=2, num_blocks=64)
    with pytest.raises(ValueError, match="prompt 1"):
        llm.generate([[3, 4, 5], [3, 10**6]], sp)
    assert not llm.engine.has_work()
    assert llm.generate([[3, 4, 5]], sp)[0].token_ids == fresh


# -- bad input at the doors: an error naming the field, never a crash ---------------------------

def _surrogate_bodies(rnd):
    """(raw body, the field path that holds a lone surrogate) -- a random place each time."""
    lone = rnd.choice(["\\ud800", "\\udfff", "\\uDC00", "\\udbff"])
    text = f"a{lone}b" if rnd.random() < 0.5 else lone
    k = rnd.randint(0, 2)
    msgs = [{"role": "user", "content": "hi"} for _ in range(3)]
    msgs[k]["content"] = "@"
    chat = json.dumps({"model": "m", "messages": msgs}).replace('"@"', f'"{text}"')
    yield chat.encode(), f"messages[{k}].content"
    yield json.dumps({"model": "m", "prompt": "@"}).replace('"@"', f'"{text}"').encode(), "prompt"
    stops = ["x", "y", "@"]
    rnd.shuffle(stops)
    body = json.dumps({"model": "m", "prompt": "hi", "stop": stops}).replace('"@"', f'"{text}"')
    yield body.encode(), f"stop[{stops.index('@')}]"


def test_server_refuses_lone_surrogates_naming_the_field():
    from pagedlab.server.protocol import OpenAIError, read_body
    rnd = random.Random(0)
    for _ in range(20):
        for raw, path in _surrogate_bodies(rnd):
            with pytest.raises(OpenAIError, match="surrogate") as e:
                read_body(raw)
            assert e.value.status == 400 and e.value.body()["error"]["param"] == path, raw
    # a surrogate *pair* is one character: accepted
    assert read_body(b'{"prompt": "x \\ud83d\\ude00"}')["prompt"] == "x \U0001F600"


@pytest.mark.parametrize("depth", [101, 900, 20000])
def test_server_refuses_deep_nesting_naming_the_field(depth):
    from pagedlab.server.protocol import MAX_JSON_DEPTH, OpenAIError, read_body
    rnd = random.Random(depth)
    field = rnd.choice(["messages", "metadata", "prompt", "tools"])
    open_, close = rnd.choice([("[", "]"), ('{"a": ', "}")])
    raw = f'{{"model": "m", "{field}": {open_ * depth}1{close * depth}, "z": [1]}}'.encode()
    with pytest.raises(OpenAIError, match=f"{depth} deep") as e:
        read_body(raw)
    assert e.value.status == 400 and e.value.body()["error"]["param"] == field
    ok = f'{{"model": "m", "{field}": {open_ * MAX_JSON_DEPTH}1{close * MAX_JSON_DEPTH}}}'.encode()
    assert read_body(ok)["model"] == "m"


def test_llm_arguments_named_before_anything_runs():
    llm = tiny_llm(max_num_seqs=2, num_blocks=32)
    rid = llm.engine.add_request([3, 4, 5], SamplingParams(max_new_tokens=4, ignore_eos=True))
    for bad in (True, False, 1.0, "1", None):
        with pytest.raises(TypeError, match="request_id must be an integer"):
            llm.abort(bad)
    assert llm.engine.scheduler.requests[rid].status is RequestStatus.WAITING   # untouched
    for bad in (None, 123, 1.5, b"ab"):
        with pytest.raises(TypeError, match="prompts must be"):
            llm.generate(bad)
    assert [r.request_id for r in llm.engine.run()] == [rid]
    for name in ("", "  ", None):
        with pytest.raises(ValueError, match="no model named"):
            LLM(name)


def test_cpu_pool_refuses_a_block_past_its_cap():
    from pagedlab.config import EngineConfig
    from pagedlab.engine import CPU_KV_POOL_CAP_BYTES, pool_size
    from pagedlab.kv_cache import KVCache
    cfg = tiny_config()
    per_token = KVCache.bytes_per_block(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    too_big = CPU_KV_POOL_CAP_BYTES // per_token + 1          # tokens in one block past the cap
    with pytest.raises(ValueError, match=f"block_size={too_big}: one KV block"):
        tiny_llm(block_size=too_big, dtype="float32")
    with pytest.raises(ValueError, match="one KV block"):       # a pool of one given block too
        tiny_llm(block_size=too_big, num_blocks=1, dtype="float32")
    # one token less fits: a pool of that one block (sized, not allocated here)
    fits = EngineConfig(block_size=too_big - 1, device="cpu", dtype="float32")
    assert pool_size(cfg, fits, 10**9, torch.device("cpu"), torch.float32) == 1

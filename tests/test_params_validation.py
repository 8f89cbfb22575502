"""SamplingParams is immutable and strict; the trace is a ring of the last steps."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from helpers import tiny_llm
from pagedlab import SamplingParams
from pagedlab.sampling import counter_uniform, sample
from pagedlab.trace import StepRecord, Trace

BIG = 10**400                                   # float(BIG) raises OverflowError

BAD = [
    ("max_new_tokens", v) for v in (True, False, 0, -1, 2**31, 2.5, 64.0, "5", None, BIG)
] + [
    ("max_tokens", v) for v in (True, 0, -3, 2**31, 8.0, "8")
] + [
    ("temperature", v) for v in (True, False, -0.1, -1, math.nan, math.inf, -math.inf, 1e4 + 1, 10001,
                                 BIG, -BIG, "1", None, 1j)
] + [
    ("top_k", v) for v in (True, -1, 2**31, 1.0, "3", None, BIG)
] + [
    ("top_p", v) for v in (True, False, 0, 0.0, -0.5, 1.0000001, 2, math.nan, math.inf, BIG, "0.9", None)
] + [
    ("seed", v) for v in (True, False, -1, -(2**63), 2**63, 2**64, 1.5, "x", BIG)
] + [
    ("stop_token_ids", v) for v in ("abc", b"ab", None, 5, 1.5, {1: 2}, torch.tensor([1, 2]))
] + [
    ("ignore_eos", v) for v in ("no", 0, 1, None, 1.0)
]


def _shown(v) -> str:
    return "bits" if isinstance(v, int) and abs(v) > 2**128 else repr(v)


@pytest.mark.parametrize("field, value", BAD, ids=[f"{f}={_shown(v)[:20]}" for f, v in BAD])
def test_bad_values_are_refused_naming_field_and_value(field, value):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    msg = str(e.value)
    assert msg.startswith("SamplingParams:") and field in msg and _shown(value) in msg, msg


BAD_IDS = [([1, 1.5], 1, 1.5), ([True], 0, True), ([3, "5"], 1, "5"), ([-1], 0, -1), ([2**31], 0, 2**31),
           ((7, None), 1, None), ([4, 5, BIG], 2, BIG), ([2.0], 0, 2.0)]


@pytest.mark.parametrize("ids, index, value", BAD_IDS)
def test_bad_stop_token_ids_name_index_and_value(ids, index, value):
    with pytest.raises(ValueError) as e:
        SamplingParams(stop_token_ids=ids)
    msg = str(e.value)
    assert msg.startswith(f"SamplingParams: stop_token_ids[{index}] must be an integer token id")
    assert _shown(value) in msg, msg


def test_the_issue_message_for_a_float_token_id():
    with pytest.raises(ValueError, match=r"^SamplingParams: stop_token_ids\[1\] must be an integer token id "
                                         r"in \[0, 2\*\*31-1\], found <float 1\.5>$"):
        SamplingParams(stop_token_ids=[3, 1.5])


def test_good_values_pass_and_are_normalized():
    sp = SamplingParams(max_new_tokens=2**31 - 1, temperature=2, top_k=2**31 - 1, top_p=1, seed=2**63 - 1,
                        stop_token_ids=[9, 3, 9], ignore_eos=True)
    assert sp.max_new_tokens == 2**31 - 1 and sp.top_k == 2**31 - 1 and sp.seed == 2**63 - 1
    assert type(sp.temperature) is float and sp.temperature == 2.0
    assert type(sp.top_p) is float and sp.top_p == 1.0
    assert sp.stop_token_ids == (9, 3, 9)
    assert SamplingParams(stop_token_ids={5, 2, 11}).stop_token_ids == (2, 5, 11)
    assert SamplingParams(stop_token_ids=frozenset()).stop_token_ids == ()
    assert SamplingParams(stop_token_ids=(0, 2**31 - 1)).stop_token_ids == (0, 2**31 - 1)
    for t in (0, 0.0, 1e-6, 0.7, 1e4, 10000):
        assert SamplingParams(temperature=t).temperature == float(t)
    for p in (1e-9, 0.5, 1.0):
        assert SamplingParams(top_p=p).top_p == p
    for seed in (None, 0, 1, 2**62):
        assert SamplingParams(seed=seed).seed == seed
    d = SamplingParams()
    assert (d.max_new_tokens, d.temperature, d.top_k, d.top_p, d.seed, d.stop_token_ids, d.ignore_eos) == \
        (64, 0.0, 0, 1.0, None, (), False)
    assert d.greedy and not SamplingParams(temperature=0.5).greedy
    assert SamplingParams(stop_token_ids=[1, 2]) == SamplingParams(stop_token_ids=(1, 2))


def test_numpy_scalars_are_numbers_but_numpy_bools_are_not():
    np = pytest.importorskip("numpy")
    sp = SamplingParams(max_new_tokens=np.int64(5), temperature=np.float32(0.5), seed=np.uint64(2**63 - 1),
                        stop_token_ids=[np.int32(7)])
    assert type(sp.max_new_tokens) is int and type(sp.seed) is int and type(sp.stop_token_ids[0]) is int
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=np.bool_(True))
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=np.uint64(2**64 - 1))


def test_frozen():
    sp = SamplingParams(max_new_tokens=8, stop_token_ids=[2])
    with pytest.raises(dataclasses.FrozenInstanceError):
        sp.max_new_tokens = -1
    with pytest.raises(dataclasses.FrozenInstanceError):
        sp.seed = 2**64
    with pytest.raises(AttributeError):
        sp.stop_token_ids.append(3)                      # a tuple
    assert sp.max_new_tokens == 8 and sp.stop_token_ids == (2,)
    assert hash(sp) == hash(SamplingParams(max_new_tokens=8, stop_token_ids=(2,)))


def test_replace_derives_a_checked_copy():
    sp = SamplingParams(max_new_tokens=8, temperature=0.5, seed=3)
    hot = dataclasses.replace(sp, temperature=1.5)
    assert (hot.max_new_tokens, hot.temperature, hot.seed) == (8, 1.5, 3) and sp.temperature == 0.5
    assert dataclasses.replace(sp, max_new_tokens=3).max_new_tokens == 3
    with pytest.raises(ValueError, match="seed"):
        dataclasses.replace(sp, seed=-1)


def test_max_tokens_alias():
    assert SamplingParams(max_tokens=5).max_new_tokens == 5
    assert SamplingParams(max_tokens=5, max_new_tokens=5).max_new_tokens == 5
    assert SamplingParams(max_tokens=64).max_new_tokens == 64
    assert SamplingParams(max_tokens=None).max_new_tokens == 64
    with pytest.raises(ValueError, match=r"max_tokens must be max_new_tokens \(64\) .*, found 5"):
        SamplingParams(max_tokens=5, max_new_tokens=64)     # 64 given explicitly: still a conflict
    with pytest.raises(ValueError, match=r"max_tokens must be max_new_tokens \(6\) .*, found 5"):
        SamplingParams(max_new_tokens=6, max_tokens=5)
    assert "max_tokens" not in {f.name for f in dataclasses.fields(SamplingParams)}   # one stored number


def test_max_tokens_reads_back_under_both_names():
    assert SamplingParams(max_tokens=16).max_tokens == 16 == SamplingParams(max_new_tokens=16).max_tokens
    assert SamplingParams().max_tokens == SamplingParams().max_new_tokens == 64
    shorter = dataclasses.replace(SamplingParams(max_tokens=16, seed=1), max_new_tokens=3)
    assert (shorter.max_tokens, shorter.seed) == (3, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().max_new_tokens = 5
    with pytest.raises(AttributeError):
        SamplingParams().max_tokens = 5


def test_n_greedy_samples_are_refused_naming_the_way_out():
    with pytest.raises(ValueError, match=r"n must be 1 with temperature=0 .*found 2: set temperature > 0"):
        SamplingParams(n=2)
    assert SamplingParams(n=2, temperature=0.7).n == 2


def test_sample_runs_at_the_int64_seed_extreme():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 97, generator=g)
    seeds = torch.tensor([2**63 - 1, 0, 2**62], dtype=torch.int64)
    pos = torch.tensor([0, 5, 2**31 - 1])
    u = counter_uniform(seeds, pos, 97)
    assert 0 < u.min() and u.max() < 1
    for top_k, top_p in ((0, 1.0), (5, 0.9)):
        tok = sample(logits, torch.full((3,), 0.8), torch.full((3,), top_k), torch.full((3,), top_p), seeds, pos,
                     any_top_filter=top_k > 0)
        assert tok.shape == (3,) and 0 <= int(tok.min()) and int(tok.max()) < 97
        again = sample(logits, torch.full((3,), 0.8), torch.full((3,), top_k), torch.full((3,), top_p), seeds, pos,
                       any_top_filter=top_k > 0)
        assert torch.equal(tok, again)


def test_engine_runs_with_the_largest_seed():
    llm = tiny_llm(max_num_seqs=2, num_blocks=64)
    sp = SamplingParams(max_new_tokens=5, temperature=1.0, top_p=0.9, seed=2**63 - 1, ignore_eos=True)
    a = llm.generate([[3, 4, 5], [6, 7]], [sp, SamplingParams(max_new_tokens=3, ignore_eos=True)])[0].token_ids
    assert len(a) == 5 and a == llm.generate([[3, 4, 5]], sp)[0].token_ids


# ----------------------------------------------------------------------------- the trace ring
def _record(step: int) -> StepRecord:
    return StepRecord(step=step, start_s=0.01 * step, duration_s=0.001, slot_request=[step, None],
                      slot_phase=["prefill" if step % 3 == 0 else "decode", None], block_table=[[step], []],
                      pool_used=1, pool_total=8, queue=[], emitted={step: step}, num_tokens=1)


def _fill(trace: Trace, n: int) -> None:
    for _ in range(n):
        trace.append(_record(trace.next_step))


def test_trace_keeps_exactly_the_last_steps_and_keeps_counting():
    t = Trace(2, 16, 8, max_steps=5)
    _fill(t, 3)
    assert len(t) == 3 and t.num_dropped == 0 and t.next_step == 3
    assert [s.step for s in t.steps] == [0, 1, 2]
    _fill(t, 9)
    assert len(t) == 5 and t.num_dropped == 7 and t.next_step == 12
    assert [s.step for s in t.steps] == [7, 8, 9, 10, 11]
    assert [s.step for s in t] == [7, 8, 9, 10, 11]
    assert t[0].step == t.num_dropped == 7 and t[-1].step == 11 and t[4].step == 11
    assert [s.step for s in t[1:3]] == [8, 9] and [s.step for s in t.steps[:2]] == [7, 8]
    assert [s.step for s in t[::-2]] == [11, 9, 7]
    with pytest.raises(IndexError):
        t[5]
    t.steps.append(_record(99))                          # a copy: the trace is untouched
    assert len(t) == 5
    assert [d["step"] for d in t.to_dicts()] == [7, 8, 9, 10, 11]
    assert t.utilization() == 0.5                        # slot 0 busy, slot 1 idle, over the kept steps
    assert t.timeline(width=2).splitlines()[0] == "slot  0 |hi|"      # steps 7, 8: decode
    assert t.timeline().splitlines()[1] == "slot  1 |.....|"


def test_trace_default_cap_and_unbounded():
    assert Trace(1, 16, 8).max_steps == Trace.DEFAULT_MAX_STEPS == 10_000
    t = Trace(2, 16, 8, max_steps=None)
    _fill(t, 12_000)
    assert len(t) == 12_000 and t.num_dropped == 0 and t.next_step == 12_000 and t[0].step == 0
    capped = Trace(2, 16, 8)
    _fill(capped, 10_003)
    assert len(capped) == 10_000 and capped.num_dropped == 3 and capped[0].step == 3


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "10"])
def test_trace_bad_max_steps(bad):
    with pytest.raises(ValueError, match="max_steps"):
        Trace(2, 16, 8, max_steps=bad)


def test_max_trace_steps_reaches_the_engine():
    from helpers import tiny_llm
    from pagedlab import SamplingParams
    llm = tiny_llm(trace=True, max_trace_steps=4)
    llm.generate([[5, 6, 7]], SamplingParams(max_new_tokens=9, ignore_eos=True))
    assert llm.trace.max_steps == 4 and len(llm.trace) == 4 and llm.trace.num_dropped > 0
    assert [s.step for s in llm.trace] == list(range(llm.trace.next_step - 4, llm.trace.next_step))

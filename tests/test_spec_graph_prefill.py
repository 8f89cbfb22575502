"""runner.GRAPH_PREFILL_ROWS: a step with a few prompt tokens (a short prompt, the rest of one after
prefix-cache hits, a chunk) replays the decode graphs, each prompt token one decode row -- what a
speculative verify step does with its guesses. Token for token the eager path's output (fp32, the
graph code path run eagerly on a CPU), plain and speculative, greedy and seeded sampling, with
prefix caching and chunked prefill, and the prompt rows really ran through the graphs."""
import random

import pytest

from helpers import tiny_llm
from pagedlab import SamplingParams
from pagedlab.runner import ModelRunner


def workload(rnd):
    base = [rnd.randrange(3, 400) for _ in range(30)]
    prompts = [base[:rnd.randint(2, 30)] + [rnd.randrange(3, 400) for _ in range(rnd.randint(1, 6))]
               for _ in range(9)] + [[rnd.randrange(3, 400)]]          # shared prefixes, a 1-token prompt
    params = [SamplingParams(max_tokens=12, ignore_eos=True, seed=i, temperature=0.0 if i % 3 else 0.8,
                             logprobs=1 if i == 4 else None) for i in range(len(prompts))]
    return prompts, params


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3}])
def test_prompt_tokens_as_graph_rows_give_the_same_tokens(spec, monkeypatch):
    prompts, params = workload(random.Random(5))
    kw = dict(dtype="float32", max_num_seqs=8, cuda_graphs="eager", block_size=4, prefix_caching=True,
              max_num_batched_tokens=8, speculative_config=spec)
    want = tiny_llm(**kw).generate(prompts, params)
    seen, rows = [], ModelRunner._prompt_rows
    monkeypatch.setattr(ModelRunner, "_prompt_rows", lambda self, prefill: seen.append(len(prefill)) or
                        rows(self, prefill))
    monkeypatch.setattr(ModelRunner, "GRAPH_PREFILL_ROWS", 8)
    llm = tiny_llm(**kw)
    got = llm.generate(prompts, params)
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids
    assert got[4].logprobs and [x.token_id for x in got[4].logprobs] == [x.token_id for x in want[4].logprobs]
    assert len(seen) >= 3                           # prompt rows replayed (hits, chunks, short prompts)
    assert llm.engine.scheduler.allocator.num_used == 0


def test_the_default_replays_prompt_rows_only_where_graphs_are_captured(monkeypatch):
    """GRAPH_PREFILL_ROWS None (the default): GRAPH_PREFILL_AUTO rows where the graphs are captured
    (CUDA), off where the graph code path runs eagerly (CPU tests); an explicit number wins."""
    from types import SimpleNamespace as NS
    runner = tiny_llm(dtype="float32", max_num_seqs=16, cuda_graphs="eager").engine.runner
    assert ModelRunner.GRAPH_PREFILL_ROWS is None
    step = lambda n, decodes=0: NS(prefill=[NS(num_scheduled=n)], decode=[NS(spec_token_ids=[])] * decodes)  # noqa: E731
    assert not runner.replays(step(4)) and runner.replays(NS(prefill=[], decode=[NS(spec_token_ids=[])] * 3))
    monkeypatch.setattr(runner.graphs, "capture", True)          # (what a CUDA engine has)
    monkeypatch.setattr(ModelRunner, "GRAPH_PREFILL_AUTO", 10)
    assert runner.replays(step(4, 6)) and not runner.replays(step(5, 6)) and not runner.replays(step(11))
    monkeypatch.setattr(runner, "GRAPH_PREFILL_ROWS", 0)
    assert not runner.replays(step(1))


def test_prefill_sizes_reach_past_max_num_seqs(monkeypatch):
    """GRAPH_PREFILL_SIZES: the graphs go up to the prefill bound whatever max_num_seqs is, so a
    2-slot engine replays prompts of up to 24 tokens whole -- token for token the eager path --
    while its decode steps keep their own sizes."""
    rnd = random.Random(9)
    prompts = [[rnd.randrange(3, 400) for _ in range(n)] for n in (23, 5, 17, 24, 30)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    kw = dict(dtype="float32", max_num_seqs=2, cuda_graphs="eager", block_size=4)
    eager = tiny_llm(**kw)
    want = [eager.generate(p, params)[0] for p in prompts]          # one stream: a prompt at a time
    monkeypatch.setattr(ModelRunner, "GRAPH_PREFILL_ROWS", 24)
    monkeypatch.setattr(ModelRunner, "GRAPH_PREFILL_SIZES", False)
    plain = tiny_llm(**kw).engine.runner.graphs
    assert plain.sizes == [1, 2]                    # without: nothing past the slots
    monkeypatch.setattr(ModelRunner, "GRAPH_PREFILL_SIZES", True)
    seen, rows = [], ModelRunner._prompt_rows
    monkeypatch.setattr(ModelRunner, "_prompt_rows", lambda self, prefill: seen.append(
        sum(r.num_scheduled for r in prefill)) or rows(self, prefill))
    llm = tiny_llm(**kw)
    assert llm.engine.runner.graphs.sizes == [1, 2, 4, 8, 16, 24]
    got = [llm.generate(p, params)[0] for p in prompts]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert 23 in seen and 24 in seen and 30 not in seen          # the 30-token prompt runs eagerly
    monkeypatch.setattr(ModelRunner, "GRAPH_PREFILL_ROWS", 40)  # past the decode sizes: powers of two
    assert tiny_llm(**kw).engine.runner.graphs.sizes == [1, 2, 4, 8, 16, 32, 40]
    assert tiny_llm(**dict(kw, max_num_seqs=3)).engine.runner.graphs.sizes == [1, 2, 3, 4, 8, 16, 32, 40]

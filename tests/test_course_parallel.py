"""Notebook 13's checks (pagedlab/course/parallel.py): the course's solutions pass and are returned;
stubs say "not written yet"; planted bugs in the cut of a weight, the column- and row-parallel
linear layers, the vocabulary-parallel embedding and a whole Llama layer each fail with a message
that names the case and gives the matching hint -- on two processes over gloo, and on two threads
(the fallback where fork is missing)."""
import pytest
import torch
import torch.nn.functional as F

from pagedlab.course import parallel as pc
from pagedlab.course import CheckFailed
from pagedlab.parallel import shard as ref

shard = pc.solution("shard")
column = pc.solution("column_parallel_linear")
row = pc.solution("row_parallel_linear")
embedding = pc.solution("vocab_parallel_embedding")


@pytest.fixture(autouse=True)
def _no_solutions(monkeypatch):
    monkeypatch.delenv("PAGEDLAB_SOLUTIONS", raising=False)
    monkeypatch.delenv("PAGEDLAB_RANKS", raising=False)


@pytest.fixture(params=["processes", "threads"])
def ranks(request, monkeypatch):
    monkeypatch.setenv("PAGEDLAB_RANKS", request.param)
    return request.param


def test_solutions_pass_and_are_returned(ranks, capsys):
    assert pc.check_shard(shard) is shard
    assert pc.check_column_parallel(column) is column
    assert pc.check_row_parallel(row) is row
    assert pc.check_vocab_embedding(embedding) is embedding
    assert pc.check_tp_layer(llama_layer) is llama_layer
    out = capsys.readouterr().out
    for name in ("shard", "column_parallel_linear", "row_parallel_linear", "vocab_parallel_embedding", "llama_layer"):
        assert f"\u2713 {name}" in out
    assert ("processes (torch.distributed, gloo)" if ranks == "processes" else "threads (PAGEDLAB_RANKS=threads)") in out


def test_solutions_are_the_reference_pieces():
    assert pc.ranks_mode()[0] == "processes"          # Linux: fork is there, gloo too
    x, w = torch.randn(3, 8), torch.randn(6, 8)
    assert torch.equal(column(x, w), ref.column_parallel_linear(x, w))
    assert torch.equal(shard(w, "cols", 1, 2), ref.shard(w, "cols", 1, 2))


def test_solutions_switch(monkeypatch):
    monkeypatch.setenv("PAGEDLAB_SOLUTIONS", "1")
    assert pc.check_shard(lambda *a: None).__name__ == "shard"
    assert pc.check_row_parallel(lambda *a: None).__name__ == "row_parallel_linear"


def _stub(*args):
    raise NotImplementedError("write it")


@pytest.mark.parametrize("check,name", [(pc.check_shard, "shard"), (pc.check_column_parallel, "column_parallel_linear"),
                                        (pc.check_row_parallel, "row_parallel_linear"),
                                        (pc.check_vocab_embedding, "vocab_parallel_embedding")])
def test_stubs_say_not_written(check, name, ranks):
    with pytest.raises(CheckFailed, match="not written yet") as e:
        check(_stub)
    assert f"show_solution({name!r})" in str(e.value) and "Traceback" not in str(e.value)


# -- piece 1: the cut ------------------------------------------------------------------------------

def wrong_dim(t, rule, rank, size):            # rows and cols swapped
    return shard(t, {"rows": "cols", "cols": "rows"}.get(rule), rank, size)


def wrong_offset(t, rule, rank, size):         # counts ranks from the end
    return shard(t, rule, size - 1 - rank, size)


def no_raise(t, rule, rank, size):             # a dimension that does not divide: the first n // size
    if rule is None or size == 1:
        return t
    dim = 0 if rule == "rows" else 1
    k = t.shape[dim] // size
    return t.narrow(dim, rank * k, k)


@pytest.mark.parametrize("fn,says", [(wrong_dim, "rule 'rows' cuts dim 0"), (wrong_offset, "that is rank 1's part"),
                                     (lambda t, rule, rank, size: t, "each rank keeps 1/2"),
                                     (no_raise, "raise ValueError")])
def test_shard_bugs(fn, says):
    with pytest.raises(CheckFailed, match=says):
        pc.check_shard(fn)


# -- pieces 2-4, on two ranks ------------------------------------------------------------------------

def col_full_width(x, w_shard):                # pads to all output features
    y = x @ w_shard.t()
    return torch.cat([y, torch.zeros_like(y)], dim=-1)


@pytest.mark.parametrize("fn,says", [
    (lambda x, w: x @ w, "(?s)raised RuntimeError.*x @ w_shard.t\\(\\)"),      # no transpose: shapes do not fit
    (lambda x, w: (x @ w.t()).t(), "transposed"),
    (col_full_width, "all .* output features"),
    (lambda x, w: 2 * x @ w.t(), "times a constant"),
])
def test_column_bugs(fn, says, ranks):
    with pytest.raises(CheckFailed, match=says):
        pc.check_column_parallel(fn)


def row_no_reduce(x, w, all_reduce):           # forgets the all-reduce
    return x @ w.t()


def row_twice(x, w, all_reduce):
    y = x @ w.t()
    all_reduce(y)
    all_reduce(y)
    return y


def row_returns_none(x, w, all_reduce):
    return all_reduce(x @ w.t())


def row_mean(x, w, all_reduce):
    y = x @ w.t()
    all_reduce(y)
    return y / 2


def row_reduces_a_copy(x, w, all_reduce):
    y = x @ w.t()
    all_reduce(y.clone())
    return y


def row_only_rank_0(x, w, all_reduce):          # every rank must join: rank 1 is left waiting
    y = x @ w.t()
    if torch.distributed.is_initialized() and torch.distributed.get_rank() == 0:
        all_reduce(y)
    return y


@pytest.mark.parametrize("fn,says", [
    (row_no_reduce, "all_reduce was not called"), (row_twice, "called 2 times"), (row_returns_none, "returned None"),
    (row_mean, "mean of the partials"), (row_reduces_a_copy, "reduce y_r itself"),
])
def test_row_bugs(fn, says, ranks):
    with pytest.raises(CheckFailed, match=says) as e:
        pc.check_row_parallel(fn)
    assert "expected" in str(e.value) and "on rank" in str(e.value)


def test_row_rank_that_never_joins_is_reported_not_hung(monkeypatch):
    monkeypatch.setattr(pc, "TIMEOUT_S", 5.0)
    monkeypatch.setenv("PAGEDLAB_RANKS", "processes")
    with pytest.raises(CheckFailed, match="did not meet in a collective|all_reduce was not called") as e:
        pc.check_row_parallel(row_only_rank_0)
    assert "rank" in str(e.value)


def emb_no_offset(ids, e, rank, all_reduce):
    n = e.shape[0]
    mine = (ids >= 0) & (ids < n)
    h = e[ids.clamp(0, n - 1)] * mine.unsqueeze(-1)
    all_reduce(h)
    return h


def emb_no_mask(ids, e, rank, all_reduce):
    n = e.shape[0]
    h = e[(ids - rank * n).clamp(0, n - 1)]
    all_reduce(h)
    return h


def emb_no_reduce(ids, e, rank, all_reduce):
    n = e.shape[0]
    local = ids - rank * n
    mine = (local >= 0) & (local < n)
    return e[local.clamp(0, n - 1)] * mine.unsqueeze(-1)


def emb_index_error(ids, e, rank, all_reduce):
    h = e[ids - rank * e.shape[0]]
    all_reduce(h)
    return h


@pytest.mark.parametrize("fn,says", [(emb_no_offset, "wrong rank offset"), (emb_no_mask, "ZEROS"),
                                     (emb_no_reduce, "all_reduce was not called"),
                                     (emb_index_error, "(?s)raised IndexError.*rank r holds token ids")])
def test_embedding_bugs(fn, says, ranks):
    with pytest.raises(CheckFailed, match=says):
        pc.check_vocab_embedding(fn)


# -- a whole Llama layer (as notebook 13 writes it), and planted mistakes in it ------------------------

def llama_layer(h, positions, w, cfg, size, all_reduce, residual_before_reduce=False, reduces=(True, True),
                kv_heads=None):
    t, d = h.shape[0], cfg.head_dim
    heads, kv = cfg.num_heads // size, kv_heads or cfg.num_kv_heads // size
    x = pc.rms_norm(h, w["input_layernorm.weight"], cfg.rms_norm_eps)
    q = column(x, w["self_attn.q_proj.weight"]).view(t, heads, d)
    k = column(x, w["self_attn.k_proj.weight"]).view(t, kv, d)
    v = column(x, w["self_attn.v_proj.weight"]).view(t, kv, d)
    q, k = pc.rope(q, positions, cfg), pc.rope(k, positions, cfg)
    o = pc.causal_attention(q, k, v)

    def out_proj(x, w_, residual, do_reduce):
        if residual_before_reduce:
            y = residual + x @ w_.t()
            all_reduce(y)
            return y
        return residual + (row(x, w_, all_reduce) if do_reduce else x @ w_.t())

    h = out_proj(o, w["self_attn.o_proj.weight"], h, reduces[0])
    x = pc.rms_norm(h, w["post_attention_layernorm.weight"], cfg.rms_norm_eps)
    g, u = column(x, w["mlp.gate_proj.weight"]), column(x, w["mlp.up_proj.weight"])
    h = out_proj(F.silu(g) * u, w["mlp.down_proj.weight"], h, reduces[1])
    return h, k, v


@pytest.mark.parametrize("kw,says", [
    (dict(reduces=(False, True)), "called 1 times"),
    (dict(reduces=(True, False)), "called 1 times"),
    (dict(residual_before_reduce=True), "add it AFTER the all-reduce"),
])
def test_layer_bugs(kw, says, ranks):
    def layer(*args):
        return llama_layer(*args, **kw)
    with pytest.raises(CheckFailed, match=says):
        pc.check_tp_layer(layer)


def test_layer_heads_not_split():
    def layer(h, positions, w, cfg, size, all_reduce):          # views k with all KV heads: a shape error
        return llama_layer(h, positions, w, cfg, size, all_reduce, kv_heads=cfg.num_kv_heads)
    with pytest.raises(CheckFailed, match="raised RuntimeError"):
        pc.check_tp_layer(layer)


def test_layer_stub_and_wrong_return():
    with pytest.raises(CheckFailed, match="not written yet"):
        pc.check_tp_layer(_stub)
    with pytest.raises(CheckFailed, match="return \\(h_out, k, v\\)"):
        pc.check_tp_layer(lambda *a: llama_layer(*a)[0])


def test_reference_layer_is_transformers_llama():
    """The unsharded reference the layer check compares with: a whole tiny Llama built from
    reference_layer gives transformers' logits (fp32)."""
    pytest.importorskip("transformers")
    from pagedlab.config import tiny_config
    from pagedlab.reference import hf_model
    from pagedlab.weights import random_checkpoint
    ckpt = random_checkpoint(tiny_config(), seed=3)
    ids = torch.tensor([1, 5, 9, 200, 31, 7, 7, 400, 3, 11])
    want = hf_model(ckpt)(ids[None]).logits[0]
    got = pc.reference_logits(ckpt.tensors, ckpt.config, ids)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (got - want).abs().max()


def test_run_ranks_gathers_and_reports(ranks):
    def job(comm):
        t = torch.full((2, 3), float(comm.rank + 1))
        comm.all_reduce(t)
        return t, comm.all_gather(torch.full((1, 2), float(comm.rank)))
    outs = pc.run_ranks(job)
    for t, g in outs:
        assert torch.equal(t, torch.full((2, 3), 3.0))
        assert torch.equal(g, torch.tensor([[0.0, 0.0, 1.0, 1.0]]))

    def bad(comm):
        if comm.rank == 1:
            raise ValueError("boom")
        comm.all_reduce(torch.ones(1))
    with pytest.raises(CheckFailed, match="ValueError: boom on rank 1"):
        pc.run_ranks(bad)


def test_model_config_and_bench(tmp_path):
    assert pc.model_config("random:tiny").num_heads == 6
    assert (pc.model_config("smollm2").num_heads, pc.model_config("smollm2").num_kv_heads) == (9, 3)
    with pytest.raises(ValueError, match="num_heads \\(query heads\\) = 9"):
        ref.check_split(pc.SMOLLM2_135M, 2)
    ref.check_split(pc.SMOLLM2_135M, 3)
    assert pc.load_parallel_bench(tmp_path / "absent.json") is None


def test_parallel_bench_verdict_is_read_from_its_rows():
    """docs/parallel_bench.json's verdict is what `bench parallel` writes from the rows beside it
    (pagedlab.bench.parallel.verdict), so no number in it can contradict them; and its comparison
    of the NCCL time with what halving the weights saved follows the numbers both ways."""
    import copy

    from pagedlab.bench.parallel import verdict
    bench = pc.load_parallel_bench()
    assert bench["verdict"] == verdict(bench["rows"])
    rows = copy.deepcopy(bench["rows"])
    tp2 = next(r for r in rows if r["config"] == "TP=2")["profile"]["batch1"]
    one = next(r for r in rows if r["config"] == "TP=1")["profile"]["batch1"]
    saved = one["kernel_total_us"] - (tp2["kernel_total_us"] - tp2["nccl_us"])
    assert ("less than that saving" in verdict(rows)) == (tp2["nccl_us"] < saved)
    tp2["kernel_total_us"] += saved                      # a TP=2 step whose non-NCCL kernels saved nothing
    assert "(more than that saving)" in verdict(rows)


def test_a_gloo_start_that_fails_is_tried_again_after_a_growing_pause(monkeypatch):
    """Gloo's loopback set-up now and then fails before any rank runs (CI once saw three immediate
    tries fail within 0.1 s): _run tries again after 0.25 s, 0.5 s, ...; a job's own error is not
    retried; five failed starts give the set-up error back."""
    starts, pauses = [], []
    results = iter([[{"error": "gloo", "setup": True}] * 2] * 2 + [[{"result": 1}, {"result": 2}]])

    def fake(job, size, timeout_s):
        starts.append(1)
        return next(results)
    monkeypatch.setattr(pc, "_run_processes", fake)
    monkeypatch.setattr(pc.time, "sleep", pauses.append)
    assert pc._run(None, 2, 5, mode="processes") == [{"result": 1}, {"result": 2}]
    assert len(starts) == 3 and pauses == [0.25, 0.5]
    starts.clear()
    pauses.clear()
    monkeypatch.setattr(pc, "_run_processes", lambda job, size, t: starts.append(1) or [{"error": "x"}] * 2)
    assert pc._run(None, 2, 5, mode="processes") == [{"error": "x"}] * 2 and len(starts) == 1 and not pauses
    monkeypatch.setattr(pc, "_run_processes", lambda job, size, t: starts.append(1) or [{"error": "g", "setup": True}] * 2)
    starts.clear()
    assert pc._run(None, 2, 5, mode="processes")[0]["setup"] and len(starts) == 5
    assert pauses == [0.25, 0.5, 1.0, 2.0]

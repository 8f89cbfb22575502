"""kernels/graph_inputs.py: a decode graph's inputs gathered in one launch -- bit for bit the torch
composition (the Triton kernel under the interpreter on CPU, for real on a GPU), and the engine's
tokens with cuda_graph.DecodeGraphs.FUSED_INPUTS on equal those with it off."""
import pytest
import torch

from helpers import tiny_llm
from pagedlab import SamplingParams
from pagedlab.cuda_graph import DecodeGraphs
from pagedlab.kernels.graph_inputs import decode_inputs_torch, decode_inputs_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("b,w,h", [(1, 37, 70), (5, 3, 1500), (3, 1100, 16)])
def test_one_launch_equals_the_torch_ops(dtype, b, w, h):
    g = torch.Generator().manual_seed(b * w + h)
    vocab, rows, src = 50, 9, 2 * b + 7
    inputs = torch.stack([torch.randint(0, 10**6, (b,), generator=g),         # token (unused here)
                          torch.randint(0, 4096, (b,), generator=g),          # position
                          torch.randint(0, 10**9, (b,), generator=g),         # KV slot
                          torch.randint(1, 4097, (b,), generator=g),          # length
                          torch.randint(0, rows, (b,), generator=g),          # slot of the request
                          torch.randint(0, src, (b,), generator=g)], dim=1).to(DEV)
    token_src = torch.randint(0, vocab, (src,), generator=g).to(DEV)
    table = torch.randint(-1, 10**6, (rows, w), generator=g, dtype=torch.int32).to(DEV)
    embed = torch.randn(vocab, h, generator=g).to(dtype).to(DEV)
    want = decode_inputs_torch(inputs, token_src, table, embed)
    got = decode_inputs_triton(inputs, token_src, table, embed)
    for a, e in zip(got, want):
        assert a.dtype == e.dtype and a.shape == e.shape and torch.equal(a, e)


def test_the_engine_gives_the_same_tokens_with_fused_inputs(monkeypatch):
    prompts = [[5, 6, 7, 8, 9], [11] * 19, [3, 4], [8, 1, 2]]
    sp = SamplingParams(max_new_tokens=7, ignore_eos=True)
    kw = dict(max_num_seqs=3, block_size=4, device=DEV, dtype="float32", attention_backend="triton",
              cuda_graphs=True if DEV == "cuda" else "eager")
    monkeypatch.setattr(DecodeGraphs, "FUSED_INPUTS", False)
    plain = tiny_llm(**kw)
    assert not plain.engine.runner.graphs.fused_inputs
    want = [o.token_ids for o in plain.generate(prompts, sp)]
    monkeypatch.setattr(DecodeGraphs, "FUSED_INPUTS", True)
    import pagedlab.kernels.gemv as gemv
    import pagedlab.kernels.graph_inputs as gi
    # (on a GPU these run while the graphs are captured, on the CPU at every eager "replay")
    calls, fn = [], gi.decode_inputs_triton
    monkeypatch.setattr(gi, "decode_inputs_triton", lambda *a: calls.append(a[0].shape[0]) or fn(*a))
    merged, lin = [], gemv._linear
    monkeypatch.setattr(gemv, "_linear", lambda *a, **k: merged.append(k.get("tokens_out")) or lin(*a, **k))
    llm = tiny_llm(**kw)
    graphs = llm.engine.runner.graphs
    assert graphs.fused_inputs
    got = [o.token_ids for o in llm.generate(prompts, sp)]
    assert got == want
    assert 1 in calls                                   # the one-row graph gathered in one launch,
    assert any(t is not None and t.data_ptr() == graphs.prev_tokens.data_ptr() for t in merged)
    # ... and its LM head wrote the argmax straight into prev_tokens (no copy launch)
    torch_llm = tiny_llm(**dict(kw, attention_backend="torch"))
    assert not torch_llm.engine.runner.graphs.fused_inputs      # the references keep the torch ops

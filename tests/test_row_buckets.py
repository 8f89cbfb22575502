"""Matmuls at a few row counts (kernels/row_buckets.py): every row count maps to a bucket at most
12.5% larger (exact up to SMALL_ROWS), buckets are fixed points, the warmed list covers every
bucket, and a padded matmul returns exactly the rows of the unpadded one (fp64 reference)."""
import random

import pytest
import torch

from pagedlab.kernels.row_buckets import SMALL_ROWS, all_buckets, bucket_rows, padded_linear


def test_buckets_bound_the_padding_and_cover_every_row_count():
    buckets = all_buckets(8192)
    assert buckets == sorted(set(buckets))
    rng = random.Random(0)
    for m in [1, 2, SMALL_ROWS, SMALL_ROWS + 1, 8191, 8192] + rng.sample(range(1, 8193), 3000):
        b = bucket_rows(m)
        assert b >= m and bucket_rows(b) == b and b in buckets, m
        assert b == m if m <= SMALL_ROWS else b - m <= m // 8, (m, b)
    assert len(buckets) - SMALL_ROWS <= 8 * 5          # 8 per octave from 256 to 8192
    assert max(all_buckets(600)) <= 600


@pytest.mark.parametrize("residual", [False, True])
def test_padded_rows_change_nothing(residual):
    g = torch.Generator().manual_seed(1)
    for m, pad, n, k in [(3, 5, 7, 11), (300, 20, 33, 64), (1, 1, 5, 3)]:
        x = torch.randn(m, k, generator=g)
        w = torch.randn(n, k, generator=g)
        r = torch.randn(m, n, generator=g) if residual else None
        want = x.double() @ w.double().t() + (r.double() if residual else 0)
        before = r.clone() if residual else None
        got = padded_linear(x, w, r, pad)
        assert got.shape == (m, n)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        if residual:                                   # the caller's residual is left as it was
            assert torch.equal(r, before)


def test_steps_padded_to_a_bucket_give_the_same_tokens_and_cache():
    """The runner pads an eager step's rows up to bucket_rows (on CUDA; forced here on the CPU):
    padding tokens store their K/V in the null block, attend to nothing and give no logits, so
    every request's tokens -- prefill-only, mixed and decode steps, sampled and greedy -- and every byte of the KV pool
    are those of the unpadded run, the null block aside (no request reads it)."""
    from helpers import tiny_llm
    from pagedlab import SamplingParams
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randint(120, 240))] for _ in range(5)]
    params = [SamplingParams(max_new_tokens=rng.randint(3, 7), ignore_eos=True, temperature=t, seed=i)
              for i, t in enumerate([0.0, 0.8, 0.0, 1.0, 0.0])]
    runs = []
    for pad in (False, True):
        llm = tiny_llm(dtype="float32", max_num_seqs=3, num_blocks=128, block_size=8, max_num_batched_tokens=600,
                       attention_backend="torch", cuda_graphs=False, prefix_caching=False)
        model, seen, forward = llm.engine.model, [], llm.engine.model.forward
        model.forward = lambda ids, pos, kv, meta, *a, **k: (
            seen.append((ids.shape[0], meta.num_prefill_tokens + meta.num_decode_tokens)),
            forward(ids, pos, kv, meta, *a, **k))[1]
        llm.engine.runner.pad_rows = pad
        runs.append(([o.token_ids for o in llm.generate(prompts, params)], llm.engine.kv_cache, seen))
        assert llm.engine.scheduler.allocator.num_used == 0
        assert llm.engine.num_isolated_steps == 0      # no step raised (a request-at-a-time rerun
                                                       # gives the same tokens and would hide it)
    (ref, ref_kv, _), (got, kv, seen) = runs
    assert got == ref
    pool = kv.null_block                                            # the blocks requests own
    diff = max((a[:pool] - b[:pool]).abs().max().item() for a, b in zip(ref_kv.k + ref_kv.v, kv.k + kv.v))
    assert diff < 1e-5          # fp32: a matmul of more rows may round its last bit differently
    assert all(rows == bucket_rows(real) for rows, real in seen)
    assert any(rows > real for rows, real in seen)                  # some steps really were padded


def test_padding_rows_attend_to_nothing():
    """attend() with rows past the step's prefill and decode tokens: those rows are zeros, the
    others what the unpadded call gives."""
    from pagedlab.attention import AttentionMetadata, attend
    from pagedlab.kernels import select_kernels
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(2, 4, 2, 8, generator=g), torch.randn(2, 4, 2, 8, generator=g)    # 2 blocks of 4
    table, i32 = torch.tensor([[0, 1], [1, 0]], dtype=torch.int32), lambda x: torch.tensor(x, dtype=torch.int32)
    meta = AttentionMetadata(torch.arange(3), 3, table[:1], i32([0, 3]), i32([3]), 3, table[1:], i32([6]), 6)
    q = torch.randn(4 + 5, 4, 8, generator=g)                                           # 3 + 1 rows, 5 padding
    ops = select_kernels("torch")
    out = attend(ops, q, k, v, meta, 0.3)
    assert torch.equal(out[:4], attend(ops, q[:4], k, v, meta, 0.3))
    assert out[4:].abs().sum() == 0

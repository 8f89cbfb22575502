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

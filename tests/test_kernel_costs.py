"""pagedlab.kernels.decode_costs: the counts checked by hand on small shapes, and against the H200 json."""
import pytest

from pagedlab.course import load_h200_bench
from pagedlab.kernels.decode_costs import decode_costs, h200_rows, used_splits

# 1 sequence of 32 tokens, 4 query heads on 2 KV heads (G = 2), head_dim 16, 2-byte dtype.
SHAPE = dict(batch=1, ctx=32, heads=4, kv_heads=2, head_dim=16, block_size=16, dtype_bytes=2)
ROW = 16 * 2                       # one head's row: 16 dims x 2 bytes = 32 bytes
FLOPS = 4 * 32 * (2 * 16 + 2 * 16)   # 4 query heads x 32 keys x (16 mul+add for q.k, 16 for p.v)


def test_gqa_by_hand():
    c = decode_costs("gqa", **SHAPE)
    assert c.programs == 2                                  # 1 sequence x 2 KV heads
    assert c.kv_bytes == 2 * 32 * 2 * ROW                   # K and V, 32 keys, 2 KV heads: 4096
    assert c.table_bytes == 2 * 32 * 4                      # each program looks up 32 int32 entries
    assert c.q_bytes == 4 * ROW and c.write_bytes == 4 * ROW and c.scratch_read_bytes == 0
    assert c.flops == FLOPS
    assert c.bytes == 4096 + 256 + 128 + 128
    assert c.intensity == pytest.approx(8192 / 4608)


def test_blocked_and_naive_load_kv_once_per_query_head():
    gqa = decode_costs("gqa", **SHAPE)
    for v in ("naive", "blocked"):
        c = decode_costs(v, **SHAPE)
        assert c.programs == 4                              # one per query head
        assert c.kv_bytes == 2 * gqa.kv_bytes               # G = 2 query heads per KV head
        assert c.table_bytes == 4 * 32 * 4
        assert c.flops == gqa.flops and c.intensity < gqa.intensity


def test_split_kv_by_hand():
    c = decode_costs("split_kv", num_splits=2, block_n=16, **SHAPE)
    assert c.programs == 4                                  # 2 KV heads x 2 splits
    assert c.kv_bytes == decode_costs("gqa", **SHAPE).kv_bytes   # the same K/V bytes...
    assert c.q_bytes == 2 * 4 * ROW                         # ...but each split loads its queries
    partials = 4 * 2 * (2 + 16) * 4                         # 4 heads x 2 splits x (m, l, 16 acc) fp32
    assert c.write_bytes == 4 * ROW + partials and c.scratch_read_bytes == partials
    # 4 splits of 32 keys in 16-key tiles: each split gets one tile, so only 2 splits work
    assert used_splits(32, 4, 16) == 2
    c4 = decode_costs("split_kv", num_splits=4, block_n=16, **SHAPE)
    assert c4.programs == 8 and c4.q_bytes == c.q_bytes


def test_auto_plan_matches_the_h200_run():
    bench = load_h200_bench()
    if bench is None:
        pytest.skip("docs/kernels_bench.json not here")
    for r in bench["table"]:
        c = decode_costs("auto", r["batch"], r["ctx"], sm_count=bench["meta"]["sm_count"])
        assert [c.variant, c.num_splits] == r["auto_plan"]
    rows = {(r["batch"], r["ctx"], r["variant"]): r for r in h200_rows(bench)}
    # docs/kernels.md: gqa reads K/V at 4.07 TB/s at batch 256 x 4096; 2 x 256 x 4096 x 8 x 64 x 2 bytes
    assert rows[256, 4096, "gqa"]["h200_kv_tbs"] == pytest.approx(4.07, abs=0.01)
    assert rows[1, 32768, "split_kv"]["programs"] == 8 * 128
    assert rows[1, 32768, "gqa"]["programs"] == 8


def test_bad_input():
    with pytest.raises(ValueError):
        decode_costs("tiled", 1, 8)
    with pytest.raises(ValueError):
        decode_costs("gqa", 1, 8, heads=6, kv_heads=4)

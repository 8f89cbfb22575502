"""Triton kernels against their plain-torch references.

On CPU (CI) the kernels run under the Triton interpreter (TRITON_INTERPRET=1) in fp32 and fp16 on
small, irregular shapes. On a CUDA device the same tests run compiled, in bf16, at full
Llama-3.2-1B attention shapes (32 query heads, 8 KV heads, head_dim 64), against the fp32 reference.
Every input is random (never zeros); block tables are shuffled; sequence lengths are not multiples
of the block size; unused block-table entries are -1.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    # must happen before any @triton.jit function is defined (tests/conftest.py does it too)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagedlab.kernels.decode_attention import (VARIANTS, choose_decode_plan,  # noqa: E402
                                               decode_attention_torch, decode_attention_triton)
from pagedlab.kernels.kv_store import kv_store_torch, kv_store_triton  # noqa: E402
from pagedlab.kernels.prefill_attention import (prefill_attention_torch,  # noqa: E402
                                                prefill_attention_triton)
from pagedlab.kernels.paged import gather_pages  # noqa: E402
from pagedlab.kernels.rmsnorm import rms_norm_torch, rms_norm_triton  # noqa: E402
from pagedlab.kernels.rope import rope_cos_sin, rope_torch, rope_triton  # noqa: E402

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
# interpreter: fp32 and fp16 are exact enough (bf16 is NOT right under the interpreter)
DTYPES = [torch.bfloat16] if GPU else [torch.float32, torch.float16]
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 1e-2}
# attention head shapes: (Hq, Hkv, D). GPU: Llama-3.2-1B (group 4) plus groups 1 and 3.
HEADS = [(32, 8, 64), (8, 8, 64), (24, 8, 64)] if GPU else [(4, 4, 16), (6, 2, 32), (8, 2, 16)]
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def rel_err(out, ref):
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check(out, ref, dtype):
    assert not torch.isnan(out).any()
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"relative error {err:.3g} >= {TOL[dtype]}"


def make_paged(seq_lens, block_size, hkv, d, dtype, gen, stale=False):
    """Random K/V pool with the blocks of every sequence scattered (shuffled physical ids).
    Unused block-table entries are -1, or (stale=True) ids of blocks owned by other sequences."""
    need = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(max(need), 1) + 1
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[used:used + n]
        used += n
        if stale:
            table[i, n:] = perm[torch.randint(0, num_blocks, (max_blocks - n,), generator=gen)]
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype)
    return (k_cache.to(DEV), v_cache.to(DEV), table.to(DEV),
            torch.tensor(seq_lens, dtype=torch.int32, device=DEV))


# ---------------------------------------------------------------------------------- RMSNorm
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [2048, 1000] if GPU else [100, 64])
def test_rms_norm(dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    t = 77 if GPU else 5
    x = torch.randn(t, hidden, generator=gen).to(dtype).to(DEV)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(DEV)
    check(rms_norm_triton(x, w, 1e-5), rms_norm_torch(x, w, 1e-5), dtype)


# ---------------------------------------------------------------------------------- RoPE
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 64), (24, 8, 128)] if GPU else [(6, 2, 16), (3, 1, 32)])
def test_rope(dtype, hq, hkv, d):
    gen = torch.Generator().manual_seed(d)
    t, max_pos = (300, 131072) if GPU else (9, 5000)
    cos_sin = rope_cos_sin(d, 500000.0, max_pos, LLAMA3_SCALING, device=DEV)
    qkv = torch.randn(t, hq + 2 * hkv, d, generator=gen).to(dtype).to(DEV)
    q, k = qkv[:, :hq], qkv[:, hq:hq + hkv]                 # strided views, like a fused QKV
    positions = torch.randint(0, max_pos, (t,), generator=gen).to(DEV)
    q0, k0 = q.clone(), k.clone()
    qo, ko = rope_triton(q, k, positions, cos_sin)
    qr, kr = rope_torch(q, k, positions, cos_sin)
    check(qo, qr, dtype)
    check(ko, kr, dtype)
    assert torch.equal(q, q0) and torch.equal(k, k0)        # inputs untouched


# ---------------------------------------------------------------------------------- KV-store
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 16])
def test_kv_store(dtype, block_size):
    gen = torch.Generator().manual_seed(block_size)
    hkv, d = (8, 64) if GPU else (2, 16)
    num_blocks = 40 if block_size == 16 else 300
    t = 37
    kc = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype).to(DEV)
    vc = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype).to(DEV)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t].to(DEV)
    k = torch.randn(t, hkv, d, generator=gen).to(dtype).to(DEV)
    v = torch.randn(t, hkv, d, generator=gen).to(dtype).to(DEV)
    kc2, vc2 = kc.clone(), vc.clone()
    kv_store_triton(k, v, kc, vc, slots)
    kv_store_torch(k, v, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    # a negative slot (padding token) stores nothing
    before = kc.clone()
    kv_store_triton(k[:2], v[:2], kc, vc, torch.tensor([-1, -1], device=DEV))
    assert torch.equal(kc, before)


# ---------------------------------------------------------------------------------- prefill
def prefill_case(q_lens, ctx_lens, block_size, heads, dtype, seed, stale=False):
    hq, hkv, d = heads
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    k_cache, v_cache, table, sl = make_paged(seq_lens, block_size, hkv, d, dtype, gen, stale)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    q = torch.randn(int(cu[-1]), hq, d, generator=gen).to(dtype).to(DEV)
    cu = cu.to(DEV)
    scale = d ** -0.5
    out = prefill_attention_triton(q, k_cache, v_cache, table, cu, sl, scale, max(q_lens))
    ref = prefill_attention_torch(q, k_cache, v_cache, table, cu, sl, scale, max(q_lens))
    check(out, ref, dtype)
    return out, q, k_cache, v_cache, table, cu, sl, scale


if GPU:
    PREFILL_CASES = [  # (q_lens, ctx_lens, block_size)
        ([1000], [0], 16),
        ([513, 77, 1, 300], [0, 0, 0, 0], 16),
        ([200, 1, 129], [700, 33, 0], 16),                 # chunked prefill / prefix cache
        ([37, 90], [5, 0], 1),
        ([2048, 100], [1024, 3], 32),
    ]
else:
    PREFILL_CASES = [
        ([23], [0], 16),
        ([9, 1, 30], [0, 0, 0], 16),
        ([7, 1, 20], [19, 40, 0], 16),                     # queries after cached context
        ([5, 11], [3, 0], 1),
        ([40, 2], [33, 60], 32),
    ]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("case", range(len(PREFILL_CASES)))
def test_prefill_attention(dtype, heads, case):
    q_lens, ctx_lens, block_size = PREFILL_CASES[case]
    prefill_case(q_lens, ctx_lens, block_size, heads, dtype, seed=case, stale=case % 2 == 1)


def test_prefill_attention_no_hint_and_empty_sequence():
    """Without max_q_len (no host sync: the grid is bounded by the table) and with a sequence
    that has no new query tokens in the middle of the batch; nothing may become NaN."""
    dtype = DTYPES[0]
    hq, hkv, d = HEADS[-1]
    gen = torch.Generator().manual_seed(7)
    q_lens, ctx = [6, 0, 3], [2, 5, 0]
    seq_lens = [a + b for a, b in zip(q_lens, ctx)]
    k_cache, v_cache, table, sl = make_paged(seq_lens, 16, hkv, d, dtype, gen)
    cu = torch.tensor([0, 6, 6, 9], dtype=torch.int32, device=DEV)
    q = torch.randn(9, hq, d, generator=gen).to(dtype).to(DEV)
    out = prefill_attention_triton(q, k_cache, v_cache, table, cu, sl, d ** -0.5)
    ref = prefill_attention_torch(q, k_cache, v_cache, table, cu, sl, d ** -0.5)
    check(out, ref, dtype)


# ---------------------------------------------------------------------------------- decode
if GPU:
    DECODE_CASES = [  # (seq_lens, block_size)
        ([8191], 16),
        ([1, 17, 300, 1000, 2049], 16),
        ([513] * 64, 16),
        ([33, 1, 4000], 1),
        ([1500, 64, 31], 32),
    ]
else:
    DECODE_CASES = [
        ([45], 16),
        ([1, 17, 30], 16),
        ([13, 1, 40, 7, 22, 9], 16),
        ([9, 1, 21], 1),
        ([70, 31], 32),
    ]


@pytest.mark.parametrize("variant", VARIANTS + ("auto",))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("case", range(len(DECODE_CASES)))
def test_decode_attention(variant, dtype, heads, case):
    seq_lens, block_size = DECODE_CASES[case]
    hq, hkv, d = heads
    gen = torch.Generator().manual_seed(100 + case)
    k_cache, v_cache, table, sl = make_paged(seq_lens, block_size, hkv, d, dtype, gen,
                                             stale=case % 2 == 0)
    q = torch.randn(len(seq_lens), hq, d, generator=gen).to(dtype).to(DEV)
    scale = d ** -0.5
    out = decode_attention_triton(q, k_cache, v_cache, table, sl, scale, max(seq_lens),
                                  variant=variant)
    ref = decode_attention_torch(q, k_cache, v_cache, table, sl, scale, max(seq_lens))
    check(out, ref, dtype)


@pytest.mark.parametrize("num_splits", [2, 3, 7])
def test_decode_split_kv_forced_splits(num_splits):
    """Explicit split counts, including splits that are empty for short sequences, a length-0
    sequence (CUDA-graph padding -> zeros) and no max_seq_len hint."""
    dtype = DTYPES[0]
    hq, hkv, d = HEADS[0]
    gen = torch.Generator().manual_seed(num_splits)
    seq_lens = [300, 1, 0, 77] if GPU else [50, 1, 0, 19]
    k_cache, v_cache, table, sl = make_paged(seq_lens, 16, hkv, d, dtype, gen)
    q = torch.randn(len(seq_lens), hq, d, generator=gen).to(dtype).to(DEV)
    out = decode_attention_triton(q, k_cache, v_cache, table, sl, d ** -0.5, variant="split_kv",
                                  num_splits=num_splits)
    ref = decode_attention_torch(q, k_cache, v_cache, table, sl, d ** -0.5)
    assert not torch.isnan(out).any()
    assert torch.equal(out[2].float(), torch.zeros_like(out[2].float()))
    keep = torch.tensor([0, 1, 3], device=DEV)
    check(out[keep], ref[keep], dtype)


@pytest.mark.parametrize("heads", HEADS)
def test_decode_split_kv_merges_in_chunks(heads):
    """The last split merges the partials a chunk of splits at a time: with a small merge tile
    the merge takes several chunks, the last one partly past the splits in use."""
    from pagedlab.kernels import decode_attention as da
    from pagedlab.kernels.launch import merge_config
    dtype = DTYPES[0]
    hq, hkv, d = heads
    per_split = (1 << (hq // hkv - 1).bit_length()) * max(16, 1 << (d - 1).bit_length())
    merge_tile = per_split * (4 if not GPU else 16)                      # 4 / 16 splits a chunk
    config = merge_config(da.DECODE_CONFIG, {"split_kv": {"MERGE_TILE": merge_tile}})
    gen = torch.Generator().manual_seed(hq + d)
    seq_lens = [1200, 5, 300] if not GPU else [5000, 5, 1300]
    k_cache, v_cache, table, sl = make_paged(seq_lens, 16, hkv, d, dtype, gen)
    q = torch.randn(len(seq_lens), hq, d, generator=gen).to(dtype).to(DEV)
    splits = 10 if not GPU else 40
    chunk = da._merge_chunk(hq // hkv, max(16, 1 << (d - 1).bit_length()), splits, merge_tile)
    assert 1 < chunk < splits and splits % chunk           # several chunks, the last one partial
    out = decode_attention_triton(q, k_cache, v_cache, table, sl, d ** -0.5, variant="split_kv",
                                  num_splits=splits, config=config)
    check(out, decode_attention_torch(q, k_cache, v_cache, table, sl, d ** -0.5), dtype)


def test_decode_split_kv_merges_in_launch_again_and_again():
    """split_kv's last split merges the partials and resets its arrival counter: launches that
    reuse the same scratch (same shapes, as in a CUDA graph) with other lengths stay right."""
    dtype = DTYPES[0]
    hq, hkv, d = HEADS[0]
    gen = torch.Generator().manual_seed(21)
    longest = 700 if GPU else 60
    for trial in range(4):
        seq_lens = [int(x) for x in torch.randint(1, longest, (3,), generator=gen)]
        k_cache, v_cache, table, sl = make_paged(seq_lens, 16, hkv, d, dtype, gen)
        q = torch.randn(3, hq, d, generator=gen).to(dtype).to(DEV)
        out = decode_attention_triton(q, k_cache, v_cache, table, sl, d ** -0.5, longest,
                                      variant="split_kv", num_splits=5)
        check(out, decode_attention_torch(q, k_cache, v_cache, table, sl, d ** -0.5), dtype)


def test_decode_zero_length_all_variants():
    dtype = DTYPES[0]
    hq, hkv, d = HEADS[-1]
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache, table, sl = make_paged([5, 0], 16, hkv, d, dtype, gen)
    q = torch.randn(2, hq, d, generator=gen).to(dtype).to(DEV)
    ref = decode_attention_torch(q, k_cache, v_cache, table, sl, d ** -0.5)
    for variant in VARIANTS:
        out = decode_attention_triton(q, k_cache, v_cache, table, sl, d ** -0.5, variant=variant)
        assert not torch.isnan(out).any()
        assert torch.equal(out[1].float(), torch.zeros_like(out[1].float()))
        check(out[:1], ref[:1], dtype)


def test_auto_plan_is_host_only():
    """auto's choice depends only on host ints (CUDA-graph safe) and splits small batches."""
    assert choose_decode_plan(1, 8, 32768, 132)[0] == "split_kv"
    assert choose_decode_plan(256, 8, 4096, 132) == ("gqa", 1)
    assert choose_decode_plan(1, 8, 16, 132) == ("gqa", 1)              # nothing to split
    # split counts are powers of two (few compiled variants), within 2x of the programs wanted
    from pagedlab.kernels.decode_attention import MAX_SPLITS, choose_num_splits
    for b in range(1, 40):
        for ctx in (300, 1000, 2048, 5000, 32768):
            n = choose_num_splits(b, 8, ctx, 132)
            assert n & (n - 1) == 0 and 1 <= n <= MAX_SPLITS, (b, ctx, n)
            assert 2 * n > min(-(-8 * 132 // (8 * b)), -(-ctx // 256), MAX_SPLITS), (b, ctx, n)


# ---------------------------------------------------------------------------------- launch configs
def _snapshot(config):
    from pagedlab.kernels.launch import to_plain
    return to_plain(config)


@pytest.mark.parametrize("variant", ["blocked", "split_kv"])
def test_decode_configs_are_explicit_and_defaults_never_change(variant):
    """Two launch configs (other tile, warps and stages) give the same numbers, and a call with
    another config leaves the module's defaults as they were (they are read-only)."""
    from pagedlab.kernels import decode_attention as da
    from pagedlab.kernels.launch import merge_config
    dtype = DTYPES[0]
    hq, hkv, d = HEADS[1]
    gen = torch.Generator().manual_seed(31)
    seq_lens = [70, 3, 45] if not GPU else [3000, 3, 1100]
    k_cache, v_cache, table, sl = make_paged(seq_lens, 16, hkv, d, dtype, gen)
    q = torch.randn(len(seq_lens), hq, d, generator=gen).to(dtype).to(DEV)
    before = _snapshot(da.DECODE_CONFIG)
    other = merge_config(da.DECODE_CONFIG, {variant: {"BLOCK_N": 32, "num_warps": 2, "num_stages": 1}})
    a = decode_attention_triton(q, k_cache, v_cache, table, sl, d ** -0.5, variant=variant, num_splits=3)
    b = decode_attention_triton(q, k_cache, v_cache, table, sl, d ** -0.5, variant=variant, num_splits=3,
                                config=other)
    assert _snapshot(da.DECODE_CONFIG) == before
    assert other[variant]["BLOCK_N"] == 32 and da.DECODE_CONFIG[variant]["BLOCK_N"] != 32
    check(b, a.float(), dtype)
    check(a, decode_attention_torch(q, k_cache, v_cache, table, sl, d ** -0.5), dtype)
    with pytest.raises(TypeError):
        da.DECODE_CONFIG[variant]["BLOCK_N"] = 32                # read-only


def test_prefill_config_is_explicit():
    from pagedlab.kernels import prefill_attention as pa
    from pagedlab.kernels.launch import merge_config
    dtype = DTYPES[0]
    hq, hkv, d = HEADS[1]
    gen = torch.Generator().manual_seed(32)
    k_cache, v_cache, table, sl = make_paged([29, 40], 16, hkv, d, dtype, gen)
    cu = torch.tensor([0, 9, 29], dtype=torch.int32, device=DEV)       # 9 and 20 new tokens
    q = torch.randn(29, hq, d, generator=gen).to(dtype).to(DEV)
    before = _snapshot(pa.PREFILL_CONFIG)
    flat = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2, "PACK_GQA": False}
    tiers = merge_config(pa.PREFILL_CONFIG, {"short": {"BLOCK_N": 16, "num_stages": 2}})
    a = prefill_attention_triton(q, k_cache, v_cache, table, cu, sl, d ** -0.5, 20)
    b = prefill_attention_triton(q, k_cache, v_cache, table, cu, sl, d ** -0.5, 20, config=flat)
    c = prefill_attention_triton(q, k_cache, v_cache, table, cu, sl, d ** -0.5, 20, config=tiers)
    assert _snapshot(pa.PREFILL_CONFIG) == before
    check(b, a.float(), dtype)
    check(c, a.float(), dtype)
    check(a, prefill_attention_torch(q, k_cache, v_cache, table, cu, sl, d ** -0.5, 20), dtype)
    with pytest.raises(ValueError):
        merge_config(pa.PREFILL_CONFIG, {"BLOCK_M": 16})        # the defaults are tiers: name one


def test_prefill_config_tiers_by_length():
    """Each length takes the first tier that holds it; a flat config is used as given."""
    from pagedlab.kernels import prefill_attention as pa
    tiers = pa.PREFILL_CONFIG
    bounds = [c["max_q_len"] for c in tiers.values()]
    assert bounds[-1] is None and all(a < b for a, b in zip(bounds[:-2], bounds[1:-1]))
    cpu = torch.device("cpu")
    for name, c in tiers.items():
        n = c["max_q_len"] or 10 ** 6
        assert pa.prefill_launch_config(tiers, n, cpu) == dict(c), name
    first = next(iter(tiers.values()))
    assert pa.prefill_launch_config(tiers, 1, cpu) == dict(first)
    flat = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    assert pa.prefill_launch_config(flat, 10 ** 6, cpu) == flat


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("heads", [(8, 2, 16), (4, 1, 16), (6, 3, 16)])
def test_prefill_gqa_packing_equals_one_head_per_tile(pack, heads):
    """PACK_GQA puts a KV head's whole group of query heads in one tile (rows = query x head):
    the same function as one head per tile, for group sizes 4, 4 (MQA) and 3 (not packed)."""
    from pagedlab.kernels import prefill_attention as pa
    dtype = DTYPES[0]
    hq, hkv, d = heads
    gen = torch.Generator().manual_seed(hq * 10 + hkv)
    q_lens, ctx = [21, 1, 40], [0, 17, 9]
    k_cache, v_cache, table, sl = make_paged([a + b for a, b in zip(q_lens, ctx)], 16, hkv, d, dtype, gen, True)
    cu = torch.tensor([0, 21, 22, 62], dtype=torch.int32, device=DEV)
    q = torch.randn(62, hq, d, generator=gen).to(dtype).to(DEV)
    cfg = {"BLOCK_M": 64, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2, "PACK_GQA": pack}
    out = prefill_attention_triton(q, k_cache, v_cache, table, cu, sl, d ** -0.5, 40, config=cfg)
    check(out, prefill_attention_torch(q, k_cache, v_cache, table, cu, sl, d ** -0.5, 40), dtype)


PREFILL_LOOP_FORMS = {   # the key loop's forms (flat configs; PREFILL_CONFIG's tiers pick among them)
    "one_loop": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "PACK_GQA": True,
                 "ONE_LOOP": True},
    "one_loop_nopack": {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2,
                        "PACK_GQA": False, "ONE_LOOP": True},
    "split_diag16_mslow": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2,
                           "PACK_GQA": True, "BLOCK_N_DIAG": 16, "M_SLOW": True},
}


@pytest.mark.parametrize("form", list(PREFILL_LOOP_FORMS))
@pytest.mark.parametrize("block_size", [16, 5])
def test_prefill_loop_forms_match_reference(form, block_size):
    """The one-loop form (key indices clamped to the sequence, the causal mask only on the tiles
    that cross the diagonal) and the split form with narrower diagonal tiles and the query tiles
    last in the grid (M_SLOW) compute the same function: ragged lengths, queries after cached context, a sequence with no new tokens, a page
    size that divides no tile, stale table entries past each sequence."""
    dtype = DTYPES[0]
    hq, hkv, d = HEADS[1] if GPU else (8, 2, 16)
    gen = torch.Generator().manual_seed(block_size * 7 + len(form))
    q_lens, ctx = ([300, 1, 0, 77], [129, 40, 9, 0]) if GPU else ([37, 1, 0, 9], [21, 6, 9, 0])
    k_cache, v_cache, table, sl = make_paged([a + b for a, b in zip(q_lens, ctx)], block_size, hkv,
                                             d, dtype, gen, stale=True)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    cu = cu.to(DEV)
    q = torch.randn(int(cu[-1]), hq, d, generator=gen).to(dtype).to(DEV)
    out = prefill_attention_triton(q, k_cache, v_cache, table, cu, sl, d ** -0.5, max(q_lens),
                                   config=PREFILL_LOOP_FORMS[form])
    check(out, prefill_attention_torch(q, k_cache, v_cache, table, cu, sl, d ** -0.5, max(q_lens)), dtype)


# the shapes (Llama-3.2-1B heads): the kernel against torch's SDPA in fp32, causal GQA, at
# every length on the GPU; on the CPU (interpreter) the lengths that run in seconds
SDPA_SHAPES = ([(1, 512), (1, 1024), (1, 2048), (1, 4096), (1, 8192), (8, 512), (4, 2048)] if GPU
               else [(1, 512), (2, 256)])


@pytest.mark.parametrize("batch,length", SDPA_SHAPES)
def test_prefill_against_sdpa_fp32(batch, length):
    import torch.nn.functional as F
    hq, hkv, d, bs = 32, 8, 64, 16
    gen = torch.Generator().manual_seed(length + batch)
    k_cache, v_cache, table, sl = make_paged([length] * batch, bs, hkv, d, torch.float32, gen, True)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=DEV) * length
    q = torch.randn(batch * length, hq, d, generator=gen).to(DEV)
    out = prefill_attention_triton(q, k_cache, v_cache, table, cu, sl, d ** -0.5, length)
    k = gather_pages(k_cache, table)[:, :length].transpose(1, 2).double()       # [B, Hkv, L, D]
    v = gather_pages(v_cache, table)[:, :length].transpose(1, 2).double()
    qs = q.view(batch, length, hq, d).transpose(1, 2).double()
    ref = F.scaled_dot_product_attention(qs, k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1),
                                         is_causal=True, scale=d ** -0.5)
    ref = ref.transpose(1, 2).reshape(batch * length, hq, d)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-5, (batch, length, err)


def test_select_kernels_binds_configs_and_checks_names():
    from pagedlab.kernels import select_kernels
    from pagedlab.kernels.decode_attention import DECODE_CONFIG
    from pagedlab.kernels.gemv import GEMV_CONFIG
    before = (_snapshot(DECODE_CONFIG), _snapshot(GEMV_CONFIG))
    ops = select_kernels("triton", "split_kv", decode_config={"split_kv": {"BLOCK_N": 32}},
                         gemv_config={"residual": {"num_warps": 2}}, pdl="off")
    assert ops.decode_attention.keywords["variant"] == "split_kv"
    assert ops.decode_attention.keywords["config"]["split_kv"]["BLOCK_N"] == 32
    assert ops.decode_attention.keywords["config"]["gqa"] == DECODE_CONFIG["gqa"]
    assert ops.linear_residual.keywords["config"]["num_warps"] == 2
    assert ops.norm_swiglu.keywords["config"] == GEMV_CONFIG["swiglu"]
    assert ops.norm_lm_head.keywords["pdl"] == "off"
    assert (_snapshot(DECODE_CONFIG), _snapshot(GEMV_CONFIG)) == before
    with pytest.raises(ValueError, match="BLOK_N"):
        select_kernels("triton", decode_config={"split_kv": {"BLOK_N": 32}})
    with pytest.raises(ValueError, match="PDL mode"):
        select_kernels("triton", pdl="early")                   # retired (measured slower)
    with pytest.raises(ValueError, match="decode variant"):
        select_kernels("triton", "fast")
    assert not hasattr(select_kernels("torch").decode_attention, "keywords")


@pytest.fixture
def fake_capability(monkeypatch):
    """Pretend the CUDA device has a given compute capability (the device facts are cached)."""
    from pagedlab.kernels import launch

    def fake(cap):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
        launch.clear_device_cache()
    yield fake
    monkeypatch.undo()
    launch.clear_device_cache()


@pytest.mark.parametrize("cap,mode", [((7, 5), "off"), ((8, 0), "off"), ((8, 6), "off"),
                                      ((9, 0), "late"), ((10, 0), "late")])
def test_pdl_only_on_hopper_and_newer(fake_capability, cap, mode, monkeypatch):
    """T4 (sm75) and A100 (sm80) never get a PDL launch, whatever mode is asked for."""
    from pagedlab.kernels import pdl
    fake_capability(cap)
    monkeypatch.setattr(pdl, "REQUESTED_DEFAULT", "late")
    cuda = torch.device("cuda", 0)
    has_gdc = pdl._triton_has_pdl()
    want = mode if has_gdc else "off"
    assert pdl.default_mode(cuda) == want
    assert pdl.effective_mode(cuda, "late") == want
    assert pdl.pdl_flag(cuda, "late") == (want == "late")
    assert pdl.pdl_flag(cuda, "off") == 0
    assert pdl.launch_options(pdl.pdl_flag(cuda)) == ({"launch_pdl": True} if want == "late" else {})
    monkeypatch.setattr(pdl, "REQUESTED_DEFAULT", "off")          # PAGEDLAB_PDL=off
    assert pdl.default_mode(cuda) == "off"
    assert pdl.default_mode(torch.device("cpu")) == "off" and pdl.pdl_flag(torch.device("cpu"), "late") == 0


@pytest.mark.parametrize("cap,stages", [((7, 5), 2), ((8, 0), 3), ((9, 0), 3)])
def test_pipeline_depth_is_capped_before_ampere(fake_capability, cap, stages):
    from pagedlab.kernels import launch
    fake_capability(cap)
    assert launch.num_stages(3, torch.device("cuda", 0)) == stages
    assert launch.num_stages(1, torch.device("cuda", 0)) == 1
    assert launch.num_stages(3, torch.device("cpu")) == 3


def test_sm_count_on_cpu_is_the_named_constant():
    from pagedlab.kernels import launch
    assert launch.sm_count(torch.device("cpu")) == launch.CPU_SM_COUNT

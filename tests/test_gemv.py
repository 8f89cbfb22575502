"""The fused decode-time linear layers (pagedlab/kernels/gemv.py) against their unfused references.

Reference = the plain-torch composition run in fp64 on the same (rounded) inputs. On CPU the fused
kernels run under the Triton interpreter in fp32/fp16 at small irregular shapes; on a GPU in bf16
at full Llama-3.2-1B shapes. Each case also runs above MAX_ROWS (the composed Triton+cuBLAS path).
"""
import functools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagedlab.kernels import gemv, scratch  # noqa: E402
from pagedlab.kernels.rope import rope_cos_sin  # noqa: E402

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
DTYPES = [torch.bfloat16] if GPU else [torch.float32, torch.float16]
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 1e-2}
# (hidden, intermediate, Hq, Hkv, D, vocab): GPU = Llama-3.2-1B; CPU = small and irregular
SHAPES = [(2048, 8192, 32, 8, 64, 128256)] if GPU else [(200, 344, 6, 2, 32, 1001), (64, 96, 4, 4, 16, 77)]
ROWS = [1, 3, gemv.MAX_ROWS, gemv.MAX_ROWS + 3]   # fused kernel up to MAX_ROWS, then composed
# launch configs: the defaults, and small tiles that split K over several programs (split-K with
# its in-kernel reduction) even at the small CPU shapes; BLOCK_R 8 (M = 1 only, else raised to 16)
SPLIT = dict(BLOCK_R=8, K_SPLIT=64, BLOCK_K=32, num_warps=4, num_stages=2)
CONFIGS = {"default": None, "split": SPLIT}    # None: the launcher's own default (GEMV_CONFIG)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def cfg(config):
    """Keyword arguments that pass `config` explicitly, or leave the launcher's default."""
    return {} if config is None else {"config": config}


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def check(out, ref, dtype):
    assert torch.isfinite(out).all()
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"relative error {err:.3g} >= {TOL[dtype]}"


def rand(*shape, dtype, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEV)


def f64(t):
    return t.double()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("t", ROWS)
@pytest.mark.parametrize("config", CONFIGS)
def test_linear_residual(config, dtype, shape, t):
    gen = torch.Generator().manual_seed(t)
    hidden, inter = shape[:2]
    for k, n in [(hidden, hidden), (inter, hidden)]:           # o_proj and down_proj shapes
        x, w = rand(t, k, dtype=dtype, gen=gen), rand(n, k, dtype=dtype, gen=gen, scale=k ** -0.5)
        r = rand(t, n, dtype=dtype, gen=gen)
        out = gemv.linear_residual_triton(x, w, r, **cfg(CONFIGS[config]), fused=t <= gemv.MAX_ROWS)
        assert out.shape == (t, n) and out.dtype == dtype
        check(out, gemv.linear_residual_torch(f64(x), f64(w), f64(r)), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("t", ROWS)
@pytest.mark.parametrize("config", CONFIGS)
def test_norm_swiglu(config, dtype, shape, t):
    gen = torch.Generator().manual_seed(10 + t)
    hidden, inter = shape[:2]
    x = rand(t, hidden, dtype=dtype, gen=gen, scale=3.0)
    g = rand(hidden, dtype=dtype, gen=gen)
    w = rand(2 * inter, hidden, dtype=dtype, gen=gen, scale=hidden ** -0.5)
    out = gemv.norm_swiglu_triton(x, g, 1e-5, w, **cfg(CONFIGS[config]), fused=t <= gemv.MAX_ROWS)
    assert out.shape == (t, inter) and out.dtype == dtype
    check(out, gemv.norm_swiglu_torch(f64(x), f64(g), 1e-5, f64(w)), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("t", ROWS)
@pytest.mark.parametrize("config", CONFIGS)
def test_norm_lm_head(config, dtype, shape, t):
    gen = torch.Generator().manual_seed(20 + t)
    hidden, vocab = shape[0], shape[5]
    x = rand(t, hidden, dtype=dtype, gen=gen, scale=0.5)
    g = rand(hidden, dtype=dtype, gen=gen)
    w = rand(vocab, hidden, dtype=dtype, gen=gen, scale=0.05)
    out = gemv.norm_lm_head_triton(x, g, 1e-5, w, **cfg(CONFIGS[config]), fused=t <= gemv.MAX_ROWS)
    assert out.shape == (t, vocab) and out.dtype == torch.float32
    ref = gemv.norm_lm_head_torch(f64(x), f64(g), 1e-5, f64(w))
    check(out, ref, dtype)
    if t <= gemv.MAX_ROWS:      # greedy picks agree wherever the reference's top-2 gap is clear
        top2 = ref.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 4 * TOL[dtype] * ref.abs().max()
        assert torch.equal(out.argmax(-1)[clear], ref.argmax(-1)[clear])
    # greedy=True: the in-kernel argmax is exactly torch's argmax of the same logits
    logits, tokens = gemv.norm_lm_head_triton(x, g, 1e-5, w, greedy=True, **cfg(CONFIGS[config]), fused=t <= gemv.MAX_ROWS)
    assert tokens.dtype == torch.int64 and torch.equal(logits, out)
    assert torch.equal(tokens, out.argmax(-1))


def test_greedy_ties_pick_the_first_index():
    """Two rows of the head tie for the maximum, in different programs: the smaller index wins,
    as in torch.argmax."""
    dtype = DTYPES[0]
    gen = torch.Generator().manual_seed(5)
    hidden, vocab = SHAPES[-1][0], SHAPES[-1][5]
    # small integers: the two tied dot products are exact whatever the summation order
    x = torch.randint(-3, 4, (3, hidden), generator=gen).to(dtype).to(DEV)
    g = torch.ones(hidden, dtype=dtype, device=DEV)
    w = rand(vocab, hidden, dtype=dtype, gen=gen, scale=0.01)
    winner = x[0].sign()                                       # aligned with token 0's input
    first, second = 5, vocab - 3
    w[first] = w[second] = winner
    logits, tokens = gemv.norm_lm_head_triton(x, g, 1e-5, w, greedy=True, config=SPLIT)
    assert logits[0, first] == logits[0, second] == logits[0].max()
    assert tokens[0].item() == first
    assert torch.equal(tokens, logits.argmax(-1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("t", ROWS)
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("config", CONFIGS)
def test_norm_qkv_rope_store(config, dtype, shape, t, block_size):
    gen = torch.Generator().manual_seed(30 + t + block_size)
    hidden, _, hq, hkv, d, _ = shape
    x = rand(t, hidden, dtype=dtype, gen=gen, scale=2.0)
    g = rand(hidden, dtype=dtype, gen=gen)
    w = rand((hq + 2 * hkv) * d, hidden, dtype=dtype, gen=gen, scale=hidden ** -0.5)
    cos_sin = rope_cos_sin(d, 500000.0, 40000, LLAMA3_SCALING, device=DEV)
    positions = torch.randint(0, 40000, (t,), generator=gen).to(DEV)
    num_blocks = t // block_size + 4
    k_cache = rand(num_blocks, block_size, hkv, d, dtype=dtype, gen=gen)
    v_cache = rand(num_blocks, block_size, hkv, d, dtype=dtype, gen=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t].to(DEV)   # scattered slots
    kc, vc = k_cache.clone(), v_cache.clone()
    q = gemv.norm_qkv_rope_store_triton(x, g, 1e-5, w, positions, cos_sin, kc, vc, slots, hq, **cfg(CONFIGS[config]), fused=t <= gemv.MAX_ROWS)
    kr, vr = f64(k_cache), f64(v_cache)
    qr = gemv.norm_qkv_rope_store_torch(f64(x), f64(g), 1e-5, f64(w), positions, cos_sin.double(),
                                        kr, vr, slots, hq)
    assert q.shape == (t, hq, d) and q.dtype == dtype
    check(q, qr, dtype)
    flat = lambda c: c.reshape(-1, hkv, d)   # noqa: E731
    check(flat(kc)[slots], flat(kr)[slots], dtype)
    check(flat(vc)[slots], flat(vr)[slots], dtype)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEV)
    untouched[slots] = False
    assert torch.equal(flat(kc)[untouched], flat(k_cache)[untouched])     # nothing else written
    assert torch.equal(flat(vc)[untouched], flat(v_cache)[untouched])


def test_qkv_negative_slot_stores_nothing():
    """Padding tokens (slot -1) still get q, but leave the cache alone."""
    dtype = DTYPES[0]
    gen = torch.Generator().manual_seed(7)
    hidden, _, hq, hkv, d, _ = SHAPES[-1]
    x = rand(3, hidden, dtype=dtype, gen=gen)
    g = rand(hidden, dtype=dtype, gen=gen)
    w = rand((hq + 2 * hkv) * d, hidden, dtype=dtype, gen=gen, scale=hidden ** -0.5)
    cos_sin = rope_cos_sin(d, 10000.0, 64, device=DEV)
    positions = torch.tensor([3, 9, 1], device=DEV)
    k_cache = rand(4, 4, hkv, d, dtype=dtype, gen=gen)
    v_cache = rand(4, 4, hkv, d, dtype=dtype, gen=gen)
    kc, vc = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([5, -1, 11], device=DEV)
    q = gemv.norm_qkv_rope_store_triton(x, g, 1e-5, w, positions, cos_sin, kc, vc, slots, hq, config=SPLIT)
    kr, vr = k_cache.clone().double(), v_cache.clone().double()
    keep = torch.tensor([0, 2], device=DEV)
    qr = gemv.norm_qkv_rope_store_torch(f64(x)[keep], f64(g), 1e-5, f64(w), positions[keep],
                                        cos_sin.double(), kr, vr, slots[keep], hq)
    check(q[keep], qr, dtype)
    check(kc.double(), kr, dtype)
    assert torch.equal(kc.reshape(-1, hkv, d)[[0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12]],
                       k_cache.reshape(-1, hkv, d)[[0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12]])
    assert torch.equal(vc.reshape(-1, hkv, d)[[0, 13, 14, 15]], v_cache.reshape(-1, hkv, d)[[0, 13, 14, 15]])


def test_split_k_counters_reset_between_launches():
    """The split-K counters must be back at zero after every launch: run the same launch again
    (as a CUDA graph replay would) and get the same, deterministic result."""
    dtype = DTYPES[0]
    gen = torch.Generator().manual_seed(11)
    x, w, r = rand(1, 200, dtype=dtype, gen=gen), rand(50, 200, dtype=dtype, gen=gen, scale=0.1), rand(1, 50, dtype=dtype, gen=gen)
    first = gemv.linear_residual_triton(x, w, r, config=SPLIT)
    for _ in range(3):
        assert torch.equal(gemv.linear_residual_triton(x, w, r, config=SPLIT), first)
    counters = [v[1] for key, v in scratch.DEFAULT.items() if key[0] == "gemv"]     # (other kernels keep other kinds)
    assert counters and all(int(c.abs().sum()) == 0 for c in counters)
    check(first, gemv.linear_residual_torch(f64(x), f64(w), f64(r)), dtype)


def test_split_k_scratch_belongs_to_its_owner():
    """kernels/scratch.py: launches under owned_by(pool) take their partial sums and counters from
    that pool -- two owners, two sets of buffers for the same shape (an engine's graph capture never
    counts on another engine's counters) -- and the same results; the default pool is not touched."""
    dtype = DTYPES[0]
    gen = torch.Generator().manual_seed(12)
    x, w, r = rand(1, 200, dtype=dtype, gen=gen), rand(50, 200, dtype=dtype, gen=gen, scale=0.1), rand(1, 50, dtype=dtype, gen=gen)
    before = dict(scratch.DEFAULT)
    a, b = {}, {}
    with scratch.owned_by(a):
        ya = gemv.linear_residual_triton(x, w, r, config=SPLIT)
        assert scratch.current() is a
    with scratch.owned_by(b):
        yb = gemv.linear_residual_triton(x, w, r, config=SPLIT)
    assert scratch.current() is scratch.DEFAULT and scratch.DEFAULT == before
    assert list(a) == list(b) and len(a) == 1 and next(iter(a))[0] == "gemv"
    (wa, ca), (wb, cb) = a[next(iter(a))], b[next(iter(b))]
    assert wa.data_ptr() != wb.data_ptr() and ca.data_ptr() != cb.data_ptr()
    assert torch.equal(ya, yb) and int(ca.abs().sum()) == int(cb.abs().sum()) == 0
    check(ya, gemv.linear_residual_torch(f64(x), f64(w), f64(r)), dtype)


def test_forced_paths_agree_and_guard_rows():
    """fused=True/False pick a path explicitly (the benchmark compares them); too many rows for the
    fused kernel is an error, not silently wrong output."""
    dtype = DTYPES[0]
    gen = torch.Generator().manual_seed(3)
    x, w, r = rand(4, 96, dtype=dtype, gen=gen), rand(40, 96, dtype=dtype, gen=gen, scale=0.1), rand(4, 40, dtype=dtype, gen=gen)
    a = gemv.linear_residual_triton(x, w, r, fused=True)
    b = gemv.linear_residual_triton(x, w, r, fused=False)
    check(a, b.double(), dtype)
    with pytest.raises(ValueError, match="at most"):
        gemv.linear_residual_triton(rand(gemv.MAX_ROWS + 1, 96, dtype=dtype, gen=gen), w,
                                    rand(gemv.MAX_ROWS + 1, 40, dtype=dtype, gen=gen), fused=True)


def test_pdl_mode_is_checked_and_off_on_cpu():
    import subprocess
    import sys

    from pagedlab.kernels import pdl
    cpu = torch.device("cpu")
    assert pdl.pdl_flag(cpu) == 0 and pdl.pdl_flag(cpu, "late") == 0 and pdl.launch_options(0) == {}
    with pytest.raises(ValueError, match="must be one of"):
        pdl.pdl_flag(cpu, "prefetch")                   # a retired mode
    bad = subprocess.run([sys.executable, "-c", "import pagedlab.kernels.pdl"], capture_output=True,
                         text=True, env=dict(os.environ, PAGEDLAB_PDL="sometimes"))
    assert bad.returncode != 0 and "PAGEDLAB_PDL must be one of" in bad.stderr


def test_gemv_config_from_env_is_checked_and_defaults_never_change(tmp_path):
    import json
    import subprocess
    import sys

    from pagedlab.kernels.launch import to_plain
    before = to_plain(gemv.GEMV_CONFIG)
    dtype = DTYPES[0]
    gen = torch.Generator().manual_seed(4)
    x, w, r = rand(1, 96, dtype=dtype, gen=gen), rand(40, 96, dtype=dtype, gen=gen, scale=0.1), rand(1, 40, dtype=dtype, gen=gen)
    gemv.linear_residual_triton(x, w, r, config=SPLIT, pdl="off")
    assert to_plain(gemv.GEMV_CONFIG) == before
    with pytest.raises(TypeError):
        gemv.GEMV_CONFIG["residual"]["num_warps"] = 8            # read-only
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps({"residual": {"num_warps": 8}}))
    bad.write_text(json.dumps({"residual": {"num_wraps": 8}}))
    show = "from pagedlab.kernels import gemv; print(gemv.GEMV_CONFIG['residual']['num_warps'], gemv.GEMV_CONFIG['qkv']['BLOCK_R'])"
    r = subprocess.run([sys.executable, "-c", show], capture_output=True, text=True,
                       env=dict(os.environ, PAGEDLAB_GEMV_CONFIG=str(good)))
    assert r.stdout.split() == ["8", str(gemv.GEMV_CONFIG["qkv"]["BLOCK_R"])], r.stderr
    r = subprocess.run([sys.executable, "-c", show], capture_output=True, text=True,
                       env=dict(os.environ, PAGEDLAB_GEMV_CONFIG=str(bad)))
    assert r.returncode != 0 and "num_wraps" in r.stderr


@pytest.mark.skipif(not GPU, reason="programmatic dependent launch needs a Hopper GPU")
def test_pdl_modes_give_identical_results():
    """A decode layer's kernels back to back (no sync between them) under every PDL mode: a kernel
    that read its input before the previous one finished writing it would change the numbers."""
    from pagedlab.kernels import pdl
    from pagedlab.kernels.decode_attention import decode_attention_triton
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90+")
    hidden, inter, hq, hkv, d, vocab = SHAPES[0]
    gen = torch.Generator().manual_seed(5)
    dt = torch.bfloat16
    h0 = rand(1, hidden, dtype=dt, gen=gen)
    norm_w = rand(hidden, dtype=dt, gen=gen, scale=0.2) + 1
    w_qkv = rand((hq + 2 * hkv) * d, hidden, dtype=dt, gen=gen, scale=hidden ** -0.5)
    w_o = rand(hidden, hq * d, dtype=dt, gen=gen, scale=hidden ** -0.5)
    w_gu = rand(2 * inter, hidden, dtype=dt, gen=gen, scale=hidden ** -0.5)
    w_d = rand(hidden, inter, dtype=dt, gen=gen, scale=inter ** -0.5)
    w_lm = rand(vocab, hidden, dtype=dt, gen=gen, scale=hidden ** -0.5)
    cos_sin = rope_cos_sin(d, 500000.0, 4096, LLAMA3_SCALING, device=DEV)
    ctx, bs = 777, 16
    blocks = -(-ctx // bs)
    k0, v0 = rand(blocks + 1, bs, hkv, d, dtype=dt, gen=gen), rand(blocks + 1, bs, hkv, d, dtype=dt, gen=gen)
    table = torch.randperm(blocks + 1, generator=gen)[:blocks].to(torch.int32).view(1, -1).to(DEV)
    pos = torch.tensor([ctx - 1], device=DEV)
    slot = (table[0, (ctx - 1) // bs].long() * bs + (ctx - 1) % bs).view(1)
    seq_lens = torch.tensor([ctx], dtype=torch.int32, device=DEV)

    def layer_steps(mode):
        k_cache, v_cache = k0.clone(), v0.clone()
        h = h0
        for _ in range(3):
            q = gemv.norm_qkv_rope_store_triton(h, norm_w, 1e-5, w_qkv, pos, cos_sin, k_cache, v_cache,
                                                slot, hq, pdl=mode)
            o = decode_attention_triton(q, k_cache, v_cache, table, seq_lens, d ** -0.5, 4096, pdl=mode)
            h = gemv.linear_residual_triton(o.reshape(1, hq * d), w_o, h, pdl=mode)
            h = gemv.linear_residual_triton(gemv.norm_swiglu_triton(h, norm_w, 1e-5, w_gu, pdl=mode),
                                            w_d, h, pdl=mode)
        logits, tok = gemv.norm_lm_head_triton(h, norm_w, 1e-5, w_lm, greedy=True, pdl=mode)
        return h, logits, tok, k_cache

    results = {mode: layer_steps(mode) for mode in pdl.MODES}
    torch.cuda.synchronize()
    for mode, res in results.items():
        for a, b in zip(res, results["off"]):
            assert torch.equal(a, b), f"PDL mode {mode!r} changed the results"


# ACC2D (one token): the products summed over K once per program, not once per loop step.
# Split K and not, with a loop of several steps (BLOCK_K 32 < K_SPLIT) and a ragged last step.
ACC2D = {"split": dict(SPLIT, K_SPLIT=48, BLOCK_K=16, ACC2D=1),
         "whole_k": dict(SPLIT, BLOCK_R=4, K_SPLIT=4096, BLOCK_K=32, ACC2D=1)}


def one_token_inputs(gen, dtype, fp8: bool, hidden: int, inter: int):
    """One token's inputs for the fused kernels, and weight(n, k) -> (the weight the kernel takes,
    its fp64 reference): a plain weight, or FP8 codes + scales and their dequantized fp64 values."""
    from pagedlab.quantization import quantize_weight

    def weight(n, k):
        w = rand(n, k, dtype=dtype, gen=gen, scale=k ** -0.5)
        if not fp8:
            return w, f64(w)
        q = quantize_weight(w)
        return q, q.q.double() * q.scale.double()[:, None]
    x = rand(1, hidden, dtype=dtype, gen=gen, scale=2.0)
    return weight, x, rand(1, inter, dtype=dtype, gen=gen), rand(1, hidden, dtype=dtype, gen=gen), \
        rand(hidden, dtype=dtype, gen=gen)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", ACC2D)
@pytest.mark.parametrize("fp8", [False, True])
def test_acc2d_one_token(config, dtype, fp8):
    """Every fused kernel at one token with ACC2D on, plain and FP8 weights, against the fp64
    composition of the references on the same (dequantized) weights; the greedy token exactly
    torch's argmax of the kernel's logits."""
    c = ACC2D[config]
    gen = torch.Generator().manual_seed(41 + len(config) + fp8)
    hidden, inter, hq, hkv, d, vocab = SHAPES[-1]
    weight, x, xi, r, g = one_token_inputs(gen, dtype, fp8, hidden, inter)
    kw = dict(config=c, fp8_config=c, fused=True)
    tol = max(TOL[dtype], 2e-2) if fp8 else TOL[dtype]
    for xin in (x, xi):
        w, wr = weight(hidden, xin.shape[1])
        out = gemv.linear_residual_triton(xin, w, r, **kw)
        err = rel_err(out, gemv.linear_residual_torch(f64(xin), wr, f64(r)))
        assert err < tol, err
    w, wr = weight(2 * inter, hidden)
    err = rel_err(gemv.norm_swiglu_triton(x, g, 1e-5, w, **kw), gemv.norm_swiglu_torch(f64(x), f64(g), 1e-5, wr))
    assert err < tol, err
    w, wr = weight(vocab, hidden)
    logits, tokens = gemv.norm_lm_head_triton(x, g, 1e-5, w, greedy=True, **kw)
    assert rel_err(logits, gemv.norm_lm_head_torch(f64(x), f64(g), 1e-5, wr)) < tol
    assert torch.equal(tokens, logits.argmax(-1))
    w, wr = weight((hq + 2 * hkv) * d, hidden)
    cos_sin = rope_cos_sin(d, 500000.0, 64, device=DEV)
    pos, slots = torch.tensor([37], device=DEV), torch.tensor([9], device=DEV)
    k_cache = rand(4, 4, hkv, d, dtype=dtype, gen=gen)
    v_cache = rand(4, 4, hkv, d, dtype=dtype, gen=gen)
    kc, vc, kr, vr = k_cache.clone(), v_cache.clone(), f64(k_cache), f64(v_cache)
    q = gemv.norm_qkv_rope_store_triton(x, g, 1e-5, w, pos, cos_sin, kc, vc, slots, hq, **kw)
    qr = gemv.norm_qkv_rope_store_torch(f64(x), f64(g), 1e-5, wr, pos, cos_sin.double(), kr, vr, slots, hq)
    for a, b in ((q, qr), (kc, kr), (vc, vr)):
        assert rel_err(a, b) < tol


# PREFETCH (one token): extra programs at the front of the grid read another matrix into L2 and
# change nothing else -- the result bit for bit that of the plain launch, and close to fp64.
PREFETCH = {"split": dict(SPLIT, K_SPLIT=40, BLOCK_K=16, ACC2D=0),          # ragged last step
            "acc2d_one_step": dict(SPLIT, BLOCK_R=4, K_SPLIT=16, BLOCK_K=16, ACC2D=1)}


@pytest.mark.parametrize("dtype", DTYPES[:1])
@pytest.mark.parametrize("config,fp8", [("split", False), ("acc2d_one_step", True)])
def test_prefetch_one_token(config, dtype, fp8):
    plain = PREFETCH[config]
    tried = dict(plain, PREFETCH=5, PREFETCH_MB=0)
    gen = torch.Generator().manual_seed(43 + len(config) + fp8)
    hidden, inter, hq, hkv, d, vocab = SHAPES[-1]
    weight, x, xi, r, g = one_token_inputs(gen, dtype, fp8, hidden, inter)
    other, _ = weight(37, 29)                 # the "next" matrix: odd size, int8 words when fp8
    tol = max(TOL[dtype], 2e-2) if fp8 else TOL[dtype]

    def both(fn, ref):
        a = fn(dict(config=plain, fp8_config=plain, fused=True))
        b = fn(dict(config=tried, fp8_config=tried, fused=True, prefetch=other))
        for u, v in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            assert torch.equal(u, v), "PREFETCH changed the result"
        assert rel_err(b[0] if isinstance(b, tuple) else b, ref) < tol
    for xin in (x, xi):
        w, wr = weight(hidden, xin.shape[1])
        both(lambda kw: gemv.linear_residual_triton(xin, w, r, **kw),
             gemv.linear_residual_torch(f64(xin), wr, f64(r)))
    w, wr = weight(2 * inter, hidden)
    both(lambda kw: gemv.norm_swiglu_triton(x, g, 1e-5, w, **kw),
         gemv.norm_swiglu_torch(f64(x), f64(g), 1e-5, wr))
    w, wr = weight((hq + 2 * hkv) * d, hidden)
    cos_sin = rope_cos_sin(d, 500000.0, 64, device=DEV)
    pos, slots = torch.tensor([37], device=DEV), torch.tensor([9], device=DEV)
    k_cache = rand(4, 4, hkv, d, dtype=dtype, gen=gen)
    v_cache = rand(4, 4, hkv, d, dtype=dtype, gen=gen)
    outs = []
    for kw in (dict(config=plain, fp8_config=plain), dict(config=tried, fp8_config=tried, prefetch=other)):
        kc, vc = k_cache.clone(), v_cache.clone()
        outs.append((gemv.norm_qkv_rope_store_triton(x, g, 1e-5, w, pos, cos_sin, kc, vc, slots, hq,
                                                     fused=True, **kw), kc, vc))
    kr, vr = f64(k_cache), f64(v_cache)
    qr = gemv.norm_qkv_rope_store_torch(f64(x), f64(g), 1e-5, wr, pos, cos_sin.double(), kr, vr, slots, hq)
    for a, b, ref in zip(outs[0], outs[1], (qr, kr, vr)):
        assert torch.equal(a, b)
        assert rel_err(b, ref) < tol


def test_prefetch_programs_are_extra_row_blocks():
    """The prefetch programs are whole row blocks added to the grid, no more than the words need,
    and none for a launch of several tokens or a config without PREFETCH."""
    x = torch.zeros(1, 64)
    w = torch.zeros(4000, 64)                                                      # 256,000 words
    cfg = dict(SPLIT, PREFETCH=64, PREFETCH_MB=0)
    blocks, kw = gemv._prefetch_args(w, 2, cfg, 1, x.device)
    assert blocks == 32 and kw["pf_n"] == 256000 and kw["PF_BLOCKS"] == 32      # 64 programs / 2 splits
    blocks, kw = gemv._prefetch_args(w[:1000], 2, cfg, 1, x.device)             # 64,000 words: 16 programs
    assert blocks == 8 and kw["pf_n"] == 64000
    small = torch.zeros(3, 5, dtype=torch.float16)                                # 30 bytes: uint8 words
    blocks, kw = gemv._prefetch_args(small, 2, cfg, 1, x.device)
    assert blocks == 1 and kw["pf_n"] == 30 and kw["pf_ptr"].dtype == torch.uint8
    assert gemv._prefetch_args(w, 2, cfg, 2, x.device) == (0, {})
    assert gemv._prefetch_args(w, 2, SPLIT, 1, x.device) == (0, {})
    assert gemv._prefetch_args(None, 2, cfg, 1, x.device) == (0, {})
    capped = dict(cfg, PREFETCH_MB=1)
    big = torch.zeros(1 << 19, dtype=torch.int32)                                  # 2 MB
    assert gemv._prefetch_args(big, 1, capped, 1, x.device)[1]["pf_n"] == (1 << 20) // 4


# ATTN (one token, decode only): the decode attention runs in the QKV launch's tail -- the
# program that completes a KV head group's row blocks attends for it. Against the fp64
# composition (QKV, then attention over the paged cache), and bit for bit against the two
# launches with the gqa kernel (the same loop), at a context of several ragged BLOCK_N tiles
# over scattered pages; twice in a row (the group counters reset) and, above the config's ATTN
# context bound, the two-launch path.
ATTN = {"split": dict(SPLIT, ACC2D=0, PREFETCH=0, PREFETCH_MB=0, ATTN=64, ATTN_BLOCK_N=16),
        "acc2d_prefetch": dict(SPLIT, BLOCK_R=4, K_SPLIT=16, BLOCK_K=16, ACC2D=1, PREFETCH=3,
                               PREFETCH_MB=0, ATTN=64, ATTN_BLOCK_N=32)}


@pytest.mark.parametrize("config,fp8,shape,dtype", [("split", False, 0, d) for d in DTYPES]
                         + [("acc2d_prefetch", True, 1, DTYPES[0])])
def test_attention_in_qkv_launch(config, dtype, fp8, shape):
    from pagedlab.kernels.decode_attention import DECODE_CONFIG, decode_attention_triton
    from pagedlab.kernels.launch import merge_config
    c = ATTN[config]
    gen = torch.Generator().manual_seed(47 + shape + fp8)
    hidden, inter, hq, hkv, d, _ = SHAPES[shape % len(SHAPES)]
    weight, x, _, _, g = one_token_inputs(gen, dtype, fp8, hidden, inter)
    w, wr = weight((hq + 2 * hkv) * d, hidden)
    other, _ = weight(37, 29)
    bs, ctx = 5, 43                                   # 9 pages, the last one partly filled
    nb = 12
    cos_sin = rope_cos_sin(d, 500000.0, 64, device=DEV)
    table = torch.randperm(nb, generator=gen)[:9].int()[None].to(DEV)
    pos = torch.tensor([ctx - 1], device=DEV)
    slot = (table[0, (ctx - 1) // bs].long() * bs + (ctx - 1) % bs).view(1)
    lens = torch.tensor([ctx], dtype=torch.int32, device=DEV)
    k_cache = rand(nb, bs, hkv, d, dtype=dtype, gen=gen)
    v_cache = rand(nb, bs, hkv, d, dtype=dtype, gen=gen)
    gqa = functools.partial(decode_attention_triton, variant="gqa",
                            config=merge_config(DECODE_CONFIG, {"gqa": {"BLOCK_N": c["ATTN_BLOCK_N"]}}))
    off = dict(c, ATTN=0)
    kr, vr = f64(k_cache), f64(v_cache)
    ref = gemv.norm_qkv_rope_store_attend_torch(f64(x), f64(g), 1e-5, wr, pos, cos_sin.double(), kr, vr,
                                                slot, hq, table, lens, d ** -0.5)
    runs = []
    for cf, bound in ((off, 64), (c, 64), (c, 64), (c, 65)):     # the 2nd fused run: counters reset
        assert gemv.attend_fused(x, k_cache, cf, bound) == (cf is c and bound == 64)
        kc, vc = k_cache.clone(), v_cache.clone()
        o = gemv.norm_qkv_rope_store_attend_triton(x, g, 1e-5, w, pos, cos_sin, kc, vc, slot, hq, table,
                                                   lens, d ** -0.5, bound, config=cf, fp8_config=cf,
                                                   prefetch=other, decode_attention=gqa)
        runs.append((o, kc, vc))
    tol = max(TOL[dtype], 2e-2) if fp8 else TOL[dtype]
    assert runs[0][0].shape == (1, hq, d)
    for o, kc, vc in runs:
        for a, b in zip((o, kc, vc), runs[0]):
            assert torch.equal(a, b), "attention in the QKV launch changed the result"
        assert rel_err(o, ref) < tol
        assert rel_err(kc, kr) < tol


@pytest.mark.skipif(not GPU, reason="the interpreter's argmax (numpy's nanargmax) refuses an all-NaN row")
@pytest.mark.parametrize("config", CONFIGS)
def test_greedy_tokens_stay_in_the_vocabulary_on_nan_logits(config):
    """A row whose logits are all NaN (what garbage in the residual stream gives) still yields a
    token id inside the vocabulary: the next step gathers its embedding by that id, and one
    outside is an illegal address that ends the process. (Triton's argmax keeps the right operand
    when a comparison with NaN is false, so the reduction could end on a masked lane past the
    vocabulary; docs/kernels.md, session 16.)"""
    dtype = DTYPES[0]
    gen = torch.Generator().manual_seed(9)
    hidden, vocab = SHAPES[-1][0], SHAPES[-1][5]
    x = rand(3, hidden, dtype=dtype, gen=gen, scale=0.5)
    x[1] = float("nan")
    g = rand(hidden, dtype=dtype, gen=gen)
    w = rand(vocab, hidden, dtype=dtype, gen=gen, scale=0.05)
    logits, tokens = gemv.norm_lm_head_triton(x, g, 1e-5, w, greedy=True, **cfg(CONFIGS[config]), fused=True)
    assert torch.isnan(logits[1]).all() and not torch.isnan(logits[[0, 2]]).any()
    assert ((tokens >= 0) & (tokens < vocab)).all(), tokens
    assert torch.equal(tokens[[0, 2]], logits[[0, 2]].argmax(-1))

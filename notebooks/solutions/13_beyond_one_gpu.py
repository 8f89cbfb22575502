# Solutions to notebook 13. Run from the notebook (uses torch, plt, shard_ref, parallel_course,
# LLAMA_3_2_1B, BENCH, silu).
import statistics
import time


# 1. Which splits work. Every cut dimension must divide: query heads, KV heads, the MLP width and the
#    vocabulary. The KV heads are the smallest of them, so they set the limit: Llama-3.2-1B and
#    Llama-3.1-70B (8 KV heads) split into 1, 2, 4 or 8; SmolLM2 (3 KV heads, 9 query heads) into 1
#    or 3. With TP larger than the number of KV heads a rank would hold a fraction of a KV head --
#    impossible, since a query head needs its KV head's whole vectors. Engines that allow it COPY
#    the KV heads instead (each on several ranks): the weights still split, but the KV cache per
#    GPU stops shrinking.
models = {"Llama-3.2-1B": LLAMA_3_2_1B, "SmolLM2-135M": parallel_course.SMOLLM2_135M,
          "Llama-3.1-70B": parallel_course.LLAMA_3_1_70B}
for label, c in models.items():
    works = []
    for tp in range(1, 17):
        try:
            shard_ref.check_split(c, tp)
            works.append(tp)
        except ValueError:
            pass
    dims = {"query heads": c.num_heads, "KV heads": c.num_kv_heads, "MLP width": c.intermediate_size,
            "vocabulary": c.vocab_size}
    limit = min(dims, key=dims.get)
    print(f"{label:14} TP in {works}; {', '.join(f'{k} {v:,}' for k, v in dims.items())} -> limited by the {limit}")


# 2. Count the talk (Llama-3.2-1B, TP=2, bf16). Per decode step: 2 all-reduces x 16 layers + 1 after
#    the embedding = 33 all-reduces of [B, 2048] bf16, and the logits' all-gather ([B, V/2] fp32 from
#    each rank). The weights each GPU reads per step: half of 2.47 GB.
c = LLAMA_3_2_1B
weights_per_gpu = c.num_parameters() * 2 / 2
for batch in (1, 256):
    reduce_bytes = 33 * batch * c.hidden_size * 2
    gather_bytes = batch * (c.vocab_size // 2) * 4
    print(f"batch {batch:3}: all-reduces {reduce_bytes / 1e6:7.3f} MB, logits all-gather {gather_bytes / 1e6:7.2f} MB, "
          f"weights read per GPU {weights_per_gpu / 1e9:.2f} GB ({(reduce_bytes + gather_bytes) / weights_per_gpu:.2%})")
if BENCH is not None:
    tp2 = next(r for r in BENCH["rows"] if r["config"] == "TP=2")
    if tp2.get("allreduce_us_per_step"):
        us = tp2["allreduce_us_per_step"]
        print(f"measured at batch 1: {us:.0f} us of NCCL per step for 34 collectives = {us / 34:.1f} us each, "
              f"for 4 KB all-reduces that NVLink would move in well under a microsecond:")
print("the collectives are bound by their COUNT (a fixed cost each: launch, wait for the other GPU, "
      "synchronize), not by their bytes.")


# 3. Measure the fixed cost of an all-reduce between two processes (gloo over the loopback here;
#    NCCL over NVLink is faster, but has a floor of its own).
sizes = [1, 10, 100, 1_000, 10_000, 100_000, 1_000_000]


def time_all_reduce(comm):
    out = {}
    for n in sizes:
        t = torch.ones(n)
        repeat = 50 if n <= 10_000 else 10
        for _ in range(5):                                    # warm up
            comm.all_reduce(t)
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            comm.all_reduce(t)
            times.append(time.perf_counter() - t0)
        out[n] = (statistics.median(times) * 1e6, (max(times) - min(times)) * 1e6)
    return out


res = parallel_course.run_ranks(time_all_reduce)[0]
for n, (med, spread) in res.items():
    print(f"{n:>9,} floats ({n * 4 / 1024:9.1f} KiB): median {med:9.1f} us (spread {spread:.1f} us)")
floor = res[1][0]
print(f"the floor: about {floor:.0f} us for one float; 34 of them would add {34 * floor / 1e3:.1f} ms to every step")
plt.figure(figsize=(5, 3))
plt.loglog([n * 4 for n in sizes], [res[n][0] for n in sizes], "o-")
plt.xlabel("bytes all-reduced")
plt.ylabel("median time (us)")
plt.title("gloo all_reduce, 2 processes, this machine")
plt.grid(alpha=0.3, which="both")


# 4. The other order. SiLU is not linear: silu(g0 + g1) != silu(g0) + silu(g1), so with gate/up
#    row-parallel (each rank holding a PARTIAL gate and up) the ranks must add the partials up
#    BEFORE SwiGLU: an all-reduce of gate and up, 2 x intermediate numbers per token. Then down,
#    column-parallel, leaves the output scattered by feature: an all-gather of hidden numbers to
#    make h whole again. Column -> row exchanges ONE all-reduce of hidden numbers per token.
g0, g1 = torch.randn(5), torch.randn(5)
print("silu(g0 + g1)        ", [round(v, 3) for v in silu(g0 + g1).tolist()])
print("silu(g0) + silu(g1)  ", [round(v, 3) for v in (silu(g0) + silu(g1)).tolist()])
row_first = 2 * c.intermediate_size + c.hidden_size
print(f"numbers exchanged per token per MLP, Llama-3.2-1B: row -> column {row_first:,} "
      f"(2 x {c.intermediate_size:,} + {c.hidden_size:,}), column -> row {c.hidden_size:,}: "
      f"{row_first / c.hidden_size:.0f}x more, and two collectives instead of one")

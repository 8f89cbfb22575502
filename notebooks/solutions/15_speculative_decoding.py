# Solutions to notebook 15. Run from the notebook (uses llm, copy_prompt, params, real, out,
# NgramProposer, Speculator, use, mine).
from pagedlab.config import LLAMA_3_2_1B
from pagedlab.course import quant as quant_course

# 1. k. Tokens per step grow with k while the guesses keep being right, and level off where the
#    runs of right guesses end (a copy that diverges from its source). A step emits the kept
#    guesses plus one token of the model's own, so never more than k + 1.
for k in (1, 2, 4, 8):
    use(llm.engine, Speculator(NgramProposer(3, 1), k, adaptive=False))
    llm.engine.reset_timing()
    o = llm.generate([copy_prompt], params, chat=real)[0]
    print(f"k={k}: {len(o.token_ids) / llm.engine.timing['steps']:.2f} tokens per step "
          f"(kept {o.num_spec_accepted} of {o.num_spec_proposed})")
use(llm.engine, mine)

# 2. Expected tokens per verify: 1 + r + ... + r^k = (1 - r^(k+1)) / (1 - r).
for r in (0.5, 0.8, 0.95):
    print(f"r={r}: {(1 - r ** 5) / (1 - r):.2f} tokens per step with k=4")
if out.num_spec_proposed:
    print(f"the copy-heavy run kept {out.num_spec_accepted / out.num_spec_proposed:.0%} of its guesses")

# 3. Batch 64 vs 320 rows. Weight bytes per step stay ~2.5 GB (bf16); flops are 2 x params x rows.
#    At 4.8 TB/s the bytes take ~0.5 ms; 320 rows x 2 x 1.24e9 flops = 0.79 TFLOP -> ~0.8 ms at
#    990 TFLOP/s (and real GEMMs reach a fraction of that): the step is compute bound and longer,
#    so unless most guesses are kept, the batch gets slower. Speculation pays at small batch.
r = quant_course.weight_bytes_per_token(LLAMA_3_2_1B, 2)
params_count = r["linear"] / 2
for rows in (64, 320):
    t_bytes = r["total"] / 4.8e12
    t_flops = 2 * params_count * rows / 990e12
    print(f"{rows} rows: bytes {t_bytes * 1e3:.2f} ms, flops {t_flops * 1e3:.2f} ms -> "
          f"~{max(t_bytes, t_flops) * 1e3:.2f} ms per step")

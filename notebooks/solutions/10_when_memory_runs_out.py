# Solutions to notebook 10. Run from the notebook (uses MODEL, tight, prompts, params, SLOTS).
from pagedlab.kv_cache import blocks_needed

# 1. The smallest pool without preemption: search upwards.
for n in range(POOL_BLOCKS, 64):
    t = LLM(MODEL, dtype="float32", max_num_seqs=SLOTS, num_blocks=n, trace=True,
            show_progress=False, checkpoint=tight.checkpoint)
    t.generate(prompts, params)
    if not any(s.preempted for s in t.trace.steps):
        print(f"no preemption from {n} blocks")
        break
# A safe prediction: the SLOTS largest final sizes, in blocks. (The real minimum can be lower:
# the longest requests are not necessarily running at the same time.)
final = sorted((blocks_needed(len(p) + sp.max_new_tokens, 16) for p, sp in zip(prompts, params)), reverse=True)
print("upper bound from lengths:", sum(final[:SLOTS]))
assert n <= sum(final[:SLOTS])

# 2. Preempting the oldest throws away the most work (its whole long context must be recomputed),
#    and the oldest is the closest to finishing and freeing its blocks. Worse, the re-admitted old
#    request becomes the newest, so two long requests can evict each other again and again.

# Solutions to notebook 05. Run from the notebook (uses per_token, lengths, SLOTS, simulate_static).
# 1. The original's 2 GiB pool.
tokens = (2 << 30) // per_token
print(f"2 GiB / {per_token // 1024} KiB = {tokens} tokens = {tokens // 2048} sequences of 2048 tokens "
      f"(the original's 65,536 blocks each hold 16 tokens of ONE layer: 65,536 x 16 / 16 layers)")
assert tokens == 65536

# 2. Sorting by length before batching.
order = sorted(range(len(lengths)), key=lambda r: lengths[r])
sorted_sim = simulate_static([lengths[r] for r in order], SLOTS)
busy_sorted = sum(r is not None for s in sorted_sim for r in s)
print(f"sorted: {len(sorted_sim)} steps, utilization {busy_sorted / (len(sorted_sim) * SLOTS):.0%}")
assert len(sorted_sim) <= len(simulate_static(lengths, SLOTS))
# A server does not know how many tokens a request will produce (it stops at an end-of-turn token),
# and cannot hold early arrivals back to wait for similar ones without hurting their latency.

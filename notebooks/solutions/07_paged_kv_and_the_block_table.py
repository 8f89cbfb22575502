# Solutions to notebook 07. Run from the notebook (uses trace, prompt_len, stored, blocks_needed, Allocator).
# 1. Waste for several block sizes, from the same run.
for bs in (1, 4, 16, 64, 256):
    reserved, done = 0, {}
    for s in trace.steps:
        for rid in s.slot_request:
            if rid is not None:                  # prompt + k tokens cached at a request's k-th step
                reserved += blocks_needed(prompt_len[rid] + done.get(rid, 0), bs) * bs
                done[rid] = done.get(rid, 0) + 1
    print(f"block size {bs:3d}: paged wastes {1 - sum(stored) / reserved:.1%}")
    if bs == BS:
        assert reserved == sum(paged)          # the same count as the notebook's
# 1-token blocks waste nothing, but the block table gets as long as the sequence, the kernels do
# one table lookup (a dependent memory read) per token instead of per 16, and K/V loads become
# tiny scattered reads. 16 keeps the waste small and the reads large.


# 2. A stricter allocator.
class CheckedAllocator(Allocator):
    @property
    def num_free(self):
        return len(self.free_list)

    def allocate(self, who, n=1):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"allocate at least one block, got {n!r}")
        return super().allocate(who, n)


a = CheckedAllocator(4)
a.allocate("x", 3)
try:
    a.allocate("y", 0)
except ValueError as e:
    print("refused:", e)
assert a.num_free == 1
# pagedlab's Scheduler.schedule() checks allocator.num_free before every allocation: a new request
# waits in the queue, and a running one that needs a block preempts the newest running request.

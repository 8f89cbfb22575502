# Solutions to notebook 10. Run from the notebook (uses MODEL, SCHED_MODEL, tight, prompts, params, SLOTS,
# POOL_BLOCKS, workload, make_room, LLM).
from pagedlab.kv_cache import blocks_needed


# 1. The smallest pool without preemption. "Preempts or not" only gets better with more blocks,
#    so bisect between a pool that preempts (POOL_BLOCKS) and one that cannot (every request's
#    final size at once). The schedule depends on lengths only: pagedlab's Scheduler without a
#    model (course's pagedlab_schedule) answers each try in milliseconds; one engine run confirms.
from pagedlab.course.checks import pagedlab_schedule


def preempts(n):
    return any(s["preempted"] for s in pagedlab_schedule(workload, SLOTS, n))


final = sorted((blocks_needed(p + m, 16) for p, m in workload), reverse=True)
lo, hi = POOL_BLOCKS, sum(final)           # lo preempts, hi cannot
assert preempts(lo) and not preempts(hi)
while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if preempts(mid) else (lo, mid)
t = LLM(SCHED_MODEL, dtype="float32", max_num_seqs=SLOTS, num_blocks=hi, trace=True, admit_group=1,
        show_progress=False, checkpoint=tight.checkpoint)
t.generate(prompts, params)
assert not any(s.preempted for s in t.trace.steps)
print(f"no preemption from {hi} blocks ({hi - 1} preempt)")
# A safe prediction: the SLOTS largest final sizes, in blocks. (The real minimum can be lower:
# the longest requests are not necessarily running at the same time.)
print("upper bound from lengths:", sum(final[:SLOTS]))
assert hi <= sum(final[:SLOTS])


# 2. Preempt the oldest instead: your make_room with victim = state.running[0] -- the one line that
#    changes; here the course's make_room with that line as a parameter.
from pagedlab.course.checks import EngineState, make_room_preempting, reference_step


def make_room_oldest(state, seq):
    return make_room_preempting(state, seq, which=0)


thrown = {}
for rule in (make_room, make_room_oldest):
    st, steps, lost = EngineState.new(workload, SLOTS, POOL_BLOCKS), 0, 0
    while st.has_work() and steps < 5000:
        st.preempted = []
        before = {s.rid: s.num_tokens for s in st.running}
        reference_step(st, rule)
        lost += sum(before[r] for r in st.preempted if r in before)
        steps += 1
    print(f"{rule.__name__:17s}: {steps} steps, {lost} cached tokens thrown away"
          + ("" if not st.has_work() else " -- and still not done"))
    thrown[rule.__name__] = lost
assert thrown["make_room"] > thrown["make_room_oldest"]     # what the notebook's text says of this workload
# Read the two lines above: which rule throws away more on a workload depends on how far each
# victim had got when the pool ran out (on this one, with the course's lengths, newest-first
# throws away more). The case against the oldest is the worst case: the oldest running request has usually computed the most (all of it is
# recomputed), it is the closest to finishing and freeing its blocks, and once re-admitted it is
# the newest -- so two long requests can evict each other again and again. Newest-first never
# touches the oldest running request (as long as the pool can hold it alone): it runs to the
# end, then the next oldest does, so every request finishes.

# 3. With the notebook's model: the same preemptions (lengths decide them), and recompute is still
#    invisible in the tokens. (On a CPU the first 4 requests make the point in seconds: one of them
#    is preempted.)
few = slice(None) if torch.cuda.is_available() else slice(0, 4)
runs = {}
for name in (SCHED_MODEL, MODEL):
    e = LLM(name, dtype="float32", max_num_seqs=SLOTS, num_blocks=POOL_BLOCKS, trace=True, admit_group=1,
            show_progress=False)
    got = e.generate(prompts[few], params[few])
    runs[name] = [s.preempted for s in e.trace.steps]
roomy_real = LLM(MODEL, dtype="float32", max_num_seqs=SLOTS, admit_group=1, show_progress=False,
                 checkpoint=e.checkpoint)
assert [o.token_ids for o in got] == [o.token_ids for o in roomy_real.generate(prompts[few], params[few])]
assert runs[MODEL] == runs[SCHED_MODEL] and any(runs[MODEL])     # the same preemptions, at least one
print(f"{MODEL}: the same {sum(map(len, runs[MODEL]))} preemptions as {SCHED_MODEL}, and the same tokens as a roomy pool")

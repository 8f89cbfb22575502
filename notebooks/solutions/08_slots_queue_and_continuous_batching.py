# Solutions to notebook 08. Run from the notebook (uses trace, lengths, SLOTS, MODEL, prompts, params).
import math

# 1. A lower bound: the longest request needs max(lengths) steps on its own, and each step makes at
#    most SLOTS tokens, so sum(lengths) tokens need at least sum / SLOTS steps.
bound = max(max(lengths), math.ceil(sum(lengths) / SLOTS))
print(f"lower bound {bound} steps, continuous batching took {len(trace)}")
assert len(trace) >= bound


# 2. One request's life.
def lifecycle(trace, rid):
    events = [(s.step, s.slot_request.index(rid), s.slot_phase[s.slot_request.index(rid)])
              for s in trace.steps if rid in s.slot_request]
    finished = next(s.step for s in trace.steps if rid in s.finished)
    return events, finished


events, finished = lifecycle(trace, 3)
print(events[:3], "...", events[-1], "finished at step", finished)
assert events[0][2] == "prefill" and all(ph == "decode" for _, _, ph in events[1:])
assert finished == events[-1][0] and len(events) == lengths[3]

# 3. When the queue empties, slots that free can no longer be refilled: utilization falls
#    (the "tail" of the run, waiting for the longest remaining requests).
empty_at = next(s.step for s in trace.steps if not s.queue)
tail = trace.steps[empty_at:]
tail_util = sum(p is not None for s in tail for p in s.slot_phase) / (len(tail) * SLOTS)
print(f"queue empty from step {empty_at}; utilization after that: {tail_util:.0%}")

# 4. The schedule depends on lengths only: with ignore_eos=True each request runs exactly its
#    max_new_tokens, whatever tokens the model picks, so any model gives the same slots and blocks.
#    (On a CPU the first 8 requests make the point in seconds; the whole workload takes minutes.)
few = slice(None) if torch.cuda.is_available() else slice(0, 8)
runs = {}
for name in (SCHED_MODEL, MODEL):
    e = LLM(name, max_num_seqs=SLOTS, num_blocks=NUM_BLOCKS, block_size=BS, trace=True, admit_group=1,
            show_progress=False)
    e.generate(prompts[few], params[few])
    runs[name] = [s.slot_request for s in e.trace.steps]
assert runs[MODEL] == runs[SCHED_MODEL]
print(f"{MODEL} and {SCHED_MODEL}: the same {len(runs[MODEL])} steps, slot for slot")

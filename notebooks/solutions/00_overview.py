# Solutions to notebook 00. Run from the notebook (uses MODEL, PROMPTS, MAX_NEW_TOKENS, SLOTS).
from pagedlab import LLM, SamplingParams

# 1. Fewer slots -> more steps; more slots than prompts does not help once every prompt has one.
#    Steps are bounded below by the longest request (prefill + its decode steps), not by n / slots.
for slots in (1, 4):
    other = LLM(MODEL, max_num_seqs=slots, trace=True, admit_group=1, show_progress=False, checkpoint=llm.checkpoint)
    other.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW_TOKENS), chat=True)
    print(f"{slots} slot(s): {len(other.trace)} steps, utilization {other.trace.utilization():.0%}")


# 2. Steps with at least one prefill.
def prefill_steps(trace):
    return [s.step for s in trace.steps if "prefill" in s.slot_phase]


print("prefill steps:", prefill_steps(llm.trace))
# Step 0 prefills two prompts together; the other two are prefilled when slots free up: 2 or 3
# prefill steps (3 when the two slots free at different steps).
assert 2 <= len(prefill_steps(llm.trace)) <= 3

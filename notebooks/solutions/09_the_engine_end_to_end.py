# Solutions to notebook 09. Run from the notebook (uses MODEL, ckpt, prompts, params).
# 1. Late arrivals. (admit_group=1: a late request takes a free slot at once; on a GPU the engine's
#    default would hold it for a group of prompts -- notebook 11.)
e = LLM(MODEL, max_num_seqs=4, num_blocks=NUM_BLOCKS, admit_group=1, show_progress=False, checkpoint=ckpt)
eng = e.engine
early = [eng.add_request(p, sp) for p, sp in zip(prompts[:4], params[:4])]
late, step, res = [], 0, {}
rest = list(zip(prompts[4:], params[4:])) if GPU else list(zip(prompts[4:6], params[4:6]))   # a CPU: 2 late ones
while eng.has_work() or rest:
    if rest and step % 5 == 0:
        late.append(eng.add_request(*rest.pop(0)))
    for r in eng.step():                     # step() hands back the requests that finished
        res[r.request_id] = r.token_times[0] - r.arrival_time          # its time to first token
    step += 1
avg = lambda ids: sum(res[i] for i in ids) / len(ids) * 1e3
print(f"TTFT: queued at start {avg(early):.0f} ms, late arrivals {avg(late):.0f} ms")
# A late request waits only for a free slot (continuous batching), not for a whole batch.

# 2. Seeded sampling is independent of the batch.
sp = SamplingParams(max_new_tokens=8 if GPU else 5, temperature=0.8, seed=1234, ignore_eos=True)
alone = LLM(MODEL, max_num_seqs=1, num_blocks=NUM_BLOCKS, show_progress=False, checkpoint=ckpt).generate([prompts[0]], sp)[0].token_ids
others = params[1:3] if GPU else [SamplingParams(max_new_tokens=5, ignore_eos=True)] * 2    # a CPU: short ones
batched = LLM(MODEL, max_num_seqs=4, num_blocks=NUM_BLOCKS, show_progress=False, checkpoint=ckpt).generate(
    [prompts[1], prompts[0], prompts[2]], [others[0], sp, others[1]])[1].token_ids
print(alone, batched)
# The noise is a hash of (seed, position, token id): it does not depend on the batch, the slot or
# the step. (In bf16 on a GPU, batching can still change the logits' last bits, and a near-tie may
# flip; in fp32 on the CPU the tokens match.)
if e.engine.dtype == torch.float32:
    assert alone == batched

# 3. The greedy LM head: logits and the argmax from one fused launch (+ a tiny merge).
#    (In the CPU's Triton interpreter every program is Python: the first 1024 rows of the head.)
h = torch.randn(1, model.config.hidden_size, device=model.device).to(model.dtype)
head = model.lm_head if GPU else model.lm_head[:1024].contiguous()
logits, token = gemv.norm_lm_head_triton(h, model.norm, eps, head, fused=True, greedy=True)
ref = gemv.norm_lm_head_torch(h, model.norm, eps, head)
assert token.item() == logits.argmax(-1).item()                  # exactly the argmax of its logits
top2 = ref[0].topk(2).values
print("fused:", token.item(), "unfused:", ref.argmax(-1).item(), f"(top-2 gap {float(top2[0] - top2[1]):.4f})")
# The two paths round differently, so they may disagree only where the top two logits nearly tie.

# 4. This machine's host and device shares of a step (the plain engine: no overlap).
t = plain.engine.timing
host_ms = (t["schedule"] + t["accept"]) / t["steps"] * 1e3
device_ms = (t["launch"] + t["read"]) / t["steps"] * 1e3
print(f"per step: host bookkeeping {host_ms:.3f} ms, launch + wait for the device {device_ms:.3f} ms")
viz.draw_overlap(host_ms, max(device_ms, 1e-3), title="this machine, plain engine");
# Without overlap 'launch' includes the wait for the step's tokens (runner.run reads them). On a
# CPU there is no separate device: the forward itself runs inside 'launch', and overlap has
# nothing to hide.

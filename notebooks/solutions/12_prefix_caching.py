# Solutions to notebook 12. Run from the notebook (uses SCHED_MODEL, SLOTS, SYSTEM, prompts, params,
# LLM, SamplingParams, random).
import matplotlib.pyplot as plt


def hit_rate(llm, batch, params):
    outs = llm.generate(batch, params)
    return sum(o.num_cached_tokens for o in outs) / sum(len(o.prompt_token_ids) for o in outs), outs


# 1. One token short of a block boundary. Only FULL blocks have keys, and a block's key covers
#    every token up to its end. With a 63-token system prompt, block 3 holds system tokens 48-62
#    AND the first token of the question: its key differs for every request, so it never hits.
#    Each request loses 15 shared tokens (only 48 of 63 cached); at 64 or 65 tokens all 64 are.
#    Advice: a system prompt that is a few tokens short of a multiple of the block size wastes
#    almost a block per request -- pad it (or trim it) to a boundary if you control it; a prefix
#    is shared only up to the last block boundary inside it.
rng = random.Random(3)
one = SamplingParams(max_new_tokens=2, ignore_eos=True)
for n in (4 * 16 - 1, 4 * 16, 4 * 16 + 1):
    llm1 = LLM(SCHED_MODEL, max_num_seqs=SLOTS, prefix_caching=True, show_progress=False)
    system = [rng.randrange(3, 500) for _ in range(n)]
    llm1.generate([system + [1, 2]], one)                              # warm
    batch = [system + [rng.randrange(3, 500) for _ in range(8)] for _ in range(8)]
    rate, outs = hit_rate(llm1, batch, one)
    print(f"system prompt {n} tokens: cached per request {outs[0].num_cached_tokens:2d} of {n + 8}, "
          f"hit rate {rate:.0%}")
    assert outs[0].num_cached_tokens == 16 * (n // 16)


# 2. A cold batch: blocks are named only once they are computed (at the next schedule(), or when
#    their request finishes). Requests admitted in the same step as the first one find nothing:
#    they compute their own copies (register() then keeps the first copy; the others stay
#    private). Requests admitted in later steps hit.
cold = LLM(SCHED_MODEL, max_num_seqs=SLOTS, prefix_caching=True, show_progress=False)
outs = cold.generate(prompts, params)
print("cold batch, cached tokens per request:", [o.num_cached_tokens for o in outs],
      f"(the first {sum(o.num_cached_tokens == 0 for o in outs)} were admitted before anything was named)")


# 3. Eviction: two system prompts of 4 blocks, alternating. A request holds 5 blocks while it runs
#    (4 + its question); what is left of the pool keeps cached blocks, least recently used first.
#    Too small a pool evicts a prompt's blocks before it comes round again; once both chains fit
#    next to the running requests, every later request hits.
rng = random.Random(4)
sys2 = [[rng.randrange(3, 500) for _ in range(64)] for _ in range(2)]
pools, rates = [8, 12, 16, 24, 64], []
for nb in pools:
    e = LLM(SCHED_MODEL, max_num_seqs=1, num_blocks=nb, prefix_caching=True, show_progress=False)
    batch = [sys2[i % 2] + [rng.randrange(3, 500) for _ in range(8)] for i in range(12)]
    got = [e.generate([p], one)[0] for p in batch]                    # one after another
    rates.append(sum(o.num_cached_tokens for o in got) / sum(len(o.prompt_token_ids) for o in got))
    print(f"num_blocks={nb:3d}: hit rate {rates[-1]:.0%}")
plt.figure(figsize=(4, 2.6))
plt.plot(pools, rates, "o-")
plt.xlabel("num_blocks")
plt.ylabel("hit rate")
plt.title("two system prompts, alternating")
plt.grid(alpha=0.3)


# 4. A chat's second turn: its prompt = turn 1's prompt + answer + new question. Every full block
#    of turn 1's prompt AND answer was named (blocks are named as they fill during decoding, and
#    at the end), so turn 2 finds everything up to the last full block of (prompt + answer). The
#    last, partial block of turn 1 had no key: those tokens are computed again.
chat = LLM(SCHED_MODEL, max_num_seqs=SLOTS, prefix_caching=True, show_progress=False)
turn1 = [rng.randrange(3, 500) for _ in range(40)]
ans = chat.generate([turn1], SamplingParams(max_new_tokens=30, ignore_eos=True))[0]
turn2 = turn1 + ans.token_ids + [rng.randrange(3, 500) for _ in range(10)]
out2 = chat.generate([turn2], one)[0]
print(f"turn 2: {len(turn2)} tokens, {out2.num_cached_tokens} cached "
      f"(turn 1 + answer = {len(turn1) + len(ans.token_ids)} tokens: its full blocks, "
      f"{16 * ((len(turn1) + len(ans.token_ids)) // 16)} tokens)")

"""Speculative decoding: several tokens per step, the very same tokens.

A decode step computes one token per sequence, and at batch 1 it costs what reading every weight
costs, whatever the sequence. Speculation guesses k next tokens cheaply (a *proposer*), then the
target model checks all of them in ONE forward: k + 1 query positions per sequence,

    row 0: the last token          at position n - 1   -> the target's token t0 for position n
    row i: the i-th guess d(i-1)   at position n-1+i   -> the target's token ti for position n+i

Each row is an ordinary decode row of the paged cache: same block-table row, its own position,
KV slot and length n + i (the causal mask is just each row's length). So verification needs no new
attention kernel, mixes with prefills and plain decodes in one step, and replays the decode CUDA
graphs (a graph of b rows serves any mix of sequences and guesses).

Accept rule (accept.py): d0 is kept if it equals t0, d1 if also d1 == t1, ...; the step emits
t0 .. ta, a = the number of guesses kept, so one token always comes (t0, what a plain step would
give) and up to k + 1 come. Every emitted token is the target's own choice at its position:
greedy output is token for token the non-speculative output. With sampling, each row's token is
drawn by the same seeded counter-based sampler (sampling.py: noise keyed by seed and position)
and a guess is kept when the drawn token equals it -- for a proposer that guesses one token
(n-gram, a greedy draft model) that IS rejection sampling (rejection.py): a guess d is accepted
with probability p(d), and a rejected row's token is distributed as p without d, renormalized.

Bookkeeping (scheduler.py): blocks are taken for the k guesses before the step (without
preempting anyone: guesses shrink to the room there is), the sequence's num_computed advances only
over the tokens kept, and blocks past what the sequence now needs go back to the pool. K/V written
for rejected guesses sit past the sequence's length: no kernel reads them, the next step
overwrites them.

The overlap loop (engine.py) runs a step ahead only where nobody guesses (Speculator.wants_sync):
a proposal starts from the last token, and a verify step's next rows depend on how many guesses
it keeps, which the host learns only by reading it. Text where guessing does not pay pauses its
requests (AdaptiveK); a batch where it does not pay -- a verify step costs the whole batch its
step ahead -- closes the gate (gate.py BatchGate): plain steps, run ahead, and a probe now and then.

A verify step's few rows (k + 1 per sequence) run the same fused decode kernels as one row
(kernels/gemv.py fused_rows: rows padded to 16, tensor-core dots), captured in the decode graphs.

    method "ngram"  ngram.py   prompt lookup: the last n tokens matched earlier in the sequence
    method "draft"  draft.py   a smaller model with the same tokenizer guesses greedily
    gate.py                    speculation on or off for the whole batch (tokens gained vs step cost)
    shadow.py                  n-gram lookups replayed on the emitted tokens: what guessing would keep,
                               known without a verify step (Speculator.shadow_on)
"""
from .accept import AdaptiveK, accept_greedy, emit
from .config import SpeculativeConfig
from .ngram import NgramProposer, propose_ngram
from .rejection import rejection_sample

__all__ = ["AdaptiveK", "NgramProposer", "SpeculativeConfig", "accept_greedy", "emit",
           "propose_ngram", "rejection_sample", "make_proposer"]


def make_proposer(config: SpeculativeConfig, target_model=None, engine_config=None, max_model_len=None,
                  num_blocks=None):
    """The proposer a SpeculativeConfig names (a draft model's pool: as many tokens as the
    target's `num_blocks`, sequences up to the target's `max_model_len`)."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_max, config.prompt_lookup_min)
    from .draft import DraftProposer
    return DraftProposer(config.model, target_model, engine_config, max_model_len, num_blocks)

"""Rejection sampling: guesses from a draft distribution q, tokens distributed as the target's p.

For each guess d_i (drawn from q_i): keep it with probability min(1, p_i(d_i) / q_i(d_i)); at the
first rejection draw the token from the residual max(p_i - q_i, 0), renormalized, and stop; if all
k are kept, draw a bonus token from p_k. Whatever q is, each emitted token is distributed exactly
as p (Leviathan et al. 2023; Chen et al. 2023). A proposer that guesses a single token (n-gram, a
greedy draft) has q = one-hot(d): keep with probability p(d), else draw from p without d -- which
is what "draw from p, keep the guess if the draw equals it" does, the rule the engine runs
(sampling.py's seeded sampler, one draw per verify row).
"""
from __future__ import annotations

import torch


def rejection_sample(p: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None,
                     generator: torch.Generator | None = None) -> list[int]:
    """p [k+1, V] target probabilities at each verify row, drafts [k] the guesses, q [k, V] the
    draft's probabilities they were drawn from (None: one-hot guesses). Returns the emitted tokens
    (1 .. k+1 of them)."""
    k = drafts.shape[0]
    if q is None:
        q = torch.zeros(k, p.shape[1], dtype=p.dtype, device=p.device)
        q[torch.arange(k), drafts] = 1.0
    u = torch.rand(k + 1, generator=generator, dtype=torch.float64)
    out = []
    for i in range(k):
        d = int(drafts[i])
        pd, qd = float(p[i, d]), float(q[i, d])
        if qd > 0 and u[i] * qd <= pd:               # keep with probability min(1, p/q)
            out.append(d)
            continue
        residual = (p[i] - q[i]).clamp(min=0)
        if float(residual.sum()) <= 0:               # p == q: nothing left to correct towards
            residual = p[i]
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(p[k], 1, generator=generator)))
    return out

"""Tensor parallelism, the arithmetic: how each weight of a Llama layer is cut across N ranks.

Megatron-LM's recipe (also vLLM's and nano-vllm's). A linear layer y = x W^T, W: [out, in], can be
cut two ways:

    column-parallel  W cut along `out` (rows of W): rank r computes its own slice of y's features.
                     No communication: each rank ends with a different part of y.
    row-parallel     W cut along `in` (columns of W): rank r multiplies ITS slice of x's features
                     and gets a partial y of full width; y = the SUM of the partials (all-reduce).

Chain them column -> row and the features in between never leave the rank:

    attention   QKV column-parallel (each rank gets whole heads: Hq/N query and Hkv/N KV heads,
                so its attention and its KV cache cover only its heads), O row-parallel -> all-reduce
    MLP         gate/up column-parallel (SwiGLU is elementwise: a rank's slice of the intermediate
                features needs nothing from the others), down row-parallel -> all-reduce
    embedding   the vocabulary cut into N ranges: a rank looks up only ids in its range (zeros for
                the rest) -> all-reduce
    LM head     the vocabulary cut the same way: each rank computes the logits of its range ->
                all-gather into full rows

So a layer costs two all-reduces of [tokens, hidden], and each rank holds 1/N of the weights and of
the KV cache. Norms are small and replicated. Everything below is plain torch; the model
(model.py) applies these rules at load time and calls the two communication functions.
"""
from __future__ import annotations

import torch

# HF tensor name suffix -> how it is cut. "rows": along dim 0 (column-parallel / vocabulary),
# "cols": along dim 1 (row-parallel), None: replicated.
SPLIT_RULES = {
    "embed_tokens.weight": "rows", "lm_head.weight": "rows",
    "q_proj.weight": "rows", "k_proj.weight": "rows", "v_proj.weight": "rows",
    "o_proj.weight": "cols",
    "gate_proj.weight": "rows", "up_proj.weight": "rows",
    "down_proj.weight": "cols",
    "input_layernorm.weight": None, "post_attention_layernorm.weight": None, "norm.weight": None,
}


def split_rule(name: str):
    for suffix, rule in SPLIT_RULES.items():
        if name.endswith(suffix):
            return rule
    raise ValueError(f"tensor parallelism: no split rule for tensor {name!r}")


def check_split(config, tp: int) -> None:
    """Can this model be cut into `tp` ranks? Every cut dimension must divide evenly: query heads,
    KV heads (each rank keeps whole heads and whole GQA groups), the MLP's intermediate size and the
    vocabulary. Raises ValueError naming what does not divide and the sizes that would work."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
    dims = {"num_heads (query heads)": config.num_heads, "num_kv_heads (KV heads)": config.num_kv_heads,
            "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size}
    bad = {k: v for k, v in dims.items() if v % tp}
    if bad:
        ok = [n for n in range(1, config.num_kv_heads + 1) if all(v % n == 0 for v in dims.values())]
        what = ", ".join(f"{k} = {v}" for k, v in bad.items())
        raise ValueError(f"tensor_parallel_size={tp} does not divide this model ({config.name}): {what}. "
                         f"Each rank must hold whole heads; sizes that work: {ok}")


def shard(tensor: torch.Tensor, rule, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s piece of `tensor` under `rule` (a view, no copy)."""
    if rule is None or size == 1:
        return tensor
    dim = 0 if rule == "rows" else 1
    n = tensor.shape[dim]
    if n % size:
        raise ValueError(f"dimension {dim} of size {n} does not split into {size} equal parts")
    return tensor.narrow(dim, rank * (n // size), n // size)


def shard_checkpoint(tensors: dict, rank: int, size: int) -> dict:
    """Every tensor of a checkpoint cut for one rank (views into the full tensors)."""
    return {name: shard(t, split_rule(name), rank, size) for name, t in tensors.items()}


# -------------------------------------------------------------------------------------------
# The layers, written out (what model.py does inline with its fused kernels). `all_reduce` and
# `all_gather` are the group's functions: torch.distributed over NCCL on GPUs, gloo on CPU.
# -------------------------------------------------------------------------------------------
def column_parallel_linear(x: torch.Tensor, w_shard: torch.Tensor) -> torch.Tensor:
    """x [T, in] (the same on every rank) @ W_r^T, W_r = rows of W: this rank's slice of the output
    features [T, out/N]. No communication."""
    return x @ w_shard.t()


def row_parallel_linear(x_shard: torch.Tensor, w_shard: torch.Tensor, all_reduce) -> torch.Tensor:
    """x_r [T, in/N] (this rank's features) @ W_r^T, W_r = columns of W: a partial sum [T, out];
    the all-reduce adds the N partials so every rank holds the full y."""
    y = x_shard @ w_shard.t()
    all_reduce(y)
    return y


def vocab_parallel_embedding(ids: torch.Tensor, embed_shard: torch.Tensor, rank: int,
                             all_reduce) -> torch.Tensor:
    """Rows of the embedding for token ids: each rank holds vocabulary range
    [rank * V/N, (rank+1) * V/N); ids outside its range get zeros; the all-reduce fills them in."""
    n = embed_shard.shape[0]
    local = ids - rank * n
    mine = (local >= 0) & (local < n)
    h = embed_shard[local.clamp(0, n - 1)] * mine.unsqueeze(-1).to(embed_shard.dtype)
    all_reduce(h)
    return h


def vocab_parallel_logits(h: torch.Tensor, lm_head_shard: torch.Tensor, all_gather) -> torch.Tensor:
    """Each rank's logits for its vocabulary range [T, V/N], gathered into full rows [T, V]."""
    return all_gather(h @ lm_head_shard.t())

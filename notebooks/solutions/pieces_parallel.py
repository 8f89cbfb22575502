"""Solutions to notebook 13's pieces (checked by parallel_course.check_shard, check_column_parallel,
check_row_parallel and check_vocab_embedding). Read one with parallel_course.show_solution("shard"),
("column_parallel_linear"), ("row_parallel_linear") or ("vocab_parallel_embedding");
PAGEDLAB_SOLUTIONS=1 makes the checks use these."""


def shard(tensor, rule, rank, size):
    if rule is None or size == 1:
        return tensor                                   # replicated (norms), or one rank holds it all
    dim = 0 if rule == "rows" else 1                    # rows: output features; cols: input features
    n = tensor.shape[dim]
    if n % size:
        raise ValueError(f"dimension {dim} of size {n} does not split into {size} equal parts")
    return tensor.narrow(dim, rank * (n // size), n // size)


def column_parallel_linear(x, w_shard):
    return x @ w_shard.t()                              # [T, in] @ [in, out/N]: this rank's features


def row_parallel_linear(x_shard, w_shard, all_reduce):
    y = x_shard @ w_shard.t()                           # [T, in/N] @ [in/N, out]: a partial sum
    all_reduce(y)                                       # in place: the sum of every rank's partial
    return y


def vocab_parallel_embedding(ids, embed_shard, rank, all_reduce):
    n = embed_shard.shape[0]                            # this rank holds token ids rank*n .. rank*n + n-1
    local = ids - rank * n
    mine = (local >= 0) & (local < n)
    h = embed_shard[local.clamp(0, n - 1)] * mine.unsqueeze(-1).to(embed_shard.dtype)   # zeros elsewhere
    all_reduce(h)                                       # each id's row comes from its one owner
    return h

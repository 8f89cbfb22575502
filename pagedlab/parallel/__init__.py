"""Beyond one GPU: tensor parallelism (every layer cut across T ranks) and data parallelism (D
replicas behind a router), over torch.distributed -- NCCL between GPUs, gloo on CPU.

    shard.py          how each weight is cut, and the parallel linear layers written out
    group.py          one model copy's ranks: the model's collectives and the per-step message
    workers.py        the processes: start, weights to every rank, the rank > 0 loop, shutdown
    world.py          rank 0 starts the world: processes, groups, weights (retried), and how it ends
    data_parallel.py  replicas and the router

The front door is LLM(model, tensor_parallel_size=T, data_parallel_size=D); notebook 13 builds
the sharded layers in the open.
"""

"""Benchmarks (they need a CUDA GPU): `python -m pagedlab bench kernels | engine | gemv | step`, or
`python -m pagedlab.bench.<name>`. And one that needs only a server to talk to: `bench serve`.

    kernels   the attention kernels: paged decode variants against SDPA, causal prefill
    engine    pagedlab against transformers: one stream and an offline workload
    gemv      the decode-time linear layers, fused Triton against cuBLAS + small kernels
    step      one batch-1 decode step: PDL modes, host overlap on and off
    serve     an OpenAI-compatible server under Poisson load (HTTP only: any server, any machine)

What they share (timing, copy bandwidth, metadata, output files) is in common.py.
"""

BENCHMARKS = ("kernels", "engine", "gemv", "step")      # on a CUDA GPU
HTTP_BENCHMARKS = ("serve",)                             # a client of a server: no GPU here

"""Benchmarks (they need a CUDA GPU): `python -m pagedlab bench kernels | engine | gemv | step`, or
`python -m pagedlab.bench.<name>`. And one that needs only a server to talk to: `bench serve`.

    kernels   the attention kernels: paged decode variants against SDPA, causal prefill
    engine    pagedlab against transformers: one stream and an offline workload
    gemv      the decode-time linear layers, fused Triton against cuBLAS + small kernels
    step      one batch-1 decode step: PDL modes, host overlap on and off
    prefix    prefix caching off and on: a shared system prompt, multi-turn chats, no sharing
              (--small runs on CPU)
    parallel  one GPU against two: tensor parallel (split) and data parallel (replicas)
    spec      speculative decoding (n-gram) off and on: copy-heavy and free-running text, one
              stream and batched (--small runs on CPU)
    fp8       FP8 weights against bf16/fp32: quality on SmolLM2 (any device, CPU is fine) and
              (--speed) tokens/s on CUDA
    serve     an OpenAI-compatible server under Poisson load (HTTP only: any server, any machine)

What they share (timing, copy bandwidth, metadata, output files) is in common.py.
"""

BENCHMARKS = ("kernels", "engine", "gemv", "step", "prefix", "parallel", "fp8", "spec")   # on a CUDA GPU
HTTP_BENCHMARKS = ("serve",)                             # a client of a server: no GPU here

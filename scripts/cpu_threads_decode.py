"""SmolLM2 on the CPU, one sequence: decode tokens/s with torch.set_num_threads(1) and (2), alternating,
each measurement printed as it is made with the machine's load average (the README's "CPU threads").
PREFILL_LEN > 0 also times the prefill of a prompt that long (its time to first token).
MODEL "random" runs SmolLM2-135M's shapes with random weights (the same arithmetic, no GGUF needed:
what a machine without the model file measures); the default is the real model.

    python scripts/cpu_threads_decode.py [REPEATS=3] [NEW_TOKENS=24] [PREFILL_LEN=0] [MODEL=smollm2]
"""
import os
import sys

import torch

from pagedlab import LLM, SamplingParams
from pagedlab.config import ModelConfig

# SmolLM2-135M-Instruct's shapes, as its GGUF declares them (LLM("smollm2").config)
SMOLLM2_SHAPES = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                      max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1,
                      eos_token_ids=[2], name="SmolLM2-135M shapes, random weights")

if __name__ == "__main__":
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    params = SamplingParams(max_tokens=int(sys.argv[2]) if len(sys.argv) > 2 else 24, ignore_eos=True)
    prefill_len = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    model = sys.argv[4] if len(sys.argv) > 4 else "smollm2"
    if model == "random":
        model = ModelConfig(**SMOLLM2_SHAPES)
    llm = LLM(model, device="cpu", max_num_seqs=1, show_progress=False)
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?"
    print(f"torch {torch.__version__}, {llm.config.name}, cores this process may use: {affinity}", flush=True)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))              # warm-up
    for _ in range(repeats):
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = llm.generate([[1, 2, 3, 4, 5]], params)[0]
            print(f"threads={threads} decode {len(out.itl_s) / sum(out.itl_s):.1f} tok/s  "
                  f"load average {os.getloadavg()[0]:.1f}", flush=True)
            if prefill_len:
                out = llm.generate([list(range(1000, 1000 + prefill_len))], SamplingParams(max_tokens=1))[0]
                print(f"threads={threads} prefill of {prefill_len} tokens {out.ttft_s:.2f} s", flush=True)

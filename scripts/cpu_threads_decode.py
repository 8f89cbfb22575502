"""SmolLM2 on the CPU, one sequence: decode tokens/s with torch.set_num_threads(1) and (2), alternating,
each measurement printed as it is made with the machine's load average (the README's "CPU threads").
PREFILL_LEN > 0 also times the prefill of a prompt that long (its time to first token).

    python scripts/cpu_threads_decode.py [REPEATS=3] [NEW_TOKENS=24] [PREFILL_LEN=0]
"""
import os
import sys

import torch

from pagedlab import LLM, SamplingParams

if __name__ == "__main__":
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    params = SamplingParams(max_tokens=int(sys.argv[2]) if len(sys.argv) > 2 else 24, ignore_eos=True)
    prefill_len = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    llm = LLM("smollm2", device="cpu", max_num_seqs=1, show_progress=False)
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

"""The sampled draw, torch (sampling.sample, ~30 passes over [B, V]) against the one-pass Triton
kernel (kernels/gumbel_sample.py), on the GPU: do_bench medians at the serving burst's batch sizes
and Llama 3's vocabulary (128,256), fp32 logits, temperature 1, no top-k / top-p.

    python scripts/sampling_bench.py            # prints a table; $OUT/sampling_bench.json
"""
import json, os
from pathlib import Path

import torch
import triton

from pagedlab.kernels.gumbel_sample import gumbel_argmax_torch, gumbel_argmax_triton

rows = []
for b in (1, 8, 64, 256):
    v = 128256
    g = torch.Generator(device="cuda").manual_seed(b)
    logits = torch.randn(b, v, device="cuda", generator=g) * 4
    temp = torch.ones(b, device="cuda")
    seeds = torch.randint(0, 2**31, (b,), device="cuda", generator=g)
    pos = torch.randint(0, 2**20, (b,), device="cuda", generator=g)
    same = gumbel_argmax_torch(logits, temp, seeds, pos).tolist() == gumbel_argmax_triton(logits, temp, seeds, pos).tolist()
    t_torch = triton.testing.do_bench(lambda: gumbel_argmax_torch(logits, temp, seeds, pos), return_mode="median")
    t_fused = triton.testing.do_bench(lambda: gumbel_argmax_triton(logits, temp, seeds, pos), return_mode="median")
    rows.append(dict(batch=b, vocab=v, torch_us=t_torch * 1e3, fused_us=t_fused * 1e3, same_tokens=same,
                     speedup=t_torch / t_fused))
    print(f"B={b:4d} V={v}: torch {t_torch * 1e3:8.1f} us, fused {t_fused * 1e3:7.1f} us, "
          f"{t_torch / t_fused:5.1f}x, same tokens: {same}", flush=True)
out = Path(os.environ.get("OUT", "out"))
out.mkdir(parents=True, exist_ok=True)
(out / "sampling_bench.json").write_text(json.dumps(
    {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
     "rows": rows}, indent=1))

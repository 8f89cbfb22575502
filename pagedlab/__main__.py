"""Command line: python -m pagedlab demo | generate | bench kernels | bench engine | bench gemv"""
from __future__ import annotations

import argparse
import sys

DEMO_PROMPTS = ["What is 2+2?", "Name a color.", "Say hello.", "Capital of France?"]


def _llm(args, **kw):
    from .llm import LLM
    return LLM(args.model, device=args.device, dtype=args.dtype, max_num_seqs=args.slots,
               attention_backend=args.backend, **kw)


def demo(args) -> None:
    from .sampling import SamplingParams
    llm = _llm(args, trace=True)
    eng = llm.engine
    print(f"model: {llm.checkpoint.source} on {eng.device} ({str(eng.dtype).replace('torch.', '')}), "
          f"{eng.config.max_num_seqs} slots, KV pool {eng.kv_cache.num_blocks} blocks x "
          f"{eng.config.block_size} tokens, attention: {llm.model.kernels.backend}\n")
    prompts = args.prompts or DEMO_PROMPTS

    def show(o):
        print(f"[request {o.request_id} finished: {o.finish_reason}, {len(o.token_ids)} tokens, "
              f"first token after {o.ttft_s * 1e3:.0f} ms]")
        print(f"  Q: {o.prompt}\n  A: {o.text.strip()}\n", flush=True)

    outs = llm.generate(prompts, SamplingParams(max_new_tokens=args.max_new_tokens,
                                                temperature=args.temperature), chat=True, on_finish=show)
    trace = llm.trace
    print(f"slot timeline ({len(trace)} steps; capital letter = prefill, small = decode, '.' = idle):")
    print(trace.timeline())
    n = sum(len(o.token_ids) for o in outs)
    total = sum(s.duration_s for s in trace.steps)
    print(f"\n{n} tokens in {total:.2f} s of steps ({n / total:.1f} tokens/s), "
          f"slot utilization {trace.utilization():.0%}")


def generate(args) -> None:
    from .sampling import SamplingParams
    llm = _llm(args)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    for o in llm.generate(args.prompts, params, chat=not args.raw):
        print(o.text.strip())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m pagedlab", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp):
        sp.add_argument("--model", default="smollm2",
                        help="smollm2 (embedded), random:tiny, random:llama-3.2-1b, a .gguf, a checkpoint "
                             "directory, or a hub id such as meta-llama/Llama-3.2-1B-Instruct")
        sp.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
        sp.add_argument("--dtype", default=None, help="bfloat16, float16 or float32 (default: bf16 on cuda, fp32 on cpu)")
        sp.add_argument("--slots", type=int, default=2, help="max sequences decoding together")
        sp.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
        sp.add_argument("--max-new-tokens", type=int, default=48)
        sp.add_argument("--temperature", type=float, default=0.0)

    d = sub.add_parser("demo", help="the four prompts of the original engine, 2 slots")
    common(d)
    d.add_argument("prompts", nargs="*")
    g = sub.add_parser("generate", help="answer prompts")
    common(g)
    g.add_argument("prompts", nargs="+")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--raw", action="store_true", help="no chat template")
    b = sub.add_parser("bench", help="benchmarks: kernels | engine | gemv | step | boundaries")
    b.add_argument("what", choices=["kernels", "engine", "gemv", "step", "boundaries"])
    b.add_argument("rest", nargs=argparse.REMAINDER)

    args = p.parse_args(argv)
    try:
        if args.cmd == "demo":
            demo(args)
        elif args.cmd == "generate":
            generate(args)
        elif args.cmd == "bench":
            import importlib
            mod = importlib.import_module(f"pagedlab.bench_{args.what}")
            mod.main(args.rest)
    except (ValueError, FileNotFoundError, PermissionError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()

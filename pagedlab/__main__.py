"""Command line: python -m pagedlab demo | generate | serve | bench kernels|engine|gemv|step|serve

Every argument is checked before the model is loaded (loading takes seconds to a minute): a bad
one is one line on stderr that names its flag, and exit status 2.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import re
import sys

from .bench import BENCHMARKS, HTTP_BENCHMARKS

from .config import EngineConfig
from .conversation import DEMO_PROMPTS
from .sampling import DEFAULT_MAX_TOKENS
USAGE_ERROR = 2                                        # exit status of a bad argument, as argparse's
SEED_LIMIT = 2 ** 63                                   # seeds are int64 on the device
DTYPE_NAMES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
               "half": "float16", "float32": "float32", "fp32": "float32", "float": "float32"}
DEVICE_HINTS = {"gpu": "cuda", "nvidia": "cuda", "cude": "cuda", "cpus": "cpu", "host": "cpu"}


def fail(message: str) -> None:
    """One line on stderr, exit status 2."""
    text = " ".join(str(message).split())
    print(f"error: {text}", file=sys.stderr)
    raise SystemExit(USAGE_ERROR)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help shows every option's default: "(default: X)" after its help, unless the help already
    says what the default is or there is none to show."""

    def _get_help_string(self, action):
        text = action.help or ""
        d = action.default
        shown = not (d is None or d is False or d is argparse.SUPPRESS) and action.option_strings
        if shown and "default" not in text:
            text += " (default: %(default)s)"
        return text


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line usage errors (the full usage stays under --help), defaults in --help."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        fail(f"{message} (see: {self.prog} --help)")


# ------------------------------------------------------------------ argument checks
def check_device(device: str | None) -> str | None:
    """--device: None, cpu, cuda or cuda:N, and a CUDA device that torch can see."""
    if device is None:
        return None
    name = device.strip().lower()
    if not re.fullmatch(r"cpu|cuda(:\d+)?", name):
        base, _, index = name.partition(":")
        guess = DEVICE_HINTS.get(base)
        hint = f" (did you mean {guess + (':' + index if index else '')}?)" if guess else ""
        fail(f"--device must be cpu, cuda or cuda:N, got {device!r}{hint}")
    if name.startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            fail(f"--device {name}: no CUDA device here (torch.cuda.is_available() is False); "
                 f"use --device cpu")
        if ":" in name and int(name.split(":")[1]) >= torch.cuda.device_count():
            fail(f"--device {name}: torch sees {torch.cuda.device_count()} CUDA device(s)")
    return name


def check_dtype(dtype: str | None) -> str | None:
    if dtype is None:
        return None
    name = DTYPE_NAMES.get(dtype.strip().lower())
    if name is None:
        fail(f"--dtype must be bfloat16, float16 or float32 (or bf16, fp16, fp32), got {dtype!r}")
    return name


def check_args(args) -> None:
    """Every argument of demo/generate, before anything is loaded. Normalises device and dtype."""
    if not args.model.strip():
        fail("--model must name a model, got an empty string")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        fail(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")
    if args.slots < 1:
        fail(f"--slots (--max-num-seqs) must be >= 1, got {args.slots}")
    if args.max_new_tokens < 1:
        fail(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    check_memory_fraction(args)
    if getattr(args, "top_k", 0) < 0:
        fail(f"--top-k must be >= 0 (0 = off), got {args.top_k}")
    top_p = getattr(args, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:                    # also rejects nan
        fail(f"--top-p must be in (0, 1] (1 = off), got {top_p}")
    seed = getattr(args, "seed", None)
    if seed is not None and not 0 <= seed < SEED_LIMIT:
        fail(f"--seed must be in [0, 2**63), got {seed}")
    for i, prompt in enumerate(args.prompts, 1):
        if not prompt.strip():
            fail(f"PROMPT {i} of {len(args.prompts)} is empty: give some text to answer")
    check_parallel_args(args)
    args.device = check_device(args.device)
    args.dtype = check_dtype(args.dtype)
    if args.backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        import torch
        on_cpu = args.device == "cpu" or (args.device is None and not torch.cuda.is_available())
        if on_cpu:
            fail("--backend triton on CPU runs in Triton's interpreter: set TRITON_INTERPRET=1 "
                 "in the environment, or use --backend torch or --device cuda")


def check_memory_fraction(args) -> None:
    v = args.gpu_memory_utilization
    if v is not None and not 0.0 < v <= 1.0:                      # also rejects nan
        fail(f"--gpu-memory-utilization must be in (0, 1] (the share of free GPU memory for the KV "
             f"pool), got {v}")


# ------------------------------------------------------------------ commands
def check_parallel_args(args, data_parallel: bool = True) -> None:
    for flag, v in (("--tensor-parallel-size", args.tensor_parallel_size),
                    ("--data-parallel-size", getattr(args, "data_parallel_size", 1))):
        if v < 1:
            fail(f"{flag} must be >= 1, got {v}")
    if not data_parallel and getattr(args, "data_parallel_size", 1) > 1:
        fail("serve runs one engine: for data parallelism start one server per GPU behind a load balancer")


def _llm(args, **kw):
    from .llm import LLM
    if args.gpu_memory_utilization is not None:
        kw["memory_fraction"] = args.gpu_memory_utilization
    if getattr(args, "quantization", None):
        kw["quantization"] = args.quantization
    kw["prefix_caching"] = args.prefix_caching
    if getattr(args, "speculative_config", None):
        kw["speculative_config"] = spec_json(args.speculative_config)
    return LLM(args.model, device=args.device, dtype=args.dtype, max_num_seqs=args.slots,
               attention_backend=args.backend, tensor_parallel_size=args.tensor_parallel_size,
               data_parallel_size=getattr(args, "data_parallel_size", 1), **kw)


def spec_json(text: str) -> dict:
    """--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}' (vLLM's flag)."""
    import json
    try:
        value = json.loads(text)
    except ValueError as e:
        fail(f"--speculative-config must be JSON such as '{{\"method\": \"ngram\", "
             f"\"num_speculative_tokens\": 4}}': {e}")
    from .spec.config import SpeculativeConfig
    try:
        SpeculativeConfig.of(value)
    except (TypeError, ValueError) as e:
        fail(f"--speculative-config: {e}")
    return value


def demo(args) -> None:
    from .sampling import SamplingParams
    print(f"loading {args.model} ...", flush=True)
    llm = _llm(args, trace=True)
    eng = llm.engine
    print(f"model: {llm.checkpoint.source} on {eng.device} ({str(eng.dtype).replace('torch.', '')}), "
          f"{eng.config.max_num_seqs} slots, KV pool {eng.kv_cache.num_blocks} blocks x "
          f"{eng.config.block_size} tokens, attention: {llm.model.kernels.backend}\n")
    prompts = args.prompts or DEMO_PROMPTS

    print(f"answering {len(prompts)} prompts, {eng.config.max_num_seqs} at a time ...\n", flush=True)

    def show(o):
        print(f"[request {o.request_id} finished: {o.finish_reason}, {len(o.token_ids)} tokens, "
              f"first token {o.ttft_s * 1e3:.0f} ms after it was queued (waiting for a slot included)]")
        print(f"  Q: {o.prompt}\n  A: {o.text.strip()}\n", flush=True)

    outs = llm.generate(prompts, SamplingParams(max_new_tokens=args.max_new_tokens,
                                                temperature=args.temperature), chat=True, on_finish=show)
    say_length_limit(outs, args.max_new_tokens)
    trace = llm.trace
    print(f"slot timeline ({len(trace)} steps; capital letter = prefill, small = decode, '.' = idle):")
    print(trace.timeline())
    n = sum(len(o.token_ids) for o in outs)
    total = sum(s.duration_s for s in trace.steps)
    print(f"\n{n} tokens in {total:.2f} s of steps ({n / total:.1f} tokens/s), "
          f"slot utilization {trace.utilization():.0%}")


def generate(args) -> None:
    from .sampling import SamplingParams
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    llm = _llm(args)
    outs = llm.generate(args.prompts, params, chat=not args.raw)
    for o in outs:
        print(o.text.strip())
    say_length_limit(outs, args.max_new_tokens)


def say_length_limit(outs, max_tokens: int) -> None:
    """On stderr: which answers stopped at the token limit rather than at their end."""
    cut = [i for i, o in enumerate(outs) if o.finish_reason == "length"]
    if cut:
        which = "" if len(outs) == 1 else f" (answer{'s' if len(cut) > 1 else ''} {', '.join(str(i + 1) for i in cut)})"
        print(f"[stopped at {max_tokens} tokens (max_tokens){which}; pass --max-tokens N for more]",
              file=sys.stderr, flush=True)


def check_serve_args(args) -> None:
    """Every argument of serve, before anything is loaded: also that the port is free and that the
    server's packages are installed (one line each)."""
    if not args.model.strip():
        fail("--model must name a model, got an empty string")
    if args.slots < 1:
        fail(f"--slots (--max-num-seqs) must be >= 1, got {args.slots}")
    check_memory_fraction(args)
    if args.max_waiting < 0:
        fail(f"--max-waiting must be >= 0 (requests queued beyond the slots before 503), got {args.max_waiting}")
    if not 0 <= args.port <= 65535:
        fail(f"--port must be in [0, 65535] (0: any free port), got {args.port}")
    if not args.host.strip():
        fail("--host must be an address such as 127.0.0.1 or 0.0.0.0, got an empty string")
    if args.served_model_name is not None and not args.served_model_name.strip():
        fail("--served-model-name must not be empty")
    if args.max_model_len is not None and args.max_model_len < 2:
        fail(f"--max-model-len must be >= 2 (a prompt token and a new one), got {args.max_model_len}")
    check_parallel_args(args)
    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        fail(f"serve needs {', '.join(missing)}: pip install 'pagedlab[serve]'")
    import socket
    try:
        with socket.create_server((args.host, args.port)):
            pass
    except OSError as e:
        fail(f"--host {args.host} --port {args.port}: cannot listen there ({e.strerror or e})")
    args.device = check_device(args.device)
    args.dtype = check_dtype(args.dtype)
    if args.backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        import torch
        if args.device == "cpu" or (args.device is None and not torch.cuda.is_available()):
            fail("--backend triton on CPU runs in Triton's interpreter: set TRITON_INTERPRET=1 "
                 "in the environment, or use --backend torch or --device cuda")


def serve(args) -> None:
    """The engine core(s) in processes of their own (data parallelism: one per replica), the HTTP
    front end here."""
    from .server import serve as run_server
    kw = {"max_model_len": args.max_model_len} if args.max_model_len else {}
    kw["prefix_caching"] = args.prefix_caching
    if args.quantization:
        kw["quantization"] = args.quantization
    if args.speculative_config:
        kw["speculative_config"] = spec_json(args.speculative_config)
    if args.gpu_memory_utilization is not None:
        kw["memory_fraction"] = args.gpu_memory_utilization
    name = args.served_model_name or args.model
    dp = args.data_parallel_size
    if args.engine_thread:           # the design before core processes: one process, two threads
        if dp > 1:
            fail("--engine-thread runs one engine: leave out --data-parallel-size")
        llm = _llm(args, **kw)
        run_server(llm, model_name=name, host=args.host, port=args.port, max_waiting=args.max_waiting,
                   background=False, log_level=args.log_level)
        return
    print(f"loading {args.model} in {dp} engine core process{'es' if dp > 1 else ''} ...",
          file=sys.stderr, flush=True)
    run_server(args.model, model_name=name, host=args.host, port=args.port, max_waiting=args.max_waiting,
               background=False, log_level=args.log_level, data_parallel_size=dp,
               on_ready=lambda allm: print(
                   f"serving {name} ({dp} x {args.slots} slots, at most {args.max_waiting} waiting) on "
                   f"http://{args.host}:{args.port}  (Ctrl-C stops)", file=sys.stderr, flush=True),
               device=args.device, dtype=args.dtype, max_num_seqs=args.slots, attention_backend=args.backend,
               tensor_parallel_size=args.tensor_parallel_size, **kw)


def prefix_caching_flag(parser) -> None:
    """--prefix-caching / --no-prefix-caching (vLLM's --[no-]enable-prefix-caching too): on by default."""
    parser.add_argument("--prefix-caching", "--enable-prefix-caching", dest="prefix_caching",
                        action=argparse.BooleanOptionalAction, default=EngineConfig.prefix_caching,
                        help="share the KV blocks of equal prompt prefixes between requests "
                             "(costs < 2%% when nothing is shared)")


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m pagedlab", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{demo,generate,serve,bench}")

    def common(sp):
        sp.add_argument("--model", default="smollm2",
                        help="smollm2 (embedded), random:tiny, random:llama-3.2-1b, a .gguf, a checkpoint "
                             "directory, or a hub id such as meta-llama/Llama-3.2-1B-Instruct")
        sp.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
        sp.add_argument("--dtype", default=None,
                        help="bfloat16, float16 or float32 (default: bf16 on GPUs of compute capability 8.0+, fp16 below, e.g. a T4; fp32 on cpu)")
        sp.add_argument("--slots", "--max-num-seqs", dest="slots", type=int, default=2, metavar="N",
                        help="max sequences decoding together (>= 1)")
        sp.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                        help=f"share of free GPU memory for the KV pool, in (0, 1] (default: "
                             f"{EngineConfig.memory_fraction}; on cpu the pool holds every slot at full length)")
        sp.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"], help="attention kernels")
        prefix_caching_flag(sp)
        sp.add_argument("--quantization", default=None, choices=["fp8"],
                        help="fp8: linear weights in FP8 e4m3, per-channel scales (GPUs of compute capability 8.9+, or cpu)")
        sp.add_argument("--max-tokens", "--max-new-tokens", dest="max_new_tokens", type=int, metavar="N",
                        default=DEFAULT_MAX_TOKENS, help="new tokens per answer at most (>= 1)")
        sp.add_argument("--temperature", type=float, default=0.0, help=">= 0 (0 = greedy)")
        sp.add_argument("--speculative-config", default=None, metavar="JSON",
                        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
        sp.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="split every layer across N processes/GPUs (>= 1; docs/parallel.md)")
        sp.add_argument("--data-parallel-size", type=int, default=1,
                        help="N replicas behind a router, one process/GPU each (>= 1)")

    d = sub.add_parser("demo", help="the four prompts of the original engine, 2 slots")
    common(d)
    d.add_argument("prompts", nargs="*", metavar="PROMPT")
    g = sub.add_parser("generate", help="answer prompts",
                       description="Answer prompts (chat template on, greedy, at most --max-tokens new "
                                   "tokens: the Python defaults; README: Defaults).")
    common(g)
    g.add_argument("prompts", nargs="+", metavar="PROMPT")
    g.add_argument("--top-k", type=int, default=0, help=">= 0 (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="in (0, 1] (1 = off)")
    g.add_argument("--seed", type=int, default=None,
                   help="in [0, 2**63) (default: drawn from the engine's seed, 0: runs repeat)")
    g.add_argument("--raw", action="store_true", help="no chat template")
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/chat/completions, "
                                     "/v1/completions, /v1/models, /metrics, /health)",
                       description="An OpenAI-compatible HTTP server. A request's defaults are OpenAI's: "
                                   "temperature 1.0; max_tokens 16 on /v1/completions and the rest of the "
                                   "context on /v1/chat/completions (README: Defaults).")
    s.add_argument("--model", default="smollm2", help="as for demo/generate")
    s.add_argument("--served-model-name", default=None,
                   help="the name clients give as 'model' (default: --model)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000, help="0: any free port")
    s.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    s.add_argument("--dtype", default=None, help="bfloat16, float16 or float32 (default: as for demo/generate)")
    s.add_argument("--slots", "--max-num-seqs", dest="slots", type=int, default=8, metavar="N",
                   help="max sequences decoding together (>= 1)")
    s.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                   help="share of free GPU memory for the KV pool, in (0, 1] (default: "
                        f"{EngineConfig.memory_fraction})")
    s.add_argument("--max-waiting", type=int, default=256,
                   help="requests queued beyond the slots; one more gets 503 + Retry-After (>= 0)")
    s.add_argument("--max-model-len", type=int, default=None, help="longest sequence (default: the model's)")
    s.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"], help="attention kernels")
    prefix_caching_flag(s)
    s.add_argument("--quantization", default=None, choices=["fp8"],
                   help="fp8: linear weights in FP8 e4m3, per-channel scales (GPUs of compute capability 8.9+, or cpu)")
    s.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' (docs/speculative.md)')
    s.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split every layer across N processes/GPUs (>= 1; docs/parallel.md)")
    s.add_argument("--data-parallel-size", type=int, default=1,
                   help="N engine cores (one process and GPU each) behind this one server, "
                        "least-loaded routing (>= 1)")
    s.add_argument("--engine-thread", action="store_true",
                   help="run the engine on a thread of the server's process instead of an engine core "
                        "process (slower under load: they share one GIL; for comparison)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level")
    b = sub.add_parser("bench", help="benchmarks: " + " | ".join(BENCHMARKS + HTTP_BENCHMARKS),
                       description="Benchmarks: kernels, engine, gemv, step on a CUDA GPU; serve "
                                   "against any OpenAI-compatible server. The arguments after the "
                                   "name go to the benchmark: python -m pagedlab bench NAME --help")
    b.add_argument("what", choices=BENCHMARKS + HTTP_BENCHMARKS)
    b.add_argument("rest", nargs=argparse.REMAINDER)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "bench":
        import importlib
        mod = importlib.import_module(f"pagedlab.bench.{args.what}")
        return mod.main(args.rest) or 0
    if args.cmd == "serve":
        check_serve_args(args)
    else:
        check_args(args)
    from .weights import GatedModelError, ModelNotFound
    try:
        {"demo": demo, "generate": generate, "serve": serve}[args.cmd](args)
    except (ModelNotFound, GatedModelError) as e:
        fail(f"--model: {e}")
    except (ValueError, OSError, NotImplementedError) as e:   # OSError: a download, a file
        fail(e)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Command line: python -m pagedlab demo | generate | serve | bench kernels|engine|gemv|step|serve

Every argument is checked before the model is loaded (loading takes seconds to a minute): a bad
one is one line on stderr that names its flag, and exit status 2.
"""
from __future__ import annotations

import sys

# Ctrl-C while `python -m pagedlab` starts: nothing here imports torch (nor does `import pagedlab`,
# whose names are imported on first use), so the second or more of importing it runs inside main(),
# where a Ctrl-C is "interrupted" and 130; and a Ctrl-C during this file's own few imports is said
# the same way. (Left: Python's own start-up before this file runs, some tens of milliseconds.)
try:
    import argparse
    import importlib.util
    import os

    from .bench import BENCHMARKS, HTTP_BENCHMARKS
    from .config import DEFAULT_MAX_WAITING, EngineConfig
    from .conversation import DEMO_PROMPTS
    from .validation import ValidationError, check_device_present, check_int
except KeyboardInterrupt:
    if __name__ != "__main__":
        raise
    print("interrupted", file=sys.stderr)
    exec("")                   # (see main)
    raise SystemExit(130) from None

# what a bad argument raises once the model loads (its message is the error line; anything else
# is a bug and keeps its traceback). MemoryError: a size no machine has, e.g. --slots 99999999999
USER_ERRORS = (ValueError, OSError, NotImplementedError, MemoryError)
# EngineConfig fields that only the model can check (config.check_max_model_len): a bad one is an
# error line naming its flag ("error: --max-model-len: max_model_len must be at most 256, ..." on random:tiny)
MODEL_CHECKED = ("max_model_len",)
USAGE_ERROR = 2                                        # exit status of a bad argument, as argparse's
# the flag that sets each field (an error names the field as the user wrote it)
FLAGS = {"max_new_tokens": "--max-tokens (--max-new-tokens)", "max_num_seqs": "--slots (--max-num-seqs)",
         "memory_fraction": "--gpu-memory-utilization", "attention_backend": "--backend",
         "prefix_caching": "--prefix-caching"}


def fail(message: str) -> None:
    """One line on stderr, exit status 2."""
    text = " ".join(str(message).split())
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")    # argv not UTF-8: shown escaped
    print(f"error: {text}", file=sys.stderr)
    raise SystemExit(USAGE_ERROR)


def flag_of(field: str) -> str:
    return FLAGS.get(field, "--" + field.replace("_", "-"))


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
def build_objects(args, sampling: bool = True) -> None:
    """The real objects from the flags, before anything is loaded: their checks are the checks
    (validation.py), so a bad flag fails with the Python API's words under the flag's name. Sets
    args.params (SamplingParams; sampling=False: None) and args.engine_kwargs (EngineConfig's
    fields, checked by building one, and the parallel sizes)."""
    from .config import resolve_backend
    from .llm import parallel_sizes
    from .sampling import SamplingParams
    try:
        # (EngineConfig bounds it below only: 10**20 reached the engine core as an OverflowError;
        # above the model's own limit it is refused once the model is read: config.check_max_model_len)
        check_int("max_model_len", getattr(args, "max_model_len", None), 2, 2**31 - 1, optional=True)
        args.params = SamplingParams(
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=getattr(args, "top_k", 0),
            top_p=getattr(args, "top_p", 1.0), seed=getattr(args, "seed", None)) if sampling else None
        device = args.device.strip().lower() if args.device else None      # flags: any case
        kw = dict(max_num_seqs=args.slots, attention_backend=args.backend, device=device, dtype=args.dtype)
        for name, value in (("memory_fraction", args.gpu_memory_utilization),
                            ("max_model_len", getattr(args, "max_model_len", None)),
                            ("quantization", getattr(args, "quantization", None)),
                            ("prefix_caching", getattr(args, "prefix_caching", None)),
                            ("admit_group", getattr(args, "admit_group", None)),
                            ("admit_wait", getattr(args, "admit_wait", None)),
                            ("speculative_config", spec_json(args.speculative_config)
                             if getattr(args, "speculative_config", None) else None)):
            if value is not None:
                kw[name] = value
        config = EngineConfig(**kw)
        kw["device"], kw["dtype"] = config.device, config.dtype
        parallel_sizes(args.tensor_parallel_size, getattr(args, "data_parallel_size", 1))
        if config.device is not None:
            check_device_present(config.device)
        import torch
        resolve_backend(config.attention_backend, torch.device(config.device or (
            "cuda" if torch.cuda.is_available() else "cpu")))
    except ValidationError as e:
        if e.owner in (None, "SamplingParams"):
            fail(e.rule(flag_of(e.field.split("[")[0])))
        fail(f"{flag_of(e.owner)}: {e.rule()}")          # a field inside a flag's value
    args.engine_kwargs = kw


def check_args(args) -> None:
    """Every argument of demo/generate, before anything is loaded."""
    if not args.model.strip():
        fail("--model must name a model, got an empty string")
    for i, prompt in enumerate(args.prompts, 1):
        if not prompt.strip():
            fail(f"PROMPT {i} of {len(args.prompts)} is empty: give some text to answer")
    build_objects(args)


# ------------------------------------------------------------------ commands
def _llm(args, **kw):
    from .llm import LLM
    return LLM(args.model, tensor_parallel_size=args.tensor_parallel_size,
               data_parallel_size=getattr(args, "data_parallel_size", 1), **args.engine_kwargs, **kw)


def spec_json(text: str) -> dict:
    """--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}' (vLLM's flag)."""
    import json
    try:
        value = json.loads(text)
    except ValueError as e:
        fail(f"--speculative-config must be JSON such as '{{\"method\": \"ngram\", "
             f"\"num_speculative_tokens\": 4}}': {e}")
    return value                # checked as EngineConfig(speculative_config=...) (build_objects)


def demo(args) -> None:
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

    outs = llm.generate(prompts, args.params, chat=True, on_finish=show)
    say_length_limit(outs, args.max_new_tokens)
    trace = llm.trace
    print(f"slot timeline ({len(trace)} steps; capital letter = prefill, small = decode, '.' = idle):")
    print(trace.timeline())
    n = sum(len(o.token_ids) for o in outs)
    total = sum(s.duration_s for s in trace.steps)
    print(f"\n{n} tokens in {total:.2f} s of steps ({n / total:.1f} tokens/s), "
          f"slot utilization {trace.utilization():.0%}")


def generate(args) -> None:
    llm = _llm(args)
    outs = llm.generate(args.prompts, args.params, chat=not args.raw)
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
    try:
        check_int("port", args.port, 0, 65535, note=" (0: any free port)")
        check_int("data_parallel_size", args.data_parallel_size, 1)
        most, why = api_servers_limit(args.data_parallel_size)
        check_int("api_servers", args.api_servers, 1, most, note=f" (front-end processes on the port: {why})")
        most, why = max_waiting_limit(args.api_servers)
        check_int("max_waiting", args.max_waiting, 0, most,
                  note=f" (requests queued beyond the slots before 503: {why})")
    except ValidationError as e:
        fail(e.rule(flag_of(e.field)))
    from .async_llm import KEEPALIVE_S, liveness, liveness_seconds
    try:
        liveness(args.core_silent_s, args.core_give_up_s)
        liveness_seconds("PAGEDLAB_SSE_KEEPALIVE_S", None, KEEPALIVE_S, zero_ok=True)
    except ValueError as e:             # "silent_s must be ..." (a flag's) or "PAGEDLAB_CORE_SILENT_S must be ..."
        why = str(e)
        fail(why if why.startswith("PAGEDLAB_") else "--core-" + why.replace("_", "-", 2))
    if not args.host.strip():
        fail("--host must be an address such as 127.0.0.1 or 0.0.0.0, got an empty string")
    if args.served_model_name is not None and not args.served_model_name.strip():
        fail("--served-model-name must not be empty")
    build_objects(args, sampling=False)
    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        fail(f"serve needs {', '.join(missing)}: pip install 'pagedlab[serve]'")
    import socket
    try:
        with socket.create_server((args.host, args.port)):
            pass
    except (OSError, UnicodeError, TypeError, ValueError) as e:   # TypeError: a host that is not UTF-8
        fail(f"--host {args.host} --port {args.port}: cannot listen there "
             f"({getattr(e, 'strerror', None) or e})")


# descriptors a server process holds besides one per front end / connection: its libraries, the
# engine cores' pipes, the listening socket, files (measured on random:tiny: 19-28 in the server,
# 23 in each front end of --api-servers 2)
FD_RESERVE = 64
NO_FD_LIMIT_MAX_WAITING = 2**20        # --max-waiting's bound where the open-files limit is unknown


def open_files_limit() -> int | None:
    """The open-files limit of this process (ulimit -n; what its children inherit), None if none."""
    try:
        import resource
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY or soft <= 0 else soft


def api_servers_limit(data_parallel_size: int) -> tuple[int, str]:
    """The most front ends --api-servers may start, and why: one per CPU this process may run on
    (more only take turns on them, each a process with its own copy of the libraries; 2 allowed
    on any machine), and no more than the open-files limit leaves room for -- while this process
    starts them it holds, for each, a listening socket, a pipe to every engine core and its own
    lifeline (99999999999 ran out of them: "Too many open files")."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    most, why = max(2, cpus), f"at most one per CPU, {cpus} here" if cpus >= 2 else "at most 2 on one CPU"
    fds = open_files_limit()
    if fds is not None:
        room = max(1, (fds - FD_RESERVE) // (6 + 4 * data_parallel_size))
        if room < most:
            most, why = room, f"as many as the open-files limit leaves room for, ulimit -n {fds}"
    return most, why


def max_waiting_limit(api_servers: int) -> tuple[int, str]:
    """The most requests --max-waiting may let wait, and why. Every waiting request holds an open
    connection in a front-end process, and a process holds at most `ulimit -n` files: a bound past
    that is never reached -- the server fails to accept ("Too many open files") before it would
    answer 503. So: what the open-files limit leaves room for, in each front end."""
    fds = open_files_limit()
    if fds is None:
        return NO_FD_LIMIT_MAX_WAITING, "no open-files limit here"
    per = "" if api_servers == 1 else f" in each of {api_servers} front ends"
    return max(DEFAULT_MAX_WAITING, api_servers * (fds - FD_RESERVE)), \
        f"each holds an open connection, and ulimit -n is {fds}{per}"


def serve(args) -> None:
    """The engine core(s) in processes of their own (data parallelism: one per replica), the HTTP
    front end here."""
    from .server import serve as run_server
    name = args.served_model_name or args.model
    dp = args.data_parallel_size
    if args.engine_thread:           # one process: the engine on a thread beside the server
        if dp > 1:
            fail("--engine-thread runs one engine: leave out --data-parallel-size")
        if args.api_servers > 1:
            fail("--engine-thread runs the engine in the server's one process: leave out --api-servers")
        llm = _llm(args)
        run_server(llm, model_name=name, host=args.host, port=args.port, max_waiting=args.max_waiting,
                   background=False, log_level=args.log_level, silent_s=args.core_silent_s,
                   give_up_s=args.core_give_up_s)
        return
    n = args.api_servers
    print(f"loading {args.model} in {dp} engine core process{'es' if dp > 1 else ''} ...",
          file=sys.stderr, flush=True)
    fronts = f", {n} front-end processes" if n > 1 else ""
    run_server(args.model, model_name=name, host=args.host, port=args.port, max_waiting=args.max_waiting,
               background=False, log_level=args.log_level, data_parallel_size=dp, api_servers=n,
               silent_s=args.core_silent_s, give_up_s=args.core_give_up_s,
               on_ready=lambda allm: print(
                   f"serving {name} ({dp} x {args.slots} slots, at most {args.max_waiting} waiting{fronts}) on "
                   f"http://{args.host}:{args.port}  (Ctrl-C stops)", file=sys.stderr, flush=True),
               tensor_parallel_size=args.tensor_parallel_size, **args.engine_kwargs)


def prefix_caching_flag(parser) -> None:
    """--prefix-caching / --no-prefix-caching (vLLM's --[no-]enable-prefix-caching too): on by default."""
    parser.add_argument("--prefix-caching", "--enable-prefix-caching", dest="prefix_caching",
                        action=argparse.BooleanOptionalAction, default=EngineConfig.prefix_caching,
                        help="share the KV blocks of equal prompt prefixes between requests "
                             "(costs < 2%% when nothing is shared)")


def build_parser() -> ArgumentParser:
    from .sampling import DEFAULT_MAX_TOKENS         # (imports torch: called inside main())
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
        sp.add_argument("--max-model-len", type=int, default=None, metavar="N",
                        help="longest sequence, prompt and answer (default: the model's own limit)")
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

    d = sub.add_parser("demo", help="four short prompts, 2 slots, and the slot timeline")
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
                   help="in [0, 2**63-1] (default: drawn from the engine's seed, 0: runs repeat)")
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
    s.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING, metavar="N",
                   help="requests queued beyond the slots; one more gets 503 + Retry-After (>= 0; at "
                        "most what the open-files limit leaves room for: each waiting request holds a "
                        "connection, and a front end can hold ulimit -n files)")
    s.add_argument("--max-model-len", type=int, default=None, help="longest sequence (default: the model's)")
    s.add_argument("--admit-group", type=int, default=EngineConfig.admit_group, metavar="N",
                   help="while requests run, admit waiting prompts once min(N, waiting) slots are free, "
                        "so they share one prompt step (1: any free slot at once; default: 8 on CUDA, 1 on CPU)")
    s.add_argument("--admit-wait", type=int, default=EngineConfig.admit_wait, metavar="STEPS",
                   help="with --admit-group: hold the queue at most this many steps in a row")
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
    s.add_argument("--api-servers", "--api-server-count", dest="api_servers", type=int, default=1, metavar="N",
                   help="N HTTP front-end processes on the port (SO_REUSEPORT), each in front of every "
                        "engine core: HTTP, tokenizing and streaming on N CPUs (Linux; 1 to the CPUs "
                        "this process may use, or 2: more only take turns on them; and no more than "
                        "ulimit -n leaves room for: each needs a socket and pipes while they start)")
    s.add_argument("--engine-thread", action="store_true",
                   help="run the engine on a thread of the server's process instead of an engine core "
                        "process (slower under load: they share one GIL; for comparison)")
    s.add_argument("--core-silent-s", type=float, default=None, metavar="S",
                   help="/health answers 503 once an engine core has not answered for S seconds: stopped, "
                        "or stuck in a step (default 30; env PAGEDLAB_CORE_SILENT_S)")
    s.add_argument("--core-give-up-s", type=float, default=None, metavar="S",
                   help="after S seconds of silence, end that core's open streams with an error and refuse "
                        "new requests until it answers (default 300; 0: never; env PAGEDLAB_CORE_GIVE_UP_S)")
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
    """The command line; Ctrl-C at any moment (checking arguments, importing torch, loading,
    generating, serving) is one line, "interrupted", and exit status 130 (the shell's)."""
    try:
        return run(argv)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        # CPython marks a KeyboardInterrupt raised inside exec() as unhandled even when it is
        # caught (dataclasses build their methods with exec: a Ctrl-C while torch imports often
        # lands there), and then ends the process with SIGINT at exit -- status -2, not 130. Each
        # exec() clears that mark when it starts, so an empty one forgets it.
        exec("")
        return 130


def run(argv=None) -> int:
    from .interrupts import deferred
    # torch's import (a second or two) as one piece: a Ctrl-C in it is raised when it is over (a
    # second Ctrl-C at once). Raised inside, it did not always reach main(): torch's C extension
    # swallows an error importing numpy (the Ctrl-C was lost: the command ran on), and one raised
    # under a C++ initializer can abort the process (SIGABRT).
    with deferred():
        import torch  # noqa: F401
    args = build_parser().parse_args(argv)
    if args.cmd == "bench":
        import importlib
        mod = importlib.import_module(f"pagedlab.bench.{args.what}")
        return mod.main(args.rest) or 0
    if args.cmd == "serve":
        check_serve_args(args)
    else:
        check_args(args)
    from .core_process import CoreStartError
    from .weights import GatedModelError, ModelNotFound
    try:
        try:
            {"demo": demo, "generate": generate, "serve": serve}[args.cmd](args)
        except CoreStartError as e:      # serve: the engine core's own error, when it is the user's
            if isinstance(e.error, USER_ERRORS):
                raise e.error from None
            raise
    except (ModelNotFound, GatedModelError) as e:
        fail(flagged(e, "--model"))      # (the draft model's: --speculative-config)
    except ValidationError as e:         # a flag checked against the model once it is read
        if e.owner is None and e.field in MODEL_CHECKED:
            fail(f"{flag_of(e.field)}: {e.rule()}")
        fail(flagged(e))
    except USER_ERRORS as e:             # OSError: a download, a file
        fail(f"out of memory building the engine (MemoryError{': ' + str(e) if str(e) else ''}): a flag "
             "asks for more than this machine has; see --slots and --max-model-len"
             if isinstance(e, MemoryError) else flagged(e))
    return 0


def flagged(e: Exception, flag: str | None = None) -> str:
    """The error line of an error raised once the model loads. One about a field inside a flag's
    value (`e.owner` an EngineConfig field, its message "owner: ..."; e.g. the draft model of
    --speculative-config, spec/draft.py) names that flag; any other is `flag: message`."""
    from dataclasses import fields
    owner, text = getattr(e, "owner", None), str(e)
    if owner in {f.name for f in fields(EngineConfig)} and text.startswith(f"{owner}: "):
        return f"{flag_of(owner)}: {text[len(owner) + 2:]}"
    return f"{flag}: {text}" if flag else text


if __name__ == "__main__":
    sys.exit(main())

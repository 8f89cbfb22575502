"""The front door: LLM loads a model, builds the engine and answers prompts.

    llm = LLM("smollm2")                                  # or "random:tiny", a checkpoint dir, a hub id
    outs = llm.generate(prompts, SamplingParams(...))     # list[RequestOutput], in prompt order
    for delta in llm.stream(prompt): ...                  # one prompt, a StreamDelta per step
    outs = llm.chat(messages)                             # generate(..., chat=True)

LLM(...) checks its keywords (engine_args.py: vLLM's names too) and builds its EngineConfig before
anything loads; then it loads the checkpoint (weights.py), picks the tokenizer and builds the model
and the engine behind an engine core (rank.py). generate checks every prompt before any is queued,
turns n samples into n requests (SamplingParams.samples) and steps the core until all are done
(engine_core.run_requests). With tensor_parallel_size / data_parallel_size > 1 it starts the other
ranks' processes (parallel/) and this process is rank 0 -- under data parallelism also the router
that spreads the requests over the replicas.
"""
from __future__ import annotations

import inspect
import numbers
import sys
from collections.abc import Mapping
from dataclasses import replace

import torch

from .config import (EngineConfig, check_max_model_len, resolve_backend,  # noqa: F401 (resolve_backend: here too)
                     resolve_device_dtype)
from .conversation import check_conversation, is_conversation
from .cpu_threads import apply_cpu_thread_policy
from .engine_args import engine_config_kwargs
from .interrupts import deferred
from .parallel.shard import check_split
from .engine_core import run_requests
from .output_processor import RequestOutput
from .rank import build_engine, build_model
from .sampling import SamplingParams
from .tokenizer import ByteTokenizer, HFTokenizer, Llama3Tokenizer
from .validation import check_int, show
from .weights import DEFAULT_MODEL, load_checkpoint, missing_tokenizer_message


LLAMA3_VOCAB_SIZE = 128256        # 128,000 BPE tokens + 256 special tokens: a Llama 3 vocabulary


def gather(outputs: list[RequestOutput]) -> RequestOutput:
    """One prompt's samples as one RequestOutput: the first, with every sample in `.outputs`."""
    return outputs[0] if len(outputs) == 1 else replace(outputs[0], outputs=outputs)


def make_tokenizer(ckpt):
    """Llama 3 vocabularies use pagedlab's own Llama 3 tokenizer (without llama-models installed: the
    checkpoint's own tokenizer files, if it has them); other checkpoints their own;
    random weights a byte tokenizer. A checkpoint directory without tokenizer files is an error
    that says what is missing (pass LLM(tokenizer=...) to bring one)."""
    c = ckpt.config
    if c.vocab_size == LLAMA3_VOCAB_SIZE:
        try:
            return Llama3Tokenizer()
        except FileNotFoundError:
            if ckpt.tokenizer_dir is not None and not ckpt.gguf_file:
                return HFTokenizer(ckpt.tokenizer_dir)      # the checkpoint's own tokenizer files
            if ckpt.tokenizer_dir is None and ckpt.source.startswith("random"):
                import warnings
                warnings.warn("llama-models is not installed: random Llama 3 weights get a byte "
                              "tokenizer (pip install --no-deps llama-models for the real one)")
                return ByteTokenizer(c.vocab_size, c.bos_token_id, c.eos_token_ids)
            raise
    if ckpt.gguf_file:
        return HFTokenizer(ckpt.tokenizer_dir, gguf_file=ckpt.gguf_file)
    if ckpt.tokenizer_dir:
        return HFTokenizer(ckpt.tokenizer_dir)
    if not ckpt.source.startswith("random"):
        raise ValueError(missing_tokenizer_message(ckpt.source))
    return ByteTokenizer(c.vocab_size, c.bos_token_id, c.eos_token_ids)


def check_text(text: str, where: str) -> None:
    """Text the tokenizer can take: valid Unicode. A lone surrogate ('\\udcff': bytes that are not
    UTF-8 read with errors='surrogateescape', a command line argument in another encoding, JSON's
    "\\ud800") would otherwise fail deep inside the tokenizer with a message that names nothing."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{where} is not valid Unicode: {e.object[e.start:e.end]!r} at index {e.start} is a "
                         "lone surrogate (text decoded from bytes that are not UTF-8? decode them with "
                         "errors='replace')") from None


def _is_ndarray(x) -> bool:
    np = sys.modules.get("numpy")          # (no numpy imported: no array can have been made)
    return np is not None and isinstance(x, np.ndarray)


def array_prompt(a):
    """A numpy array given as a prompt: a 1-D array of numbers is one prompt's token ids (as a 1-D
    tensor is; its elements are checked as token ids), a 1-D array of strings a list of prompts."""
    if a.ndim == 1:
        return a.tolist()
    raise ValueError(f"a prompt array must be 1-D (one prompt's token ids), got shape {tuple(a.shape)}: "
                     "pass a list of 1-D arrays for several prompts")


def _renamed(e: Exception, text: str) -> Exception:
    """e's kind of exception with another message (a kind whose constructor takes more than a
    message -- UnicodeError, ValidationError -- becomes a plain ValueError / TypeError)."""
    try:
        new = type(e)(text)
        if str(new) == text:
            return new
    except Exception:                     # noqa: BLE001 -- only choosing the exception's class
        pass
    return (TypeError if isinstance(e, TypeError) else ValueError)(text)


def parallel_sizes(tp, dp) -> tuple[int, int]:
    return check_int("tensor_parallel_size", tp, 1), check_int("data_parallel_size", dp, 1)


def check_parallel_devices(device, world: int) -> None:
    """T * D ranks need T * D GPUs (cuda:0 ..), or run on the CPU (any number of processes)."""
    if device.type != "cuda":
        return
    if device.index not in (None, 0):
        raise ValueError(f"a parallel LLM uses cuda:0 .. cuda:{world - 1}; got device {device}")
    have = torch.cuda.device_count()
    if have < world:
        raise ValueError(f"tensor_parallel_size x data_parallel_size = {world} ranks need {world} GPUs; "
                         f"torch sees {have}")


class LLM:
    """LLM(model="smollm2" | "random:tiny" | path | hub id, device=None, dtype=None, **EngineConfig fields)"""

    def __init__(self, model=DEFAULT_MODEL, *, device=None, dtype=None, seed: int = 0,
                 show_progress: bool = True, checkpoint=None, tokenizer=None,
                 kernel_options: dict | None = None, allocator=None, scheduler=None,
                 decode_kernel=None, tensor_parallel_size: int = 1, data_parallel_size: int = 1,
                 warmup: bool = True, **engine_kwargs):
        """kernel_options: launch settings for the Triton kernels (decode_config, prefill_config,
        gemv_config, pdl), see kernels.select_kernels; the defaults suit the device.

        Your own pieces in place of pagedlab's (plugins.py; None: pagedlab's own):
          allocator      a class or factory taking num_blocks: allocate(owner, n) -> n block ids,
                         free(blocks), and num_free or free_list (notebook 07's Allocator);
                         prefix_caching=True needs a BlockAllocator's prefix-cache API
                         (with a plugged allocator prefix caching is off unless asked for)
          scheduler      a Scheduler subclass or factory with Scheduler's signature
                         (plugins.scheduler_with_make_room(make_room): notebook 10's preemption)
          decode_kernel  a function with kernels.decode_attention_torch's signature
                         (plugins.decode_kernel_from(decode_one): notebook 06's loop); CUDA graphs
                         are then off unless cuda_graphs is given

        Beyond one device (parallel/): tensor_parallel_size=T cuts every layer across T ranks,
        data_parallel_size=D runs D replicas behind a router; T * D processes (this one is rank 0),
        on GPUs cuda:0 .. cuda:T*D-1. Call close() (or use `with LLM(...) as llm:`) to stop them.

        warmup: on CUDA, compile the Triton kernels every kind of step needs at load (warmup.py,
        with a progress bar; Triton keeps them on disk for the next process), so the first
        requests wait for no compiler. False: they compile on first use instead.

        vLLM's names are taken where they mean the same (engine_args.py: gpu_memory_utilization,
        enable_prefix_caching, enforce_eager); an unknown keyword is a TypeError before anything
        loads, naming the nearest known one."""
        engine_kwargs = engine_config_kwargs(engine_kwargs, inspect.signature(LLM.__init__).parameters)
        if checkpoint is None and (model is None or (isinstance(model, str) and not model.strip())):
            raise ValueError(f"LLM(model={model!r}): no model named; give a name ('smollm2', "
                             "'random:tiny'), a checkpoint directory or a Hugging Face hub id")
        self.model_name = model if isinstance(model, str) and checkpoint is None else None   # as the user named it
        if not isinstance(warmup, bool):
            raise TypeError(f"LLM(): warmup must be True or False, got {warmup!r:.60}")
        self._warmup = warmup
        self._show_progress = bool(show_progress)
        self.warmup_info: dict = {}       # what the warm-up at load did (warmup.py): seconds, steps
        tp, dp = parallel_sizes(tensor_parallel_size, data_parallel_size)
        if tp * dp > 1 and (allocator is not None or scheduler is not None or decode_kernel is not None):
            raise ValueError("allocator=, scheduler= and decode_kernel= plug into one process; they "
                             "cannot be combined with tensor_parallel_size / data_parallel_size > 1")
        if decode_kernel is not None:
            engine_kwargs.setdefault("cuda_graphs", False)
        if allocator is not None:        # a plugged allocator shares no blocks unless asked to
            engine_kwargs.setdefault("prefix_caching", False)
        device, dtype = resolve_device_dtype(device, dtype)
        apply_cpu_thread_policy(device)          # cpu_threads.py: one thread unless the user chose
        if tp * dp > 1:
            check_parallel_devices(device, tp * dp)
        engine_config = EngineConfig(device=str(device), dtype=str(dtype).replace("torch.", ""),
                                     seed=seed, **engine_kwargs)      # checked before anything loads
        # a Checkpoint given by hand is checked like a loaded one (shapes, dtypes, finite values)
        self.checkpoint = ckpt = checkpoint.validate() if checkpoint is not None else \
            load_checkpoint(model, seed=seed, show_progress=show_progress)
        backend = resolve_backend(engine_config.attention_backend, device)
        check_split(ckpt.config, tp)
        check_max_model_len(engine_config, ckpt.config)   # before the model's RoPE table, KV pool, workers
        tokenizer = tokenizer or make_tokenizer(ckpt)
        self.tensor_parallel_size, self.data_parallel_size = tp, dp
        self._workers = self._router = None
        group = None
        if tp * dp > 1:           # the other ranks' processes first; this one is rank 0
            from .parallel.world import start_world
            self._workers, self._router, self._close = start_world(
                self, tp, dp, device, dtype, ckpt, engine_config, backend, kernel_options, tokenizer,
                setup=lambda group: self._setup(ckpt.config, ckpt.tensors, tokenizer, device, dtype,
                                                engine_config, backend, kernel_options, group))
        else:
            self._setup(ckpt.config, ckpt.tensors, tokenizer, device, dtype, engine_config, backend,
                        kernel_options, None, allocator=allocator, scheduler=scheduler,
                        decode_kernel=decode_kernel)

    def _setup(self, config, tensors, tokenizer, device, dtype, engine_config, backend, kernel_options,
               group, allocator=None, scheduler=None, decode_kernel=None):
        """Kernels, model (this rank's cut under tensor parallelism), tokenizer and engine (rank.py)."""
        self.config, self.engine_config, self.tokenizer = config, engine_config, tokenizer
        self.model = build_model(config, tensors, device, dtype, engine_config, backend, kernel_options,
                                 tp=group, decode_kernel=decode_kernel)
        self.engine, self.core, self.outputs = build_engine(self.model, tokenizer, engine_config,
                                                            allocator=allocator, scheduler=scheduler)
        self._next_dp_id = 0
        if self._warmup:
            from .warmup import warm_up
            self.warmup_info = warm_up(self.engine, self._show_progress)

    def close(self) -> None:
        """Stop the worker processes of a parallel LLM (a no-op otherwise, and the second time).
        Its CUDA graphs go first: they hold the communicators' kernels."""
        if self._workers is not None:
            if getattr(self, "engine", None) is not None and self.model.device.type == "cuda":
                torch.cuda.synchronize(self.model.device)
                self.engine.runner.graphs = None
            self._close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _check_driver(self):
        driver = getattr(self, "_core_thread", None)         # AsyncLLM(llm)'s engine thread (async_llm.py)
        if driver is not None and driver.thread.is_alive():
            raise RuntimeError("this LLM's engine is driven by an AsyncLLM (AsyncLLM(llm) or serve(llm): its "
                               "engine thread steps it), and two drivers would take each other's tokens: use "
                               "that AsyncLLM, or call its shutdown() first")

    def _check_open(self):
        self._check_driver()
        if self._workers is not None and self._workers.closed:
            stopped = self.model.tp.stopped if self.model.tp is not None else None
            raise RuntimeError(stopped or "this LLM was closed (close() stops its parallel workers); "
                               "create a new LLM")

    @property
    def trace(self):
        return self.engine.trace

    def abort(self, request_id: int) -> bool:
        """Cancel a request (see Engine.abort). The id must be an integer: True would otherwise
        be taken for request 1 (True == 1 as a key)."""
        if isinstance(request_id, bool) or not isinstance(request_id, numbers.Integral):
            raise TypeError(f"request_id must be an integer (a RequestOutput's request_id), got "
                            f"{request_id!r} ({type(request_id).__name__})")
        self._check_driver()
        return self.engine.abort(int(request_id))

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 chat: bool = False, use_tqdm: bool = False, on_finish=None, *,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 system: str | None = None) -> list[RequestOutput]:
        """prompts: a string, a list of token ids, a conversation (a list of role/content dicts,
        conversation.py), or a list of any of those. chat=True wraps strings in the model's chat
        template (a conversation always is), after a `system` turn if given. params (or vLLM's
        name, sampling_params): one SamplingParams for all prompts or one per prompt. Returns one
        RequestOutput per prompt, in order; `.outputs` lists its n samples (n = 1: itself), as
        vLLM's. Every prompt is checked before any is queued. If generate is interrupted (Ctrl-C,
        an exception in on_finish) its unfinished requests are aborted; requests that others added
        through engine.add_request and that finish meanwhile are handed back to the engine, not lost."""
        if prompts is None or isinstance(prompts, (numbers.Number, bytes, bytearray)) or \
                not hasattr(prompts, "__iter__"):
            raise TypeError(f"prompts must be a string, a list of token ids, a conversation or a list "
                            f"of those; got {show(prompts)} ({type(prompts).__name__})")
        if isinstance(prompts, Mapping):       # (iterating it would make a prompt of each key)
            raise TypeError(f"prompts must be a string, a list of token ids, a conversation or a list of "
                            f"those; got a {type(prompts).__name__}: a conversation is a list of messages, "
                            "e.g. [{'role': 'user', 'content': '...'}]")
        if isinstance(prompts, (set, frozenset)):
            raise TypeError("prompts must be ordered (a list or a tuple): outputs come back in prompt order, "
                            f"and a {type(prompts).__name__} has none")
        if on_finish is not None and not callable(on_finish):
            raise TypeError(f"on_finish must be a function taking a RequestOutput (or None), got "
                            f"{show(on_finish)} ({type(on_finish).__name__})")
        params = self._params_argument(params, sampling_params)
        if system is not None and not chat:
            raise ValueError("system= is a chat turn: use LLM.chat(prompts, system=...) (or chat=True)")
        if _is_ndarray(prompts):
            prompts = array_prompt(prompts)
            if prompts and not isinstance(prompts[0], str):
                prompts = [prompts]            # one prompt's token ids (checked as such below)
        if isinstance(prompts, (str, torch.Tensor)) or is_conversation(prompts) or (
                isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], numbers.Integral)):
            prompts = [prompts]
        prompts = list(prompts)
        params_list = self._params_list(params, len(prompts))
        self._check_open()
        items, counts = [], []
        for i, (p, sp) in enumerate(zip(prompts, params_list)):
            # n samples of a prompt are n requests (SamplingParams.samples: seeds seed, seed + 1, ...)
            samples = sp.samples()
            try:
                ids, text, _ = self._check_prompt(p, samples[0], chat, system)
            except (ValueError, TypeError) as e:
                raise _renamed(e, f"prompt {i}: {e}" if len(prompts) > 1 else str(e)) from None
            items += [(ids, text, s) for s in samples]
            counts.append(len(samples))
        run = self._run if self._router is None else self._run_replicas
        outs = iter(run(items, use_tqdm, on_finish))
        samples = [gather([next(outs) for _ in range(n)]) for n in counts]
        return [o if o.outputs is not None else replace(o, outputs=[o]) for o in samples]

    @staticmethod
    def _params_list(params, n: int) -> list[SamplingParams]:
        """One SamplingParams per prompt: params given once for all, or a list of n (None in it:
        the defaults). Anything else is a TypeError naming it, before anything is queued."""
        if isinstance(params, (list, tuple)):
            out = [SamplingParams() if p is None else p for p in params]
            for j, p in enumerate(out):
                if not isinstance(p, SamplingParams):
                    raise TypeError(f"params[{j}] must be a SamplingParams (or None: the defaults), got "
                                    f"{show(p)} ({type(p).__name__})")
            if len(out) != n:
                raise ValueError(f"{n} prompts but {len(out)} SamplingParams")
            return out
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, a list of them (one per prompt) or None, got "
                            f"{show(params)} ({type(params).__name__})")
        return [params] * n

    @staticmethod
    def _params_argument(params, sampling_params):
        """params, or vLLM's keyword for it (sampling_params=), not both."""
        if sampling_params is None:
            return params
        if params is not None:
            raise TypeError("give the SamplingParams once: params or sampling_params (vLLM's name), not both")
        return sampling_params

    def _check_prompt(self, prompt, params, chat: bool, system: str | None):
        """engine.check_request, with a conversation (or a string under a system turn) rendered by
        the chat template first; its RequestOutput.prompt is then the rendered text, as vLLM's."""
        if is_conversation(prompt) or (chat and system is not None and isinstance(prompt, str)):
            turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            turns = check_conversation(turns, system)
            for j, m in enumerate(turns):
                check_text(m["content"], "system" if system is not None and j == 0 else
                           "the prompt's text" if isinstance(prompt, str) else
                           f"messages[{j - (system is not None)}].content")
            ids = self.tokenizer.chat(turns)
            ids, _, params = self.engine.check_request(ids, params)
            return ids, self.tokenizer.decode(ids), params
        if system is not None:
            raise ValueError("system= needs text or a conversation to put its turn before; this prompt is token ids")
        if isinstance(prompt, str):
            check_text(prompt, "the prompt's text")
        elif _is_ndarray(prompt):
            prompt = array_prompt(prompt)
        return self.engine.check_request(prompt, params, chat=chat)

    def get_tokenizer(self):
        """The tokenizer this LLM encodes and decodes with: encode(text), decode(ids),
        chat(messages) -> ids (for a Hugging Face checkpoint the transformers tokenizer is its .hf)."""
        return self.tokenizer

    def _run(self, items, use_tqdm: bool = False, on_finish=None) -> list[RequestOutput]:
        return run_requests(self.core, self.outputs, items, use_tqdm, on_finish)

    def _run_replicas(self, items, use_tqdm: bool = False, on_finish=None) -> list[RequestOutput]:
        """Data parallelism: the router. Seeds are drawn here as one engine would draw them, each
        request goes to the least-loaded replica, replica 0 (this process) runs its share while the
        others run theirs, and the outputs come back in order (parallel/data_parallel.py)."""
        from .parallel.data_parallel import RemoteError, assign, collect, request_cost, send
        from .parallel.group import WorkerFailed
        eng, tp, dp = self.engine, self.tensor_parallel_size, self.data_parallel_size
        items = [(ids, text, p if p.seed is not None else replace(p, seed=eng.draw_seed()))
                 for ids, text, p in items]
        where = assign([request_cost(ids, p) for ids, _, p in items], dp)
        shares = [[i for i, r in enumerate(where) if r == k] for k in range(dp)]
        results = {}
        stop = self._workers.spec.stop
        stop.value = 0
        try:
            with deferred():     # every replica gets its work list, or none does: a Ctrl-C waits
                for k in range(1, dp):
                    send([items[i] for i in shares[k]], k * tp, self._router)
        except Exception as e:
            why = self._workers.failure(wait_s=2.0)
            self.close()
            raise WorkerFailed(f"{why or e} -- the parallel workers were shut down; create a new LLM") from e
        try:
            results[0] = self._run([items[i] for i in shares[0]], use_tqdm, on_finish)
        except BaseException:    # interrupted (or failed): the others end their shares at their next step
            stop.value = 1
            raise
        finally:                 # even so: collect the others' answers to this call (in step for the next)
            try:
                answers = collect([k * tp for k in range(1, dp)], self._router, stop)
            except Exception as e:
                why = self._workers.failure(wait_s=2.0)
                self.close()
                raise WorkerFailed(f"{why or e} -- the parallel workers were shut down; "
                                   "create a new LLM") from e
            results.update((k, answers[k * tp]) for k in range(1, dp))
        for k in range(1, dp):
            if isinstance(results[k], RemoteError):
                raise RuntimeError(f"replica {k} (rank {results[k].rank}) failed:\n{results[k].text}")
        outs = [None] * len(items)
        for k in range(dp):
            for i, out in zip(shares[k], results[k]):
                outs[i] = replace(out, request_id=self._next_dp_id + i)
                if on_finish and k > 0:
                    on_finish(outs[i])
        self._next_dp_id += len(items)
        return outs

    def stream(self, prompt, params: SamplingParams | None = None, chat: bool = False, *,
               sampling_params: SamplingParams | None = None, system: str | None = None):
        """Generate one prompt and yield a StreamDelta (new text and token ids) after every step that
        added tokens; the last one has finished=True, the finish_reason and the RequestOutput.
        Text is detokenized incrementally and never splits a character. Closing the generator
        early (break, an exception, Ctrl-C) aborts the request; requests that others added and
        that finish meanwhile are handed back to the engine."""
        self._check_open()
        if self._router is not None:
            raise ValueError("stream() runs on one engine: with data_parallel_size > 1 use generate(), "
                             "or serve each replica as its own server behind a load balancer")
        core, proc = self.core, self.outputs
        if system is not None and not chat:
            raise ValueError("system= is a chat turn: pass chat=True as well")
        ids, text, params = self._check_prompt(prompt, self._params_argument(params, sampling_params), chat, system)
        [rid] = core.add([(None, ids, text, params)])
        state = proc.add(rid, ids, text, params, stream=True)
        try:
            while True:
                if state.output is None:
                    changed, stopped = proc.process(core.step())
                    core.abort(stopped)
                delta = state.delta()
                if delta is not None:
                    yield delta
                    if delta.finished:
                        return
        finally:
            if state.output is None:
                core.abort([rid])
                proc.states.pop(rid, None)
            self.engine.hand_back(core.take_foreign())

    def chat(self, messages, params=None, **kw) -> list[RequestOutput]:
        """generate(..., chat=True): messages is a string (one user turn), a conversation (a list
        of role/content dicts), or a list of either; system="..." puts a system turn first."""
        return self.generate(messages, params, chat=True, **kw)

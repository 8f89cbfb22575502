"""The front door: LLM(model=...).generate(prompts, SamplingParams(...)) -> list[RequestOutput]."""
from __future__ import annotations

import os
from dataclasses import dataclass

from .config import EngineConfig
from .engine import Engine, resolve_device_dtype
from .kernels import select_kernels
from .model import LlamaModel
from .request import Request
from .sampling import SamplingParams
from .tokenizer import ByteTokenizer, HFTokenizer, Llama3Tokenizer
from .weights import DEFAULT_MODEL, load_checkpoint


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    ttft_s: float                 # time to first token (from add_request)
    itl_s: list[float]            # inter-token latencies
    num_preemptions: int


def make_output(req: Request, tokenizer) -> RequestOutput:
    times = req.token_times
    return RequestOutput(
        request_id=req.request_id, prompt=req.prompt, prompt_token_ids=list(req.prompt_token_ids),
        text=tokenizer.decode(req.output_token_ids, skip_special=True),
        token_ids=list(req.output_token_ids), finish_reason=req.finish_reason,
        ttft_s=times[0] - req.arrival_time if times else float("nan"),
        itl_s=[b - a for a, b in zip(times, times[1:])], num_preemptions=req.num_preemptions)


def make_tokenizer(ckpt):
    """Llama 3 vocabularies use pagedlab's own Llama 3 tokenizer; other checkpoints their own."""
    c = ckpt.config
    if c.vocab_size == 128256:
        try:
            return Llama3Tokenizer()
        except FileNotFoundError:
            if ckpt.tokenizer_dir is None:      # random weights: any tokenizer will do
                import warnings
                warnings.warn("llama-models is not installed: random Llama 3 weights get a byte "
                              "tokenizer (pip install --no-deps llama-models for the real one)")
                return ByteTokenizer(c.vocab_size, c.bos_token_id, c.eos_token_ids)
    if ckpt.gguf_file:
        return HFTokenizer(ckpt.tokenizer_dir, gguf_file=ckpt.gguf_file)
    if ckpt.tokenizer_dir:
        return HFTokenizer(ckpt.tokenizer_dir)
    return ByteTokenizer(c.vocab_size, c.bos_token_id, c.eos_token_ids)


def resolve_backend(name: str, device) -> str:
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if name == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the Triton backend on CPU runs in Triton's interpreter: set the environment "
                         "variable TRITON_INTERPRET=1 before pagedlab is imported (or use "
                         "attention_backend='torch', or device='cuda')")
    return name


class LLM:
    """LLM(model="smollm2" | "random:tiny" | path | hub id, device=None, dtype=None, **EngineConfig fields)"""

    def __init__(self, model=DEFAULT_MODEL, *, device=None, dtype=None, seed: int = 0,
                 show_progress: bool = True, checkpoint=None, tokenizer=None, **engine_kwargs):
        device, dtype = resolve_device_dtype(device, dtype)
        self.checkpoint = ckpt = checkpoint or load_checkpoint(model, seed=seed, show_progress=show_progress)
        self.config = ckpt.config
        self.engine_config = EngineConfig(device=str(device), dtype=str(dtype).replace("torch.", ""),
                                          seed=seed, **engine_kwargs)
        backend = resolve_backend(self.engine_config.attention_backend, device)
        kernels = select_kernels(backend, self.engine_config.decode_variant)
        max_len = self.engine_config.max_model_len or self.config.max_position_embeddings
        self.model = LlamaModel(ckpt.config, ckpt.tensors, device, dtype, kernels, max_positions=max_len)
        self.tokenizer = tokenizer or make_tokenizer(ckpt)
        self.engine = Engine(self.model, self.tokenizer, self.engine_config)

    @property
    def trace(self):
        return self.engine.trace

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 chat: bool = False, use_tqdm: bool = False, on_finish=None) -> list[RequestOutput]:
        """prompts: a string, a list of token ids, or a list of either. chat=True wraps strings in the
        model's chat template. Returns one RequestOutput per prompt, in order. Every prompt is
        checked before any is queued."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params_list = params if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} SamplingParams")
        ids = []
        try:
            for p, sp in zip(prompts, params_list):
                ids.append(self.engine.add_request(p, sp, chat=chat))
        except Exception:
            for rid in ids:          # nothing half-queued: take back the ones already added
                self.engine.scheduler.waiting.remove(self.engine.requests.pop(rid))
            raise
        wanted, done = set(ids), {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(ids), desc="requests", unit="req")
        while len(done) < len(wanted):
            for r in self.engine.step():
                if r.request_id in wanted:
                    done[r.request_id] = out = make_output(r, self.tokenizer)
                    if bar:
                        bar.update(1)
                    if on_finish:
                        on_finish(out)
        if bar:
            bar.close()
        return [done[rid] for rid in ids]

    def chat(self, prompts, params=None, **kw) -> list[RequestOutput]:
        return self.generate(prompts, params, chat=True, **kw)

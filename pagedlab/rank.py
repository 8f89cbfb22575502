"""What one process builds from its weights: kernels -> model (its cut) -> engine -> core.

    model = build_model(config, tensors, device, dtype, engine_config, backend)
    engine, core, outputs = build_engine(model, tokenizer, engine_config)

Every process that runs a model builds it here and nowhere else: LLM (one process, or rank 0 of a
parallel world), a data-parallel replica and a tensor-parallel rank > 0 (the model alone: it runs
only the runner). So a model is built the same way whoever holds it.
"""
from __future__ import annotations

from .config import EngineConfig
from .engine import Engine, max_positions
from .engine_core import EngineCore
from .kernels import select_kernels
from .model import LlamaModel
from .output_processor import OutputProcessor


def build_model(config, tensors: dict, device, dtype, engine_config: EngineConfig, backend: str,
                kernel_options: dict | None = None, tp=None, presharded: bool = False,
                decode_kernel=None) -> LlamaModel:
    """Kernels for this device (decode_kernel: a learner's decode attention instead), then the
    model -- this rank's cut when `tp` (a parallel.group.ParallelGroup) is given."""
    kernels = select_kernels(backend, engine_config.decode_variant, **(kernel_options or {}))
    if decode_kernel is not None:
        kernels.decode_attention = decode_kernel
    return LlamaModel(config, tensors, device, dtype, kernels, max_positions=max_positions(engine_config, config),
                      tp=tp, presharded=presharded, quantization=engine_config.quantization)


def build_engine(model: LlamaModel, tokenizer, engine_config: EngineConfig, allocator=None,
                 scheduler=None) -> tuple[Engine, EngineCore, OutputProcessor]:
    """The engine on the model (its KV pool, scheduler, runner), the core that alone steps it, and
    the output processor that turns its tokens into text and RequestOutputs."""
    engine = Engine(model, tokenizer, engine_config, allocator=allocator, scheduler=scheduler)
    return engine, EngineCore(engine), OutputProcessor(tokenizer, engine.stop_token_ids)

"""What one process builds from its weights: kernels -> model (its cut) -> engine -> core.

    model = build_model(config, tensors, device, dtype, engine_config, backend)   # model.py
    engine, core, outputs = build_engine(model, tokenizer, engine_config)

Every process that runs a model builds it here and nowhere else: LLM (one process, or rank 0 of a
parallel world), a data-parallel replica and a tensor-parallel rank > 0 (the model alone: it runs
only the runner). So a model is built the same way whoever holds it.
"""
from __future__ import annotations

from .config import EngineConfig
from .engine import Engine
from .engine_core import EngineCore
from .model import LlamaModel, build_model  # noqa: F401 (build_model: built here, defined beside the model)
from .output_processor import OutputProcessor


def build_engine(model: LlamaModel, tokenizer, engine_config: EngineConfig, allocator=None,
                 scheduler=None) -> tuple[Engine, EngineCore, OutputProcessor]:
    """The engine on the model (its KV pool, scheduler, runner), the core that alone steps it, and
    the output processor that turns its tokens into text and RequestOutputs."""
    engine = Engine(model, tokenizer, engine_config, allocator=allocator, scheduler=scheduler)
    return engine, EngineCore(engine), OutputProcessor(tokenizer, engine.stop_token_ids)

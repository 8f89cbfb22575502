"""pagedlab: a small, real LLM inference engine for Llama models -- paged KV cache, continuous
batching and Triton kernels -- built to be read and rebuilt step by step in the notebooks."""
from .config import LLAMA_3_2_1B, EngineConfig, ModelConfig, tiny_config
from .engine import Engine
from .llm import LLM, RequestOutput
from .sampling import SamplingParams
from .version import __version__  # noqa: F401
from .weights import load_checkpoint

__all__ = ["LLM", "AsyncLLM", "Engine", "EngineConfig", "ModelConfig", "SamplingParams", "RequestOutput",
           "LLAMA_3_2_1B", "tiny_config", "load_checkpoint"]


def __getattr__(name):
    """Imported on first use: AsyncLLM (asyncio and the engine-core machinery) and the server
    (`pagedlab.server.serve(...)` after `import pagedlab`; it needs the `serve` extra)."""
    if name == "AsyncLLM":
        from .async_llm import AsyncLLM
        return AsyncLLM
    if name == "server":
        import importlib
        return importlib.import_module(".server", __name__)
    raise AttributeError(f"module 'pagedlab' has no attribute {name!r}")

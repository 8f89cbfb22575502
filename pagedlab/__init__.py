"""pagedlab: a small, real LLM inference engine for Llama models -- paged KV cache, continuous
batching and Triton kernels -- built to be read and rebuilt step by step in the notebooks."""
from .config import LLAMA_3_2_1B, EngineConfig, ModelConfig, tiny_config
from .engine import Engine
from .llm import LLM, RequestOutput
from .sampling import SamplingParams
from .weights import load_checkpoint

__all__ = ["LLM", "Engine", "EngineConfig", "ModelConfig", "SamplingParams", "RequestOutput",
           "LLAMA_3_2_1B", "tiny_config", "load_checkpoint"]
__version__ = "0.1.0"

"""pagedlab: a small, real LLM inference engine for Llama models -- paged KV cache, continuous
batching and Triton kernels -- built to be read and rebuilt step by step in the notebooks.

The public names (`from pagedlab import LLM, SamplingParams, ...`) are imported on first use
(PEP 562), and so are the package's modules (`pagedlab.weights` after `import pagedlab`). Under
`python -m pagedlab` the package's import is then quick and imports no torch, so the CLI takes
charge of Ctrl-C before the seconds of importing torch (a Ctrl-C then is one line, not a traceback:
__main__.py). A plain `import pagedlab` still imports torch at once, to read torch's own CPU thread
count (cpu_threads.py): a `torch.set_num_threads(n)` made after it and before the LLM is built
stays the user's choice."""
import sys as _sys

if _sys.argv[:1] != ["-m"]:    # (while `python -m pagedlab ...` imports this package, argv[0] is "-m")
    from . import cpu_threads as _cpu_threads  # noqa: F401 -- torch's default thread count, read now
from .version import __version__  # noqa: F401

__all__ = ["LLM", "AsyncLLM", "Engine", "EngineConfig", "ModelConfig", "SamplingParams", "RequestOutput",
           "LLAMA_3_2_1B", "tiny_config", "load_checkpoint"]

# each public name -> the module that defines it
_HOMES = {"LLM": "llm", "RequestOutput": "llm", "AsyncLLM": "async_llm", "Engine": "engine",
          "EngineConfig": "config", "ModelConfig": "config", "LLAMA_3_2_1B": "config", "tiny_config": "config",
          "SamplingParams": "sampling", "load_checkpoint": "weights"}


def __getattr__(name):
    """A public name, imported from its module on first use (then kept here); or one of the
    package's modules (`pagedlab.server.serve(...)` after `import pagedlab`: the server needs the
    `serve` extra)."""
    import importlib
    home = _HOMES.get(name)
    if home is not None:
        value = getattr(importlib.import_module(f".{home}", __name__), name)
        globals()[name] = value
        return value
    if not name.startswith("_"):
        import importlib.util
        try:
            found = importlib.util.find_spec(f"{__name__}.{name}") is not None
        except (ImportError, ValueError):
            found = False
        if found:
            return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'pagedlab' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))

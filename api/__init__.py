"""tierserve: a Ray-based distributed LLM serving runtime with tensor parallelism."""
from tierserve.runtime.config import EngineConfig
from tierserve.runtime.llm import LLM
from tierserve.runtime.outputs import CompletionOutput, RequestOutput
from tierserve.scheduler.params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineConfig",
           "AsyncLLM", "EngineHandle", "EngineDeadError", "connect", "serve", "stop"]
__version__ = "0.1.0"

# Ray-backed names load on first use: in-process generation never pays for importing Ray.
_LAZY = {
    "AsyncLLM": "tierserve.deploy.ray_engine",
    "serve": "tierserve.deploy.ray_engine",
    "stop": "tierserve.deploy.ray_engine",
    "connect": "tierserve.runtime.client",
    "EngineHandle": "tierserve.runtime.client",
    "EngineDeadError": "tierserve.runtime.executor",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tierserve' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(module), name)

"""tierserve: a Ray-based distributed LLM serving runtime with tensor parallelism.

The public names load on first use (PEP 562), so that `import tierserve.deploy.cli` (the
`tierserve` command's `--help` and argument errors) never imports torch or Ray.
"""
from __future__ import annotations

import importlib

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "RequestOutputKind", "StructuredOutputs",
           "ReasoningStart", "LoRARequest", "TextPrompt", "TokensPrompt",
           "StructuredOutputsParams", "RepetitionDetectionParams", "BeamSearchParams",
           "BeamSearchOutput",
           "BeamSearchSequence", "PoolingParams", "EmbeddingRequestOutput",
           "ScoringRequestOutput", "RequestOutput", "CompletionOutput",
           "EngineConfig", "EngineDeadError", "DuplicateRequestError", "connect", "serve",
           "stop", "analyze"]
__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "LLM": "tierserve.runtime.llm",
    "AsyncLLM": "tierserve.runtime.client",
    "connect": "tierserve.runtime.client",
    "DuplicateRequestError": "tierserve.runtime.client",
    "EngineConfig": "tierserve.runtime.config",
    "EngineDeadError": "tierserve.runtime.errors",
    "CompletionOutput": "tierserve.runtime.outputs",
    "RequestOutput": "tierserve.runtime.outputs",
    "SamplingParams": "tierserve.scheduler.params",
    "StructuredOutputs": "tierserve.scheduler.output_rules",
    "RequestOutputKind": "tierserve.scheduler.params",
    "ReasoningStart": "tierserve.scheduler.output_rules",
    "StructuredOutputsParams": "tierserve.scheduler.output_rules",
    "RepetitionDetectionParams": "tierserve.scheduler.output_rules",
    "analyze": "tierserve.runtime.analyze",
    "BeamSearchParams": "tierserve.runtime.beam_search",
    "BeamSearchOutput": "tierserve.runtime.beam_search",
    "BeamSearchSequence": "tierserve.runtime.beam_search",
    "PoolingParams": "tierserve.runtime.pooling",
    "LoRARequest": "tierserve.runtime.lora",
    "TextPrompt": "tierserve.runtime.requests",
    "TokensPrompt": "tierserve.runtime.requests",
    "EmbeddingRequestOutput": "tierserve.runtime.pooling",
    "ScoringRequestOutput": "tierserve.runtime.pooling",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tierserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _RayDeployments:
    """The Ray transport for engines in other processes, imported on first use: in-process
    generation never pays for importing Ray."""

    @staticmethod
    def _impl():
        from tierserve.deploy.ray_engine import RayDeployments
        return RayDeployments()

    def start(self, config):
        return self._impl().start(config)

    def connect(self, name, namespace):
        return self._impl().connect(name, namespace)


def _register_transport() -> None:
    from tierserve.runtime import client
    client.set_deployments(_RayDeployments())


_register_transport()


def serve(name: str, namespace: str | None = None, **options):
    """Starts the named deployment on Ray (detached), or connects to the running one."""
    from tierserve.deploy.ray_engine import serve as _serve
    return _serve(name, namespace, **options)


def stop(name: str, namespace: str | None = None) -> bool:
    """Stops the named deployment: engine, workers, placement group."""
    from tierserve.deploy.ray_engine import stop as _stop
    return _stop(name, namespace)

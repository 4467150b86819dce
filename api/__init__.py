"""tierserve: a Ray-based distributed LLM serving runtime with tensor parallelism."""
from tierserve.runtime import client as _client
from tierserve.runtime.client import AsyncLLM, connect
from tierserve.runtime.config import EngineConfig
from tierserve.runtime.executor import EngineDeadError
from tierserve.runtime.llm import LLM
from tierserve.runtime.outputs import CompletionOutput, RequestOutput
from tierserve.scheduler.params import SamplingParams

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "RequestOutput", "CompletionOutput",
           "EngineConfig", "EngineDeadError", "connect", "serve", "stop"]
__version__ = "0.1.0"


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


_client.set_deployments(_RayDeployments())


def serve(name: str, namespace: str | None = None, **options) -> AsyncLLM:
    """Starts the named deployment on Ray (detached), or connects to the running one."""
    from tierserve.deploy.ray_engine import serve as _serve
    return _serve(name, namespace, **options)


def stop(name: str, namespace: str | None = None) -> bool:
    """Stops the named deployment: engine, workers, placement group."""
    from tierserve.deploy.ray_engine import stop as _stop
    return _stop(name, namespace)

"""The central scheduler actor: a Ray actor around one AsyncEngine (runtime/async_engine.py).

Its workers are Ray actors reached over the ZMQ data plane (RayExecutor). A stream is an async
generator method (Ray streaming generator) yielding msgspec-encoded output batches: cancelling
it on the client aborts its requests here.
"""
from __future__ import annotations

import asyncio
import os

import ray

from tierserve.deploy.ray_executor import RayExecutor, restore_priority
from tierserve.runtime.async_engine import AsyncEngine
from tierserve.runtime.client import CLIENT_LEASE_S
from tierserve.runtime.config import EngineConfig
from tierserve.scheduler.messages import ClientChannelCodec, EngineCoreOutputs, EngineCoreRequest

__all__ = ["EngineActor"]


class EngineActor:
    def __init__(self, config: EngineConfig, pg, bundles: list[int], name: str) -> None:
        restore_priority()
        self.name = name
        self.engine = AsyncEngine(config, lambda spec: RayExecutor(
            spec, pg, bundles, config.step_timeout_s, name,
            spares=config.spare_workers and config.max_restarts > 0))
        self._codec = ClientChannelCodec()

    async def generate(self, requests: list[EngineCoreRequest]):
        """Streams msgspec-encoded EngineCoreOutputs batches until every request finished. The
        requests are leased: the client renews them while it streams (`renew`)."""
        async for batch in self.engine.generate(requests, lease_s=CLIENT_LEASE_S):
            yield self._codec.encode(EngineCoreOutputs(batch))

    async def renew(self, request_ids: list[str]) -> None:
        self.engine.renew(request_ids)

    async def abort(self, request_ids: list[str]) -> list[str]:
        """Aborts the requests; returns those that were running or waiting."""
        return await asyncio.wrap_future(self.engine.abort(request_ids))

    async def list_requests(self) -> list[dict]:
        return await asyncio.wrap_future(self.engine.run_on_loop(
            lambda core: core.describe_requests()))

    async def reset_prefix_cache(self) -> bool:
        return await asyncio.wrap_future(self.engine.run_on_loop(
            lambda core: core.reset_prefix_cache()))

    async def check_integrity(self) -> None:
        """Asserts the scheduler's, the pool's and the tiers' invariants (no block leaked in
        any tier) between steps; for tests and operators."""
        await asyncio.wrap_future(self.engine.run_on_loop(
            lambda core: core.scheduler.check_integrity()))

    async def stats(self) -> dict:
        return self.engine.stats()

    async def info(self) -> dict:
        executor = self.engine.core.executor
        tp = self.engine.config.tensor_parallel_size
        return dict(self.engine.info(), node_ip=ray.util.get_node_ip_address(), pid=os.getpid(),
                    namespace=ray.get_runtime_context().namespace,
                    worker_names=[executor.worker_name(r) for r in range(tp)],
                    worker_nodes=executor.worker_nodes, worker_pids=executor.worker_pids)

    async def dataplane(self) -> dict:
        """The data plane's endpoints (XPUB broadcast and reply PULL, TCP and IPC), the last
        step id broadcast and dropped_frames; read-only, and no keys."""
        return self.engine.core.executor.dataplane()

    async def health(self) -> bool:
        return self.engine.health()

    async def shutdown(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.engine.shutdown)

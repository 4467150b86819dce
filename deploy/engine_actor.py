"""The central scheduler actor: a Ray actor around one AsyncEngine (runtime/async_engine.py).

Its workers are Ray actors reached over the ZMQ data plane (RayExecutor). A stream is an async
generator method (Ray streaming generator) yielding msgspec-encoded output batches: cancelling
it on the client aborts its requests here.
"""
from __future__ import annotations

import asyncio
import os

import ray

from tierserve.deploy.kv_publisher import KVEventPublisher
from tierserve.runtime.client import CLIENT_LEASE_S
from tierserve.runtime.config import EngineConfig
from tierserve.scheduler.kv_events import KVEventCodec
from tierserve.scheduler.messages import ClientChannelCodec, EngineCoreOutputs, EngineCoreRequest

__all__ = ["EngineActor"]

# The owner of requests no caller can name (a call without an owner token aborts nothing).
_NOBODY = object()
# How often `watch` looks at the engine's health.
_WATCH_POLL_S = 0.25


class EngineActor:
    # The engine's modules (torch among them) are imported in the actor's process alone: a
    # client that looks the actor up by name unpickles this class, and `tierserve status`
    # must not pay for torch.
    def __init__(self, config: EngineConfig, pg, bundles: list[int], name: str) -> None:
        from tierserve.deploy.ray_executor import RayExecutor, restore_priority
        from tierserve.runtime.async_engine import AsyncEngine

        restore_priority()
        self.name = name
        self.engine = AsyncEngine(config, lambda spec: RayExecutor(
            spec, pg, bundles, config.step_timeout_s, name,
            spares=config.spare_workers and config.max_restarts > 0))
        self._codec = ClientChannelCodec()
        self._publisher: KVEventPublisher | None = None
        if config.publishes_kv_events:
            self._publisher = KVEventPublisher()
            self.engine.set_kv_event_sink(self._publisher.put)
        self._stopping = False

    async def generate(self, requests: list[EngineCoreRequest], owner: str | None = None,
                       hold: bool = False):
        """Streams msgspec-encoded EngineCoreOutputs batches until every request finished. The
        requests are leased: the client renews them while it streams (`renew`); `owner` is the
        client's token, which its aborts and stops carry. hold: an offline batch, queued whole
        (AsyncEngine.generate)."""
        async for batch in self.engine.generate(requests, lease_s=CLIENT_LEASE_S,
                                                owner=owner, hold=hold):
            yield self._codec.encode(EngineCoreOutputs(batch))

    async def renew(self, request_ids: list[str]) -> bool:
        """Renews the leases; answering at all tells the client the engine is alive."""
        self.engine.renew(request_ids)
        return True

    async def abort(self, request_ids: list[str], owner: str | None = None) -> list[str]:
        """Aborts those of the requests `owner` started; returns those that were running or
        waiting."""
        return await asyncio.wrap_future(self.engine.abort(request_ids, owner or _NOBODY))

    async def stop(self, seqs: list[tuple[str, int]], owner: str | None = None) -> None:
        """Finishes samples a stop string ended, of requests `owner` started."""
        self.engine.stop([tuple(s) for s in seqs], owner or _NOBODY)

    async def abort_named(self, names: list[str]) -> list[str]:
        """The operator's abort (`tierserve abort`): requests named by engine id or label,
        whoever started them."""
        return await asyncio.wrap_future(self.engine.abort_named(names))

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

    # ------------------------------------------------------------------ KV events

    async def subscribe_kv_events(self, subscriber, tag) -> None:
        """`subscriber.kv_events.remote(tag, frames)` receives every KV event batch from now on
        (msgspec frames, docs/kv_events.md); its first one starts a resync."""
        if self._publisher is None:
            raise RuntimeError("this engine publishes no KV events (kv_events is off)")
        self._publisher.subscribe(subscriber, tag)

    async def kv_snapshot(self) -> bytes:
        """Every tier's hashes as one encoded KVSnapshot; the batches before it were handed
        to the publisher first."""
        snap = await asyncio.wrap_future(self.engine.kv_snapshot())
        return KVEventCodec().encode(snap)

    async def watch(self, healing: bool = False) -> tuple[str, str]:
        """Returns when the engine's state differs from the caller's view: ("dead", why) once
        it can no longer serve (or shuts down), ("healing", "") while it rebuilds its workers
        (the caller saw it serving), ("serving", "") after (the caller saw it healing). A
        router keeps one call pending per replica, and learns of an actor's death from its
        failure, at once."""
        core = self.engine.core
        while not self._stopping:
            if self.engine.dead_reason is not None:
                return "dead", self.engine.dead_reason
            if core.healing != healing:
                return ("healing" if core.healing else "serving"), ""
            await asyncio.sleep(_WATCH_POLL_S)
        return "dead", "shut down"

    async def shutdown(self) -> None:
        self._stopping = True
        if self._publisher is not None:
            self._publisher.close()
        await asyncio.get_running_loop().run_in_executor(None, self.engine.shutdown)

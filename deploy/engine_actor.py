"""The central scheduler actor: an async Ray actor around one EngineCore.

The EngineCore is touched by one thread only, the step loop; actor calls hand it work through an
inbox and receive outputs through per-stream asyncio queues. A stream is an async generator
method (Ray streaming generator): cancelling it on the client aborts its requests here.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import defaultdict

import ray

from tierserve.deploy.ray_executor import RayExecutor, restore_priority
from tierserve.runtime.config import EngineConfig
from tierserve.runtime.engine_core import EngineCore
from tierserve.runtime.executor import EngineDeadError
from tierserve.scheduler.messages import (
    ClientChannelCodec, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest,
)
from tierserve.scheduler.params import FinishReason

__all__ = ["EngineActor"]

log = logging.getLogger("tierserve.engine_actor")

# The step loop sleeps this long at most when idle (new work wakes it at once).
_IDLE_WAIT_S = 0.1


class EngineActor:
    def __init__(self, config: EngineConfig, pg, bundles: list[int], name: str) -> None:
        restore_priority()
        self.config = config
        self.name = name
        self.core = EngineCore(config, lambda spec: RayExecutor(spec, pg, bundles,
                                                                config.step_timeout_s, name))
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._sinks: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._codec = ClientChannelCodec()
        self._stats = self.core.stats()
        self._dead: str | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-step-loop", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the step loop thread

    def _run(self) -> None:
        while not self._stopping:
            self._drain_inbox()
            core = self.core
            if self._dead is None and (core.has_unfinished_requests()
                                       or core.scheduler.has_pending_worker_updates()):
                outputs = core.step()
                # Set before publishing: a stream that sees the death outputs must also see this.
                self._dead = core.dead_reason
                self._stats = core.stats()
                self._publish(outputs)
            else:
                self._wake.wait(_IDLE_WAIT_S)
                self._wake.clear()

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._publish([self._add(payload)])
            elif kind == "abort":
                self._publish(self.core.abort_requests(payload))
            elif kind == "call":
                fn, future = payload
                self._loop.call_soon_threadsafe(future.set_result, fn())

    def _add(self, request: EngineCoreRequest) -> EngineCoreOutput | None:
        try:
            self.core.add_request(request)
            return None
        except (ValueError, EngineDeadError) as e:
            return EngineCoreOutput(request.req_id, finish_reason=FinishReason.ERROR,
                                    error=str(e))

    def _publish(self, outputs: list[EngineCoreOutput | None]) -> None:
        by_sink: dict[asyncio.Queue, list] = defaultdict(list)
        for o in outputs:
            if o is not None and (sink := self._sinks.get(o.req_id)) is not None:
                by_sink[sink].append(o)
        for sink, batch in by_sink.items():
            self._loop.call_soon_threadsafe(sink.put_nowait, batch)

    def _submit(self, kind: str, payload) -> None:
        self._inbox.put((kind, payload))
        self._wake.set()

    # ------------------------------------------------------------------ actor methods

    async def generate(self, requests: list[EngineCoreRequest]):
        """Streams msgspec-encoded EngineCoreOutputs batches until every request finished."""
        self._loop = self._loop or asyncio.get_running_loop()
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        sink: asyncio.Queue = asyncio.Queue()
        pending = {r.req_id for r in requests}
        for r in requests:
            if r.req_id in self._sinks:
                raise ValueError(f"request id {r.req_id!r} is already in use")
            self._sinks[r.req_id] = sink
        for r in requests:
            self._submit("add", r)
        try:
            while pending:
                batch = await sink.get()
                if self._dead is not None:
                    raise EngineDeadError(self._dead)
                for o in batch:
                    if o.finish_reason is not None:
                        pending.discard(o.req_id)
                yield self._codec.encode(EngineCoreOutputs(batch))
        finally:
            if pending:  # the client went away or cancelled: free the blocks now
                self._submit("abort", list(pending))
            for r in requests:
                self._sinks.pop(r.req_id, None)

    async def abort(self, request_ids: list[str]) -> None:
        self._submit("abort", list(request_ids))

    async def call(self, method: str):
        """Runs a read-only EngineCore query on the step-loop thread."""
        self._loop = self._loop or asyncio.get_running_loop()
        fn = {"reset_prefix_cache": self.core.reset_prefix_cache}[method]
        future = self._loop.create_future()
        self._submit("call", (fn, future))
        return await future

    async def stats(self) -> dict:
        return dict(self._stats, dead=self._dead)

    async def info(self) -> dict:
        core = self.core
        return {"model": self.config.model, "max_model_len": core.max_model_len,
                "vocab_size": core.vocab_size,
                "tensor_parallel_size": self.config.tensor_parallel_size,
                "node_ip": ray.util.get_node_ip_address(),
                "namespace": ray.get_runtime_context().namespace,
                "worker_names": [self.core.executor.worker_name(r)
                                 for r in range(self.config.tensor_parallel_size)],
                "worker_nodes": self.core.executor.worker_nodes}

    async def health(self) -> bool:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        return True

    async def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10.0)
        self.core.shutdown()

"""AsyncEngine: an EngineCore driven by its own step-loop thread, for concurrent streaming callers.

The EngineCore is touched by one thread only, the step loop; callers hand it work through an
inbox of typed messages and receive each step's outputs through a per-stream queue on their own
event loop. The same class serves an in-process `AsyncLLM` and, inside a Ray actor
(deploy/engine_actor.py), a deployment.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from tierserve.runtime.config import EngineConfig
from tierserve.runtime.engine_core import EngineCore
from tierserve.runtime.executor import EngineDeadError, Executor, InProcessExecutor
from tierserve.scheduler.messages import EngineCoreOutput, EngineCoreRequest
from tierserve.scheduler.params import FinishReason
from tierserve.workers.worker import WorkerSpec

__all__ = ["AsyncEngine"]

log = logging.getLogger("tierserve.async_engine")

# The step loop sleeps this long at most when idle (new work wakes it at once).
_IDLE_WAIT_S = 0.1


@dataclass(frozen=True, slots=True)
class AddRequests:
    requests: list[EngineCoreRequest]


@dataclass(frozen=True, slots=True)
class AbortRequests:
    request_ids: list[str]


@dataclass(frozen=True, slots=True)
class RunOnLoop:
    """A read or maintenance call on the EngineCore, run between steps; its result (or error)
    goes to `future`."""

    fn: Callable[[EngineCore], object]
    future: concurrent.futures.Future


InboxMessage = AddRequests | AbortRequests | RunOnLoop


@dataclass(slots=True)
class _Sink:
    """Where one stream's outputs go: a queue owned by the stream's event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, batch: list[EngineCoreOutput]) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, batch)
        except RuntimeError:  # the stream's event loop is closed: nobody is listening
            pass


class AsyncEngine:
    def __init__(self, config: EngineConfig,
                 executor_factory: Callable[[WorkerSpec], Executor] = InProcessExecutor) -> None:
        self.config = config
        self.core = EngineCore(config, executor_factory)
        self._inbox: queue.SimpleQueue[InboxMessage] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._sinks: dict[str, _Sink] = {}
        self._stats = self.core.stats()
        self._dead: str | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-step-loop", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ read-only views

    @property
    def tokenizer(self):
        return self.core.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.core.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    def stats(self) -> dict:
        return dict(self._stats, dead=self._dead)

    def info(self) -> dict:
        return self.core.info()

    def health(self) -> bool:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        return True

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
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(msg, AddRequests):
                self._publish([self._add(r) for r in msg.requests])
            elif isinstance(msg, AbortRequests):
                self._publish(self.core.abort_requests(msg.request_ids))
            else:
                try:
                    msg.future.set_result(msg.fn(self.core))
                except Exception as e:
                    msg.future.set_exception(e)

    def _add(self, request: EngineCoreRequest) -> EngineCoreOutput | None:
        try:
            self.core.add_request(request)
            return None
        except (ValueError, EngineDeadError) as e:
            return EngineCoreOutput(request.req_id, finish_reason=FinishReason.ERROR,
                                    error=str(e))

    def _publish(self, outputs: list[EngineCoreOutput | None]) -> None:
        batches: dict[int, tuple[_Sink, list]] = {}
        for o in outputs:
            if o is not None and (sink := self._sinks.get(o.req_id)) is not None:
                batches.setdefault(id(sink), (sink, []))[1].append(o)
        for sink, batch in batches.values():
            sink.put(batch)

    def _submit(self, msg: InboxMessage) -> None:
        self._inbox.put(msg)
        self._wake.set()

    # ------------------------------------------------------------------ callers

    async def generate(self, requests: list[EngineCoreRequest]
                       ) -> AsyncIterator[list[EngineCoreOutput]]:
        """Each step's outputs for these requests until every one has finished. Leaving the
        iteration early (break, cancel, an error) aborts what is left and frees its blocks."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        ids = [r.req_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids must be distinct")
        taken = [rid for rid in ids if rid in self._sinks]
        if taken:
            raise ValueError(f"request id {taken[0]!r} is already in use")
        sink = _Sink(asyncio.get_running_loop(), asyncio.Queue())
        pending = set(ids)
        for rid in ids:
            self._sinks[rid] = sink
        self._submit(AddRequests(list(requests)))
        try:
            while pending:
                batch = await sink.queue.get()
                if self._dead is not None:
                    raise EngineDeadError(self._dead)
                for o in batch:
                    if o.finish_reason is not None:
                        pending.discard(o.req_id)
                yield batch
        finally:
            if pending:  # the caller went away or cancelled: free the blocks now
                self._submit(AbortRequests(list(pending)))
            for rid in ids:
                self._sinks.pop(rid, None)

    def abort(self, request_ids: list[str]) -> None:
        self._submit(AbortRequests(list(request_ids)))

    def run_on_loop(self, fn: Callable[[EngineCore], object]) -> concurrent.futures.Future:
        """fn(core) on the step-loop thread between steps; its result as a future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(RunOnLoop(fn, future))
        return future

    def reset_prefix_cache(self) -> bool:
        return self.run_on_loop(EngineCore.reset_prefix_cache).result()

    def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._wake.set()
        self._thread.join(10.0)
        self.core.shutdown()

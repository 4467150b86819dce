"""AsyncEngine: an EngineCore driven by its own step-loop thread, for concurrent streaming callers.

The EngineCore is touched by one thread only, the step loop; callers hand it work through an
inbox of typed messages and receive each step's outputs through a per-stream queue on their own
event loop. The same class serves an in-process `AsyncLLM` and, inside a Ray actor
(deploy/engine_actor.py), a deployment.

Requests of a remote client can be leased: unless the client renews the lease (a heartbeat
while it streams), the engine aborts them when it runs out, so a client that vanishes (killed,
partitioned) never leaves requests generating and holding blocks. A lease runs only while the
engine does: after the engine's own process was stopped (SIGSTOP, a long pause), every lease is
extended by the pause, since its client's renewals could not be heard meanwhile.

Requests have owners: a stream's requests are its caller's (the `owner` token a remote client
passes, else the stream itself), and an abort or a stop from a caller reaches only requests
that caller started. Only the operator's `abort_named` reaches any request.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from tierserve.runtime.config import EngineConfig
from tierserve.runtime.engine_core import EngineCore, rejection
from tierserve.runtime.executor import EngineDeadError, Executor, InProcessExecutor
from tierserve.runtime.outputs import BatchFeed, Outstanding
from tierserve.scheduler.kv_events import KVEventBatch, KVSnapshot
from tierserve.scheduler.messages import EngineCoreOutput, EngineCoreRequest
from tierserve.scheduler.params import ErrorKind, FinishReason
from tierserve.workers.worker import WorkerSpec

__all__ = ["AsyncEngine"]

log = logging.getLogger("tierserve.async_engine")

# The step loop sleeps this long at most when idle (new work wakes it at once).
_IDLE_WAIT_S = 0.1


@dataclass(frozen=True, slots=True)
class AddRequests:
    requests: list[EngineCoreRequest]
    lease_s: float | None = None  # None: the requests live until they finish or are aborted


@dataclass(frozen=True, slots=True)
class AbortRequests:
    request_ids: list[str]
    # Receives the ids that were found (and aborted), where the caller wants to know.
    future: concurrent.futures.Future | None = None
    # The operator's abort: the ids may be labels too.
    by_name: bool = False


@dataclass(frozen=True, slots=True)
class StopSequences:
    """Samples a client's stop string ended: (request id, sample index)."""

    seqs: list[tuple[str, int]]


@dataclass(frozen=True, slots=True)
class RenewLeases:
    request_ids: list[str]


@dataclass(frozen=True, slots=True)
class RunOnLoop:
    """A read or maintenance call on the EngineCore, run between steps; its result (or error)
    goes to `future`."""

    fn: Callable[[EngineCore], object]
    future: concurrent.futures.Future


InboxMessage = AddRequests | AbortRequests | StopSequences | RenewLeases | RunOnLoop

# How often the step loop looks for leases that ran out.
_LEASE_CHECK_S = 0.5
# A gap this long between two loop iterations means the engine itself was not running (its
# process stopped, or a step that long): leases are extended by the gap.
_STALL_S = 1.0
# How long a held batch (generate's hold) waits to send again what a full queue refused.
_REFUSED_RETRY_S = 0.05
# How often an idle step loop checks that its workers are alive.
_WORKER_CHECK_S = 1.0


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
        # Who started each request: its stream's owner token (event-loop side, like _sinks).
        self._owners: dict[str, object] = {}
        # Step-loop state: lease length and deadline (monotonic) of each leased request.
        self._leases: dict[str, tuple[float, float]] = {}
        self._next_lease_check = 0.0
        self._last_iteration = time.monotonic()
        self._next_worker_check = 0.0
        self._stats = self.core.stats()
        self._dead: str | None = None
        self._stopping = False
        # Receives each KV event batch on the step loop; it must not block (deploy/'s
        # publisher queues it for another thread).
        self._kv_sink: Callable[[KVEventBatch], None] | None = None
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
        # The core can die between steps too (a maintenance call on the loop).
        return self._dead or self.core.dead_reason

    def stats(self) -> dict:
        return dict(self._stats, dead=self.dead_reason)

    def info(self) -> dict:
        return self.core.info()

    def health(self) -> bool:
        """True, or EngineDeadError saying why the engine cannot serve."""
        if self._dead is None and not self._thread.is_alive() and not self._stopping:
            self._dead = "the engine's step loop is gone"
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        return True

    # ------------------------------------------------------------------ the step loop thread

    def _run(self) -> None:
        while not self._stopping:
            try:
                self._iterate()
            except Exception as e:  # never a silent death: every waiter hears of it
                log.exception("engine loop failed")
                self._fail_all(f"the engine loop failed: {type(e).__name__}: {e}")

    def _iterate(self) -> None:
        now = time.monotonic()
        if self._leases and now - self._last_iteration > _STALL_S:
            self._extend_leases(now - self._last_iteration)
        self._last_iteration = now
        changed = self._drain_inbox()
        if self._leases:
            self._expire_leases()
        core = self.core
        if self._dead is None and core.has_work():
            outputs = core.step()
            # Set before publishing: a stream that sees the death outputs must also see this.
            self._dead = core.dead_reason
            self._stats = core.stats()
            self._publish(outputs)
            if self._leases:
                for o in outputs:
                    if o.finish_reason is not None and not core.has_request(o.req_id):
                        self._leases.pop(o.req_id, None)
            changed = True
        else:
            if self._dead is None:
                self._check_workers()
            self._wake.wait(_IDLE_WAIT_S)
            self._wake.clear()
        if changed and self._kv_sink is not None and self._dead is None:
            self._kv_sink(core.take_kv_events())

    def _check_workers(self) -> None:
        """While idle, now and then: a worker that died meanwhile is replaced at once."""
        now = time.monotonic()
        if now < self._next_worker_check or self.core.dead_reason is not None:
            return
        self._next_worker_check = now + _WORKER_CHECK_S
        restarts = self.core.restarts
        outputs = self.core.check_workers()
        if self.core.restarts != restarts or self.core.dead_reason is not None:
            self._dead = self.core.dead_reason
            self._stats = self.core.stats()
        self._publish(outputs)

    def _fail_all(self, reason: str) -> None:
        if self._dead is None:
            self._dead = reason
            self._stats = dict(self._stats)
        self._publish([EngineCoreOutput(rid, finish_reason=FinishReason.ERROR, error=reason,
                                        error_kind=ErrorKind.ENGINE_DEAD)
                       for rid in list(self._sinks)])

    def _drain_inbox(self) -> bool:
        """Handles every message waiting; whether there was any."""
        handled = False
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return handled
            handled = True
            if isinstance(msg, AddRequests):
                self._publish([self._add(r, msg.lease_s) for r in msg.requests])
            elif isinstance(msg, AbortRequests):
                ids = self.core.request_ids(msg.request_ids) if msg.by_name else msg.request_ids
                self._abort(ids, msg.future)
            elif isinstance(msg, StopSequences):
                self.core.stop_sequences(msg.seqs)
            elif isinstance(msg, RenewLeases):
                now = time.monotonic()
                for rid in msg.request_ids:
                    if rid in self._leases:
                        length = self._leases[rid][0]
                        self._leases[rid] = (length, now + length)
            else:
                try:
                    msg.future.set_result(msg.fn(self.core))
                except Exception as e:
                    msg.future.set_exception(e)

    def _abort(self, request_ids: list[str],
               future: concurrent.futures.Future | None = None) -> None:
        outputs = self.core.abort_requests(request_ids)
        for o in outputs:
            self._leases.pop(o.req_id, None)
        self._publish(outputs)
        if future is not None:
            future.set_result(list(dict.fromkeys(o.req_id for o in outputs)))

    def _extend_leases(self, gap: float) -> None:
        self._leases = {rid: (length, deadline + gap)
                        for rid, (length, deadline) in self._leases.items()}

    def _expire_leases(self) -> None:
        now = time.monotonic()
        if now < self._next_lease_check:
            return
        self._next_lease_check = now + _LEASE_CHECK_S
        expired = [rid for rid, (_, deadline) in self._leases.items() if deadline < now]
        if expired:
            log.warning("aborting %d request(s) whose client stopped renewing: %s",
                        len(expired), ", ".join(expired[:5]))
            self._abort(expired)

    def _add(self, request: EngineCoreRequest, lease_s: float | None) -> EngineCoreOutput | None:
        """None once queued; else the request's one (error) output. Whatever goes wrong in
        adding it fails this request alone."""
        try:
            self.core.add_request(request)
            if lease_s is not None:
                self._leases[request.req_id] = (lease_s, time.monotonic() + lease_s)
            return None
        except EngineDeadError as e:
            return EngineCoreOutput(request.req_id, finish_reason=FinishReason.ERROR,
                                    error=str(e), error_kind=ErrorKind.ENGINE_DEAD)
        except Exception as e:
            return rejection(request, e)

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

    async def generate(self, requests: list[EngineCoreRequest], *, lease_s: float | None = None,
                       owner: object = None, hold: bool = False
                       ) -> AsyncIterator[list[EngineCoreOutput]]:
        """Each step's outputs for these requests until every one has finished. Leaving the
        iteration early (break, cancel, an error) aborts what is left and frees its blocks.
        With lease_s, requests not renewed (`renew`) for that long are aborted. A request whose
        id is taken gets one error output and touches nothing of the request holding it.
        hold: an offline batch, queued whole: past the queue's bound its requests wait in this
        stream and go in as it drains, where a server's are refused (overloaded)."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        sink = _Sink(asyncio.get_running_loop(), asyncio.Queue())
        owner = sink if owner is None else owner
        mine, refused = [], []
        for r in requests:
            rid = r.req_id
            if isinstance(rid, str) and rid and rid not in self._sinks:
                self._sinks[rid], self._owners[rid] = sink, owner
                mine.append(r)
            else:
                refused.append(rejection(r, ValueError(
                    f"request_id {rid!r} is already in use" if isinstance(rid, str) and rid
                    else f"request_id must be a non-empty string, got {rid!r}")))
        pending = Outstanding(mine)
        feed = BatchFeed(mine, self.config.max_queued_requests) if hold else None
        if mine:
            self._submit(AddRequests(feed.release() if feed else mine, lease_s))
        try:
            if refused:
                yield refused
            while pending:
                batch = await sink.queue.get()
                if self._dead is not None:
                    raise EngineDeadError(self._dead)
                if feed is not None:
                    batch = await self._feed(feed, batch, lease_s)
                pending.update(batch)
                if batch:
                    yield batch
        finally:
            if pending:  # the caller went away or cancelled: free the blocks now
                self._submit(AbortRequests(list(pending)))
            for r in mine:
                self._sinks.pop(r.req_id, None)
                self._owners.pop(r.req_id, None)

    async def _feed(self, feed: BatchFeed, batch: list[EngineCoreOutput],
                    lease_s: float | None) -> list[EngineCoreOutput]:
        """A held batch's outputs to deliver; its next requests sent as room opens."""
        batch = feed.update(batch)
        if feed.stalled:  # other clients hold the queue: wait for them to drain it
            await asyncio.sleep(_REFUSED_RETRY_S)
        more = feed.release()
        if more:
            self._submit(AddRequests(more, lease_s))
        return batch

    def _own(self, request_ids, owner: object) -> list:
        """The ids among these that `owner` started (all of them for owner None)."""
        if owner is None:
            return list(request_ids)
        return [rid for rid in request_ids if self._owners.get(rid) == owner]

    def abort(self, request_ids: list[str], owner: object = None) -> concurrent.futures.Future:
        """Aborts those of the requests that `owner` started (any, for None); the future gets
        the ids that were running or waiting."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(AbortRequests(self._own(request_ids, owner), future=future))
        return future

    def abort_named(self, names: list[str]) -> concurrent.futures.Future:
        """The operator's abort: requests named by engine id or by label, whoever started
        them; the future gets the engine ids aborted."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(AbortRequests(list(names), future=future, by_name=True))
        return future

    def stop(self, seqs: list[tuple[str, int]], owner: object = None) -> None:
        """Finishes samples a client's stop string ended, (request id, sample index), of
        requests `owner` started (any, for None)."""
        own = set(self._own({rid for rid, _ in seqs}, owner))
        seqs = [(rid, index) for rid, index in seqs if rid in own]
        if seqs:
            self._submit(StopSequences(seqs))

    def renew(self, request_ids: list[str]) -> None:
        """Extends the leases of these requests by their full length."""
        self._submit(RenewLeases(list(request_ids)))

    def list_requests(self) -> list[dict]:
        """The engine's unfinished requests, oldest first."""
        return self.run_on_loop(EngineCore.describe_requests).result()

    def run_on_loop(self, fn: Callable[[EngineCore], object]) -> concurrent.futures.Future:
        """fn(core) on the step-loop thread between steps; its result as a future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(RunOnLoop(fn, future))
        return future

    def reset_prefix_cache(self) -> bool:
        return self.run_on_loop(EngineCore.reset_prefix_cache).result()

    def set_kv_event_sink(self, sink: Callable[[KVEventBatch], None] | None) -> None:
        """Where the step loop hands each KV event batch (the engine must publish events)."""
        if sink is not None and self.core.kv_events is None:
            raise RuntimeError("this engine publishes no KV events (kv_events is off)")
        self._kv_sink = sink

    def kv_snapshot(self) -> concurrent.futures.Future:
        """A future KVSnapshot; the batch of changes before it goes to the sink first, so the
        sink sees every batch up to the snapshot's seq before the snapshot is returned."""
        def snapshot(core: EngineCore) -> KVSnapshot:
            batch, snap = core.kv_snapshot()
            if self._kv_sink is not None:
                self._kv_sink(batch)
            return snap
        return self.run_on_loop(snapshot)

    def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._wake.set()
        self._thread.join(10.0)
        self.core.shutdown()

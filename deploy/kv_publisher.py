"""Publishes an engine's KV event batches to its subscribers, off the step loop.

The step loop hands each batch to `put` (a queue append). A thread encodes the batches and
sends them to every subscriber as `subscriber.kv_events.remote(tag, frames)`, one call in
flight per subscriber: batches that arrive meanwhile go together in the next call, so a slow
subscriber costs the engine nothing and receives fewer, larger calls. A subscriber that is
gone is dropped. Without subscribers batches are dropped: a subscriber's first batch starts a
resync (docs/kv_events.md).
"""
from __future__ import annotations

import logging
import queue
import threading

import ray

from tierserve.scheduler.kv_events import KVEventBatch, KVEventCodec

__all__ = ["KVEventPublisher"]

log = logging.getLogger("tierserve.kv_publisher")

# A call still unanswered after this long is given up on (the subscriber is stuck); the
# batches keep flowing in new calls, and the subscriber resyncs on the gap if it missed one.
_CALL_TIMEOUT_S = 30.0


class KVEventPublisher:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[KVEventBatch | None] = queue.SimpleQueue()
        self._codec = KVEventCodec()
        self._lock = threading.Lock()
        self._subscribers: dict[bytes, tuple[object, object]] = {}  # id -> (handle, tag)
        self._in_flight: dict[bytes, ray.ObjectRef] = {}
        self._pending: dict[bytes, list[bytes]] = {}
        self.frames_sent = 0
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher",
                                        daemon=True)
        self._thread.start()

    def put(self, batch: KVEventBatch | None) -> None:
        """The step loop's sink; never blocks."""
        if batch is not None:
            self._queue.put(batch)

    def subscribe(self, handle, tag) -> None:
        """`handle.kv_events.remote(tag, frames)` receives every batch from now on."""
        key = handle._actor_id.binary()
        with self._lock:
            self._subscribers[key] = (handle, tag)
            self._pending.setdefault(key, [])

    def unsubscribe(self, handle) -> None:
        key = handle._actor_id.binary()
        with self._lock:
            self._subscribers.pop(key, None)
            self._pending.pop(key, None)
            self._in_flight.pop(key, None)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(5.0)

    def _run(self) -> None:
        while True:
            try:
                batch = self._queue.get(timeout=0.05 if self._has_pending() else None)
            except queue.Empty:
                batch = ...
            if batch is None:
                return
            frames = [] if batch is ... else [self._codec.encode(batch)]
            while True:  # whatever else is queued goes in the same calls
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    return
                frames.append(self._codec.encode(more))
            try:
                self._send(frames)
            except Exception:  # never let the publisher die: the subscriber resyncs
                log.exception("could not publish KV events")

    def _has_pending(self) -> bool:
        with self._lock:
            return any(self._pending.values())

    def _send(self, frames: list[bytes]) -> None:
        with self._lock:
            subscribers = dict(self._subscribers)
            for key in subscribers:
                self._pending[key].extend(frames)
        for key, (handle, tag) in subscribers.items():
            ref = self._in_flight.get(key)
            if ref is not None:
                ready, _ = ray.wait([ref], timeout=0)
                if not ready:
                    continue  # one call in flight: these frames wait for the next
                if not self._answered(key, ref):
                    continue
            with self._lock:
                pending, self._pending[key] = self._pending.get(key, []), []
            if pending:
                self._in_flight[key] = handle.kv_events.remote(tag, pending)
                self.frames_sent += len(pending)

    def _answered(self, key: bytes, ref) -> bool:
        """A call completed; False (and the subscriber dropped) when it failed because the
        subscriber is gone."""
        del self._in_flight[key]
        try:
            ray.get(ref, timeout=_CALL_TIMEOUT_S)
        except ray.exceptions.RayActorError:
            log.info("a KV event subscriber is gone; dropping it")
            with self._lock:
                self._subscribers.pop(key, None)
                self._pending.pop(key, None)
            return False
        except Exception as e:
            log.warning("a KV event subscriber failed a call: %s", e)
        return True

"""Transports between the EngineCore and its workers.

An executor starts the workers (control plane), then carries each step's SchedulerOutput to
every rank and rank 0's reply back (data plane). The in-process one here runs one Worker in this
process; deploy/ has the Ray + ZMQ one. Both carry the same encoded frames, so the in-process
path exercises the wire codecs every step and the worker never shares mutable state with the
scheduler.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from tierserve.scheduler.messages import (
    EngineChannelCodec, FromWorker, SchedulerOutput, ShutdownWorker, ToWorker,
    WorkerChannelCodec,
)
from tierserve.workers.worker import ModelInfo, TierReport, Worker, WorkerSpec

__all__ = ["WorkerInfo", "Executor", "InProcessExecutor", "EngineDeadError"]


class EngineDeadError(RuntimeError):
    """The workers are gone or stuck: every in-flight request fails with this, and so does every
    later call."""


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    num_blocks: int
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    backends: tuple[dict, ...]  # each rank's Backend.describe()
    kv_block_bytes: int = 0  # one block id on one rank
    cpu_slots: int = 0  # KV tiers: CPU slots and SSD entries, the same ids on every rank
    ssd_entries: int = 0
    # SSD entries from an earlier run found whole on every rank: (entry, block hash, key).
    ssd_found: tuple[tuple[int, bytes, bytes], ...] = ()
    copy_bytes_per_s: float = 0.0
    weight_bytes: int = 0  # the model's weights as the ranks hold them, all ranks

    @classmethod
    def from_ranks(cls, num_blocks: int, ranks: list[ModelInfo],
                   tiers: list[TierReport]) -> "WorkerInfo":
        """The engine's view of its ranks: the pool size they agreed on, the model as rank 0
        reports it, every rank's backend, and the tiers every rank has (an SSD entry counts
        only where every rank holds the same block)."""
        first = ranks[0]
        found = set(tiers[0].found)
        for report in tiers[1:]:
            found &= set(report.found)
        return cls(num_blocks, first.vocab_size, first.max_position_embeddings,
                   first.eos_token_ids, tuple(r.backend for r in ranks), first.kv_block_bytes,
                   min(t.cpu_slots for t in tiers), min(t.ssd_entries for t in tiers),
                   tuple(sorted(found)), min(t.copy_bytes_per_s for t in tiers),
                   sum(r.weight_bytes for r in ranks))


class Executor(Protocol):
    """submit sends a step without waiting; collect waits for the reply of the oldest step
    submitted and not yet collected (steps run, and are collected, in submission order). At
    most two steps are in flight. execute is submit + collect for any message, and is only
    called with no step in flight."""

    def start(self) -> WorkerInfo: ...

    def submit(self, msg: SchedulerOutput) -> None: ...

    def collect(self, msg: SchedulerOutput) -> FromWorker: ...

    def execute(self, msg: ToWorker) -> FromWorker | None: ...

    def stats(self) -> dict: ...

    def shutdown(self) -> None: ...


class InProcessExecutor:
    """TP=1 in this process: no Ray, no ZMQ, the same Worker and the same frames. With async
    scheduling the worker runs its steps on a thread of its own, so the engine schedules the
    next step while the forward runs (torch and the kernels release the GIL); otherwise a
    step runs on the caller's thread when it is collected."""

    def __init__(self, spec: WorkerSpec) -> None:
        if spec.tensor_parallel_size != 1:
            raise ValueError("the in-process executor runs tensor_parallel_size=1 only")
        self.worker = Worker(spec)
        self._to_worker = WorkerChannelCodec()
        self._from_worker = EngineChannelCodec()
        self._thread: ThreadPoolExecutor | None = None
        if spec.async_scheduling:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="tierserve-worker",
                                              initializer=self.worker.bind_thread)
        # Encoded frames (inline) or their replies' futures (threaded), oldest first.
        self._pending: deque[bytes | Future] = deque()

    def start(self) -> WorkerInfo:
        self.worker.init_device()
        info = self.worker.load_model(use_kernels=self.worker.kernels_ready())
        num_blocks = self.worker.determine_num_blocks()
        tiers = self.worker.initialize_cache(num_blocks)
        return WorkerInfo.from_ranks(num_blocks, [info], [tiers])

    def submit(self, msg: SchedulerOutput) -> None:
        frame = self._to_worker.encode(msg)
        self._pending.append(frame if self._thread is None else
                             self._thread.submit(self._run, frame))

    def collect(self, msg: SchedulerOutput) -> FromWorker:
        item = self._pending.popleft()
        reply = self._run(item) if isinstance(item, bytes) else item.result()
        return self._from_worker.decode(reply)

    def execute(self, msg: ToWorker) -> FromWorker | None:
        assert not self._pending, "execute with steps in flight"
        frame = self._to_worker.encode(msg)
        reply = (self._run(frame) if self._thread is None else
                 self._thread.submit(self._run, frame).result())
        return None if reply is None else self._from_worker.decode(reply)

    def _run(self, frame: bytes) -> bytes | None:
        reply = self.worker.handle(self._to_worker.decode(frame))
        return None if reply is None else self._from_worker.encode(reply)

    def stats(self) -> dict:
        return {}  # no frame crosses a process boundary here, so none is ever dropped

    def shutdown(self) -> None:
        for item in self._pending:  # let a step in flight finish before the model goes
            if not isinstance(item, bytes):
                item.exception()
        self._pending.clear()
        if self.worker.runner is not None or self.worker.model is not None:
            self.execute(ShutdownWorker())
        if self._thread is not None:
            self._thread.shutdown(wait=True)



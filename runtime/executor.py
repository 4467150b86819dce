"""Transports between the EngineCore and its workers.

An executor starts the workers (control plane), then carries each step's SchedulerOutput to
every rank and rank 0's reply back (data plane). The in-process one here runs one Worker in this
process; deploy/ has the Ray + ZMQ one. Both carry the same encoded frames, so the in-process
path exercises the wire codecs every step and the worker never shares mutable state with the
scheduler.
"""
from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from tierserve.scheduler.messages import (
    EngineChannelCodec, FromWorker, SchedulerOutput, ShutdownWorker, ToWorker,
    WorkerChannelCodec,
)
from tierserve.runtime.errors import EngineDeadError
from tierserve.workers.worker import ModelInfo, TierReport, Worker, WorkerSpec

__all__ = ["WorkerInfo", "Executor", "InProcessExecutor", "EngineDeadError"]


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    num_blocks: int
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    backends: tuple[dict, ...]  # each rank's Backend.describe()
    kv_block_bytes: int = 0  # one block id on one rank
    cpu_slots: int = 0  # the CPU tier: slot ids mean the same place on every rank
    kv_head_ranges: tuple[tuple[int, int], ...] = ()  # per rank: the KV heads it holds
    copy_bytes_per_s: float = 0.0
    weight_bytes: int = 0  # the model's weights as the ranks hold them, all ranks
    decode_weight_bytes: int = 0  # of them, what a lone greedy decode step reads, all ranks
    # Seconds rank 0 spent in each part of its start (Worker.startup).
    startup: dict = field(default_factory=dict)

    @classmethod
    def from_ranks(cls, num_blocks: int, ranks: list[ModelInfo],
                   tiers: list[TierReport], startup: dict | None = None) -> "WorkerInfo":
        """The engine's view of its ranks: the pool size they agreed on, the model as rank 0
        reports it, every rank's backend, and the tiers every rank has."""
        first = ranks[0]
        return cls(num_blocks, first.vocab_size, first.max_position_embeddings,
                   first.eos_token_ids, tuple(r.backend for r in ranks), first.kv_block_bytes,
                   min(t.cpu_slots for t in tiers), tuple(t.kv_heads for t in tiers),
                   min(t.copy_bytes_per_s for t in tiers), sum(r.weight_bytes for r in ranks),
                   sum(r.decode_weight_bytes for r in ranks), dict(startup or {}))


class Executor(Protocol):
    """submit sends a step without waiting; collect waits for the reply of the oldest step
    submitted and not yet collected (steps run, and are collected, in submission order). At
    most two steps are in flight. execute is submit + collect for any message, and is only
    called with no step in flight. Any of them raises EngineDeadError when the workers are
    lost (a rank died, or a step exceeded its timeout); where `restartable`, restart then
    replaces every worker with a new one holding nothing, which the engine re-admits its
    requests to (self-healing)."""

    restartable: bool
    # Seconds per phase of the last start or restart (spawn, init, load, cache, ...).
    phases: dict[str, float]

    def start(self) -> WorkerInfo: ...

    def restart(self) -> WorkerInfo: ...

    def check_workers(self) -> None:
        """EngineDeadError when a worker is known to be gone; cheap, for idle engines."""

    def submit(self, msg: SchedulerOutput) -> None: ...

    def collect(self, msg: SchedulerOutput) -> FromWorker: ...

    def execute(self, msg: ToWorker) -> FromWorker | None: ...

    def stats(self) -> dict: ...

    def shutdown(self) -> None: ...


class InProcessExecutor:
    """TP=1 in this process: no Ray, no ZMQ, the same Worker and the same frames. With async
    scheduling the worker runs its steps on a thread of its own, so the engine schedules the
    next step while the forward runs (torch and the kernels release the GIL); otherwise a
    step runs on the caller's thread when it is collected.

    Its worker lives and dies with the engine's process: a step that raises in it is reported
    as a WorkerError, and restart gives the worker a fresh runner, KV pool and tiers (the
    weights stay loaded)."""

    restartable = True

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
        self.phases: dict[str, float] = {}

    def start(self) -> WorkerInfo:
        t0 = time.perf_counter()
        self.worker.init_device()
        t1 = time.perf_counter()
        info = self._model = self.worker.load_model(use_kernels=self.worker.kernels_ready())
        t2 = time.perf_counter()
        num_blocks = self._num_blocks = self.worker.determine_num_blocks()
        tiers = self.worker.initialize_cache(num_blocks)
        t3 = time.perf_counter()
        self.phases = {"init": round(t1 - t0, 3), "load": round(t2 - t1, 3),
                       "cache": round(t3 - t2, 3)}
        return WorkerInfo.from_ranks(num_blocks, [info], [tiers], self.worker.startup)

    def restart(self) -> WorkerInfo:
        for item in self._pending:  # a step still running on the thread finishes first
            if not isinstance(item, bytes):
                item.exception()
        self._pending.clear()
        t0 = time.perf_counter()
        tiers = self.worker.reset(self._num_blocks)
        self.phases = {"cache": round(time.perf_counter() - t0, 3)}
        return WorkerInfo.from_ranks(self._num_blocks, [self._model], [tiers])

    def check_workers(self) -> None:
        pass

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



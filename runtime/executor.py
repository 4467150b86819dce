"""Transports between the EngineCore and its workers.

An executor starts the workers (control plane), then carries each step's SchedulerOutput to
every rank and rank 0's reply back (data plane). The in-process one here runs one Worker in this
process; deploy/ has the Ray + ZMQ one. Both carry the same encoded frames, so the in-process
path exercises the wire codecs every step and the worker never shares mutable state with the
scheduler.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tierserve.scheduler.messages import (
    EngineChannelCodec, FromWorker, ShutdownWorker, ToWorker, WorkerChannelCodec,
)
from tierserve.workers.worker import ModelInfo, Worker, WorkerSpec

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
    backends: tuple[dict, ...]  # each rank's CpuBackend.describe()

    @classmethod
    def from_ranks(cls, num_blocks: int, ranks: list[ModelInfo]) -> "WorkerInfo":
        """The engine's view of its ranks: the pool size they agreed on, the model as rank 0
        reports it, and every rank's backend."""
        first = ranks[0]
        return cls(num_blocks, first.vocab_size, first.max_position_embeddings,
                   first.eos_token_ids, tuple(r.backend for r in ranks))


class Executor(Protocol):
    def start(self) -> WorkerInfo: ...

    def execute(self, msg: ToWorker) -> FromWorker | None: ...

    def shutdown(self) -> None: ...


class InProcessExecutor:
    """TP=1 in this process: no Ray, no ZMQ, the same Worker and the same frames."""

    def __init__(self, spec: WorkerSpec) -> None:
        if spec.tensor_parallel_size != 1:
            raise ValueError("the in-process executor runs tensor_parallel_size=1 only")
        self.worker = Worker(spec)
        self._to_worker = WorkerChannelCodec()
        self._from_worker = EngineChannelCodec()

    def start(self) -> WorkerInfo:
        self.worker.init_device()
        info = self.worker.load_model(use_kernels=self.worker.kernels_ready())
        num_blocks = self.worker.determine_num_blocks()
        self.worker.initialize_cache(num_blocks)
        return WorkerInfo.from_ranks(num_blocks, [info])

    def execute(self, msg: ToWorker) -> FromWorker | None:
        frame = self._to_worker.encode(msg)
        reply = self.worker.handle(self._to_worker.decode(frame))
        if reply is None:
            return None
        return self._from_worker.decode(self._from_worker.encode(reply))

    def shutdown(self) -> None:
        if self.worker.runner is not None or self.worker.model is not None:
            self.worker.handle(ShutdownWorker())



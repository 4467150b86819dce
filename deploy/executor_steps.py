"""Step dispatch of the Ray executor: each step's message is broadcast once over the ZMQ data
plane to every rank, and rank 0's ModelRunnerOutput (or any rank's WorkerError) is awaited on
one socket, applied only if it answers the step (deploy/reply_check.py), while the worker
actors' liveness is checked between short waits.
"""
from __future__ import annotations

import logging
import time

import ray

from tierserve.deploy.dataplane import DataPlaneServer
from tierserve.deploy.reply_check import reply_problem
from tierserve.runtime.executor import EngineDeadError
from tierserve.scheduler.messages import (
    FlushTiers, FromWorker, SchedulerOutput, ShutdownWorker, ToWorker, WorkerError,
)

__all__ = ["StepDispatch"]

# The executor's logger: this is its data plane.
log = logging.getLogger("tierserve.ray_executor")

# How often a waiting step checks that every worker actor is still alive.
_LIVENESS_POLL_S = 0.5


class StepDispatch:
    """The data-plane half of RayExecutor. Its state is the executor's: the data plane
    (`_plane`), the ranks (`workers`) and their run_loop refs (`_loops`, one per rank, in rank
    order), `_vocab_size`, `step_timeout_s` and `_last_step_id`."""

    _plane: DataPlaneServer | None
    workers: list
    _loops: list
    _vocab_size: int
    step_timeout_s: float
    _last_step_id: int

    def submit(self, msg: SchedulerOutput) -> None:
        """Broadcasts a step; the ranks queue it behind the one they are running."""
        self._last_step_id = msg.step_id
        self._plane.broadcast(msg)

    def collect(self, msg: SchedulerOutput) -> FromWorker:
        """Rank 0 replies in step order, so the next answer is the oldest step's."""
        return self._await_reply(msg, self.step_timeout_s)

    def execute(self, msg: ToWorker) -> FromWorker | None:
        self._last_step_id = getattr(msg, "step_id", self._last_step_id)
        self._plane.broadcast(msg)
        if isinstance(msg, ShutdownWorker):
            return None
        # A flush writes for up to its deadline before it answers.
        extra = msg.deadline_s if isinstance(msg, FlushTiers) else 0.0
        return self._await_reply(msg, self.step_timeout_s + extra)

    def check_workers(self) -> None:
        if self._loops:
            self._check_alive()

    def _await_reply(self, sent: ToWorker, timeout_s: float) -> FromWorker:
        """Waits in short slices, checking between them that every worker is alive. A reply
        that does not answer `sent` is dropped; an authenticated rank's error for it is fatal."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            # Past the deadline, one last look: a reply that came while this process itself
            # was stopped (SIGSTOP, a pause) is not a stuck worker's.
            got = self._plane.recv(min(max(remaining, 0.0), _LIVENESS_POLL_S))
            if got is None:
                if remaining <= 0:
                    raise EngineDeadError(f"step {sent.step_id} exceeded the "
                                          f"{self.step_timeout_s:.0f} s step timeout; a worker "
                                          f"is stuck")
                self._check_alive()
                continue
            reply, sender = got
            problem = reply_problem(reply, sender, sent, self._vocab_size, len(self.workers))
            if problem is not None:
                self._plane.drops.drop(f"a reply from rank {sender}: {problem}")
                self._check_alive()
                continue
            if isinstance(reply, WorkerError):
                self._fail(reply)
            return reply

    def _fail(self, error: WorkerError) -> None:
        """One rank failed mid-step: the others may be blocked in a collective it never joined,
        so the TP group is unusable. Name a dead worker if there is one, it is the cause."""
        # A peer's death often surfaces as a collective error first: give Ray a moment to
        # report it.
        deadline = time.monotonic() + _LIVENESS_POLL_S
        while True:
            self._check_alive()
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        raise EngineDeadError(f"worker rank {error.rank} failed step {error.step_id}: "
                              f"{error.message}")

    def _check_alive(self) -> None:
        done, _ = ray.wait(self._loops, num_returns=1, timeout=0)
        if not done:
            return
        try:
            ray.get(done[0])
            reason = "a worker loop exited"
        except Exception as e:
            # Ray's text names pids, addresses and actor ids: the log has it, clients do not.
            log.error("worker rank %d died: %s", self._loops.index(done[0]), e)
            reason = type(e).__name__
        rank = self._loops.index(done[0])
        raise EngineDeadError(f"worker rank {rank} died: {reason}")

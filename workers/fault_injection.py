"""Test-only faults a WorkerSpec can ask of a rank, so that the self-healing paths run on cue: a
stall before one step (debug_stall, a stuck collective) and a crash on a new request holding
one token (debug_crash, a dead worker). Both are None outside tests."""
from __future__ import annotations

import logging
import time
from typing import Iterator

from tierserve.scheduler.messages import SchedulerOutput
from tierserve.workers.worker_spec import WorkerSpec

__all__ = ["stall_if_asked", "injected_crashes"]

# The Worker's log: a rank's faults read in the same stream as its steps.
log = logging.getLogger("tierserve.worker")


def stall_if_asked(spec: WorkerSpec, rank: int, step_id: int) -> None:
    """Sleeps before the step the spec names, on the rank it names."""
    stall = spec.debug_stall
    if stall is not None and stall[:2] == (rank, step_id):
        log.warning("rank %d: stalling step %d for %.1f s (TIERSERVE_DEBUG_STALL)",
                    rank, step_id, stall[2])
        time.sleep(stall[2])


def injected_crashes(spec: WorkerSpec, rank: int, msg: SchedulerOutput) -> Iterator[str]:
    """The reason of each crash the spec asks of this rank in this step; the caller crashes the
    rank its own way (Worker.crash), which never returns."""
    crash = spec.debug_crash
    if crash is None or crash[0] != rank:
        return
    for new in msg.scheduled_new_reqs:
        if crash[1] in new.prompt_token_ids:
            log.warning("rank %d: crashing on request %r (TIERSERVE_DEBUG_CRASH)",
                        rank, new.req_id)
            yield f"injected crash on request {new.req_id!r}"

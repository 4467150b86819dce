"""Worker-loss handling: the restart budget (worker failures within RESTART_WINDOW_S against
max_restarts), the loop that replaces lost workers, and the record of what restarts did.

What a loss does to the requests, and what an engine past its budget does, are the EngineCore's:
it passes them to heal().
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable

from tierserve.runtime.config import EngineConfig
from tierserve.runtime.executor import Executor
from tierserve.scheduler import EngineCoreOutput, Scheduler

__all__ = ["WorkerHealer", "RESTART_WINDOW_S"]

log = logging.getLogger("tierserve.engine")

# Worker failures within this window count against max_restarts.
RESTART_WINDOW_S = 600.0

Outputs = list[EngineCoreOutput]


class WorkerHealer:
    """Replaces the workers of one engine while its restart budget lasts."""

    def __init__(self, config: EngineConfig, executor: Executor, scheduler: Scheduler) -> None:
        self._config = config
        self._executor = executor
        self._scheduler = scheduler
        # When each worker failure of the window was healed (monotonic).
        self._failures: deque[float] = deque()
        self.restarts = 0
        # True while the workers are being rebuilt (read by other threads: a router routes
        # nothing to a healing replica).
        self.healing = False
        self.restart_reason: str | None = None
        self.restart_s = 0.0
        self._stopped = False

    def stop(self) -> None:
        """Workers lost from now on (a shutdown) are not replaced."""
        self._stopped = True

    def heal(self, reason: str, lost: Callable[[str], Outputs],
             die: Callable[[str], Outputs]) -> Outputs:
        """The workers are lost (a rank died, or a step hung). While max_restarts failures in
        RESTART_WINDOW_S are not spent, new workers replace them; lost(reason) first drops
        what the old ones held and returns the outputs of the requests that fail alone. Past
        the budget, or where the transport cannot restart, die(message) ends the engine."""
        self.healing = True
        try:
            return self._heal_loop(reason, lost, die)
        finally:
            self.healing = False

    def _heal_loop(self, reason: str, lost: Callable[[str], Outputs],
                   die: Callable[[str], Outputs]) -> Outputs:
        outputs = []
        while True:
            if not self.may_restart():
                return outputs + die(self._death_message(reason))
            self._failures.append(time.monotonic())
            outputs += lost(reason)
            log.error("the workers are lost (%s); restarting them (%d of %d failures in %.0f "
                      "minutes)", reason, len(self._failures), self._config.max_restarts,
                      RESTART_WINDOW_S / 60)
            t0 = time.perf_counter()
            try:
                info = self._executor.restart()
            except Exception as e:  # another failure, from the budget
                log.exception("restarting the workers failed")
                reason = f"restarting the workers failed: {type(e).__name__}: {e}"
                continue
            assert info.num_blocks == self._scheduler.kv.pool.num_blocks
            self.restarts += 1
            self.restart_reason, self.restart_s = reason, time.perf_counter() - t0
            log.warning("the workers were restarted in %.2f s; %d requests re-admitted",
                        self.restart_s, len(self._scheduler.requests))
            return outputs

    def may_restart(self) -> bool:
        """Whether lost workers would be replaced now."""
        if not self._executor.restartable or self._config.max_restarts == 0 or self._stopped:
            return False
        now = time.monotonic()
        while self._failures and now - self._failures[0] > RESTART_WINDOW_S:
            self._failures.popleft()
        return len(self._failures) < self._config.max_restarts

    def _death_message(self, reason: str) -> str:
        if not self._executor.restartable or self._config.max_restarts == 0:
            return reason
        return (f"{reason} (worker failure {len(self._failures) + 1} within "
                f"{RESTART_WINDOW_S / 60:.0f} minutes; max_restarts={self._config.max_restarts})")

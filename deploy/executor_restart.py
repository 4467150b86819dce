"""Healing of the Ray executor: a restart replaces every rank, whatever state each is in, with
spare ranks where it keeps them (CPU only: processes started ahead, imports done, nothing
loaded) or new processes, in the same placement-group bundles.

The ranks and the spares take turns between two families of actor names (worker_name): the
spares are started under the names the ranks before the current ones had, so that a restart
onto spares need not wait for the killed ranks to be gone.
"""
from __future__ import annotations

import dataclasses
import logging
import time

import ray

from tierserve.deploy.dataplane import DataPlaneServer
from tierserve.runtime.executor import WorkerInfo
from tierserve.workers.worker import WorkerSpec

__all__ = ["RankRestart"]

# The executor's logger: this is its healing.
log = logging.getLogger("tierserve.ray_executor")

# How long a restart waits for the killed ranks to be gone before it starts their successors.
_KILL_WAIT_S = 10.0
# How long a restart waits for the spares' answers (a spare still starting answers later).
_SPARE_PING_S = 0.2


class RankRestart:
    """The restart half of RayExecutor. Its state is the executor's; it starts ranks with the
    executor's `_spawn` and `_launch`."""

    spec: WorkerSpec
    workers: list
    _loops: list
    _plane: DataPlaneServer | None
    _dropped: int
    _use_kernels: bool
    _spares: list
    _spares_up: list
    _dying: list
    _ready_count: int
    _next_ready_poll: float
    _family: int
    phases: dict[str, float]

    def restart(self) -> WorkerInfo:
        """Replaces every rank, whatever state each is in (dead, stuck in a collective, or
        well): the old actors are killed, and new ones (the spares, where there are) take the
        same bundles, with a fresh data plane (fresh keys), the backend and pool size the
        engine runs, and the same tiers' folder. What the first ranks measured (pool size,
        kernels, copy bandwidth) is known, and not measured again."""
        t0 = time.perf_counter()
        spares = self._take_spares()
        self._teardown(wait=not spares)  # spares have names of their own: no need to wait
        if spares:
            self._family = 1 - self._family
        teardown = round(time.perf_counter() - t0, 3)
        info = self._launch(self._restart_spec(), known=True, actors=spares)
        self.phases = {"teardown": teardown, **self.phases}
        return info

    def _restart_spec(self) -> WorkerSpec:
        # The backend the engine runs: its kernels are built and cached by now.
        return dataclasses.replace(self.spec,
                                   cpu_kernels="sync" if self._use_kernels else "off")

    def _take_spares(self) -> list:
        """The spares, if every one of them is alive (still starting counts); else none (the
        ones left are killed). A started spare answers at once; one whose node died fails."""
        spares = self._spares
        self._spares, self._spares_up = [], []
        pings = [a.node_id.remote() for a in spares]
        done, _ = ray.wait(pings, num_returns=len(pings), timeout=_SPARE_PING_S) \
            if pings else ([], [])
        try:
            ray.get(done)
            return spares
        except Exception as e:
            log.warning("a spare rank is gone (%s); starting new ranks", e)
            for a in spares:
                ray.kill(a, no_restart=True)
            return []

    def _spawn_spares(self) -> None:
        """Spares for the next restart, under the names the ranks before these had."""
        if self._dying:  # killed at the restart: their names are free once they are gone
            ray.wait(self._dying, num_returns=len(self._dying), timeout=_KILL_WAIT_S)
            self._dying = []
        try:
            self._spares = self._spawn(self._restart_spec(), 1 - self._family, spare=True)
        except Exception as e:  # a restart then starts new processes
            log.warning("could not start spare ranks: %s", e)
            return
        self._spares_up = [a.node_id.remote() for a in self._spares]
        self._ready_count = 0

    def _teardown(self, wait: bool = True) -> None:
        """Kills every rank at once (a stuck one would not answer a request to stop) and,
        with wait, waits until they are gone, which frees their names and bundles; closes
        the data plane."""
        for w in self.workers:
            ray.kill(w, no_restart=True)
        # Each resolves (with an error) once its actor is gone.
        self._dying = self._loops or [w.node_id.remote() for w in self.workers]
        if wait and self._dying:
            ray.wait(self._dying, num_returns=len(self._dying), timeout=_KILL_WAIT_S)
            self._dying = []
        self.workers, self._loops = [], []
        if self._plane is not None:
            self._dropped += self._plane.drops.count
            self._plane.close()
            self._plane = None

    def _spares_ready(self) -> int:
        """Spares started and waiting; polled at most once a second (stats are read every
        step)."""
        now = time.monotonic()
        if self._ready_count < len(self._spares_up) and now >= self._next_ready_poll:
            self._next_ready_poll = now + 1.0
            done, _ = ray.wait(self._spares_up, num_returns=len(self._spares_up), timeout=0)
            self._ready_count = len(done)
        return min(self._ready_count, len(self._spares_up))

"""The Ray + ZMQ executor: TP worker actors in a placement group; this module places and starts
them.

Control plane (start, load, profile, health, shutdown): Ray actor calls, submitted to every rank
and collected with one ray.get. Data plane (deploy/dataplane.py): each step's SchedulerOutput is
encoded once and broadcast over ZMQ to every rank (deploy/executor_steps.py). A restart replaces
every rank (deploy/executor_restart.py); the rank's side is deploy/worker_actor.py.

Every listener binds to one address: loopback when every rank is on the engine's node, else the
node's own. That holds for the data plane, rank 0's torch.distributed store and gloo's sockets.
"""
from __future__ import annotations

import logging
import time

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tierserve.deploy.dataplane import DataPlaneServer, DataPlaneTimeout
from tierserve.deploy.executor_restart import RankRestart
from tierserve.deploy.executor_steps import StepDispatch
from tierserve.deploy.placement import worker_names
from tierserve.deploy.priority import restore_priority
from tierserve.deploy.worker_actor import WorkerActor, bind_address
from tierserve.runtime.executor import EngineDeadError, WorkerInfo
from tierserve.scheduler.messages import ShutdownWorker
from tierserve.workers.worker import WorkerSpec

# WorkerActor lives in deploy/worker_actor.py, restore_priority in deploy/priority.py; the
# engine's actor imports them from here.
__all__ = ["RayExecutor", "WorkerActor", "restore_priority"]

log = logging.getLogger("tierserve.ray_executor")


class _Phases:
    """Wall time of each phase of a start, in seconds (what dominates a restart)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._t = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = round(now - self._t, 3)
        self._t = now


class RayExecutor(StepDispatch, RankRestart):
    """Worker ranks as Ray actors in a placement group's bundles: placement and startup here,
    step dispatch (StepDispatch) and restarts (RankRestart) in their modules."""

    restartable = True

    def __init__(self, spec: WorkerSpec, pg, bundles: list[int], step_timeout_s: float,
                 name_prefix: str, spares: bool = False) -> None:
        self.spec = spec
        self.name_prefix = name_prefix
        self.pg = pg
        self.bundles = bundles
        self.step_timeout_s = step_timeout_s
        self.workers: list = []
        self.worker_nodes: list[str] = []
        self.worker_pids: list[int] = []
        self._loops: list = []
        self._plane: DataPlaneServer | None = None
        self._vocab_size = 0
        self._last_step_id = -1
        self._dropped = 0  # by the data planes of earlier workers
        # What the first start decided for the engine's whole life; restarts reuse it.
        self._use_kernels = False
        self._num_blocks = 0
        # Spare ranks (CPU only: a spare holds no GPU of its bundle): one started process per
        # rank, imports done, nothing loaded, that a restart turns into the new rank instead
        # of starting a process. The ranks and the spares take turns between two families of
        # actor names (worker_name).
        self.spares_enabled = spares and spec is not None and spec.device == "cpu"
        self._spares: list = []
        self._spares_up: list = []  # each spare's first answer: done once it started
        self._dying: list = []  # run_loop refs of ranks killed without waiting
        self._ready_count, self._next_ready_poll = 0, 0.0
        self._family = 0
        # Seconds per phase of the last start or restart.
        self.phases: dict[str, float] = {}

    def _spawn(self, spec: WorkerSpec, family: int, spare: bool) -> list:
        cls = ray.remote(WorkerActor)
        num_gpus = 1 if spec.device == "cuda" else 0
        actors = []
        for rank, bundle in enumerate(self.bundles):
            # The bundle's CPUs, which may be a fraction of a core (ranks sharing cores); a
            # spare reserves none: they are its rank's until that one is gone.
            cpus = 0 if spare else self.pg.bundle_specs[bundle].get("CPU", 0)
            strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle)
            # A single-threaded actor: the forward then runs on the process's main thread.
            # From a second thread glibc serves torch's temporaries from a per-thread arena that
            # trims eagerly, and the page faults slow TP=1 on Ray well below in-process.
            # Nothing needs a concurrent call: shutdown rides the data plane, liveness the
            # run_loop ObjectRef.
            actors.append(cls.options(
                name=self.worker_name(rank, family), num_cpus=cpus,
                num_gpus=0 if spare else num_gpus,
                scheduling_strategy=strategy).remote(spec, rank, spare))
        return actors

    def worker_name(self, rank: int, family: int | None = None) -> str:
        family = self._family if family is None else family
        return worker_names(self.name_prefix, rank)[family]

    def start(self) -> WorkerInfo:
        return self._launch(self.spec, known=False)

    def _launch(self, spec: WorkerSpec, known: bool, actors: list | None = None) -> WorkerInfo:
        phases = _Phases()
        self.workers = actors or self._spawn(spec, self._family, spare=False)
        self.worker_nodes = ray.get([w.node_id.remote() for w in self.workers])
        phases.mark("spawn")
        node_id = ray.get_runtime_context().get_node_id()
        one_node = all(n == node_id for n in self.worker_nodes)
        self._plane = DataPlaneServer(bind_address(one_node), node_id, len(self.workers),
                                      label=self.name_prefix)
        init_method = ray.get(self.workers[0].open_store.remote(one_node)) \
            if len(self.workers) > 1 else None
        self.worker_pids = ray.get([
            w.init.remote(init_method, self._plane.endpoints, self._plane.rank_keys(rank),
                          one_node) for rank, w in enumerate(self.workers)])
        phases.mark("init")
        if not known:
            # Kernels on every rank or on none: the backend is one decision for the engine.
            self._use_kernels = all(ray.get([w.kernels_ready.remote() for w in self.workers]))
        infos = ray.get([w.load_model.remote(self._use_kernels) for w in self.workers])
        phases.mark("load")
        self._vocab_size = infos[0].vocab_size
        if not known:
            self._num_blocks = min(ray.get([w.determine_num_blocks.remote()
                                            for w in self.workers]))
        tiers = ray.get([w.initialize_cache.remote(self._num_blocks, known)
                         for w in self.workers])
        phases.mark("cache")
        startup = ray.get(self.workers[0].startup.remote())
        self._await_subscribers()
        self._loops = [w.run_loop.remote() for w in self.workers]
        phases.mark("subscribe")
        self.phases = phases.seconds
        if self.spares_enabled:
            self._spawn_spares()
        return WorkerInfo.from_ranks(self._num_blocks, infos, tiers, startup)

    def _await_subscribers(self) -> None:
        try:
            self._plane.await_subscribers(len(self.workers))
        except DataPlaneTimeout as e:
            raise EngineDeadError(str(e)) from None

    def shutdown(self) -> None:
        for a in self._spares:
            ray.kill(a, no_restart=True)
        self._spares, self._spares_up = [], []
        if self.workers:
            try:
                self._plane.broadcast(ShutdownWorker())
                ray.wait(self._loops, num_returns=len(self._loops), timeout=5.0)
            except Exception:  # already dead: fall through to kill
                pass
            for w in self.workers:
                ray.kill(w, no_restart=True)
            self.workers = []
        if self._plane is not None:
            self._plane.close()
            self._plane = None

    def stats(self) -> dict:
        """dropped_frames: data-plane replies dropped, never applied (unauthenticated,
        malformed, or not an answer to the step waiting), since start; spare_ranks_ready:
        spares started and waiting (where spares are kept)."""
        out = {"dropped_frames": self._dropped + (
            self._plane.drops.count if self._plane is not None else 0)}
        if self.spares_enabled:
            out["spare_ranks_ready"] = self._spares_ready()
        return out

    def dataplane(self) -> dict:
        """Where the data plane listens (no keys: those are never shown), the id of the last
        message broadcast and the dropped-frame count; for operators and bench/soak.py."""
        ep = self._plane.endpoints if self._plane is not None else None
        return {"endpoints": None if ep is None else {
                    "tcp_pub": ep.tcp_pub, "tcp_pull": ep.tcp_pull, "ipc_pub": ep.ipc_pub,
                    "ipc_pull": ep.ipc_pull},
                "last_step_id": self._last_step_id, **self.stats()}

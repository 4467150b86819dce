"""The Ray + ZMQ executor: TP worker actors in a placement group.

Control plane (start, load, profile, health, shutdown): Ray actor calls, submitted to every rank
and collected with one ray.get. Data plane (deploy/dataplane.py): each step's SchedulerOutput is encoded once
and broadcast over ZMQ to every rank; rank 0's ModelRunnerOutput (or any rank's WorkerError)
comes back on one socket, and is applied only if it answers the step (deploy/reply_check.py).

Every listener binds to one address: loopback when every rank is on the engine's node, else the
node's own. That holds for the data plane, rank 0's torch.distributed store and gloo's sockets.
"""
from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import socket
import struct
import time

import ray
import torch
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tierserve.deploy.dataplane import (
    DataPlaneClient, DataPlaneServer, DataPlaneTimeout, Endpoints, RankKeys,
)
from tierserve.deploy.placement import worker_names
from tierserve.deploy.reply_check import reply_problem
from tierserve.runtime import envs
from tierserve.runtime.executor import EngineDeadError, WorkerInfo
from tierserve.scheduler.messages import (
    FlushTiers, FromWorker, SchedulerOutput, ShutdownWorker, ToWorker, WorkerError,
)
from tierserve.workers.parallel import listen_socket
from tierserve.workers.worker import ModelInfo, TierReport, Worker, WorkerSpec

__all__ = ["RayExecutor", "WorkerActor"]

log = logging.getLogger("tierserve.ray_executor")

# How often a waiting step checks that every worker actor is still alive.
_LIVENESS_POLL_S = 0.5
# How long a restart waits for the killed ranks to be gone before it starts their successors.
_KILL_WAIT_S = 10.0
# How long a restart waits for the spares' answers (a spare still starting answers later).
_SPARE_PING_S = 0.2


def restore_priority() -> None:
    """Ray starts worker processes at nice 15. A rank's OpenMP threads stall at every barrier
    when one of them is preempted, so the whole forward slows whenever any normal-priority
    process wakes; run ranks and the engine at normal priority where we may."""
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) > 0:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
    except OSError as e:  # lowering niceness needs CAP_SYS_NICE
        log.warning("could not restore normal scheduling priority (%s); ranks may run slower "
                    "on busy machines", e)


_LOOPBACK = "127.0.0.1"
_SIOCGIFADDR = 0x8915


def _interface_of(address: str) -> str | None:
    """The network interface whose IPv4 address is `address` (Linux), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                request = struct.pack("256s", name[:15].encode())
                info = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)
            except OSError:  # no IPv4 address
                continue
            if socket.inet_ntoa(info[20:24]) == address:
                return name
    return None


def _exit_now(reason: str) -> None:
    """An injected crash (TIERSERVE_DEBUG_CRASH): the process ends as a killed one would, with
    no cleanup and no reply."""
    log.warning("exiting: %s", reason)
    os._exit(70)


class _Phases:
    """Wall time of each phase of a start, in seconds (what dominates a restart)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._t = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = round(now - self._t, 3)
        self._t = now


class WorkerActor:
    """Ray actor around one Worker rank; its data-plane loop runs in `run_loop`."""

    def __init__(self, spec: WorkerSpec, rank: int, spare: bool = False) -> None:
        # A spare waits at Ray's low priority, so that starting it takes idle CPU only; it
        # takes the normal one when it becomes a rank (init).
        if not spare:
            restore_priority()
        self.rank = rank
        self.worker = Worker(spec, rank, local_device_index=0)
        self.worker.crash = _exit_now
        self._plane: DataPlaneClient | None = None
        self._store_socket: socket.socket | None = None

    def _bind_address(self, one_node: bool) -> str:
        return _LOOPBACK if one_node else ray.util.get_node_ip_address()

    def open_store(self, one_node: bool) -> str:
        """Rank 0: starts listening for the torch.distributed store on this node's bind
        address; returns the init method. Listening now, held until init, leaves no window in
        which another process could take the port."""
        self._store_socket = listen_socket(self._bind_address(one_node))
        host, port = self._store_socket.getsockname()[:2]
        return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def init(self, dist_init_method: str | None, endpoints: Endpoints, keys: RankKeys,
             one_node: bool) -> int:
        """keys: this rank's data-plane credentials, which reach it only through this call.
        Returns this rank's process id (operators and tests signal it)."""
        restore_priority()
        self._pin_gloo(self._bind_address(one_node))
        self.worker.dist_init_method = dist_init_method
        if self._store_socket is not None:
            self.worker.dist_listen_fd = self._store_socket.detach()  # the store owns it now
            self._store_socket = None
        self.worker.init_device()
        self._plane = DataPlaneClient(endpoints, self.node_id(), keys)
        return os.getpid()

    def _pin_gloo(self, address: str) -> None:
        if self.worker.spec.device != "cpu" or self.worker.spec.tensor_parallel_size == 1:
            return
        interface = _interface_of(address)
        if interface is None:
            log.warning("rank %d: no interface holds %s; gloo listens where the host name "
                        "resolves", self.rank, address)
            return
        envs.pin_gloo_interface(interface)

    def kernels_ready(self) -> bool:
        return self.worker.kernels_ready()

    def load_model(self, use_kernels: bool) -> ModelInfo:
        return self.worker.load_model(use_kernels)

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_cache(self, num_blocks: int, known: bool = False) -> TierReport:
        return self.worker.initialize_cache(num_blocks, known)

    def startup(self) -> dict:
        return dict(self.worker.startup)

    def run_loop(self) -> None:
        # OpenMP's thread count is per calling thread and Ray starts workers with
        # OMP_NUM_THREADS=1: set it again in the thread that runs every forward.
        torch.set_num_threads(self.worker.num_threads)
        self._plane.serve(self.worker.handle, self.rank)


class RayExecutor:
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

    # ------------------------------------------------------------------ control plane

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

    def _launch(self, spec: WorkerSpec, known: bool, actors: list | None = None) -> WorkerInfo:
        phases = _Phases()
        self.workers = actors or self._spawn(spec, self._family, spare=False)
        self.worker_nodes = ray.get([w.node_id.remote() for w in self.workers])
        phases.mark("spawn")
        node_id = ray.get_runtime_context().get_node_id()
        one_node = all(n == node_id for n in self.worker_nodes)
        self._plane = DataPlaneServer(_LOOPBACK if one_node else ray.util.get_node_ip_address(),
                                      node_id, len(self.workers), label=self.name_prefix)
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

    def _await_subscribers(self) -> None:
        try:
            self._plane.await_subscribers(len(self.workers))
        except DataPlaneTimeout as e:
            raise EngineDeadError(str(e)) from None

    def check_workers(self) -> None:
        if self._loops:
            self._check_alive()

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

    def _spares_ready(self) -> int:
        """Polled at most once a second (stats are read every step)."""
        now = time.monotonic()
        if self._ready_count < len(self._spares_up) and now >= self._next_ready_poll:
            self._next_ready_poll = now + 1.0
            done, _ = ray.wait(self._spares_up, num_returns=len(self._spares_up), timeout=0)
            self._ready_count = len(done)
        return min(self._ready_count, len(self._spares_up))

    def dataplane(self) -> dict:
        """Where the data plane listens (no keys: those are never shown), the id of the last
        message broadcast and the dropped-frame count; for operators and bench/soak.py."""
        ep = self._plane.endpoints if self._plane is not None else None
        return {"endpoints": None if ep is None else {
                    "tcp_pub": ep.tcp_pub, "tcp_pull": ep.tcp_pull, "ipc_pub": ep.ipc_pub,
                    "ipc_pull": ep.ipc_pull},
                "last_step_id": self._last_step_id, **self.stats()}

    # ------------------------------------------------------------------ data plane

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


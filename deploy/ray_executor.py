"""The Ray + ZMQ executor: TP worker actors in a placement group.

Control plane (start, load, profile, health, shutdown): Ray actor calls, submitted to every rank
and collected with one ray.get. Data plane: each step's SchedulerOutput is encoded once and
published on a ZMQ XPUB socket every rank subscribes to; replies (rank 0's ModelRunnerOutput, or
any rank's WorkerError) come back on one PULL socket. Sockets bind to this node's address only.
"""
from __future__ import annotations

import logging
import socket
import threading
import time

import ray
import zmq
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tierserve.runtime.executor import EngineDeadError, WorkerInfo
from tierserve.scheduler.messages import (
    EngineChannelCodec, FromWorker, MalformedFrameError, SchedulerOutput, ShutdownWorker,
    ToWorker, WorkerChannelCodec, WorkerError,
)
from tierserve.workers.worker import Worker, WorkerSpec

__all__ = ["RayExecutor", "WorkerActor"]

log = logging.getLogger("tierserve.ray_executor")

# How often a waiting step checks that every worker actor is still alive.
_LIVENESS_POLL_S = 0.5


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class WorkerActor:
    """Ray actor around one Worker rank; its data-plane loop runs in `run_loop`."""

    def __init__(self, spec: WorkerSpec, rank: int) -> None:
        self.rank = rank
        self.worker = Worker(spec, rank, local_device_index=0)
        self._ctx = zmq.Context()
        self._stop = threading.Event()

    def node_address(self) -> tuple[str, int]:
        ip = ray.util.get_node_ip_address()
        return ip, _free_port(ip)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def init(self, dist_init_method: str, pub_address: str, pull_address: str) -> None:
        self.worker.dist_init_method = dist_init_method
        self.worker.init_device()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(pub_address)
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(pull_address)

    def load_model(self) -> dict:
        return self.worker.load_model()

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks)

    def ping(self) -> int:
        return self.rank

    def run_loop(self) -> None:
        """Receives, executes, replies, until ShutdownWorker. A frame that does not decode is
        dropped with a logged error (every rank receives the same bytes, so all drop it)."""
        to_worker, from_worker = WorkerChannelCodec(), EngineChannelCodec()
        while not self._stop.is_set():
            frame = self._sub.recv(copy=False)
            try:
                msg = to_worker.decode(frame.buffer)
            except MalformedFrameError as e:
                log.error("rank %d: dropped a frame: %s", self.rank, e)
                continue
            reply = self.worker.handle(msg)
            if reply is not None:  # rank 0's output, or any rank's WorkerError
                self._push.send(from_worker.encode(reply), copy=False)
            if isinstance(msg, ShutdownWorker):
                self._stop.set()
        self._sub.close(linger=0)
        self._push.close(linger=0)


class RayExecutor:
    def __init__(self, spec: WorkerSpec, pg, bundles: list[int], step_timeout_s: float,
                 name_prefix: str) -> None:
        self.spec = spec
        self.name_prefix = name_prefix
        self.pg = pg
        self.bundles = bundles
        self.step_timeout_s = step_timeout_s
        self.workers: list = []
        self.worker_nodes: list[str] = []
        self._loops: list = []
        self._ctx = zmq.Context()
        self._to_worker, self._from_worker = WorkerChannelCodec(), EngineChannelCodec()

    # ------------------------------------------------------------------ control plane

    def _spawn_workers(self) -> None:
        cls = ray.remote(WorkerActor)
        num_gpus = 1 if self.spec.device == "cuda" else 0
        cpus = self.spec.cpu_threads or 1
        for rank, bundle in enumerate(self.bundles):
            strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle)
            self.workers.append(cls.options(
                name=self.worker_name(rank), num_cpus=cpus, num_gpus=num_gpus,
                max_concurrency=2, scheduling_strategy=strategy).remote(self.spec, rank))

    def worker_name(self, rank: int) -> str:
        return f"{self.name_prefix}-rank{rank}"

    def _bind_sockets(self) -> tuple[str, str]:
        ip = ray.util.get_node_ip_address()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        pub_port = self._pub.bind_to_random_port(f"tcp://{ip}")
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        pull_port = self._pull.bind_to_random_port(f"tcp://{ip}")
        return f"tcp://{ip}:{pub_port}", f"tcp://{ip}:{pull_port}"

    def start(self) -> WorkerInfo:
        self._spawn_workers()
        self.worker_nodes = ray.get([w.node_id.remote() for w in self.workers])
        pub_address, pull_address = self._bind_sockets()
        host, port = ray.get(self.workers[0].node_address.remote())
        init_method = f"tcp://{host}:{port}"
        ray.get([w.init.remote(init_method, pub_address, pull_address) for w in self.workers])
        infos = ray.get([w.load_model.remote() for w in self.workers])
        num_blocks = min(ray.get([w.determine_num_blocks.remote() for w in self.workers]))
        ray.get([w.initialize_cache.remote(num_blocks) for w in self.workers])
        self._await_subscribers()
        self._loops = [w.run_loop.remote() for w in self.workers]
        info = infos[0]
        return WorkerInfo(num_blocks, info["vocab_size"], info["max_position_embeddings"],
                          tuple(info["eos_token_ids"]))

    def _await_subscribers(self, timeout_s: float = 60.0) -> None:
        """XPUB reports each subscription; publishing before every rank joined would lose
        frames (ZMQ's slow-joiner problem)."""
        deadline = time.monotonic() + timeout_s
        joined = 0
        while joined < len(self.workers):
            if not self._pub.poll(int(max(deadline - time.monotonic(), 0) * 1000)):
                raise EngineDeadError(f"only {joined} of {len(self.workers)} workers subscribed "
                                      f"within {timeout_s:.0f} s")
            if self._pub.recv()[:1] == b"\x01":
                joined += 1

    def shutdown(self) -> None:
        if self.workers:
            try:
                self._pub.send(self._to_worker.encode(ShutdownWorker()))
                ray.wait(self._loops, num_returns=len(self._loops), timeout=5.0)
            except Exception:  # already dead: fall through to kill
                pass
            for w in self.workers:
                ray.kill(w, no_restart=True)
            self.workers = []
        for sock in ("_pub", "_pull"):
            if hasattr(self, sock):
                getattr(self, sock).close(linger=0)

    # ------------------------------------------------------------------ data plane

    def execute(self, msg: ToWorker) -> FromWorker | None:
        self._pub.send(self._to_worker.encode(msg), copy=False)
        if not isinstance(msg, SchedulerOutput):
            return None
        return self._await_reply(msg.step_id)

    def _await_reply(self, step_id: int) -> FromWorker:
        deadline = time.monotonic() + self.step_timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EngineDeadError(f"step {step_id} exceeded the {self.step_timeout_s:.0f} s "
                                      f"step timeout; a worker is stuck")
            if self._pull.poll(int(min(remaining, _LIVENESS_POLL_S) * 1000)):
                reply = self._decode_reply()
                if reply is None or reply.step_id != step_id:
                    continue
                if isinstance(reply, WorkerError):
                    self._fail(reply)
                return reply
            self._check_alive()

    def _fail(self, error: WorkerError) -> None:
        """One rank failed mid-step: the others may be blocked in a collective it never joined,
        so the TP group is unusable. Name a dead worker if there is one, it is the cause."""
        self._check_alive()
        time.sleep(_LIVENESS_POLL_S)  # a peer's death often surfaces as a collective error first
        self._check_alive()
        raise EngineDeadError(f"worker rank {error.rank} failed step {error.step_id}: "
                              f"{error.message}")

    def _decode_reply(self) -> FromWorker | None:
        frame = self._pull.recv(copy=False)
        try:
            return self._from_worker.decode(frame.buffer)
        except MalformedFrameError as e:
            log.error("dropped a reply frame: %s", e)
            return None

    def _check_alive(self) -> None:
        done, _ = ray.wait(self._loops, num_returns=1, timeout=0)
        if not done:
            return
        try:
            ray.get(done[0])
            reason = "a worker loop exited"
        except Exception as e:
            reason = f"{type(e).__name__}: {e}"
        rank = self._loops.index(done[0])
        raise EngineDeadError(f"worker rank {rank} died: {reason}")


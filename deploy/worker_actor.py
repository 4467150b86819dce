"""The worker side of the Ray executor: the Ray actor around one Worker rank, which opens
rank 0's torch.distributed store, pins gloo to the bind address, and serves the data plane in
`run_loop`.

Every listener binds to one address: loopback when every rank is on the engine's node, else the
node's own (`bind_address`).
"""
from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct

import ray
import torch

from tierserve.deploy.dataplane import DataPlaneClient, Endpoints, RankKeys
from tierserve.deploy.priority import restore_priority
from tierserve.runtime import envs
from tierserve.workers.parallel import listen_socket
from tierserve.workers.worker import ModelInfo, TierReport, Worker, WorkerSpec

__all__ = ["WorkerActor", "bind_address", "restore_priority"]

# The executor's logger: a rank's records read as the executor's, as the engine's do.
log = logging.getLogger("tierserve.ray_executor")

_LOOPBACK = "127.0.0.1"
_SIOCGIFADDR = 0x8915


def bind_address(one_node: bool) -> str:
    """Where this process's listeners bind: loopback when every rank is on the engine's node."""
    return _LOOPBACK if one_node else ray.util.get_node_ip_address()


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

    def open_store(self, one_node: bool) -> str:
        """Rank 0: starts listening for the torch.distributed store on this node's bind
        address; returns the init method. Listening now, held until init, leaves no window in
        which another process could take the port."""
        self._store_socket = listen_socket(bind_address(one_node))
        host, port = self._store_socket.getsockname()[:2]
        return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def init(self, dist_init_method: str | None, endpoints: Endpoints, keys: RankKeys,
             one_node: bool) -> int:
        """keys: this rank's data-plane credentials, which reach it only through this call.
        Returns this rank's process id (operators and tests signal it)."""
        restore_priority()
        self._pin_gloo(bind_address(one_node))
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

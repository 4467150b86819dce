"""The per-step data plane: one ZMQ XPUB broadcast to every rank, one PULL for replies.

The EngineCore side (`DataPlaneServer`) encodes each message once and publishes it; every rank
(`DataPlaneClient`) decodes it, runs its handler and pushes the handler's reply, if any, back.
Sockets bind to the node's own address (and a private IPC path for ranks on the same node),
never to every interface.
"""
from __future__ import annotations

import glob
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable

import zmq

from tierserve.scheduler.messages import (
    EngineChannelCodec, FromWorker, MalformedFrameError, ShutdownWorker, ToWorker,
    WorkerChannelCodec,
)

__all__ = ["DataPlaneServer", "DataPlaneClient", "DataPlaneTimeout", "Endpoints",
           "remove_stale_ipc_dirs", "remove_ipc_dirs"]

log = logging.getLogger("tierserve.dataplane")


class DataPlaneTimeout(TimeoutError):
    pass


@dataclass(frozen=True)
class Endpoints:
    """Where ranks connect: over IPC on the engine's node, over TCP from any other node."""

    node_id: str
    tcp_pub: str
    tcp_pull: str
    ipc_pub: str
    ipc_pull: str

    def for_node(self, node_id: str) -> tuple[str, str]:
        if node_id == self.node_id:
            return self.ipc_pub, self.ipc_pull
        return self.tcp_pub, self.tcp_pull


_IPC_PREFIX = "tsdp-"
_IPC_ROOT = "/tmp"
_OWNER_FILE = "owner"


def _process_start(pid: int) -> str | None:
    """The start time of process pid (field 22 of /proc/PID/stat), which tells a live owner
    from a later process that reused its pid; None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _label(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", label)


def make_ipc_dir(label: str = "") -> str:
    """A private (0700) folder for this process's IPC sockets, marked with its owner; label
    (a deployment's id) lets `remove_ipc_dirs` find it."""
    path = tempfile.mkdtemp(prefix=f"{_IPC_PREFIX}{_label(label)}-", dir=_IPC_ROOT)
    with open(os.path.join(path, _OWNER_FILE), "w") as f:
        f.write(f"{os.getpid()} {_process_start(os.getpid())}")
    return path


def remove_ipc_dirs(label: str, wait_s: float = 10.0, root: str = _IPC_ROOT) -> list[str]:
    """Removes the IPC folders labelled `label` (a deployment being stopped), once their owner
    has exited or wait_s has passed."""
    paths = glob.glob(os.path.join(root, f"{_IPC_PREFIX}{glob.escape(_label(label))}-*"))
    deadline = time.monotonic() + wait_s
    for path in paths:
        while time.monotonic() < deadline and _owner_alive(path):
            time.sleep(0.1)
        shutil.rmtree(path, ignore_errors=True)
    return paths


def _owner_alive(path: str) -> bool:
    try:
        with open(os.path.join(path, _OWNER_FILE)) as f:
            pid, start = f.read().split()
        return _process_start(int(pid)) == start
    except (OSError, ValueError):
        return False


def remove_stale_ipc_dirs(root: str = _IPC_ROOT) -> list[str]:
    """Removes the IPC folders of data-plane servers that died without closing (a killed
    engine cannot clean up after itself); returns them. A folder whose owner still runs, or
    another user's, is left alone."""
    removed = []
    try:
        entries = [e for e in os.scandir(root) if e.name.startswith(_IPC_PREFIX) and e.is_dir()]
    except OSError:
        return removed
    for entry in entries:
        try:
            info = entry.stat()
        except OSError:  # gone meanwhile
            continue
        if info.st_uid != os.getuid() or _owner_alive(entry.path):
            continue
        # No owner file: a server still setting up, unless the folder is old.
        if not os.path.exists(os.path.join(entry.path, _OWNER_FILE)) \
                and time.time() - info.st_mtime < 60:
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed


class DataPlaneServer:
    def __init__(self, host: str, node_id: str, label: str = "") -> None:
        remove_stale_ipc_dirs()
        self._ctx = zmq.Context()
        self._ipc_dir = make_ipc_dir(label)
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        ipc_pub, ipc_pull = (f"ipc://{self._ipc_dir}/{n}" for n in ("pub", "pull"))
        self._pub.bind(ipc_pub)
        self._pull.bind(ipc_pull)
        self.endpoints = Endpoints(
            node_id, f"tcp://{host}:{self._pub.bind_to_random_port(f'tcp://{host}')}",
            f"tcp://{host}:{self._pull.bind_to_random_port(f'tcp://{host}')}", ipc_pub, ipc_pull)
        self._to_worker, self._from_worker = WorkerChannelCodec(), EngineChannelCodec()

    def await_subscribers(self, n: int, timeout_s: float = 60.0) -> None:
        """XPUB reports each subscription; publishing before every rank joined would lose
        frames (ZMQ's slow-joiner problem)."""
        deadline = time.monotonic() + timeout_s
        joined = 0
        while joined < n:
            if not self._pub.poll(int(max(deadline - time.monotonic(), 0) * 1000)):
                raise DataPlaneTimeout(f"only {joined} of {n} ranks subscribed within "
                                       f"{timeout_s:.0f} s")
            if self._pub.recv()[:1] == b"\x01":
                joined += 1

    def broadcast(self, msg: ToWorker) -> None:
        self._pub.send(self._to_worker.encode(msg), copy=False)

    def recv(self, step_id: int, timeout_s: float) -> FromWorker | None:
        """The reply for `step_id`, or None if none came within timeout_s. Stale or malformed
        replies are dropped."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._pull.poll(int(remaining * 1000) or 1):
                return None
            frame = self._pull.recv(copy=False)
            try:
                reply = self._from_worker.decode(frame.buffer)
            except MalformedFrameError as e:
                log.error("dropped a reply frame: %s", e)
                continue
            if reply.step_id == step_id:
                return reply

    def close(self) -> None:
        self._pub.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)


class DataPlaneClient:
    def __init__(self, endpoints: Endpoints, node_id: str) -> None:
        pub_address, pull_address = endpoints.for_node(node_id)
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(pub_address)
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(pull_address)
        self._stop = threading.Event()

    def serve(self, handler: Callable[[ToWorker], FromWorker | None], rank: int) -> None:
        """Receive, handle, reply, until ShutdownWorker. A frame that does not decode is dropped
        with a logged error: every rank receives the same bytes, so all ranks drop it."""
        to_worker, from_worker = WorkerChannelCodec(), EngineChannelCodec()
        while not self._stop.is_set():
            frame = self._sub.recv(copy=False)
            try:
                msg = to_worker.decode(frame.buffer)
            except MalformedFrameError as e:
                log.error("rank %d: dropped a frame: %s", rank, e)
                continue
            reply = handler(msg)
            if reply is not None:  # rank 0's output, or any rank's WorkerError
                self._push.send(from_worker.encode(reply), copy=False)
            if isinstance(msg, ShutdownWorker):
                self._stop.set()
        self._sub.close(linger=0)
        self._push.close(linger=0)

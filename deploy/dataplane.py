"""The per-step data plane: one ZMQ XPUB broadcast to every rank, one PULL for replies.

The EngineCore side (`DataPlaneServer`) encodes each message once and publishes it; every rank
(`DataPlaneClient`) decodes it, runs its handler and pushes the handler's reply, if any, back.

Invariant 9, only the deployment's own processes use its data plane:
- Every socket runs ZMQ CURVE. The server's keypair and one keypair per rank are made per
  deployment (`DataPlaneServer`) and reach each rank as `RankKeys` through a Ray actor call,
  never argv, environment or a file. A ZAP handler in the engine admits the rank keys alone and
  names each connection's rank in its User-Id, so a reply is tied to the rank that sent it.
  CURVE runs on IPC too, though the 0700 folder already keeps other users out: it costs little
  per step, keeps other processes of the same user out, and gives IPC replies a sender.
- Every socket bounds its inbound frames (ZMQ_MAXMSGSIZE). libzmq applies that bound to the
  CURVE handshake too, so it is also what an unauthenticated peer can make a process buffer per
  connection: messages therefore travel in parts of at most _PART_BYTES (one part, nearly
  always), and the bound is a part's size. A message's total size is checked by its sender,
  and again by the engine on what it receives.
  Upstream traffic on the broadcast socket (subscriptions) is discarded at each broadcast, never
  left to accumulate.
- TCP binds to one address: the node's own, or loopback when every rank is on the engine's node.
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
from dataclasses import dataclass, field
from typing import Callable

import zmq
from zmq.utils import z85

from tierserve.scheduler.messages import (
    EngineChannelCodec, FromWorker, MalformedFrameError, ShutdownWorker, ToWorker,
    WorkerChannelCodec, WorkerError,
)

__all__ = ["DataPlaneServer", "DataPlaneClient", "DataPlaneTimeout", "Endpoints", "RankKeys",
           "DropCounter", "remove_stale_ipc_dirs", "remove_ipc_dirs", "MAX_TO_WORKER_BYTES",
           "MAX_FROM_WORKER_BYTES"]

log = logging.getLogger("tierserve.dataplane")


# A message travels in parts of at most this many bytes; ZMQ_MAXMSGSIZE is a part plus CURVE's
# framing (under 40 bytes).
_PART_BYTES = 256 << 10
_MAX_PART_FRAME = _PART_BYTES + 256
# Whole messages. Engine -> ranks: a step carries each new request's whole prompt once; this is
# far above any real step, and broadcast refuses more rather than lose a rank to it.
MAX_TO_WORKER_BYTES = 1 << 30
# Ranks -> engine: a reply is O(scheduled requests) (at most 21 logprobs each) or a flush's SSD
# entry list, a few MB at most.
MAX_FROM_WORKER_BYTES = 64 << 20
# Upstream on the broadcast socket: subscriptions, one byte plus an empty topic.
_MAX_SUBSCRIPTION_BYTES = 1024
# Complete replies queued at the engine; only rank 0 answers a step, once.
_REPLY_QUEUE = 64
# A peer that connects and never finishes the CURVE handshake is dropped after this long.
_HANDSHAKE_MS = 10_000
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # RFC 27: where libzmq asks for a verdict
_ZAP_DOMAIN = b"tierserve"


class DataPlaneTimeout(TimeoutError):
    pass


@dataclass(frozen=True)
class RankKeys:
    """One rank's CURVE credentials (z85): the engine's public key and the rank's keypair."""

    server_public: bytes
    public: bytes
    secret: bytes = field(repr=False)


class DropCounter:
    """Counts dropped frames; logs the first of a burst and then one line per interval with
    how many it held back, so a flood of bad frames cannot flood the log."""

    def __init__(self, interval_s: float = 5.0) -> None:
        self.count = 0
        self._interval_s = interval_s
        self._next_log = 0.0
        self._held_back = 0

    def drop(self, reason: str) -> None:
        self.count += 1
        now = time.monotonic()
        if now < self._next_log:
            self._held_back += 1
            return
        more = f" ({self._held_back} more dropped since the last report)" \
            if self._held_back else ""
        log.error("dropped a data-plane frame: %s%s", reason, more)
        self._held_back = 0
        self._next_log = now + self._interval_s


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


class _ZapHandler:
    """The engine's ZAP handler (RFC 27): admits a CURVE client whose public key is one of the
    deployment's ranks and names the rank in the connection's User-Id; refuses everyone else.
    Its socket is made and bound here, then used only by its thread; it exits when the context
    terminates."""

    def __init__(self, ctx: zmq.Context, ranks_by_key: dict[bytes, int]) -> None:
        self._ranks_by_key = ranks_by_key
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(_ZAP_ENDPOINT)
        self._thread = threading.Thread(target=self._serve, name="tierserve-zap", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            while True:
                self._sock.send_multipart(self.verdict(self._sock.recv_multipart()))
        except zmq.ContextTerminated:
            pass
        finally:
            self._sock.close(linger=0)

    def verdict(self, request: list[bytes]) -> list[bytes]:
        if len(request) < 6:
            return [b"1.0", request[1] if len(request) > 1 else b"", b"400", b"bad request",
                    b"", b""]
        version, request_id, _domain, _address, _identity, mechanism, *credentials = request
        rank = self._ranks_by_key.get(credentials[0]) if mechanism == b"CURVE" and credentials \
            else None
        if version != b"1.0" or rank is None:
            return [b"1.0", request_id, b"400", b"not a rank of this deployment", b"", b""]
        return [b"1.0", request_id, b"200", b"OK", str(rank).encode(), b""]


def _secure_server(sock: zmq.Socket, secret: bytes, max_bytes: int) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    sock.setsockopt(zmq.HANDSHAKE_IVL, _HANDSHAKE_MS)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    # Refuse every peer if the ZAP handler is missing, rather than admit any CURVE client.
    sock.setsockopt(zmq.ZAP_DOMAIN, _ZAP_DOMAIN)
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def _secure_client(sock: zmq.Socket, keys: RankKeys, max_bytes: int) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)


class DataPlaneServer:
    """host: the address TCP binds to (the node's own, or loopback when every rank is on this
    node). Makes the deployment's keys: `rank_keys(r)` is what rank r needs to connect."""

    def __init__(self, host: str, node_id: str, num_ranks: int, label: str = "") -> None:
        if not zmq.has("curve"):
            raise RuntimeError("pyzmq was built without CURVE (libsodium); the data plane "
                               "cannot be authenticated")
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        remove_stale_ipc_dirs()
        self._server_public, server_secret = zmq.curve_keypair()
        self._rank_keys = [zmq.curve_keypair() for _ in range(num_ranks)]
        self._ctx = zmq.Context()
        self._zap = _ZapHandler(self._ctx, {z85.decode(public): rank for rank, (public, _)
                                            in enumerate(self._rank_keys)})
        self._ipc_dir = make_ipc_dir(label)
        self._pub = self._ctx.socket(zmq.XPUB)
        _secure_server(self._pub, server_secret, _MAX_SUBSCRIPTION_BYTES)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._pull = self._ctx.socket(zmq.PULL)
        _secure_server(self._pull, server_secret, _MAX_PART_FRAME)
        self._pull.setsockopt(zmq.RCVHWM, _REPLY_QUEUE)
        ipc_pub, ipc_pull = (f"ipc://{self._ipc_dir}/{n}" for n in ("pub", "pull"))
        self._pub.bind(ipc_pub)
        self._pull.bind(ipc_pull)
        self.endpoints = Endpoints(
            node_id, f"tcp://{host}:{self._pub.bind_to_random_port(f'tcp://{host}')}",
            f"tcp://{host}:{self._pull.bind_to_random_port(f'tcp://{host}')}", ipc_pub, ipc_pull)
        self._to_worker, self._from_worker = WorkerChannelCodec(), EngineChannelCodec()
        self.drops = DropCounter()

    def rank_keys(self, rank: int) -> RankKeys:
        public, secret = self._rank_keys[rank]
        return RankKeys(self._server_public, public, secret)

    def await_subscribers(self, n: int, timeout_s: float = 60.0) -> None:
        """XPUB reports each subscription; publishing before every rank joined would lose
        frames (ZMQ's slow-joiner problem). Only admitted ranks can subscribe."""
        deadline = time.monotonic() + timeout_s
        joined = 0
        while joined < n:
            if not self._pub.poll(int(max(deadline - time.monotonic(), 0) * 1000)):
                raise DataPlaneTimeout(f"only {joined} of {n} ranks subscribed within "
                                       f"{timeout_s:.0f} s")
            if self._pub.recv()[:1] == b"\x01":
                joined += 1

    def broadcast(self, msg: ToWorker) -> None:
        self._discard_upstream()
        frame = self._to_worker.encode(msg)
        if len(frame) > MAX_TO_WORKER_BYTES:
            raise ValueError(f"a {type(msg).__name__} of {len(frame)} bytes exceeds the "
                             f"data plane's {MAX_TO_WORKER_BYTES}-byte frame limit")
        _send_parts(self._pub, frame)

    def _discard_upstream(self) -> None:
        """XPUB queues what subscribers send (re-subscriptions after a reconnect, or an
        unsubscription when a rank dies) until read; nothing reads it after start."""
        while self._pub.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._pub.recv(zmq.NOBLOCK)

    def recv(self, timeout_s: float) -> tuple[FromWorker, int] | None:
        """The next reply that decodes and its sender's rank, or None if none came within
        timeout_s (0: what has already come). A frame without a rank's User-Id or that does
        not decode is dropped."""
        deadline = time.monotonic() + timeout_s
        looked = False
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 and looked:
                return None
            looked = True
            if not self._pull.poll(max(int(remaining * 1000), 1) if remaining > 0 else 0):
                return None
            parts = self._pull.recv_multipart(copy=False)
            sender = _sender_rank(parts[0])
            if sender is None:
                self.drops.drop("a reply without a rank's authenticated User-Id")
                continue
            size = sum(len(p.buffer) for p in parts)
            if size > MAX_FROM_WORKER_BYTES:
                self.drops.drop(f"rank {sender}: a reply of {size} bytes")
                continue
            try:
                return self._from_worker.decode(_joined(parts)), sender
            except MalformedFrameError as e:
                self.drops.drop(f"rank {sender}: {e}")

    def close(self) -> None:
        self._pub.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()  # ends the ZAP handler's thread, which closes its socket
        shutil.rmtree(self._ipc_dir, ignore_errors=True)


def _send_parts(sock: zmq.Socket, frame: bytes) -> None:
    if len(frame) <= _PART_BYTES:
        sock.send(frame, copy=False)
        return
    view = memoryview(frame)
    sock.send_multipart([view[i:i + _PART_BYTES] for i in range(0, len(frame), _PART_BYTES)],
                        copy=False)


def _joined(parts: list[zmq.Frame]) -> memoryview | bytes:
    return parts[0].buffer if len(parts) == 1 else b"".join(p.buffer for p in parts)


def _sender_rank(frame: zmq.Frame) -> int | None:
    """The rank the ZAP handler named for the frame's connection; None without one."""
    try:
        user = frame.get("User-Id")
    except zmq.ZMQError:  # no such property: the connection was not admitted by ZAP
        return None
    return int(user) if isinstance(user, str) and user.isdigit() else None


class DataPlaneClient:
    def __init__(self, endpoints: Endpoints, node_id: str, keys: RankKeys) -> None:
        pub_address, pull_address = endpoints.for_node(node_id)
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        _secure_client(self._sub, keys, _MAX_PART_FRAME)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(pub_address)
        self._push = self._ctx.socket(zmq.PUSH)
        _secure_client(self._push, keys, _MAX_SUBSCRIPTION_BYTES)  # nothing comes back on it
        self._push.connect(pull_address)
        self._stop = threading.Event()

    def serve(self, handler: Callable[[ToWorker], FromWorker | None], rank: int) -> None:
        """Receive, handle, reply, until ShutdownWorker. A frame that does not decode is dropped
        with a logged error: every rank receives the same bytes, so all ranks drop it."""
        to_worker, from_worker = WorkerChannelCodec(), EngineChannelCodec()
        while not self._stop.is_set():
            parts = self._sub.recv_multipart(copy=False)
            try:
                msg = to_worker.decode(_joined(parts))
            except MalformedFrameError as e:
                log.error("rank %d: dropped a frame: %s", rank, e)
                continue
            reply = handler(msg)
            if reply is not None:  # rank 0's output, or any rank's WorkerError
                _send_parts(self._push, _bounded(from_worker, reply, rank))
            if isinstance(msg, ShutdownWorker):
                self._stop.set()
        self._sub.close(linger=0)
        self._push.close(linger=0)
        self._ctx.term()


def _bounded(codec: EngineChannelCodec, reply: FromWorker, rank: int) -> bytes:
    """The encoded reply, or a WorkerError in its place if the engine would refuse its size
    (the engine would drop it and the step would time out instead)."""
    frame = codec.encode(reply)
    if len(frame) <= MAX_FROM_WORKER_BYTES:
        return frame
    return codec.encode(WorkerError(reply.step_id, rank, f"a reply of {len(frame)} bytes "
                                    f"exceeds the {MAX_FROM_WORKER_BYTES}-byte frame limit"))

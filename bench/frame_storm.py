"""Hostile frames against a deployment's data plane, from a process without its keys.

bench/soak.py runs `storm` in a child process (spawned: it inherits no Ray connection and no
key; it knows the endpoints, which are no secret, and the last step id the engine broadcast,
which is more than a real attacker would know); `python bench/frame_storm.py --endpoints JSON`
runs it alone. Frame i takes one (endpoint, channel, kind)
combination in turn, so every endpoint (XPUB broadcast and reply PULL, TCP and IPC) gets every
kind through every channel.

Channels, how a frame reaches the endpoint:
  raw         a fresh TCP / Unix connection, the frame's bytes written as they are
  zmtp-null   a fresh connection speaking ZMTP 3 with the NULL mechanism: greeting, READY, the
              frame as a message
  zmtp-curve  a fresh connection announcing CURVE, the frame where the HELLO command belongs
  zmq-plain   a pyzmq socket without CURVE (PUSH to the reply socket, XSUB to the broadcast)
  zmq-curve   the same with a keypair of its own and a made-up server key
Kinds, what the frame is: garbage bytes, truncated msgpack (an encoded reply cut short),
msgpack of the wrong types (a reply's tag with a string step id), oversized (1 MiB, over
every socket's ZMQ_MAXMSGSIZE; on raw channels announced as 64 MiB), a pickle that would create
a marker file if anything unpickled it, and forged replies encoded with the project's codec:
a ModelRunnerOutput and a WorkerError (rank 0) for the last step id broadcast or the next.

A frame counts as sent once the attacker's socket took it: a raw connection the endpoint
accepted and the frame written to it (or cut off by the endpoint hanging up mid-frame, which is
the endpoint refusing it), or a zmq send that returned. Passive subscribers (no key, and a
self-made keypair) sit on both broadcast endpoints throughout; `frames_read` counts what they
received.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import socket
import tempfile
import time
from typing import Callable

import msgspec
import zmq

from tierserve.scheduler.messages import EngineChannelCodec, ModelRunnerOutput, WorkerError

ENDPOINTS = ("tcp_pub", "tcp_pull", "ipc_pub", "ipc_pull")
CHANNELS = ("raw", "zmtp-null", "zmtp-curve", "zmq-plain", "zmq-curve")
KINDS = ("garbage", "truncated", "wrong-types", "oversized", "pickle", "forged-output",
         "forged-error")
COMBOS = [(e, c, k) for e in ENDPOINTS for c in CHANNELS for k in KINDS]

_OVERSIZED = 1 << 20
_ANNOUNCED = 64 << 20
# A zmq socket is replaced after this many frames: its queue never leaves the process (the
# handshake fails), and a new socket is a new handshake attempt.
_ZMQ_REUSE = 50


class _Marker:
    """Unpickling this creates `path`: proof that something unpickled a frame."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def payload(kind: str, step_id: int, rng: random.Random, marker: str) -> bytes:
    codec = EngineChannelCodec()
    step = step_id + rng.randrange(2)  # the step waiting, or the next one
    if kind == "garbage":
        return rng.randbytes(rng.randrange(1, 4096))
    if kind == "truncated":
        whole = codec.encode(ModelRunnerOutput(step, [rng.randrange(384)] * 8))
        return whole[:rng.randrange(1, len(whole))]
    if kind == "wrong-types":
        return msgspec.msgpack.encode([11, str(step), ["not", "tokens"], {"x": 1}])
    if kind == "oversized":
        return rng.randbytes(_OVERSIZED)
    if kind == "pickle":
        return pickle.dumps(_Marker(marker))
    if kind == "forged-output":
        n = rng.randrange(1, 5)
        return codec.encode(ModelRunnerOutput(step, [rng.randrange(384) for _ in range(n)],
                                              req_ids_digest=rng.randbytes(8)))
    assert kind == "forged-error", kind
    return codec.encode(WorkerError(step, 0, "forged: a rank failed"))


# ---------------------------------------------------------------- raw connections


def _connect(address: str) -> socket.socket:
    if address.startswith("tcp://"):
        host, port = address[6:].rsplit(":", 1)
        return socket.create_connection((host, int(port)), timeout=2)
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(2)
    s.connect(address[6:])
    return s


def _greeting(mechanism: bytes) -> bytes:
    return b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + mechanism.ljust(20, b"\0") + bytes(32)


def _frame(body: bytes, command: bool, announced: int | None = None) -> bytes:
    """A ZMTP 3 frame header and body; `announced` claims a larger size than the body."""
    size = len(body) if announced is None else announced
    flags = 0x04 if command else 0x00
    if size < 256:
        return bytes([flags, size]) + body
    return bytes([flags | 0x02]) + size.to_bytes(8, "big") + body


def _ready(socket_type: bytes) -> bytes:
    prop = b"\x0bSocket-Type" + len(socket_type).to_bytes(4, "big") + socket_type
    return _frame(b"\x05READY" + prop, command=True)


def raw_bytes(channel: str, endpoint: str, kind: str, body: bytes) -> bytes:
    announced = _ANNOUNCED if kind == "oversized" else None
    if channel == "raw":
        return body
    if channel == "zmtp-null":
        kind_of_socket = b"PUSH" if endpoint.endswith("pull") else b"XSUB"
        return _greeting(b"NULL") + _ready(kind_of_socket) + _frame(body, False, announced)
    return _greeting(b"CURVE") + _frame(body, True, announced)


def send_raw(address: str, data: bytes) -> bool:
    """True once the endpoint accepted the connection and the bytes were written or the
    endpoint hung up while they were; False if it refused the connection itself."""
    try:
        s = _connect(address)
    except OSError:
        return False
    with s:
        try:
            s.sendall(data)
        except OSError:  # reset, broken pipe or timeout: the endpoint refused the frame
            pass
    return True


# ---------------------------------------------------------------- zmq sockets


class ZmqAttacker:
    """pyzmq sockets per (endpoint, channel): without CURVE, or CURVE with a keypair of its
    own and a made-up server key; each replaced after _ZMQ_REUSE frames."""

    def __init__(self, addresses: dict[str, str]) -> None:
        self.ctx = zmq.Context()
        self.addresses = addresses
        self._socks: dict[tuple[str, str], tuple[zmq.Socket, int]] = {}

    def _socket(self, endpoint: str, channel: str, fresh: bool = False) -> zmq.Socket:
        sock, used = self._socks.get((endpoint, channel), (None, 0))
        if sock is not None and used < _ZMQ_REUSE and not fresh:
            self._socks[(endpoint, channel)] = (sock, used + 1)
            return sock
        if sock is not None:
            sock.close(linger=0)
        sock = self.ctx.socket(zmq.PUSH if endpoint.endswith("pull") else zmq.XSUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)  # bounded by _ZMQ_REUSE instead
        if channel == "zmq-curve":
            _curve_client(sock)
        sock.connect(self.addresses[endpoint])
        self._socks[(endpoint, channel)] = (sock, 1)
        return sock

    def send(self, endpoint: str, channel: str, body: bytes) -> bool:
        """A PUSH socket whose handshake was refused has no pipe to queue on until it
        reconnects: a fresh socket has one from its connect."""
        for fresh in (False, True):
            try:
                self._socket(endpoint, channel, fresh).send(body, zmq.NOBLOCK)
                return True
            except zmq.Again:
                continue
        return False

    def close(self) -> None:
        for sock, _ in self._socks.values():
            sock.close(linger=0)
        self.ctx.term()


def _curve_client(sock: zmq.Socket) -> None:
    made_up_server, _ = zmq.curve_keypair()
    public, secret = zmq.curve_keypair()
    sock.setsockopt(zmq.CURVE_SERVERKEY, made_up_server)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)


class Listeners:
    """Passive subscribers on every broadcast endpoint: no key, and a self-made keypair."""

    def __init__(self, ctx: zmq.Context, addresses: dict[str, str]) -> None:
        self.socks = []
        for endpoint in ("tcp_pub", "ipc_pub"):
            for keyed in (False, True):
                sock = ctx.socket(zmq.SUB)
                sock.setsockopt(zmq.LINGER, 0)
                if keyed:
                    _curve_client(sock)
                sock.setsockopt(zmq.SUBSCRIBE, b"")
                sock.connect(addresses[endpoint])
                self.socks.append(sock)

    def frames_read(self) -> int:
        n = 0
        for sock in self.socks:
            while sock.poll(0):
                sock.recv()
                n += 1
        return n

    def close(self) -> None:
        for sock in self.socks:
            sock.close(linger=0)


# ---------------------------------------------------------------- the storm


def storm(addresses: dict[str, str], num_frames: int, seconds: float, rounds: int,
          step_id: Callable[[], int], marker: str,
          on_round: Callable[[int, int], None] | None = None, seed: int = 0) -> dict:
    """Sends num_frames hostile frames over `seconds`, in `rounds` equal rounds, calling
    on_round(frames sent so far, broadcast frames read so far) after each. step_id() gives
    the last step id broadcast."""
    rng = random.Random(seed)
    zmq_attacker = ZmqAttacker(addresses)
    listeners = Listeners(zmq_attacker.ctx, addresses)
    sent = refused = read = 0
    interval = seconds / max(num_frames, 1)
    per_round = -(-num_frames // max(rounds, 1))
    try:
        for i in range(num_frames):
            t0 = time.monotonic()
            endpoint, channel, kind = COMBOS[i % len(COMBOS)]
            body = payload(kind, step_id(), rng, marker)
            if channel.startswith("zmq"):
                ok = zmq_attacker.send(endpoint, channel, body)
            else:
                ok = send_raw(addresses[endpoint], raw_bytes(channel, endpoint, kind, body))
            sent += ok
            refused += not ok
            if on_round is not None and ((i + 1) % per_round == 0 or i + 1 == num_frames):
                read += listeners.frames_read()
                on_round(sent, read)
            time.sleep(max(0.0, interval - (time.monotonic() - t0)))
        read += listeners.frames_read()
    finally:
        listeners.close()
        zmq_attacker.close()
    return {"sent": sent, "read": read, "refused": refused}


def storm_child(addresses: dict[str, str], num_frames: int, seconds: float, rounds: int,
                step_value, marker: str, reports, seed: int = 0) -> None:
    """storm() in a child process of the soak: the step id from a shared value, each round
    reported on `reports` (the soak checks the deployment meanwhile, while frames keep
    coming); ends with ("done", the totals)."""
    totals = None
    try:
        totals = storm(addresses, num_frames, seconds, rounds, lambda: step_value.value,
                       marker, lambda sent, read: reports.put(("round", sent, read)), seed)
    finally:
        reports.put(("done", totals))


def marker_path() -> str:
    return os.path.join(tempfile.gettempdir(), f"tierserve-storm-pickle-{os.getpid()}")


def main() -> None:
    ap = argparse.ArgumentParser(description="send hostile frames to a tierserve data plane "
                                 "(endpoints from the engine actor's dataplane() call)")
    ap.add_argument("--endpoints", required=True, help="JSON: tcp_pub, tcp_pull, ipc_pub, "
                    "ipc_pull addresses")
    ap.add_argument("--frames", type=int, default=len(COMBOS))
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--step-id", type=int, default=0, help="the step id forged replies name")
    ap.add_argument("--marker", default=None, help="the file a loaded pickle would create")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(json.dumps({"started": True}), flush=True)  # for a caller that waits for the storm
    result = storm(json.loads(args.endpoints), args.frames, args.seconds, 1,
                   lambda: args.step_id, args.marker or marker_path(), seed=args.seed)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""Invariant 9 against hostile local processes: only the deployment's own ranks can use its data
plane, frames are bounded, replies that do not answer the step are dropped, and nothing listens
on every interface.

The hostile peers are real sockets of this process (same user as the engine, so the 0700 IPC
folder does not stop them: CURVE must): ZMQ sockets with no key, a made-up key, or the engine's
public key with a key of their own; raw TCP / Unix sockets that speak ZMTP's greeting and then
announce a 50 MB frame.
"""
from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import zmq

from tests.checkpoints import make_tiny_llama
from tierserve import LLM, SamplingParams
from tierserve.deploy.dataplane import (
    MAX_FROM_WORKER_BYTES, DataPlaneClient, DataPlaneServer, RankKeys,
)
from tierserve.deploy.ray_executor import RayExecutor
from tierserve.deploy.reply_check import reply_problem
from tierserve.runtime.executor import EngineDeadError
from tierserve.scheduler.messages import (
    CachedRequestData, CopyKind, EngineChannelCodec, FlushTiers, ModelRunnerOutput,
    NewRequestData, SampleLogprobs, SchedulerOutput, ShutdownWorker, TierCopyBatch, WorkerError,
    req_ids_digest,
)
from tierserve.scheduler.params import SamplingParams as Params

VOCAB = 384
SECRET_PROMPT = [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 122, 133]
FORGED_TOKEN = 383


# ---------------------------------------------------------------- reply validation (pure)


def _step(step_id: int = 7) -> SchedulerOutput:
    cached = CachedRequestData()
    cached.add("b", [5], [])
    return SchedulerOutput(step_id, [NewRequestData("a", [1, 2, 3], Params(), [0])], cached,
                           num_scheduled_tokens=[3, 1])


def _flush(kind: CopyKind, sources: list[int]) -> TierCopyBatch:
    return TierCopyBatch(kind, sources, hashes=[b"h" * 16] * len(sources),
                         keys=[b""] * len(sources))


def _answer(out: SchedulerOutput, tokens=(9, 10), **fields) -> ModelRunnerOutput:
    return ModelRunnerOutput(out.step_id, list(tokens),
                             req_ids_digest=req_ids_digest(out.scheduled_req_ids()), **fields)


def test_reply_check_accepts_the_answer_and_an_authenticated_ranks_own_error():
    out = _step()
    assert reply_problem(_answer(out), 0, out, VOCAB, 3) is None
    assert reply_problem(_answer(out, (-1, 10)), 0, out, VOCAB, 3) is None  # partial prefill
    lp = [SampleLogprobs([9, 4], [-0.1, -2.0]), None]
    assert reply_problem(_answer(out, logprobs=lp, tier_done=[3, -1], tier_failed=[4, 5]), 0,
                         out, VOCAB, 3) is None
    assert reply_problem(WorkerError(7, 2, "oom"), 2, out, VOCAB, 3) is None
    flush = FlushTiers(8, [_flush(CopyKind.DEVICE_TO_SSD, [4, 5]), _flush(CopyKind.CPU_TO_SSD,
                                                                           [9])])
    assert reply_problem(ModelRunnerOutput(8, flushed_blocks=3), 0, flush, VOCAB, 3) is None


_BAD = {
    "an earlier step": (lambda out: ModelRunnerOutput(6, [9, 10]), 0, "answers step 6"),
    "another rank's error": (lambda out: WorkerError(7, 0, "forged"), 1,
                             "an error of rank 0 sent by rank 1"),
    "an unknown rank": (lambda out: WorkerError(7, 5, "x"), 5, "not one of the 3 ranks"),
    "a negative rank": (lambda out: WorkerError(7, 0, "x"), -1, "not one of the 3 ranks"),
    "output from rank 1": (lambda out: _answer(out), 1, "only rank 0 answers"),
    "too few tokens": (lambda out: _answer(out, [9]), 0, "1 sampled tokens for 2"),
    "too many tokens": (lambda out: _answer(out, [9, 10, 11]), 0, "3 sampled tokens for 2"),
    "a token past the vocab": (lambda out: _answer(out, [9, VOCAB]), 0, "outside [-1, 384)"),
    "a token below -1": (lambda out: _answer(out, [-2, 9]), 0, "outside [-1, 384)"),
    "other request ids": (lambda out: ModelRunnerOutput(7, [9, 10], req_ids_digest=
                                                        req_ids_digest(["b", "a"])), 0,
                          "request ids are not the step's"),
    "a logprob past the vocab": (lambda out: _answer(out, logprobs=[SampleLogprobs(
        [9, 999], [-0.1, -2.0]), None]), 0, "logprob entry"),
    "misaligned logprobs": (lambda out: _answer(out, logprobs=[None]), 0,
                            "1 logprob entries for 2"),
    "a synchronous copy kind": (lambda out: _answer(out, tier_failed=[1, 1]), 0,
                                "tier_failed"),
    "an unknown copy kind": (lambda out: _answer(out, tier_failed=[9, 1]), 0, "tier_failed"),
    "half a copy pair": (lambda out: _answer(out, tier_failed=[1]), 0, "tier_failed"),
    "three copy kinds": (lambda out: _answer(out, tier_done=[1, 2, 3]), 0, "tier_done"),
    "flushed blocks": (lambda out: _answer(out, flushed_blocks=1), 0,
                       "flushed SSD blocks in the answer to a step"),
}


@pytest.mark.parametrize("case", list(_BAD))
def test_reply_check_rejects_what_does_not_answer_the_step(case):
    make, sender, reason = _BAD[case]
    out = _step()
    assert reason in reply_problem(make(out), sender, out, VOCAB, 3)


def test_reply_check_rejects_a_flush_answer_for_more_blocks_than_it_asked():
    flush = FlushTiers(8, [_flush(CopyKind.DEVICE_TO_SSD, [4])])
    assert "the flush asked for" in reply_problem(ModelRunnerOutput(8, flushed_blocks=2), 0,
                                                  flush, VOCAB, 3)
    assert "to a flush" in reply_problem(ModelRunnerOutput(8, [1]), 0, flush, VOCAB, 3)


# ---------------------------------------------------------------- hostile ZMQ peers


def _secret_step(step_id: int) -> SchedulerOutput:
    return SchedulerOutput(step_id, [NewRequestData("victim", SECRET_PROMPT, Params(), [0, 1])],
                           num_scheduled_tokens=[len(SECRET_PROMPT)])


class _Hostile:
    """Sockets of a process outside the deployment. keys: None (no CURVE), or (server public,
    own public, own secret)."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.socks: list[zmq.Socket] = []

    def socket(self, kind: int, address: str, keys: tuple[bytes, bytes, bytes] | None):
        s = self.ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            s.setsockopt(zmq.CURVE_SERVERKEY, keys[0])
            s.setsockopt(zmq.CURVE_PUBLICKEY, keys[1])
            s.setsockopt(zmq.CURVE_SECRETKEY, keys[2])
        if kind == zmq.SUB:
            s.setsockopt(zmq.SUBSCRIBE, b"")
        s.connect(address)
        self.socks.append(s)
        return s

    def close(self) -> None:
        for s in self.socks:
            s.close(linger=0)
        self.ctx.term()


def _try_send(sock: zmq.Socket, frame: bytes) -> None:
    """Queues frame if the socket has a peer to queue it for (it has none without a
    handshake, and then the frame goes nowhere)."""
    try:
        sock.send(frame, zmq.NOBLOCK)
    except zmq.Again:
        pass


def _identities(server_public: bytes, rank_public: bytes) -> dict:
    """Who an attacker can be: no key; made-up keys; the engine's real public key with a
    keypair of its own; a rank's public key (public keys are no secret) without its secret."""
    made_up_server, _ = zmq.curve_keypair()
    own_public, own_secret = zmq.curve_keypair()
    _, other_secret = zmq.curve_keypair()
    return {"no key": None, "made-up keys": (made_up_server, own_public, own_secret),
            "own keypair": (server_public, own_public, own_secret),
            "a rank's public key": (server_public, rank_public, other_secret)}


def _serve_ranks(server: DataPlaneServer, nodes: list[str]):
    def handler(rank):
        def handle(msg):
            if rank == 0 and isinstance(msg, SchedulerOutput):
                return ModelRunnerOutput(msg.step_id, [1] * len(msg.num_scheduled_tokens),
                                         req_ids_digest=req_ids_digest(msg.scheduled_req_ids()))
            return None
        return handle

    threads = []
    for rank, node in enumerate(nodes):
        client = DataPlaneClient(server.endpoints, node, server.rank_keys(rank))
        t = threading.Thread(target=client.serve, args=(handler(rank), rank), daemon=True)
        t.start()
        threads.append(t)
    server.await_subscribers(len(nodes), timeout_s=10)
    return threads


def test_peers_without_the_keys_read_nothing_and_push_nothing():
    # rank 0 over IPC, rank 1 over TCP: both kinds of endpoint are live
    server = DataPlaneServer("127.0.0.1", "engine-node", 2)
    threads = _serve_ranks(server, ["engine-node", "other-node"])
    ep = server.endpoints
    hostile = _Hostile()
    try:
        subs, pushes = [], []
        for who, keys in _identities(server.rank_keys(0).server_public,
                                     server.rank_keys(0).public).items():
            for address in (ep.tcp_pub, ep.ipc_pub):
                subs.append((who, address, hostile.socket(zmq.SUB, address, keys)))
            for address in (ep.tcp_pull, ep.ipc_pull):
                pushes.append(hostile.socket(zmq.PUSH, address, keys))
        codec = EngineChannelCodec()
        time.sleep(0.5)  # time to connect, had they the keys
        for step in range(3):
            for push in pushes:  # forged answers and a forged error, before the real one
                for forged in (ModelRunnerOutput(step, [FORGED_TOKEN]),
                               WorkerError(step, 0, "forged")):
                    _try_send(push, codec.encode(forged))
            server.broadcast(_secret_step(step))
            reply, sender = server.recv(timeout_s=5)
            assert sender == 0 and reply.step_id == step and reply.sampled_token_ids == [1]
        assert server.recv(timeout_s=0.5) is None  # no forged frame was queued behind it
        for who, address, sub in subs:
            assert not sub.poll(200), f"{who} read the broadcast on {address}"
        assert server.drops.count == 0  # refused at the handshake, before any frame
    finally:
        hostile.close()
        server.broadcast(ShutdownWorker())
        for t in threads:
            t.join(5)
        server.close()


def test_an_authenticated_rank_cannot_answer_for_another_and_its_own_error_is_fatal(
        monkeypatch):
    """A rank's key names the rank: rank 1 (authenticated) forging rank 0's output or error is
    dropped and counted; rank 0's real answer is applied; rank 1's own error fails the step."""
    server = DataPlaneServer("127.0.0.1", "engine-node", 2)
    rank0_may_answer = threading.Event()

    def rank0(msg):  # answers step 0 only: step 1 is rank 1's to fail
        if isinstance(msg, SchedulerOutput) and msg.step_id == 0:
            rank0_may_answer.wait(5)
            return ModelRunnerOutput(msg.step_id, [42], req_ids_digest=req_ids_digest(
                msg.scheduled_req_ids()))
        return None

    client = DataPlaneClient(server.endpoints, "engine-node", server.rank_keys(0))
    loop = threading.Thread(target=client.serve, args=(rank0, 0), daemon=True)
    loop.start()
    keys = server.rank_keys(1)
    hostile = _Hostile()
    rank1 = hostile.socket(zmq.PUSH, server.endpoints.tcp_pull,
                           (keys.server_public, keys.public, keys.secret))
    executor = RayExecutor(None, None, [0, 1], 5.0, "t")
    executor._plane, executor.workers, executor._vocab_size = server, [None, None], VOCAB
    monkeypatch.setattr(executor, "_check_alive", lambda: None)
    try:
        server.await_subscribers(1, timeout_s=10)
        codec = EngineChannelCodec()
        step = _secret_step(0)
        answer = threading.Thread(target=lambda: setattr(executor, "got", executor.execute(step)))
        answer.start()
        for forged in (ModelRunnerOutput(0, [FORGED_TOKEN], req_ids_digest=req_ids_digest(
                ["victim"])), WorkerError(0, 0, "forged by rank 1")):
            rank1.send(codec.encode(forged))
        deadline = time.monotonic() + 5
        while executor.stats()["dropped_frames"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        rank0_may_answer.set()
        answer.join(10)
        assert executor.got.sampled_token_ids == [42]
        assert executor.stats() == {"dropped_frames": 2}
        rank1.send(codec.encode(WorkerError(1, 1, "rank 1 ran out of memory")))
        with pytest.raises(EngineDeadError, match="rank 1 failed step 1: rank 1 ran out"):
            executor.execute(_secret_step(1))
    finally:
        hostile.close()
        rank0_may_answer.set()
        server.broadcast(ShutdownWorker())
        loop.join(5)
        server.close()


def _zmtp_flood(address: str, frame_bytes: int = 50 << 20) -> int:
    """Speaks ZMTP 3's greeting (CURVE, as a client), then announces a frame of frame_bytes and
    streams it; returns how many of those bytes the peer took before it hung up."""
    if address.startswith("tcp://"):
        host, port = address[6:].rsplit(":", 1)
        s = socket.create_connection((host, int(port)), timeout=5)
    else:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(5)
        s.connect(address[6:])
    greeting = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"CURVE".ljust(20, b"\0") + bytes(32)
    sent, chunk = 0, bytes(1 << 20)
    with s:
        try:
            s.sendall(greeting + b"\x06" + frame_bytes.to_bytes(8, "big"))
            while sent < frame_bytes:
                s.sendall(chunk)
                sent += len(chunk)
        except OSError:  # reset or timed out: the peer refused the frame
            pass
    return sent


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_oversized_frames_are_refused_with_memory_bounded():
    server = DataPlaneServer("127.0.0.1", "engine-node", 1)
    threads = _serve_ranks(server, ["engine-node"])
    ep = server.endpoints
    try:
        before = _rss_bytes(os.getpid())
        accepted = [_zmtp_flood(a) for _ in range(3) for a in (ep.tcp_pub, ep.tcp_pull,
                                                                ep.ipc_pub, ep.ipc_pull)]
        # Even rank 0, authenticated, cannot get a frame over the limit in.
        keys = server.rank_keys(0)
        hostile = _Hostile()
        rank0 = hostile.socket(zmq.PUSH, ep.tcp_pull, (keys.server_public, keys.public,
                                                        keys.secret))
        rank0.send(bytes(MAX_FROM_WORKER_BYTES + 1))
        assert server.recv(timeout_s=1.0) is None
        hostile.close()
        grown = _rss_bytes(os.getpid()) - before
        print(f"bytes taken of each 50 MB frame: {accepted}; RSS grew {grown >> 20} MB")
        assert all(n < 50 << 20 for n in accepted), accepted
        assert grown < 40 << 20, f"memory grew {grown >> 20} MB"
        server.broadcast(_secret_step(0))  # the plane still serves its rank
        reply, sender = server.recv(timeout_s=5)
        assert (reply.step_id, sender) == (0, 0)
    finally:
        server.broadcast(ShutdownWorker())
        for t in threads:
            t.join(5)
        server.close()


def test_messages_larger_than_a_part_travel_in_parts_both_ways():
    server = DataPlaneServer("127.0.0.1", "engine-node", 2)
    big_prompt = list(range(VOCAB)) * 1000  # about 0.5 MB on the wire

    def handle(msg):
        if isinstance(msg, SchedulerOutput):
            n = len(msg.scheduled_new_reqs[0].prompt_token_ids)
            return ModelRunnerOutput(msg.step_id, [n], tier_failed=list(range(300_000)))
        return None

    clients = [DataPlaneClient(server.endpoints, node, server.rank_keys(r))
               for r, node in enumerate(["engine-node", "other-node"])]
    loops = [threading.Thread(target=c.serve, args=(handle if r == 0 else lambda m: None, r),
                              daemon=True) for r, c in enumerate(clients)]
    for t in loops:
        t.start()
    try:
        server.await_subscribers(2, timeout_s=10)
        server.broadcast(SchedulerOutput(0, [NewRequestData("big", big_prompt, Params(), [0])],
                                         num_scheduled_tokens=[1]))
        reply, sender = server.recv(timeout_s=10)
        assert sender == 0 and reply.sampled_token_ids == [len(big_prompt)]
        assert reply.tier_failed == list(range(300_000))
    finally:
        server.broadcast(ShutdownWorker())
        for t in loops:
            t.join(5)
        server.close()


def test_the_keys_never_show_in_a_repr():
    keys = RankKeys(b"S" * 40, b"P" * 40, b"x" * 40)
    assert b"x" * 40 not in repr(keys).encode() and "xxxx" not in repr(keys)


# ---------------------------------------------------------------- a TP=3 deployment on Ray


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _hex_ip(h: str) -> str:
    raw = bytes.fromhex(h)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    return socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))


def tcp_listeners(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket process pid listens on, read from /proc."""
    inodes, found = _socket_inodes(pid), set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    address, port = fields[1].split(":")
                    found.add((_hex_ip(address), int(port, 16)))
    return found


def unix_listeners(pid: int) -> set[str]:
    inodes, found = _socket_inodes(pid), set()
    with open("/proc/net/unix") as f:
        for line in list(f)[1:]:
            fields = line.split()
            if len(fields) >= 8 and fields[6] in inodes and fields[5] == "01":  # listening
                found.add(fields[7])
    return found


def _actor_process(handle) -> tuple[int, int]:
    """(pid, port of Ray's own core-worker gRPC server) of an actor, from Ray's actor table."""
    import ray._private.state
    entry = ray._private.state.actors()[handle._actor_id.hex()]
    return entry["Pid"], entry["Address"]["Port"]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, ray_session):
    import ray
    path = str(make_tiny_llama(tmp_path_factory.mktemp("sec") / "llama6", hidden_size=96,
                               num_heads=6, num_kv_heads=3, num_layers=2, seed=5))
    llm = LLM(path, tensor_parallel_size=3, block_size=4)
    try:
        engine = llm.engine.actor
        workers = [ray.get_actor(n) for n in llm.engine.info()["worker_names"]]
        yield llm, _actor_process(engine), [_actor_process(w) for w in workers]
    finally:
        llm.shutdown()


LONG = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)


def _tokens(llm) -> list[int]:
    out = llm.generate([SECRET_PROMPT], LONG, use_tqdm=False)[0]
    assert out.error is None, out.error
    return out.outputs[0].token_ids


def test_nothing_listens_on_every_interface(deployment):
    """The engine's data plane, rank 0's torch.distributed store and gloo's sockets listen on
    loopback (every rank is on this node). Ray's own core-worker gRPC server is Ray's, not the
    deployment's, and is left out."""
    _, (engine_pid, engine_ray_port), workers = deployment
    ours = {}
    for name, (pid, ray_port) in [("engine", (engine_pid, engine_ray_port))] + [
            (f"rank {r}", w) for r, w in enumerate(workers)]:
        ours[name] = {(a, p) for a, p in tcp_listeners(pid) if p != ray_port}
    assert len(ours["engine"]) == 2, ours  # XPUB and PULL
    assert ours["rank 0"], ours  # the store, at least
    for name, listeners in ours.items():
        for address, port in listeners:
            assert address == "127.0.0.1", f"{name} listens on {address}:{port}"


def test_hostile_local_processes_read_nothing_and_change_nothing(deployment):
    """The issue's attacks on every data-plane socket (TCP and IPC), during a long stream: a
    passive subscriber, forged outputs and forged errors for every step id, 50 MB frames. The
    victim's tokens equal a clean run's, the engine's memory stays put, nothing was read."""
    llm, (engine_pid, ray_port), _ = deployment
    clean = _tokens(llm)
    tcp = sorted(f"tcp://{a}:{p}" for a, p in tcp_listeners(engine_pid) if p != ray_port)
    ipc = sorted(f"ipc://{p}" for p in unix_listeners(engine_pid) if "/tsdp-" in p)
    assert len(tcp) == 2 and len(ipc) == 2, (tcp, ipc)
    hostile = _Hostile()
    stop = threading.Event()
    made_up_server, _ = zmq.curve_keypair()
    own = zmq.curve_keypair()
    subs, pushes = [], []
    for keys in (None, (made_up_server, *own)):
        for address in tcp + ipc:  # which is XPUB and which PULL is the attacker's guess
            subs.append((address, hostile.socket(zmq.SUB, address, keys)))
            pushes.append(hostile.socket(zmq.PUSH, address, keys))
    codec = EngineChannelCodec()
    forged = [codec.encode(m) for step in range(400) for m in (
        ModelRunnerOutput(step, [FORGED_TOKEN]), WorkerError(step, 0, "forged"))]

    def forge():
        while not stop.is_set():
            for push in pushes:
                for frame in forged[:20]:
                    _try_send(push, frame)
            time.sleep(0.01)

    forger = threading.Thread(target=forge, daemon=True)
    try:
        rss_before = _rss_bytes(engine_pid)
        accepted = [_zmtp_flood(a) for a in tcp + ipc for _ in range(3)]
        rss_after_flood = _rss_bytes(engine_pid)
        forger.start()
        attacked = _tokens(llm)
    finally:
        stop.set()
        forger.join(5)
        read = [address for address, sub in subs if sub.poll(0)]
        hostile.close()
    assert attacked == clean
    assert FORGED_TOKEN not in attacked
    assert read == []
    assert all(n < 50 << 20 for n in accepted), accepted
    grown = rss_after_flood - rss_before
    assert grown < 40 << 20, f"the engine grew {grown >> 20} MB under 12 x 50 MB frames"
    stats = llm.stats()
    assert stats["dropped_frames"] == 0  # none got past the handshake to be dropped later
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert llm.engine.health()
    print(f"engine RSS {rss_before >> 20} MB before, {rss_after_flood >> 20} MB after "
          f"12 x 50 MB frames; bytes taken per frame: {max(accepted)}")


# ---------------------------------------------------------------- bench/frame_storm.py


STORM = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench",
                     "frame_storm.py")


def _storm(endpoints: dict, frames: int, step_id: int, marker: str, seconds: float = 3.0):
    """bench/frame_storm.py in a process of its own (no Ray, no keys); returns the process."""
    import json
    import subprocess
    import sys
    return subprocess.Popen([sys.executable, STORM, "--endpoints", json.dumps(endpoints),
                             "--frames", str(frames), "--seconds", str(seconds),
                             "--step-id", str(step_id), "--marker", marker],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _storm_result(proc) -> dict:
    import json
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_the_frame_storm_reaches_sockets_without_curve(tmp_path):
    """The control for the storm below: against ZMQ sockets without CURVE, its frames arrive
    (forged replies that decode to the step named, pickles, frames sent up a broadcast socket),
    so the storm's nothing-got-through on the deployment is CURVE's doing."""
    ctx = zmq.Context()
    pull, pub = ctx.socket(zmq.PULL), ctx.socket(zmq.XPUB)
    for s in (pull, pub):
        s.setsockopt(zmq.LINGER, 0)
    endpoints = {"tcp_pull": f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}",
                 "tcp_pub": f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}",
                 "ipc_pull": f"ipc://{tmp_path}/pull", "ipc_pub": f"ipc://{tmp_path}/pub"}
    pull.bind(endpoints["ipc_pull"])
    pub.bind(endpoints["ipc_pub"])
    codec = EngineChannelCodec()
    try:
        result = _storm_result(_storm(endpoints, 280, 41, str(tmp_path / "marker"), 1.0))
        forged, pickles, upstream = [], 0, 0
        while pull.poll(500):
            frame = pull.recv()
            pickles += frame.startswith(b"\x80")
            try:
                forged.append(codec.decode(frame))
            except ValueError:
                pass
        while pub.poll(200):
            upstream += 1
            pub.recv()
    finally:
        pull.close()
        pub.close()
        ctx.term()
    assert result["sent"] == 280 and result["refused"] == 0
    assert {type(m) for m in forged} == {ModelRunnerOutput, WorkerError}
    assert {m.step_id for m in forged} <= {41, 42}
    assert pickles and upstream
    assert not (tmp_path / "marker").exists()  # nothing here unpickles either


def test_a_frame_storm_from_another_process_changes_nothing(deployment, tmp_path):
    """Every kind of hostile frame (bench/frame_storm.py: garbage, truncated and wrong-typed
    msgpack, oversized, pickles, forged replies and errors for the current step) through every
    channel (raw, ZMTP NULL, bogus CURVE handshakes, pyzmq without a key or with a self-made
    keypair) to every socket the engine's dataplane() names, from a process without the keys,
    during a victim's long stream: the victim's tokens equal a clean run's, no frame was read,
    dropped or unpickled, and the engine serves on."""
    import ray
    llm, _, _ = deployment
    clean = _tokens(llm)
    plane = ray.get(llm.engine.actor.dataplane.remote())
    assert set(plane["endpoints"]) == {"tcp_pub", "tcp_pull", "ipc_pub", "ipc_pull"}
    assert plane["last_step_id"] >= 0 and plane["dropped_frames"] == 0
    marker = tmp_path / "marker"
    storm = _storm(plane["endpoints"], 280, plane["last_step_id"] + 1, str(marker), 10.0)
    assert storm.stdout.readline().strip() == '{"started": true}'
    victims = 0
    while storm.poll() is None or victims == 0:  # every victim starts while frames fly
        assert _tokens(llm) == clean
        victims += 1
    result = _storm_result(storm)
    assert result == {"sent": 280, "read": 0, "refused": 0}
    assert ray.get(llm.engine.actor.dataplane.remote())["dropped_frames"] == 0
    assert not marker.exists()
    assert llm.engine.health()
    assert _tokens(llm) == clean

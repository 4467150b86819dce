"""The ZMQ data plane without Ray: broadcast to every rank, rank 0 replies, a malformed frame
is dropped with a logged error and the loop goes on. tests/test_dataplane_security.py has the
hostile peers."""
import logging
import threading

from tierserve.deploy.dataplane import DataPlaneClient, DataPlaneServer
from tierserve.scheduler import ModelRunnerOutput, SchedulerOutput, ShutdownWorker


def _start(num_ranks: int, node_of_rank):
    server = DataPlaneServer("127.0.0.1", "engine-node", num_ranks)
    seen = [[] for _ in range(num_ranks)]

    def handler(rank):
        def handle(msg):
            seen[rank].append(msg)
            if rank == 0 and isinstance(msg, SchedulerOutput):
                return ModelRunnerOutput(msg.step_id, [msg.step_id] * len(msg.num_scheduled_tokens))
            return None
        return handle

    threads = []
    for rank in range(num_ranks):
        client = DataPlaneClient(server.endpoints, node_of_rank(rank), server.rank_keys(rank))
        t = threading.Thread(target=client.serve, args=(handler(rank), rank), daemon=True)
        t.start()
        threads.append(t)
    server.await_subscribers(num_ranks, timeout_s=10)
    return server, seen, threads


def test_broadcast_reaches_every_rank_and_rank0_replies_over_ipc_and_tcp():
    # rank 0 on the engine's node (IPC), rank 1 elsewhere (TCP)
    server, seen, threads = _start(2, lambda r: "engine-node" if r == 0 else "other-node")
    for step in range(5):
        server.broadcast(SchedulerOutput(step, num_scheduled_tokens=[1, 1, 1]))
        assert server.recv(timeout_s=5) == (ModelRunnerOutput(step, [step] * 3), 0)
    server.broadcast(ShutdownWorker())
    for t in threads:
        t.join(5)
        assert not t.is_alive()
    assert [len(s) for s in seen] == [6, 6]
    server.close()


def test_malformed_frame_is_dropped_and_the_loop_goes_on(caplog):
    server, seen, threads = _start(1, lambda r: "engine-node")
    with caplog.at_level(logging.ERROR, logger="tierserve.dataplane"):
        server._pub.send(b"\x93\xff garbage")
        server.broadcast(SchedulerOutput(7, num_scheduled_tokens=[2]))
        assert server.recv(timeout_s=5) == (ModelRunnerOutput(7, [7]), 0)
    assert any("dropped a frame" in r.message for r in caplog.records)
    assert len(seen[0]) == 1
    assert server.recv(timeout_s=0.2) is None  # nothing stale is left to read
    server.broadcast(ShutdownWorker())
    threads[0].join(5)
    server.close()

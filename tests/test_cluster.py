"""Multi-node and `ray job submit` recipes, each on its own Ray cluster in a child process
(a process holds one Ray connection; the session's instance stays untouched)."""
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

from tests.checkpoints import make_tiny_llama
from tierserve import LLM, SamplingParams

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 47))]

TWO_NODES = """
import json, sys
import ray
from ray.cluster_utils import Cluster
from tierserve import LLM, SamplingParams
cluster = Cluster(initialize_head=True, head_node_args={
    "num_cpus": 1, "include_dashboard": False, "object_store_memory": 96 * 1024 * 1024})
cluster.add_node(num_cpus=1, object_store_memory=96 * 1024 * 1024)
ray.init(address=cluster.address, namespace="two-nodes", log_to_driver=False)
try:
    with LLM(sys.argv[1], tensor_parallel_size=2, placement_strategy="SPREAD",
             block_size=4) as llm:
        outs = llm.generate(json.loads(sys.argv[2]),
                            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                            use_tqdm=False)
        nodes = llm.engine.info()["worker_nodes"]
    print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs], "nodes": nodes}))
finally:
    ray.shutdown()
    cluster.shutdown()
"""


def _env(tmp: str) -> dict:
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0",
               RAY_TMPDIR=tmp, PYTHONPATH=REPO)
    env.pop("RAY_ADDRESS", None)
    return env


def test_two_node_cluster_tp2_across_nodes_gives_the_same_tokens(tmp_path):
    path = str(make_tiny_llama(tmp_path / "llama"))
    with LLM(path, block_size=4) as llm:
        ref = [o.outputs[0].token_ids for o in llm.generate(
            PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
            use_tqdm=False)]
    ray_tmp = tempfile.mkdtemp(prefix="ts-2n-", dir="/tmp")
    run = subprocess.run([sys.executable, "-c", TWO_NODES, path, json.dumps(PROMPTS)],
                         env=_env(ray_tmp), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["tokens"] == ref
    assert len(set(result["nodes"])) == 2, "the two ranks must sit on different nodes"


def _free_port() -> int:
    """A port that is free now, from below the kernel's ephemeral range (32768+ here) and above
    Ray's worker ports (10002-19999): a port the kernel handed out for bind(0) and this test
    released could be handed out again to one of the ports `ray start` binds before its
    dashboard claims it, which failed a CI run."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-31999")


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _cluster_pids(markers: list[str]) -> set[int]:
    """Our cluster's processes: those naming its private temp folder or its GCS port, and
    every descendant of those (agents rename themselves, so only their parent tells)."""
    pids = [int(e) for e in os.listdir("/proc") if e.isdigit() and int(e) != os.getpid()]
    found = {p for p in pids if any(m.encode() in _cmdline(p) for m in markers)}
    parents = {p: _parent(p) for p in pids}
    grew = True
    while grew:
        children = {p for p, pp in parents.items() if pp in found} - found
        grew = bool(children)
        found |= children
    return found


def _stop_cluster(markers: list[str]) -> None:
    pids = _cluster_pids(markers)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids | _cluster_pids(markers):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        time.sleep(1.5)


def test_ray_start_head_and_job_submit_recipe():
    ray_tmp = tempfile.mkdtemp(prefix="ts-job-", dir="/tmp")
    env = _env(ray_tmp)
    bin_dir = os.path.dirname(sys.executable)
    ray_cli, tierserve_cli = os.path.join(bin_dir, "ray"), os.path.join(bin_dir, "tierserve")
    port, dash = _free_port(), _free_port()
    markers = [ray_tmp, f":{port} ", f":{port}\0"]
    # The agents' default ports (52365, ...) belong to the session's Ray when it runs: an
    # agent that cannot bind never registers, and every job submit is refused.
    agent_ports = [f"--{name}={_free_port()}" for name in (
        "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port",
        "metrics-export-port")]
    start = subprocess.run([ray_cli, "start", "--head", f"--port={port}",
                            f"--dashboard-port={dash}", "--dashboard-host=127.0.0.1",
                            "--num-cpus=2", f"--temp-dir={ray_tmp}", "--include-dashboard=true",
                            "--object-store-memory=134217728", *agent_ports],
                           env=env, capture_output=True, text=True, timeout=120)
    try:
        assert start.returncode == 0, start.stderr[-3000:]
        address = f"http://127.0.0.1:{dash}"

        def submit(*entrypoint: str) -> str:
            # The head's job agent starts after `ray start` returns; until it registers, Ray
            # answers "No available agent ... try again later" (slow on a loaded machine).
            deadline = time.monotonic() + 180
            while True:
                run = subprocess.run([ray_cli, "job", "submit", f"--address={address}", "--",
                                      *entrypoint], env=env, capture_output=True, text=True,
                                     timeout=300)
                if run.returncode == 0 or "No available agent" not in run.stdout + run.stderr \
                        or time.monotonic() > deadline:
                    break
                time.sleep(3)
            assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
            return run.stdout

        out = submit(tierserve_cli, "serve", "--name", "jobtest", "--max-model-len", "512")
        assert "tierserve.connect('jobtest'" in out
        out = submit(sys.executable, "-m", "tierserve", "generate", "--name", "jobtest",
                     "--max-tokens", "8", "The capital of France is")
        assert "Paris" in out
        out = submit(tierserve_cli, "stop", "jobtest")
        assert "stopped 'jobtest'" in out
    finally:
        _stop_cluster(markers)
    assert not {p for p in _cluster_pids(markers) if b"" != _cmdline(p)}

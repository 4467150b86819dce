"""The Ray cluster a named deployment lives on: joined, found, or started by `tierserve serve`.

A named deployment outlives the command that started it, so it needs a Ray cluster that does
too. In order, a deployment command uses: the cluster RAY_ADDRESS names (a `ray job submit`
job's included); the local head an earlier `tierserve serve` started (recorded in a small
state file under the cache folder); the cluster `ray start` last started on this machine (Ray's
own record). Only `serve` (and `api-server --name`) may start a head when none is found: `ray
start --head --block` in a session of its own (at session niceness 5, so that other
sessions' threads, its clients', get a core at once: deploy/priority.py), with its own temp
folder, free ports and the machine's CPUs. Stopping the last deployment on such a head stops
the head (`stop_head`): its `ray start` process tears down the processes it started.

No torch here: status, stop and generate --name import this module and Ray alone.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import ray

from tierserve.deploy.priority import set_session_niceness
from tierserve.runtime import envs

__all__ = ["LocalHead", "NoClusterError", "join", "local_head", "start_head", "stop_head",
           "cluster_address", "session_pids"]

log = logging.getLogger("tierserve.deploy")

_STATE_FILE = "ray-head.json"
_HEAD_START_TIMEOUT_S = 120.0
_HEAD_STOP_TIMEOUT_S = 30.0
# Ray's own worker ports are 10002-19999 and the kernel's ephemeral ones start at 32768: a
# port picked between them is neither handed to a Ray worker nor to an outgoing connection.
_PORT_RANGE = (20000, 32000)
# Ray's object store carries only control messages and output batches here.
_OBJECT_STORE_BYTES = 256 << 20
# The head's session (autogroup) yields the cores to other sessions' threads when they wake:
# its ranks compute whenever a step runs, and the clients (often in another session) must
# still be answered at once (deploy/priority.py).
_HEAD_SESSION_NICE = 5


class NoClusterError(ValueError):
    """No Ray cluster runs where a deployment command looked for one."""


@dataclass(frozen=True)
class LocalHead:
    """A Ray head `tierserve serve` started: its GCS address, the pid of its `ray start
    --block` process (which leads a session of its own), its temp folder and log."""

    address: str
    pid: int
    temp_dir: str
    log: str
    num_cpus: int


def _state_path() -> str:
    return os.path.join(envs.cache_dir(), _STATE_FILE)


@contextlib.contextmanager
def _state_lock():
    """Serializes finding, starting and stopping the local head between processes."""
    os.makedirs(envs.cache_dir(), exist_ok=True)
    with open(_state_path() + ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _read_state() -> LocalHead | None:
    try:
        with open(_state_path()) as f:
            return LocalHead(**json.load(f))
    except (OSError, ValueError, TypeError):
        return None


def _write_state(head: LocalHead) -> None:
    tmp = _state_path() + f".{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(asdict(head), f)
    os.replace(tmp, _state_path())


def _remove_state() -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(_state_path())


def _pid_runs(head: LocalHead) -> bool:
    """Whether the head's `ray start` process still runs (its command line names the head's
    temp folder, so a reused pid is not mistaken for it)."""
    try:
        with open(f"/proc/{head.pid}/cmdline", "rb") as f:
            return head.temp_dir.encode() in f.read()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: trust the pid
        try:
            os.kill(head.pid, 0)
        except ProcessLookupError:
            return False
        return True


def _answers(address: str, timeout_s: float = 2.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def local_head() -> LocalHead | None:
    """The head an earlier `tierserve serve` started, if it still runs; a record of one that
    died is removed."""
    head = _read_state()
    if head is None:
        return None
    if _pid_runs(head):
        return head
    _remove_state()
    return None


def _ray_start_cluster() -> str | None:
    """The GCS address of the cluster `ray start` last started on this machine, if it
    answers (Ray's own record, which `ray.init()` without an address would join)."""
    try:
        from ray._private.services import find_bootstrap_address
        address = find_bootstrap_address(None)
    except Exception:  # a private API: without it, this source is skipped
        return None
    return address if address and _answers(address) else None


def cluster_address() -> str | None:
    """Where deployment commands find their cluster (module docstring), or None."""
    address = envs.ray_address()
    if address:
        return address
    head = local_head()
    if head is not None:
        return head.address
    return _ray_start_cluster()


def join(namespace: str | None = None, *, start: bool = False) -> LocalHead | None:
    """Connects this process to the deployments' cluster. With `start`, a local head is started
    when none is found (and returned); without, NoClusterError."""
    if ray.is_initialized():
        return None
    started = None
    with _state_lock():
        address = cluster_address()
        if address is None:
            if not start:
                raise NoClusterError(
                    "no Ray cluster is running here (RAY_ADDRESS is unset and no `tierserve "
                    "serve` head or `ray start` cluster was found)")
            started = start_head()
            address = started.address
    ray.init(address=address, namespace=namespace or envs.default_namespace(),
             log_to_driver=False, logging_level=logging.WARNING)
    return started


def _free_ports(n: int) -> list[int]:
    rng, ports = random.Random(), []
    for _ in range(500):
        port = rng.randrange(*_PORT_RANGE)
        if port in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise RuntimeError(f"found no {n} free ports in {_PORT_RANGE[0]}-{_PORT_RANGE[1] - 1}")


_PORT_FLAGS = ("port", "node-manager-port", "object-manager-port", "ray-client-server-port",
               "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
               "runtime-env-agent-port", "metrics-export-port")


def start_head() -> LocalHead:
    """Starts `ray start --head --block` in a session of its own (it outlives this process)
    and waits for its GCS. Call under _state_lock."""
    # Short: Ray's socket paths under it must fit a Unix socket address.
    temp_dir = tempfile.mkdtemp(prefix="tierserve-head-", dir="/tmp" if os.path.isdir("/tmp")
                                else None)
    ports = dict(zip(_PORT_FLAGS, _free_ports(len(_PORT_FLAGS))))
    num_cpus = os.cpu_count() or 1
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
           f"--temp-dir={temp_dir}", f"--num-cpus={num_cpus}", "--include-dashboard=false",
           # A head for this machine alone: its addresses are loopback ones.
           "--node-ip-address=127.0.0.1",
           "--disable-usage-stats", f"--object-store-memory={_OBJECT_STORE_BYTES}",
           *(f"--{flag}={port}" for flag, port in ports.items())]
    log_path = os.path.join(temp_dir, "ray-start.log")
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log_file,
                                stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
    set_session_niceness(proc.pid, _HEAD_SESSION_NICE)
    head = LocalHead(f"127.0.0.1:{ports['port']}", proc.pid, temp_dir, log_path, num_cpus)
    try:
        _wait_started(head, proc)
    except BaseException:
        _terminate(head, proc)
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    _write_state(head)
    return head


def _wait_started(head: LocalHead, proc: subprocess.Popen) -> None:
    """Until `ray start` has recorded its address (written once the head's processes run)."""
    record = os.path.join(head.temp_dir, "ray_current_cluster")
    deadline = time.monotonic() + _HEAD_START_TIMEOUT_S
    while not (os.path.exists(record) and _answers(head.address, 1.0)):
        if proc.poll() is not None:
            raise RuntimeError(f"`ray start --head` failed (exit {proc.returncode}):\n"
                               f"{_tail(head.log)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the local Ray head did not start within "
                               f"{_HEAD_START_TIMEOUT_S:.0f} s:\n{_tail(head.log)}")
        time.sleep(0.1)


def _tail(path: str, nbytes: int = 3000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - nbytes))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def stop_head(head: LocalHead) -> None:
    """Stops a head `start_head` started: SIGTERM to its `ray start` process (which stops every
    process it started), then SIGKILL to whatever of its session is left; removes its temp
    folder and record. This process leaves the cluster first."""
    if ray.is_initialized():
        ray.shutdown()
    with _state_lock():
        _terminate(head)
        shutil.rmtree(head.temp_dir, ignore_errors=True)
        if _read_state() == head:
            _remove_state()


def _terminate(head: LocalHead, proc: subprocess.Popen | None = None) -> None:
    if _pid_runs(head):
        with contextlib.suppress(ProcessLookupError):
            os.kill(head.pid, signal.SIGTERM)
        deadline = time.monotonic() + _HEAD_STOP_TIMEOUT_S
        while _pid_runs(head) and time.monotonic() < deadline:
            if proc is not None:
                proc.poll()  # reaps our own child
            time.sleep(0.1)
    # Whatever of the head's session is left (it began the session: every process the head
    # started, Ray's workers included, carries its pid as session id).
    for pid in session_pids(head.pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    if proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


def session_pids(sid: int) -> list[int]:
    """The processes of session `sid` (Linux /proc; none elsewhere)."""
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 3 and int(fields[3]) == sid:  # state, ppid, pgrp, session
            found.append(int(entry))
    return found

"""The README's commands, run as a new user runs them (documented commands that cannot work fail
CI): a fresh HOME and cache folder, no RAY_ADDRESS and no Ray cluster to find, on whatever cores
this machine has. One flow: the run command; every line of the command-line block in order,
with `tierserve api-server --name smol` and the README's curls before its `tierserve stop`.
`serve` must start a local Ray head that outlives it and that `stop` takes down again; after
the flow no process of that head is left.

The install and test commands are .ci/run's own; the multi-node recipe needs machines of its
own, and test_cluster.py runs its one-machine `ray job submit` form. The compiled CPU kernels
are copied into the fresh cache (a first build takes minutes; test_cpu_backend covers it):
everything else (the tokenizer's conversion, the head's record) starts empty.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tierserve.deploy.priority import session_niceness
from tierserve.deploy.ray_cluster import session_pids
from tierserve.runtime import envs

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
BIN = os.path.dirname(sys.executable)


def _block_after(marker: str) -> list[str]:
    """The commands of the bash block after `marker`: one per line, comments dropped, a
    command continuing while a quote is open (the curls' JSON bodies)."""
    match = re.search(re.escape(marker) + r"[^\n]*\n```bash\n(.*?)```", README, re.S)
    assert match, f"README lacks {marker}"
    commands, current = [], ""
    for line in match.group(1).splitlines():
        current += ("\n" if current else "") + (line if current else line.split("  #")[0])
        try:
            shlex.split(current)
        except ValueError:  # a quote is still open
            continue
        if current.strip():
            commands.append(current.strip())
        current = ""
    return commands


def _argv(command: str, port: int) -> list[str]:
    argv = [a.replace("8000", str(port)) for a in shlex.split(command)]
    if argv[0] == "tierserve":
        return [os.path.join(BIN, "tierserve"), *argv[1:]]
    if argv[0] == "python":
        return [sys.executable, *argv[1:]]
    return argv


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fresh_user(tmp_path):
    """A new user's environment: fresh HOME (so a fresh ~/.cache/tierserve, with the compiled
    kernels copied in), a private Ray temp folder (no cluster to find), no RAY_ADDRESS."""
    home = tmp_path / "home"
    cache = home / ".cache" / "tierserve"
    cache.mkdir(parents=True)
    kernels = Path(envs.cache_dir()) / "kernels"
    if kernels.is_dir():
        shutil.copytree(kernels, cache / "kernels", symlinks=True,
                        ignore=shutil.ignore_patterns("*.o", "*.ninja*", "build.lock", "lock"))
    ray_tmp = Path(os.environ.get("RAY_TMPDIR", "/tmp")) / f"readme-{os.getpid()}"
    ray_tmp.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "TIERSERVE_CACHE_DIR", "TIERSERVE_NAMESPACE")}
    env.update(HOME=str(home), RAY_TMPDIR=str(ray_tmp))
    return env, cache


class _Flow:
    def __init__(self, env: dict, port: int) -> None:
        self.env, self.port, self.times = env, port, []

    def run(self, command: str, stdin: str = "") -> subprocess.CompletedProcess:
        t0 = time.monotonic()
        out = subprocess.run(_argv(command, self.port), env=self.env, input=stdin,
                             capture_output=True, text=True, timeout=600, cwd=REPO)
        self.times.append((command.splitlines()[0][:60], time.monotonic() - t0))
        return out

    def ok(self, command: str, stdin: str = "") -> subprocess.CompletedProcess:
        out = self.run(command, stdin)
        assert out.returncode == 0, f"{command}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
        assert out.stdout.strip(), command
        assert "Traceback" not in out.stderr, f"{command}:\n{out.stderr[-3000:]}"
        return out


def test_the_readme_flow_as_a_new_user(fresh_user):
    env, cache = fresh_user
    flow = _Flow(env, _free_port())
    lines = _block_after("<!-- ci:commands")
    stop_at = lines.index("tierserve stop smol")
    head_pid = None
    try:
        (run_line,) = _block_after("<!-- ci:run -->")
        assert "Paris" in flow.ok(run_line).stdout
        for line in lines[:stop_at]:
            if line.startswith("tierserve serve"):
                _refusal_names_serve(flow, line)
            if line.startswith(_TORCH_FREE):
                out = _talks_without_torch(flow, line)
            else:
                out = flow.ok(line, "What is 2 + 2?\n" if line == "tierserve chat" else "")
            if line.startswith("tierserve serve"):
                assert "started a local Ray head" in out.stderr, out.stderr
                head_pid = json.loads((cache / "ray-head.json").read_text())["pid"]
                # Its session yields the cores to its clients' (where the kernel has
                # autogroups, which it shares the cores between first).
                assert session_niceness(head_pid) in (None, 5)
            if line.startswith("tierserve status smol"):
                assert all(part in out.stdout for part in ("running", "KV tiers", "backend"))
                assert "INFO" not in out.stderr, out.stderr  # none of Ray's log lines
        _api_server_and_curls(flow)
        assert "stopped the local Ray head" in flow.ok("tierserve stop smol").stdout
        assert _gone(head_pid), "processes of the Ray head outlived `tierserve stop`"
        assert not (cache / "ray-head.json").exists()
        for line in lines[stop_at + 1:]:
            flow.ok(line)
    finally:
        print("\n".join(f"{seconds:7.1f} s  {command}" for command, seconds in flow.times))
        _leave_nothing(flow, cache, head_pid)


def _gone(head_pid: int | None, timeout_s: float = 10.0) -> bool:
    """Whether every process of the head's session has exited (within the timeout)."""
    assert head_pid is not None, "serve recorded no head"
    deadline = time.monotonic() + timeout_s
    while session_pids(head_pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


# Commands to a running deployment: run through the CLI's main in a process that then says
# whether torch was imported.
_TORCH_FREE = ("tierserve status smol", "tierserve generate --name")
_NO_TORCH = """
import sys
from tierserve.deploy.cli import main
code = main(sys.argv[1:])
print("torch" in sys.modules, code)
"""


def _talks_without_torch(flow: _Flow, line: str) -> subprocess.CompletedProcess:
    """The command's run, which imports Ray and the client alone, never torch; its stdout
    without the wrapper's last line."""
    argv = shlex.split(line)[1:]
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", _NO_TORCH, *argv], env=flow.env,
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    flow.times.append((line[:60], time.monotonic() - t0))
    *printed, last = out.stdout.strip().splitlines() or [""]
    assert last == "False 0", out.stdout + out.stderr[-2000:]
    assert printed and "Traceback" not in out.stderr, f"{line}:\n{out.stderr[-3000:]}"
    out.stdout = "\n".join(printed)
    return out


def _refusal_names_serve(flow: _Flow, serve_line: str) -> None:
    """Before serve, status refuses with a message whose suggested command is the README's."""
    out = flow.run("tierserve status smol")
    assert out.returncode != 0 and "no Ray cluster is running" in out.stderr, out.stderr
    suggested = re.search(r"`(tierserve serve --name smol)`", out.stderr)
    assert suggested and serve_line.startswith(suggested.group(1)), out.stderr


def _api_server_and_curls(flow: _Flow) -> None:
    (line,) = [c for c in _block_after("<!-- ci:api-server") if "--name smol" in c]
    log = open(os.path.join(flow.env["HOME"], "api-server.log"), "w+")
    t0 = time.monotonic()
    server = subprocess.Popen(_argv(line, flow.port), env=flow.env, stdout=log,
                              stderr=subprocess.STDOUT, text=True, cwd=REPO)
    try:
        _wait_healthy(flow.port, server, log)
        flow.times.append((line[:60] + " (until healthy)", time.monotonic() - t0))
        chat, completion, responses = _block_after("<!-- ci:curls -->")
        body = json.loads(flow.ok(chat).stdout)
        answer = body["choices"][0]["message"]["content"]
        assert "Paris" in answer, answer
        events = [e for e in flow.ok(completion).stdout.split("\n\n") if e.strip()]
        assert events[-1] == "data: [DONE]", events[-3:]
        usage = json.loads(events[-2][len("data: "):])["usage"]
        assert usage["completion_tokens"] >= 1 and usage["prompt_tokens"] >= 1
        body = json.loads(flow.ok(responses).stdout)
        text = body["output"][0]["content"][0]["text"]
        assert body["object"] == "response" and "Paris" in text, body
    finally:
        server.send_signal(signal.SIGINT)  # Ctrl-C, as a user stops it
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.seek(0)
        text = log.read()
        log.close()
    assert "Traceback" not in text, text[-3000:]


def _wait_healthy(port: int, server: subprocess.Popen, log) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert server.poll() is None, "api-server exited:\n" + open(log.name).read()[-3000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError("api-server did not become healthy:\n" + open(log.name).read()[-3000:])


def _leave_nothing(flow: _Flow, cache: Path, head_pid: int | None) -> None:
    """After a failure: stop the deployment, then whatever is left of the head this flow
    started (its own session, found by the pid it recorded)."""
    state = cache / "ray-head.json"
    if state.exists():
        flow.run("tierserve stop smol")
        head_pid = head_pid or json.loads(state.read_text())["pid"]
    if head_pid is None:
        return
    deadline = time.monotonic() + 30
    while session_pids(head_pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in session_pids(head_pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_documents_link_inside_the_repository():
    """Every relative link of the README and docs/ names a file of this repository."""
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = doc.read_text()
        assert "../shared" not in text, doc
        for target in re.findall(r"\]\(([^)#\s]+)\)", text):
            if "://" in target:
                continue
            path = (doc.parent / target).resolve()
            assert path.is_relative_to(REPO) and path.exists(), f"{doc.name}: {target}"

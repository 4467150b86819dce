"""The README's commands, run as a user would (documented commands that cannot work fail CI):
its run command, and every line of its command-line block against the session's Ray instance.
The install and test commands are .ci/run's own; the multi-node recipe needs machines of its
own, and test_cluster.py runs its one-machine `ray job submit` form."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
NS = "tierserve-readme"


def _block_after(marker: str) -> list[str]:
    """The command lines of the bash block after `marker`, comments dropped."""
    match = re.search(re.escape(marker) + r"[^\n]*\n```bash\n(.*?)```", README, re.S)
    assert match, f"README lacks {marker}"
    lines = [line.split("  #")[0].strip() for line in match.group(1).splitlines()]
    return [line for line in lines if line]


def _run(line: str, env: dict, stdin: str | None = None) -> subprocess.CompletedProcess:
    argv = shlex.split(line)
    if argv[0] == "tierserve":
        argv = [os.path.join(os.path.dirname(sys.executable), "tierserve"), *argv[1:]]
    elif argv[0] == "python":
        argv = [sys.executable, *argv[1:]]
    return subprocess.run(argv, env=env, input=stdin or "", capture_output=True, text=True,
                          timeout=600, cwd=REPO)


def test_the_run_command_answers():
    (line,) = _block_after("<!-- ci:run -->")
    out = _run(line, dict(os.environ))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Paris" in out.stdout


@pytest.mark.usefixtures("ray_session")
def test_every_command_line_example_works():
    import ray
    env = dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address,
               TIERSERVE_NAMESPACE=NS)
    lines = _block_after("<!-- ci:commands")
    assert any(line.startswith("tierserve serve") for line in lines)
    try:
        for line in lines:
            stdin = "What is 2 + 2?\n" if line == "tierserve chat" else None
            out = _run(line, env, stdin)
            assert out.returncode == 0, f"{line}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
            assert out.stdout.strip(), line
    finally:
        _run("tierserve stop smol", env)

"""The package import table of docs/architecture.md, enforced: every import in every module
(function-level ones included) against the arrows the table allows, and no package cycle; inside
workers/, the sub-packages' own arrows (the model is built on the backends, never the reverse)."""
from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("kvcache", "scheduler", "workers", "runtime", "deploy")

# Which of tierserve's packages (or modules of one) each package may import. workers and deploy
# see only the scheduler's message types: the wire messages and the parameters inside them.
SCHEDULER_MESSAGES = {"scheduler.messages", "scheduler.params", "scheduler.output_rules"}
ALLOWED = {
    "kvcache": set(),
    "scheduler": {"kvcache"},
    "workers": SCHEDULER_MESSAGES,
    "runtime": {"kvcache", "scheduler", "workers"},
    # deploy's router hashes prompts as the engines do and reads their KV event stream.
    "deploy": {"runtime", "workers", "kvcache.hashing", "scheduler.kv_events"}
    | SCHEDULER_MESSAGES,
}
# Inside workers/: what the sub-packages may import of workers/ (a unit is a sub-package or a
# top-level module). The attention metadata (the step's contract with a backend) sees nothing;
# a backend sees only backends and that contract; the model sees the backends, the attention
# metadata and the TP group; step execution (the other top-level modules) may use all of them.
WORKERS_UNITS = {
    "workers.attention": {"workers.attention"},
    "workers.backends": {"workers.backends", "workers.attention"},
    "workers.model": {"workers.model", "workers.backends", "workers.attention",
                      "workers.parallel"},
}
# Third-party packages a package must never import: the bookkeeping core stays torch- and
# Ray-free, and only deploy/ touches Ray and ZMQ.
FORBIDDEN = {
    "kvcache": {"torch", "ray", "zmq", "msgspec"},
    "scheduler": {"torch", "ray", "zmq", "numpy"},
    "workers": {"ray", "zmq"},
    "runtime": {"ray", "zmq"},
    "deploy": set(),
}


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in a module; a relative import is reported as
    ".module" (the code base imports absolutely, so that this check sees every arrow)."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            found.append((node.lineno, module))
            # `from tierserve import deploy` (or `from tierserve.workers import parallel`)
            # names a package or module in the alias.
            if module in ("tierserve", "tierserve.workers"):
                found += [(node.lineno, f"{module}.{a.name}") for a in node.names]
    return found


def _workers_unit(dotted: list[str]) -> str:
    """workers.<sub-package> or workers.<module> of a dotted path under workers."""
    return ".".join(dotted[:2])


def violations(root: Path = REPO) -> list[str]:
    bad = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root)
            unit = _workers_unit(list(rel.with_suffix("").parts))
            for line, module in imports_of(path):
                parts = module.split(".")
                where = f"{rel}:{line}"
                if module.startswith("."):
                    bad.append(f"{where}: relative import {module}")
                    continue
                if parts[0] in FORBIDDEN[package]:
                    bad.append(f"{where}: {package}/ imports {module}")
                if parts[0] != "tierserve" or len(parts) < 2:
                    continue
                if parts[1] == package:
                    target_unit = _workers_unit(parts[1:])
                    allowed_units = WORKERS_UNITS.get(unit)
                    if package == "workers" and len(parts) > 2 and allowed_units is not None \
                            and target_unit not in allowed_units:
                        bad.append(f"{where}: {unit} -> {target_unit} is not in the workers/ "
                                   f"sub-package table")
                    continue
                target = parts[1]
                if target not in PACKAGES:
                    bad.append(f"{where}: {package}/ imports {module}, outside the packages")
                    continue
                allowed = ALLOWED[package]
                if target not in allowed and ".".join(parts[1:3]) not in allowed:
                    bad.append(f"{where}: {package}/ -> {'.'.join(parts[1:3])} is not in "
                               f"DESIGN.md's import table")
    return bad


def test_every_import_follows_the_table():
    assert violations() == []


def test_the_table_has_no_cycle():
    graph = {p: {a.split(".")[0] for a in ALLOWED[p]} for p in PACKAGES}
    done: set[str] = set()

    def visit(node: str, path: tuple[str, ...]) -> None:
        assert node not in path, f"cycle: {' -> '.join(path + (node,))}"
        if node in done:
            return
        for nxt in graph[node]:
            visit(nxt, path + (node,))
        done.add(node)

    for package in PACKAGES:
        visit(package, ())


@pytest.mark.parametrize("package,line,message", [
    ("workers", "from tierserve.runtime import envs", "workers/ -> runtime "),
    ("runtime", "from tierserve.deploy.ray_engine import serve", "runtime/ -> deploy.ray_engine"),
    ("runtime", "    import ray", "runtime/ imports ray"),
    ("kvcache", "import torch", "kvcache/ imports torch"),
    ("workers", "from tierserve.scheduler.scheduler import Scheduler",
     "workers/ -> scheduler.scheduler"),
    ("workers/backends", "from tierserve.workers.model.layers import linear",
     "workers.backends -> workers.model "),
    ("workers/backends", "from tierserve.workers import worker",
     "workers.backends -> workers.worker "),
    ("workers/model", "from tierserve.workers.model_runner import ModelRunner",
     "workers.model -> workers.model_runner "),
])
def test_an_import_against_the_table_fails(tmp_path, package, line, message):
    """The check sees a forbidden arrow added anywhere, a function's body included."""
    for p in PACKAGES:
        os.makedirs(tmp_path / p)
    os.makedirs(tmp_path / package, exist_ok=True)
    (tmp_path / package / "added.py").write_text(f"def f():\n    pass\n{line}\n")
    found = violations(tmp_path)
    assert len(found) == 1 and message in found[0], found

"""The package import table of ../shared/DESIGN.md, enforced: every import in every module
(function-level ones included) against the arrows the table allows, and no package cycle."""
from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("kvcache", "scheduler", "workers", "runtime", "deploy")

# Which of tierserve's packages (or modules of one) each package may import. workers and deploy
# see only the scheduler's message types: the wire messages and the parameters inside them.
SCHEDULER_MESSAGES = {"scheduler.messages", "scheduler.params"}
ALLOWED = {
    "kvcache": set(),
    "scheduler": {"kvcache"},
    "workers": SCHEDULER_MESSAGES,
    "runtime": {"kvcache", "scheduler", "workers"},
    "deploy": {"runtime", "workers"} | SCHEDULER_MESSAGES,
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
            # `from tierserve import deploy` names a package in the alias.
            if module == "tierserve":
                found += [(node.lineno, f"tierserve.{a.name}") for a in node.names]
    return found


def violations(root: Path = REPO) -> list[str]:
    bad = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            for line, module in imports_of(path):
                parts = module.split(".")
                where = f"{path.relative_to(root)}:{line}"
                if module.startswith("."):
                    bad.append(f"{where}: relative import {module}")
                    continue
                if parts[0] in FORBIDDEN[package]:
                    bad.append(f"{where}: {package}/ imports {module}")
                if parts[0] != "tierserve" or len(parts) < 2 or parts[1] == package:
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
])
def test_an_import_against_the_table_fails(tmp_path, package, line, message):
    """The check sees a forbidden arrow added anywhere, a function's body included."""
    for p in PACKAGES:
        os.makedirs(tmp_path / p)
    (tmp_path / package / "added.py").write_text(f"def f():\n    pass\n{line}\n")
    found = violations(tmp_path)
    assert len(found) == 1 and message in found[0], found

"""What the cluster can hold: each rank's share of CPUs, and the check that a deployment's
bundles fit the cluster before anything waits for them."""
from __future__ import annotations

import logging
import math
import os

import ray

from tierserve.runtime.config import EngineConfig

__all__ = ["default_cpus_per_worker", "resolve_cpus_per_worker", "check_placement"]

log = logging.getLogger("tierserve.deploy")

# Ray accounts resources in steps of 1e-4.
_RAY_CPU_STEPS = 10_000


def default_cpus_per_worker(tp_size: int, cores: int | None = None) -> float:
    """Each rank's share of this machine's cores: whole cores where there are enough, else a
    fraction (rounded down to Ray's resolution, so that the ranks fit the cores)."""
    cores = cores or os.cpu_count() or 1
    if cores >= tp_size:
        return cores // tp_size
    return cores * _RAY_CPU_STEPS // tp_size / _RAY_CPU_STEPS


def resolve_cpus_per_worker(config: EngineConfig) -> float:
    """The config's cpus_per_worker, else the default; a warning where ranks share cores."""
    cpus = config.cpus_per_worker
    if cpus is None:
        cpus = default_cpus_per_worker(config.tensor_parallel_size)
    if cpus < 1:
        log.warning("cpus_per_worker=%g: the %d ranks share cores (each runs %d torch "
                    "thread%s); a step takes longer than it would with a core per rank",
                    cpus, config.tensor_parallel_size, math.ceil(cpus),
                    "" if math.ceil(cpus) == 1 else "s")
    return cpus


def check_placement(tp_size: int, device: str, strategy: str, cpus_per_worker: float,
                    what: str | None = None) -> None:
    """ValueError at once when the cluster, even idle, cannot hold the ranks' bundles; it names
    a cpus_per_worker that fits where there is one."""
    from tierserve.deploy.placement import worker_bundle

    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    bundle = worker_bundle(device, cpus_per_worker)
    room, where = _room(nodes, bundle, strategy)
    if room >= tp_size:
        return
    total = {k: sum(r.get(k, 0) for r in nodes) for k in bundle}
    fix = _fitting_cpus(nodes, device, strategy, tp_size, cpus_per_worker)
    hint = (f"set cpus_per_worker={fix:g} (--cpus-per-worker {fix:g}; ranks then share "
            f"cores), lower tensor_parallel_size, or add nodes" if fix is not None else
            "lower tensor_parallel_size or add nodes")
    raise ValueError(f"{what or f'tensor_parallel_size={tp_size}'} needs {tp_size} bundles of "
                     f"{bundle} ({strategy}); {where} can hold {room} (cluster: {total}). To "
                     f"fit, {hint}")


def _room(nodes: list[dict], bundle: dict, strategy: str) -> tuple[int, str]:
    """How many bundles the nodes hold under the strategy, and where."""
    def fits(resources: dict) -> int:
        # Ray accounts in steps of 1e-4: compare in those steps, not in binary fractions.
        return min(int(round(resources.get(k, 0) * _RAY_CPU_STEPS)
                       // round(v * _RAY_CPU_STEPS)) for k, v in bundle.items())

    if strategy == "STRICT_PACK":
        return max((fits(r) for r in nodes), default=0), "one node"
    if strategy == "STRICT_SPREAD":
        return sum(min(fits(r), 1) for r in nodes), "distinct nodes"
    return sum(fits(r) for r in nodes), "the cluster"


def _fitting_cpus(nodes: list[dict], device: str, strategy: str, tp_size: int,
                  cpus: float) -> float | None:
    """The largest cpus_per_worker below `cpus` with which the ranks fit, or None."""
    from tierserve.deploy.placement import worker_bundle

    candidates = {default_cpus_per_worker(k, int(r.get("CPU", 0)) or 1)
                  for r in nodes for k in range(1, tp_size + 1)}
    for value in sorted((c for c in candidates if 0 < c < cpus), reverse=True):
        if _room(nodes, worker_bundle(device, value), strategy)[0] >= tp_size:
            return value
    return None

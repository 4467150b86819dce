"""Placement: one placement group, a bundle per TP rank, ranks ordered driver's node first."""
from __future__ import annotations

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table

__all__ = ["make_placement_group", "rank_bundles", "worker_bundle", "worker_names"]


def worker_names(prefix: str, rank: int) -> tuple[str, str]:
    """The two actor names rank `rank` of a deployment takes in turn with its spare
    (deploy/executor_restart.py)."""
    return f"{prefix}-rank{rank}", f"{prefix}-rank{rank}-b"


def worker_bundle(device: str, cpus_per_worker: float) -> dict:
    if device == "cuda":
        return {"GPU": 1, "CPU": cpus_per_worker}
    return {"CPU": cpus_per_worker}


def make_placement_group(tp_size: int, device: str, strategy: str, cpus_per_worker: float = 1,
                         detached: bool = False, timeout_s: float = 60.0, name: str = "",
                         target_node: str | None = None) -> PlacementGroup:
    """target_node: where a STRICT_PACK group should go if it fits there (a preference)."""
    bundles = [worker_bundle(device, cpus_per_worker) for _ in range(tp_size)]
    pg = placement_group(bundles, strategy=strategy, name=name,
                         lifetime="detached" if detached else None,
                         _soft_target_node_id=target_node if strategy == "STRICT_PACK" else None)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        ray.util.remove_placement_group(pg)
        raise ValueError(f"could not place {tp_size} bundles of {bundles[0]} ({strategy}) "
                         f"within {timeout_s:.0f} s; the cluster has "
                         f"{ray.available_resources()}")
    return pg


def rank_bundles(pg: PlacementGroup, driver_node_id: str | None = None) -> list[int]:
    """Bundle index of each rank: bundles on the driver's node first (rank 0 shares a node with
    the EngineCore and the driver where it can), then the rest in bundle order."""
    node_of = placement_group_table(pg)["bundles_to_node_id"]
    driver_node_id = driver_node_id or ray.get_runtime_context().get_node_id()
    return sorted(node_of, key=lambda b: (node_of[b] != driver_node_id, b))

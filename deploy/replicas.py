"""The replicas of a replicated deployment: a placement group and an EngineActor each.

Replica r of the deployment whose engine id is `uid` is the actor `uid+r<r>`, its workers
`uid+r<r>-rank<k>`, and (named deployments) its detached placement group `tierserve-pg-
<name>+r<r>`, so that `stop` finds every part of it by name whatever died. Replicas spread over
the nodes: a replica whose TP group fits one node goes, where it fits, to the node holding the
fewest of the deployment's replicas. Replicas on one node share its SSD tier folder (entries
are content-addressed: what one wrote, another finds on a miss).
"""
from __future__ import annotations

import collections
import logging
import math
import os

import ray
from ray.util.placement_group import PlacementGroup, placement_group_table, \
    remove_placement_group

from tierserve.deploy.placement import make_placement_group, worker_bundle, worker_names
from tierserve.runtime import envs
from tierserve.runtime.config import EngineConfig
from tierserve.workers.worker import resolve_device

__all__ = ["replica_uid", "replica_pg_name", "replica_config", "replica_log_path",
           "start_replica", "stop_replica", "kill_replica", "node_of"]

log = logging.getLogger("tierserve.replicas")


def replica_uid(deployment_uid: str, replica: int) -> str:
    return f"{deployment_uid}+r{replica}"


def replica_pg_name(name: str | None, replica: int) -> str:
    """A named deployment's replica placement group name ("" for an anonymous one)."""
    return f"tierserve-pg-{name}+r{replica}" if name is not None else ""


def replica_log_path(path: str, replica: int) -> str:
    """Replica r's request log: PATH with `.replica<r>` before its extension, since two
    writers of one file would interleave their frames and rotate each other's files."""
    root, ext = os.path.splitext(path)
    return f"{root}.replica{replica}{ext}"


def _alive_nodes() -> list[dict]:
    return [n for n in ray.nodes() if n.get("Alive")]


def replica_config(config: EngineConfig) -> EngineConfig:
    """The config every replica runs: CPUs per rank resolved (default: a node's cores over
    the ranks of the replicas that node would hold, spread evenly)."""
    if config.cpus_per_worker is not None:
        return config
    nodes = _alive_nodes()
    per_node = math.ceil(config.data_parallel_size / max(1, len(nodes)))
    cores = min((int(n["Resources"].get("CPU", 0)) for n in nodes), default=0) \
        or os.cpu_count() or 1
    cpus = max(1, cores // (config.tensor_parallel_size * per_node))
    return config.replace(cpus_per_worker=cpus)



def node_of(pg: PlacementGroup) -> str | None:
    """The node of the group's first bundle (where the engine actor runs)."""
    nodes = placement_group_table(pg).get("bundles_to_node_id") or {}
    return nodes.get(0)


def _target_node(config: EngineConfig, taken: collections.Counter) -> str | None:
    """The alive node holding the fewest of the deployment's replicas among those whose
    resources can hold the whole TP group; None when none can (the group then spans nodes)."""
    device = resolve_device(config.device)
    bundle = worker_bundle(device, config.cpus_per_worker)
    need = {k: v * config.tensor_parallel_size for k, v in bundle.items()}
    fits = [n["NodeID"] for n in _alive_nodes()
            if all(n["Resources"].get(k, 0) >= v for k, v in need.items())]
    return min(fits, key=lambda n: (taken[n], n)) if fits else None


def start_replica(config: EngineConfig, uid: str, name: str | None, replica: int,
                  namespace: str | None, pg: PlacementGroup | None,
                  taken: collections.Counter):
    """Starts replica `replica` (on `pg` when restarting it, else on a new group); returns
    (actor, pg). A failure leaves no actor behind, nor a group this call made."""
    from tierserve.deploy.deployment_start import start_engine_actor

    if pg is None and name is not None:  # one left by a router that died
        try:
            pg = ray.util.get_placement_group(replica_pg_name(name, replica))
        except ValueError:
            pass
    made = pg is None
    if made:
        device = resolve_device(config.device)
        strategy, target = config.placement_strategy, None
        if strategy in ("PACK", "STRICT_PACK"):
            target = _target_node(config, taken)
            if target is not None:
                strategy = "STRICT_PACK"
        pg = make_placement_group(config.tensor_parallel_size, device, strategy,
                                  config.cpus_per_worker, detached=name is not None,
                                  name=replica_pg_name(name, replica), target_node=target)
    if config.request_log_path is not None:
        config = config.replace(request_log_path=replica_log_path(config.request_log_path,
                                                                  replica))
    try:
        actor = start_engine_actor(config, pg, replica_uid(uid, replica), namespace,
                                   detached=name is not None)
    except BaseException:
        if made:
            remove_placement_group(pg)
        raise
    return actor, pg


def kill_replica(actor, uid: str, replica: int, tp_size: int, namespace: str | None) -> None:
    """Kills the replica's engine actor (if any) and its workers, by name: a dead engine's
    named workers would keep a restarted one from taking their names."""
    ns = namespace or envs.default_namespace()
    if actor is not None:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:
            pass
    prefix = replica_uid(uid, replica)
    for rank in range(tp_size):
        for worker_name in worker_names(prefix, rank):  # ranks and spares
            try:
                ray.kill(ray.get_actor(worker_name, namespace=ns), no_restart=True)
            except ValueError:  # not there
                pass


def stop_replica(actor, pg: PlacementGroup | None, uid: str, replica: int, tp_size: int,
                 namespace: str | None, timeout_s: float = 30.0) -> None:
    """A clean shutdown (the SSD tier written), then every part of the replica removed."""
    if actor is not None:
        try:
            ray.get(actor.shutdown.remote(), timeout=timeout_s)
        except Exception as e:
            log.warning("replica %d did not shut down cleanly: %s", replica, e)
    kill_replica(actor, uid, replica, tp_size, namespace)
    if pg is not None:
        try:
            remove_placement_group(pg)
        except Exception as e:
            log.warning("could not remove the placement group of replica %d: %s", replica, e)

"""Stopping a deployment in whatever state it is in: its engine actor (or its router and
replicas), its workers, placement groups and IPC folders; then the local head `serve` started
for it, once no deployment is left on that head."""
from __future__ import annotations

import logging

import ray
from ray.util.placement_group import remove_placement_group

from tierserve.deploy import ray_cluster
from tierserve.deploy.dataplane import remove_ipc_dirs, remove_stale_ipc_dirs
from tierserve.deploy.deployment_names import actor_name, deployments_left, holder_name, lookup
from tierserve.deploy.holder import release
from tierserve.runtime import envs

__all__ = ["stop", "stop_deployment"]

log = logging.getLogger("tierserve.deploy")


def stop(name: str, namespace: str | None = None) -> bool:
    """Shuts the named deployment down: engine actor, workers, placement group, IPC folders,
    whatever state it is in; then the local head `serve` started for it, if no deployment is
    left on it. False if there was nothing of it."""
    try:
        ray_cluster.join(namespace)
    except ray_cluster.NoClusterError:
        return False
    found = stop_deployment(name, namespace)
    head = ray_cluster.local_head()
    if head is not None and _joined(head) and not deployments_left():
        ray_cluster.stop_head(head)
        log.info("stopped the local Ray head at %s", head.address)
    return found


def _joined(head: ray_cluster.LocalHead) -> bool:
    """Whether this process is connected to `head` (its GCS port, on this machine)."""
    address = ray.get_runtime_context().gcs_address or ""
    return address.rpartition(":")[2] == head.address.rpartition(":")[2]


def stop_deployment(name: str, namespace: str | None) -> bool:
    """Removes whatever the named deployment left on the joined cluster; False if nothing."""
    ns = namespace or envs.default_namespace()
    replicated = _stop_replicated(name, ns)
    actor, holder = lookup(actor_name(name), ns), lookup(holder_name(name), ns)
    if actor is not None:
        try:
            ray.get(actor.shutdown.remote(), timeout=30)
        except Exception as e:  # a dead engine still gets its resources removed
            log.warning("engine %s did not shut down cleanly: %s", name, e)
        ray.kill(actor, no_restart=True)
    if holder is not None:
        release(holder, name, ns)
    # The engine's folder, on this node (elsewhere, the next data-plane server there sweeps
    # folders whose owner died).
    remove_ipc_dirs(actor_name(name), wait_s=10.0 if actor is not None else 0.0)
    remove_stale_ipc_dirs()
    return actor is not None or holder is not None or replicated


def _stop_replicated(name: str, ns: str) -> bool:
    """Stops a replicated deployment: its router stops every replica; then whatever is left
    of one (a replica or worker whose router died, a placement group), found by name."""
    from tierserve.deploy.router import router_name

    router = lookup(router_name(name), ns)
    if router is not None:
        try:
            ray.get(router.shutdown.remote(), timeout=120)
        except Exception as e:
            log.warning("the router of %s did not shut down cleanly: %s", name, e)
        ray.kill(router, no_restart=True)
    prefix = actor_name(name) + "+r"
    leftovers = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == ns and a["name"].startswith(prefix)]
    for actor_id in leftovers:
        actor = lookup(actor_id, ns)
        if actor is not None:
            ray.kill(actor, no_restart=True)
    pgs = _remove_replica_groups(holder_name(name) + "+r")
    for uid in {n.split("-rank")[0] for n in leftovers} | {prefix}:
        remove_ipc_dirs(uid, wait_s=0.0)
    return router is not None or bool(leftovers) or bool(pgs)


def _remove_replica_groups(pg_prefix: str) -> list[str]:
    """Removes the live placement groups whose name starts with `pg_prefix`; their ids."""
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup

    pgs = [pg_id for pg_id, pg in ray.util.placement_group_table().items()
           if pg.get("name", "").startswith(pg_prefix) and pg.get("state") != "REMOVED"]
    for pg_id in pgs:  # by id: a name is only found from its creator's namespace
        remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(pg_id))))
    return pgs

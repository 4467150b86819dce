"""Starting a deployment on Ray: one engine (its placement group, its EngineActor and, when
named, its holder) or a replicated one (its router). A start that fails leaves nothing behind.

The engine's modules (torch among them) are imported where an engine starts, not here: status,
stop and generate --name talk to a running deployment with Ray alone."""
from __future__ import annotations

import os

import ray
from ray.util.placement_group import remove_placement_group

from tierserve.deploy.capacity import check_placement, resolve_cpus_per_worker
from tierserve.deploy.deployment_names import actor_name
from tierserve.deploy.holder import remember
from tierserve.runtime import envs
from tierserve.runtime.config import EngineConfig

__all__ = ["start_deployment", "start_engine_actor", "start_replicated"]


def start_deployment(config: EngineConfig, name: str | None = None,
                     namespace: str | None = None):
    """Creates the placement group and the engine actor; returns (actor, placement group).
    The actor's constructor starts the workers, so this returns once the model is loaded. A
    model, TP size or placement that cannot work fails here at once, before anything waits;
    a start that fails later leaves no actor, placement group or folder behind."""
    from tierserve.deploy.placement import make_placement_group
    from tierserve.runtime.engine_setup import check_model
    from tierserve.workers.worker import resolve_device

    check_model(config)
    device = resolve_device(config.device)
    cpus = resolve_cpus_per_worker(config)
    config = config.replace(cpus_per_worker=cpus)
    check_placement(config.tensor_parallel_size, device, config.placement_strategy, cpus)
    detached = name is not None
    pg = make_placement_group(config.tensor_parallel_size, device, config.placement_strategy,
                              cpus, detached=detached)
    uid = actor_name(name) if detached else f"tierserve-{os.urandom(4).hex()}"
    holder = remember(pg, config.tensor_parallel_size, uid, name, namespace) if detached \
        else None
    try:
        actor = start_engine_actor(config, pg, uid, namespace, detached)
    except BaseException:
        remove_placement_group(pg)
        if holder is not None:
            ray.kill(holder, no_restart=True)
        raise
    return actor, pg


def start_engine_actor(config: EngineConfig, pg, uid: str, namespace: str | None,
                       detached: bool):
    """The EngineActor on rank 0's bundle of `pg`, named `uid` when detached; returns once
    its model is loaded (a start that fails leaves no actor)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from tierserve.deploy.engine_actor import EngineActor
    from tierserve.deploy.placement import rank_bundles

    actor = None
    try:
        bundles = rank_bundles(pg)
        options = dict(num_cpus=0, max_concurrency=1000,
                       scheduling_strategy=PlacementGroupSchedulingStrategy(
                           pg, placement_group_bundle_index=bundles[0]),
                       # The engine and its workers (which inherit it) see this process's
                       # TIERSERVE_* settings, not those the cluster was started with.
                       runtime_env={"env_vars": envs.actor_variables()})
        if detached:
            options.update(name=uid, namespace=namespace or envs.default_namespace(),
                           lifetime="detached")
        actor = ray.remote(EngineActor).options(**options).remote(config, pg, bundles, uid)
        ray.get(actor.health.remote())
    except BaseException as e:
        if actor is not None:
            ray.kill(actor, no_restart=True)
        bad = _bad_config(e)
        if bad is not None:
            raise bad from None
        raise
    return actor


def _bad_config(error: BaseException) -> ValueError | None:
    """The ValueError an engine's constructor raised (a config the model or the pool cannot
    take), out of the actor error Ray wraps it in."""
    for arg in getattr(error, "args", ()):
        if isinstance(arg, ray.exceptions.RayTaskError) and isinstance(arg.cause, ValueError):
            return ValueError(str(arg.cause))
    return None


def start_replicated(config: EngineConfig, name: str | None = None,
                     namespace: str | None = None):
    """A replicated deployment: its router actor, which starts data_parallel_size replicas;
    returns its client once every replica serves. Named: detached, and found by `connect`;
    anonymous: owned by the returned client."""
    from tierserve.deploy.replicas import replica_config
    from tierserve.deploy.router import Router, router_name
    from tierserve.deploy.router_client import RouterClient
    from tierserve.runtime.engine_setup import check_model
    from tierserve.workers.worker import resolve_device

    check_model(config)
    config = replica_config(config)
    device = resolve_device(config.device)
    check_placement(config.tensor_parallel_size * config.data_parallel_size, device,
                    "PACK", config.cpus_per_worker,
                    what=f"data_parallel_size={config.data_parallel_size} x "
                         f"tensor_parallel_size={config.tensor_parallel_size}")
    uid = actor_name(name) if name is not None else f"tierserve-{os.urandom(4).hex()}"
    options = dict(num_cpus=0, max_concurrency=1000,
                   runtime_env={"env_vars": envs.actor_variables()})
    if name is not None:
        # Ray restarts a named deployment's router (it then adopts the running replicas),
        # and calls made meanwhile are retried.
        options.update(name=router_name(name), namespace=namespace or envs.default_namespace(),
                       lifetime="detached", max_restarts=-1, max_task_retries=-1)
    router = ray.remote(Router).options(**options).remote(config, uid, name, namespace)
    try:
        ray.get(router.start.remote())
    except BaseException:
        ray.kill(router, no_restart=True)
        raise
    return RouterClient(router, name, owned=name is None)

"""Deployments on Ray, the entry points: `serve(name=...)` starts a detached, named deployment
(or connects to the running one); `connect(name)` is the running one's client; `stop(name)`
removes every actor and the placement group. `RayDeployments` is the transport runtime/ is
given (`tierserve` registers it).

What they are built from, one concern a module:
- deployment_names.py: the deployment's actor names, joining its cluster, finding its actors;
- capacity.py: each rank's CPUs and whether the cluster can hold the bundles;
- deployment_start.py: the placement group and engine actor, or the router of replicas;
- holder.py: the holder that remembers a named deployment's placement group and workers;
- deployment_stop.py: removing a deployment in whatever state it is in;
- engine_client.py: `RayEngineClient`, the client side of one engine, anonymous and owned by
  an `LLM` or `AsyncLLM` (gone with it), or connected to a named deployment.
"""
from __future__ import annotations

import logging

from tierserve.deploy import ray_cluster
# Callers and tests import these from here as well as from the modules that own them.
from tierserve.deploy.capacity import (  # noqa: F401
    _fitting_cpus, _room, check_placement, default_cpus_per_worker)
from tierserve.deploy.deployment_names import (
    actor_name, deployments_left, ensure_ray, holder_name, join, lookup)
from tierserve.deploy.deployment_start import (  # noqa: F401
    start_deployment, start_engine_actor, start_replicated)
from tierserve.deploy.deployment_stop import stop, stop_deployment
from tierserve.deploy.engine_client import RayEngineClient
from tierserve.runtime import envs
from tierserve.runtime.client import AsyncLLM
from tierserve.runtime.config import EngineConfig
from tierserve.runtime.errors import EngineDeadError

__all__ = ["serve", "stop", "connect", "RayEngineClient", "RayDeployments", "start_deployment",
           "ensure_ray", "actor_name"]

log = logging.getLogger("tierserve.deploy")


def serve(name: str, namespace: str | None = None, **options) -> AsyncLLM:
    """Starts the named deployment, or connects to the running one. A deployment that died
    (its engine, or a worker; with replicas, every replica) is torn down and started
    afresh. With no Ray cluster to join, a local head is started for it
    (deploy/ray_cluster.py); a start that fails stops that head again, so nothing is left
    running for a deployment that is not there."""
    config = EngineConfig.from_kwargs(**options)
    head = ray_cluster.join(namespace, start=True)
    try:
        llm = _serve_on_cluster(config, name, namespace)
    except BaseException:
        if head is not None and not deployments_left():
            ray_cluster.stop_head(head)
        raise
    if head is not None:
        log.warning("started a local Ray head for %r at %s (%d CPUs, folder %s); it stops with "
                    "its last deployment: tierserve stop %s", name, head.address, head.num_cpus,
                    head.temp_dir, name)
    return llm


def _serve_on_cluster(config: EngineConfig, name: str, namespace: str | None) -> AsyncLLM:
    try:
        llm = connect(name, namespace)
        llm.engine.health()
        return llm
    except ValueError:  # none running
        pass
    except EngineDeadError as e:
        log.warning("deployment %r is dead (%s); starting a new one", name, e)
    stop_deployment(name, namespace)  # whatever a dead or half-started one left behind
    if config.data_parallel_size > 1:
        return AsyncLLM(client=start_replicated(config, name, namespace), name=name)
    actor, _ = start_deployment(config, name, namespace)
    return AsyncLLM(client=RayEngineClient(actor, name), name=name)


def connect(name: str, namespace: str | None = None) -> AsyncLLM:
    return AsyncLLM(client=_connect_client(name, namespace), name=name)


def _connect_client(name: str, namespace: str | None):
    """The running deployment's client: its engine's, else its router's (with replicas; the
    router's modules are imported only then)."""
    ns = namespace or envs.default_namespace()
    join(name, namespace)
    if lookup(actor_name(name), ns) is None and lookup(holder_name(name), ns) is None:
        from tierserve.deploy.router import router_name
        from tierserve.deploy.router_client import RouterClient
        router = lookup(router_name(name), ns)
        if router is not None:
            return RouterClient(router, name)
    return RayEngineClient.connect(name, namespace)


class RayDeployments:
    """runtime's transport to engines on Ray (client.Deployments)."""

    def start(self, config: EngineConfig):
        if config.data_parallel_size > 1:
            # A model or TP size that cannot work fails before a Ray instance starts for it.
            from tierserve.runtime.engine_setup import check_model
            check_model(config)
            ensure_ray()
            return start_replicated(config)
        return RayEngineClient.start(config)

    def connect(self, name: str, namespace: str | None):
        return _connect_client(name, namespace)

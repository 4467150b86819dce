"""A deployment's named actors on Ray: what they are called, joining the cluster they live on,
and finding them there by name."""
from __future__ import annotations

import logging

import ray

from tierserve.deploy import ray_cluster
from tierserve.runtime import envs

__all__ = ["actor_name", "holder_name", "ensure_ray", "join", "lookup", "deployments_left"]

# Every named actor of a deployment starts with "tierserve-": `deployments_left` counts on it.
_ACTOR_PREFIX = "tierserve-engine-"
_HOLDER_PREFIX = "tierserve-pg-"


def actor_name(name: str) -> str:
    return _ACTOR_PREFIX + name


def holder_name(name: str) -> str:
    return _HOLDER_PREFIX + name


def ensure_ray(namespace: str | None = None) -> None:
    """For an engine this process owns: joins the cluster RAY_ADDRESS names (or this job's),
    else starts a private local instance that ends with this process."""
    if not ray.is_initialized():
        ray.init(address=envs.ray_address(), namespace=namespace or envs.default_namespace(),
                 log_to_driver=False, logging_level=logging.WARNING)


def join(name: str, namespace: str | None) -> None:
    """Joins the deployments' cluster; without one, no deployment named `name` is there."""
    try:
        ray_cluster.join(namespace)
    except ray_cluster.NoClusterError as e:
        raise ValueError(f"no tierserve deployment named {name!r}: {e}; `tierserve serve "
                         f"--name {name}` starts one") from None


def lookup(name: str, namespace: str):
    """The named actor's handle, or None where no actor has that name."""
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None


def deployments_left() -> list[str]:
    """What of tierserve's deployments is on the cluster this process joined: every named
    actor of theirs (engines, workers, holders, routers, replicas), as namespace/name."""
    return sorted(f"{a['namespace']}/{a['name']}"
                  for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith("tierserve-"))

"""The holder of a named deployment: a small detached actor that remembers what the deployment
owns beyond its engine actor (its placement group, its workers' names), so that `stop` can
remove all of it whatever died."""
from __future__ import annotations

import logging

import ray
from ray.util.placement_group import remove_placement_group

from tierserve.deploy.deployment_names import holder_name, lookup
from tierserve.runtime import envs

__all__ = ["remember", "release"]

log = logging.getLogger("tierserve.deploy")


def remember(pg, tp_size: int, uid: str, name: str, namespace: str | None):
    """The named deployment's holder, made before its engine starts; returns it once it
    answers."""
    holder = ray.remote(_DeploymentHolder).options(
        name=holder_name(name), namespace=namespace or envs.default_namespace(),
        lifetime="detached", num_cpus=0).remote(pg, tp_size, uid)
    ray.get(holder.ping.remote())
    return holder


def release(holder, name: str, ns: str) -> None:
    """Kills the workers the holder names and removes its placement group, then the holder."""
    try:
        pg, tp_size, uid = ray.get(holder.get.remote(), timeout=30)
        from tierserve.deploy.placement import worker_names
        for rank in range(tp_size):  # workers outlive an engine actor killed by Ray
            for worker_name in worker_names(uid, rank):  # ranks and spares
                worker = lookup(worker_name, ns)
                if worker is not None:
                    ray.kill(worker, no_restart=True)
        remove_placement_group(pg)
    except Exception as e:
        log.warning("could not release the placement group of %s: %s", name, e)
    ray.kill(holder, no_restart=True)


class _DeploymentHolder:
    def __init__(self, pg, tp_size: int, uid: str) -> None:
        self.pg, self.tp_size, self.uid = pg, tp_size, uid

    def ping(self) -> bool:
        return True

    def get(self) -> tuple:
        return self.pg, self.tp_size, self.uid

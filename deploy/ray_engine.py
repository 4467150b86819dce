"""Deployments on Ray: a placement group, the EngineCore actor on rank 0's node, its workers.

`serve(name=...)` starts a detached, named deployment (or returns the running one);
`stop(name)` removes every actor and the placement group. `RayEngineClient` is an anonymous
deployment owned by one `tierserve.LLM` / `AsyncLLM` and gone with it.
"""
from __future__ import annotations

import logging
import os

import ray
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tierserve.deploy.engine_actor import EngineActor
from tierserve.deploy.placement import make_placement_group, rank_bundles
from tierserve.runtime import envs
from tierserve.runtime.client import EngineHandle, actor_name, connect, ensure_ray
from tierserve.runtime.config import EngineConfig
from tierserve.runtime.engine_core import load_model_tokenizer, make_worker_spec
from tierserve.workers.worker import resolve_device

__all__ = ["serve", "stop", "RayEngineClient", "AsyncLLM", "start_deployment"]

log = logging.getLogger("tierserve.deploy")


def _cpus_per_worker(config: EngineConfig) -> int:
    if config.cpus_per_worker is not None:
        return config.cpus_per_worker
    return max(1, (os.cpu_count() or 1) // config.tensor_parallel_size)


def start_deployment(config: EngineConfig, name: str | None = None,
                     namespace: str | None = None):
    """Creates the placement group and the engine actor; returns (actor, placement group).
    The actor's constructor starts the workers, so this returns once the model is loaded."""
    device = resolve_device(config.device)
    cpus = _cpus_per_worker(config)
    config = config.replace(cpus_per_worker=cpus)
    detached = name is not None
    pg = make_placement_group(config.tensor_parallel_size, device, config.placement_strategy,
                              cpus, detached=detached)
    bundles = rank_bundles(pg)
    options = dict(num_cpus=0, max_concurrency=1000,
                   scheduling_strategy=PlacementGroupSchedulingStrategy(
                       pg, placement_group_bundle_index=bundles[0]))
    if detached:
        options.update(name=actor_name(name), namespace=namespace or envs.default_namespace(),
                       lifetime="detached")
    uid = actor_name(name) if detached else f"tierserve-{os.urandom(4).hex()}"
    actor = ray.remote(EngineActor).options(**options).remote(config, pg, bundles, uid)
    try:
        ray.get(actor.health.remote())
    except Exception:
        ray.kill(actor, no_restart=True)
        remove_placement_group(pg)
        raise
    return actor, pg


def _pg_name(name: str, namespace: str | None) -> str:
    return f"tierserve-{namespace or envs.default_namespace()}-{name}"


def serve(name: str, namespace: str | None = None, **options) -> EngineHandle:
    """Starts the named deployment, or returns a handle on the running one."""
    ensure_ray(namespace)
    try:
        return connect(name, namespace)
    except ValueError:
        pass
    config = EngineConfig.from_kwargs(**options)
    actor, pg = start_deployment(config, name, namespace)
    _remember_pg(actor, pg, name, namespace)
    return EngineHandle(actor, name)


def _remember_pg(actor, pg, name: str, namespace: str | None) -> None:
    # A detached placement group outlives its creator; keep its id with a named, detached
    # holder so `stop` (from any process) can remove it.
    holder = ray.remote(_PGHolder).options(
        name=_pg_name(name, namespace), namespace=namespace or envs.default_namespace(),
        lifetime="detached", num_cpus=0).remote(pg)
    ray.get(holder.ping.remote())


class _PGHolder:
    def __init__(self, pg) -> None:
        self.pg = pg

    def ping(self) -> bool:
        return True

    def get(self):
        return self.pg


def stop(name: str, namespace: str | None = None) -> bool:
    """Shuts the named deployment down: engine actor, workers, placement group. False if absent."""
    ensure_ray(namespace)
    ns = namespace or envs.default_namespace()
    try:
        actor = ray.get_actor(actor_name(name), namespace=ns)
    except ValueError:
        return False
    try:
        ray.get(actor.shutdown.remote(), timeout=30)
    except Exception as e:  # a dead engine still gets its resources removed
        log.warning("engine %s did not shut down cleanly: %s", name, e)
    ray.kill(actor, no_restart=True)
    try:
        holder = ray.get_actor(_pg_name(name, namespace), namespace=ns)
        remove_placement_group(ray.get(holder.get.remote()))
        ray.kill(holder, no_restart=True)
    except ValueError:
        pass
    return True


class RayEngineClient(EngineHandle):
    """An anonymous deployment owned by this process (LLM / AsyncLLM with Ray)."""

    def __init__(self, config: EngineConfig) -> None:
        ensure_ray()
        actor, self._pg = start_deployment(config)
        super().__init__(actor)
        self.config = config
        self._tokenizer = None
        info = self.info()
        self.vocab_size = info["vocab_size"]
        self.max_model_len = info["max_model_len"]

    def __reduce__(self):
        return (EngineHandle, (self.actor, self.name))

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_model_tokenizer(self.config.tokenizer
                                                   or make_worker_spec(self.config).model)
        return self._tokenizer

    def shutdown(self) -> None:
        if self.actor is None:
            return
        try:
            ray.get(self.actor.shutdown.remote(), timeout=30)
        except Exception as e:
            log.warning("engine did not shut down cleanly: %s", e)
        ray.kill(self.actor, no_restart=True)
        remove_placement_group(self._pg)
        self.actor = None


class AsyncLLM(RayEngineClient):
    """`AsyncLLM(model, **options)`: an engine on Ray with the streaming `generate` of
    EngineHandle; many concurrent callers share it."""

    def __init__(self, model: str | None = None, **options) -> None:
        super().__init__(EngineConfig.from_kwargs(model=model, **options))


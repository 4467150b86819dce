"""Deployments on Ray: a placement group, the EngineCore actor on rank 0's node, its workers.

`serve(name=...)` starts a detached, named deployment (or connects to the running one);
`stop(name)` removes every actor and the placement group. `RayEngineClient` is the client side
of one deployment, an engine client for runtime's `LLM` and `AsyncLLM`: anonymous and owned by
one of them (gone with it), or connected to a named one. `RayDeployments` is the transport
runtime/ is given (`tierserve` registers it).
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
from tierserve.runtime.client import AsyncLLM
from tierserve.runtime.config import EngineConfig
from tierserve.runtime.engine_core import load_model_tokenizer
from tierserve.runtime.executor import EngineDeadError
from tierserve.scheduler.messages import ClientChannelCodec, EngineCoreRequest
from tierserve.workers.worker import resolve_device

__all__ = ["serve", "stop", "connect", "RayEngineClient", "RayDeployments", "start_deployment",
           "ensure_ray", "actor_name"]

log = logging.getLogger("tierserve.deploy")

_ACTOR_PREFIX = "tierserve-engine-"


def actor_name(name: str) -> str:
    return _ACTOR_PREFIX + name


def ensure_ray(namespace: str | None = None) -> None:
    """Joins the cluster RAY_ADDRESS names (or this job's), else starts a local instance."""
    if not ray.is_initialized():
        ray.init(address=envs.ray_address(), namespace=namespace or envs.default_namespace(),
                 log_to_driver=False)


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


def serve(name: str, namespace: str | None = None, **options) -> AsyncLLM:
    """Starts the named deployment, or connects to the running one."""
    ensure_ray(namespace)
    try:
        return connect(name, namespace)
    except ValueError:
        pass
    config = EngineConfig.from_kwargs(**options)
    actor, pg = start_deployment(config, name, namespace)
    _remember_pg(actor, pg, name, namespace)
    return AsyncLLM(client=RayEngineClient(actor, name), name=name)


def connect(name: str, namespace: str | None = None) -> AsyncLLM:
    return AsyncLLM(client=RayEngineClient.connect(name, namespace), name=name)


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


class RayEngineClient:
    """The client side of one deployment: the engine actor's handle. It pickles (as the
    handle), so a connected client travels into Ray tasks and actors."""

    def __init__(self, actor, name: str | None = None, *, config: EngineConfig | None = None,
                 pg=None) -> None:
        self.actor = actor
        self.name = name
        self.config = config  # set on an owned engine
        self._pg = pg  # an owned engine's placement group, removed with it
        self._codec = ClientChannelCodec()
        self._tokenizer = None
        info = self.info()
        self.vocab_size = info["vocab_size"]
        self.max_model_len = info["max_model_len"]
        self._tokenizer_path = info["tokenizer_path"]

    @classmethod
    def start(cls, config: EngineConfig) -> "RayEngineClient":
        """An anonymous deployment owned by this client."""
        ensure_ray()
        actor, pg = start_deployment(config)
        return cls(actor, config=config, pg=pg)

    @classmethod
    def connect(cls, name: str, namespace: str | None = None) -> "RayEngineClient":
        ensure_ray(namespace)
        ns = namespace or envs.default_namespace()
        try:
            actor = ray.get_actor(actor_name(name), namespace=ns)
        except ValueError:
            raise ValueError(f"no tierserve deployment named {name!r} in namespace "
                             f"{ns!r}") from None
        return cls(actor, name)

    def __reduce__(self):
        return (RayEngineClient, (self.actor, self.name))

    @property
    def tokenizer(self):
        """The engine's tokenizer, loaded here on first use (None for a model without one)."""
        if self._tokenizer is None:
            self._tokenizer = load_model_tokenizer(self._tokenizer_path)
        return self._tokenizer

    async def generate(self, requests: list[EngineCoreRequest]):
        stream = self.actor.generate.options(num_returns="streaming").remote(requests)
        pending = {r.req_id for r in requests}
        try:
            async for ref in stream:
                batch = self._codec.decode(await ref).outputs
                pending.difference_update(o.req_id for o in batch if o.finish_reason is not None)
                yield batch
        except ray.exceptions.RayActorError as e:
            raise EngineDeadError(f"the engine actor died: {e}") from e
        finally:
            if pending:
                ray.cancel(stream)
                self.actor.abort.remote(list(pending))

    def stream_batch(self, requests: list[EngineCoreRequest]):
        stream = self.actor.generate.options(num_returns="streaming").remote(requests)
        done = False
        try:
            for ref in stream:
                yield self._codec.decode(ray.get(ref)).outputs
            done = True
        except ray.exceptions.RayActorError as e:
            raise EngineDeadError(f"the engine actor died: {e}") from e
        finally:
            if not done:
                ray.cancel(stream)
                self.actor.abort.remote([r.req_id for r in requests])

    def abort(self, request_ids: list[str]) -> None:
        self.actor.abort.remote(list(request_ids))

    def stats(self) -> dict:
        return ray.get(self.actor.stats.remote())

    def info(self) -> dict:
        return ray.get(self.actor.info.remote())

    def reset_prefix_cache(self) -> bool:
        return ray.get(self.actor.reset_prefix_cache.remote())

    def shutdown(self) -> None:
        """Stops an owned engine; a connected client just lets go of the deployment."""
        if self._pg is None or self.actor is None:
            return
        try:
            ray.get(self.actor.shutdown.remote(), timeout=30)
        except Exception as e:
            log.warning("engine did not shut down cleanly: %s", e)
        ray.kill(self.actor, no_restart=True)
        remove_placement_group(self._pg)
        self.actor = None


class RayDeployments:
    """runtime's transport to engines on Ray (client.Deployments)."""

    def start(self, config: EngineConfig) -> RayEngineClient:
        return RayEngineClient.start(config)

    def connect(self, name: str, namespace: str | None) -> RayEngineClient:
        return RayEngineClient.connect(name, namespace)

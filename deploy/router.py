"""The router of a replicated deployment: a Ray actor that owns the replicas and picks one per
request; it never carries a token (clients stream from the replica it picks,
deploy/router_client.py).

- Replicas (deploy/replicas.py): started at once, spread over the nodes; each one's death is
  seen at once (a `watch` call kept pending on it fails or returns), after which the replica
  is routed nothing, forgotten by the index and restarted on its placement group (with its
  SSD tier), and rejoins; `scale` adds replicas or drains and removes them.
- KV events (scheduler/kv_events.py) arrive by `kv_events`, tagged (replica, generation):
  the index (deploy/kv_index.py) applies them, and fetches a snapshot from the replica when
  one says so. Frames of a replica's earlier generation are dropped.
- `route` applies the policy (deploy/routing.py) to the live replicas and counts the request
  in the chosen replica's in-transit load; its time per request is measured.

Every method runs on the actor's one event loop; blocking Ray calls go to threads.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time

import ray

from tierserve.deploy.kv_index import KVIndex
from tierserve.deploy.priority import restore_priority
from tierserve.deploy.replica_set import DRAIN_TIMEOUT_S, Replica, ReplicaSet
from tierserve.deploy.replicas import replica_config
from tierserve.deploy.routing import Candidate, KVAware, RouteQuery, make_policy
from tierserve.kvcache.hashing import BlockHasher
from tierserve.runtime.config import EngineConfig
from tierserve.runtime.errors import EngineDeadError
from tierserve.scheduler.kv_events import KVEventCodec
from tierserve.scheduler.messages import MalformedFrameError

__all__ = ["Router", "router_name"]

log = logging.getLogger("tierserve.router")

# A request finding no live replica waits this long for one to (re)start before failing.
_NO_REPLICA_WAIT_S = 120.0
# Route times kept for the stats' mean and percentiles.
_ROUTE_SAMPLES = 4096


def router_name(name: str) -> str:
    return f"tierserve-router-{name}"


class Router:
    def __init__(self, config: EngineConfig, uid: str, name: str | None,
                 namespace: str | None) -> None:
        restore_priority()  # routes are on every request's way to its first token
        self.config = replica_config(config)
        self.index = KVIndex()
        hasher = BlockHasher(config.block_size, config.prefix_caching_hash_algo,
                             config.hash_seed)
        self.policy = make_policy(config.routing_policy, self.index, hasher,
                                  config.max_num_batched_tokens)
        self._hasher = hasher
        self._chain = KVAware(self.index, hasher, config.max_num_batched_tokens).chain
        self.replicas = ReplicaSet(self.config, uid, name, namespace, self._replica_up,
                                   self._replica_down)
        self._codec = KVEventCodec()
        # Per request: wall time, and this thread's CPU time (what routing costs, whatever
        # else shares the cores).
        self._route_us: collections.deque[float] = collections.deque(maxlen=_ROUTE_SAMPLES)
        self._route_cpu_us: collections.deque[float] = collections.deque(maxlen=_ROUTE_SAMPLES)
        self._routed = 0
        self._dropped_frames = 0
        # Ray restarted this actor (a named deployment's router): the replicas still run.
        self._adopted: asyncio.Future | None = None
        self._orphaned = name is not None and \
            ray.get_runtime_context().was_current_actor_reconstructed

    # ------------------------------------------------------------------ replicas

    async def start(self) -> int:
        """Starts data_parallel_size replicas; returns once every one serves (or raises the
        first start's error, the others stopped)."""
        await self.replicas.start(self.config.data_parallel_size)
        return len(self.replicas.replicas)

    async def _ready(self) -> None:
        """A restarted router first adopts the replicas (once; other calls wait for it)."""
        if not self._orphaned:
            return
        if self._adopted is None:
            self._adopted = asyncio.ensure_future(self._adopt())
        await asyncio.shield(self._adopted)

    async def _adopt(self) -> None:
        found = await self.replicas.adopt()
        log.warning("restarted: adopted %d running replicas", found)
        if not found:
            await self.replicas.start(self.config.data_parallel_size)

    def _replica_up(self, replica: Replica) -> None:
        if replica.id not in self.index.replicas:
            self.index.add_replica(replica.id)
        self._fetch_snapshot(replica)  # what it holds already (its SSD tier)

    def _replica_down(self, replica: Replica) -> None:
        if replica.id in self.index.replicas:
            self.index.remove_replica(replica.id)
        self.policy.forget(replica.id)

    async def replica_failed(self, replica_id: int, generation: int, reason: str) -> None:
        """A client saw the replica fail (its stream broke): stop routing to it now."""
        await self._ready()
        self.replicas.failed(replica_id, generation, reason)

    async def scale(self, size: int, drain_timeout_s: float = DRAIN_TIMEOUT_S) -> dict:
        """Adds replicas, or drains the highest-numbered ones away (ReplicaSet.scale)."""
        await self._ready()
        return await self.replicas.scale(size, drain_timeout_s)

    # ------------------------------------------------------------------ KV events

    async def kv_events(self, tag: tuple[int, int], frames: list[bytes]) -> None:
        await self._ready()
        replica_id, generation = tag
        replica = self.replicas.get(replica_id)
        if replica is None or replica.generation != generation \
                or replica_id not in self.index.replicas:
            return  # an earlier generation's frames, still on their way
        for data in frames:
            try:
                frame = self._codec.decode(data)
            except MalformedFrameError as e:
                self._dropped_frames += 1
                log.warning("replica %d sent a bad KV event frame: %s", replica_id, e)
                continue
            replica.load.report(frame.load, frame.epoch)
            if self.index.receive(replica_id, frame):
                self._fetch_snapshot(replica)

    def _fetch_snapshot(self, replica: Replica) -> None:
        if replica.snapshot is not None and not replica.snapshot.done():
            return
        replica.snapshot = asyncio.get_running_loop().create_task(
            self._snapshot(replica, replica.generation))

    async def _snapshot(self, replica: Replica, generation: int) -> None:
        try:
            data = await replica.actor.kv_snapshot.remote()
        except Exception as e:  # its death is the watch's to handle
            log.info("no KV snapshot from replica %d: %s", replica.id, e)
            return
        if replica.generation == generation and replica.id in self.index.replicas:
            if self.index.receive(replica.id, self._codec.decode(data)):
                replica.snapshot = None
                self._fetch_snapshot(replica)  # it moved on meanwhile (another gap)

    # ------------------------------------------------------------------ routing

    async def route(self, queries: list[RouteQuery]) -> list[tuple[int, int, object]]:
        """(replica, generation, engine actor) per query, in order."""
        await self._ready()
        if not self.replicas.live.is_set():
            try:
                await asyncio.wait_for(self.replicas.live.wait(), _NO_REPLICA_WAIT_S)
            except asyncio.TimeoutError:
                raise EngineDeadError(f"no replica of this deployment serves: "
                                      f"{self.replicas.errors()}") from None
        live = self.replicas.serving()
        out = []
        for query in queries:
            t0, c0 = time.perf_counter(), time.thread_time()
            candidates = [Candidate(r.id, r.load) for r in live if r.id not in query.exclude] \
                or [Candidate(r.id, r.load) for r in live]
            choice = self.policy.pick(query, candidates)
            replica = self.replicas.get(choice.replica)
            replica.load.route(choice.uncached_tokens)
            self._route_us.append((time.perf_counter() - t0) * 1e6)
            self._route_cpu_us.append((time.thread_time() - c0) * 1e6)
            out.append((replica.id, replica.generation, replica.actor))
        self._routed += len(queries)
        return out

    async def set_policy(self, name: str) -> str:
        """Switches the routing policy (for comparisons); returns the one it replaced."""
        old = self.policy.name
        self.policy = make_policy(name, self.index, self._hasher,
                                  self.config.max_num_batched_tokens)
        return old

    async def reset_route_times(self) -> None:
        """Starts the routing-time figures afresh (a benchmark's runs)."""
        self._route_us.clear()
        self._route_cpu_us.clear()

    async def explain(self, query: RouteQuery) -> dict[int, list[int]]:
        """What each live replica holds of the query's prompt, as the index says: blocks
        found on the device, in the CPU tier and on SSD (routes nothing)."""
        live = [r.id for r in self.replicas.serving()]
        found = self.index.match(self._chain(query.prompt_token_ids, query.cache_salt,
                                             query.lora_digest), live)
        return {r: [m.device, m.cpu, m.ssd] for r, m in found.items()}

    # ------------------------------------------------------------------ views

    async def replica_actors(self) -> dict[int, tuple[int, object]]:
        """Live replicas: id -> (generation, engine actor)."""
        await self._ready()
        return {r.id: (r.generation, r.actor) for r in self.replicas.serving()}

    async def health(self) -> bool:
        await self._ready()
        if not self.replicas.serving():
            raise EngineDeadError(f"no replica of this deployment serves: "
                                  f"{self.replicas.errors()}")
        return True

    async def describe(self) -> dict:
        """The router's own view: each replica's state, node, restarts, load, index size."""
        await self._ready()
        route_us = sorted(self._route_us)
        cpu_us = self._route_cpu_us
        return {
            "policy": self.policy.name, "routed": self._routed, "indexed_blocks": len(self.index),
            "route_us_mean": sum(route_us) / len(route_us) if route_us else 0.0,
            "route_us_p99": route_us[int(0.99 * (len(route_us) - 1))] if route_us else 0.0,
            "route_cpu_us_mean": sum(cpu_us) / len(cpu_us) if cpu_us else 0.0,
            "dropped_event_frames": self._dropped_frames,
            "replicas": {r.id: {
                "state": r.state.name.lower(), "node": r.node, "replica_restarts": r.restarts,
                "error": r.error, "generation": r.generation,
                "outstanding": r.load.outstanding, "in_transit": r.load.in_transit,
                "indexed_blocks": [len(t) for t in self.index.replicas[r.id].tiers]
                if r.id in self.index.replicas else [0, 0, 0],
                "event_resyncs": self.index.replicas[r.id].resyncs
                if r.id in self.index.replicas else 0,
            } for r in sorted(self.replicas, key=lambda r: r.id)},
        }

    async def _each(self, method: str, *args, timeout_s: float = 30.0) -> dict[int, object]:
        """method(*args) on every live replica, at once; replica -> result (an exception
        for one that failed)."""
        await self._ready()
        live = self.replicas.serving()
        refs = [getattr(r.actor, method).remote(*args) for r in live]

        async def one(ref):
            return await asyncio.wait_for(ref, timeout_s)
        results = await asyncio.gather(*(one(ref) for ref in refs), return_exceptions=True)
        return {r.id: res for r, res in zip(live, results)}

    async def info(self) -> dict:
        """A live replica's engine info, with the deployment's shape."""
        for res in (await self._each("info")).values():
            if not isinstance(res, BaseException):
                # Every replica queues as many: the deployment admits their sum.
                n = len(self.replicas.replicas)
                return dict(res, data_parallel_size=n, routing_policy=self.policy.name,
                            max_queued_requests=res["max_queued_requests"] * n)
        await self.health()
        raise EngineDeadError("no replica answered")

    async def stats(self) -> dict:
        """The replicas' stats summed (as one engine's), each replica's under `replicas`, and
        the router's own under `router`."""
        per = {r: s for r, s in (await self._each("stats")).items()
               if not isinstance(s, BaseException)}
        out = aggregate_stats(list(per.values()))
        view = await self.describe()
        out["replicas"] = {r: dict(per.get(r, {}), **v) for r, v in view.pop("replicas").items()}
        out["router"] = view
        if not per:
            out["dead"] = f"no replica of this deployment serves: {self.replicas.errors()}"
        return out

    async def list_requests(self) -> list[dict]:
        out = []
        for r, reqs in (await self._each("list_requests")).items():
            if not isinstance(reqs, BaseException):
                out += [dict(q, replica=r) for q in reqs]
        return sorted(out, key=lambda q: -q["age_s"])

    async def reset_prefix_cache(self) -> bool:
        return all(res is True for res in (await self._each("reset_prefix_cache")).values())

    async def index_state(self) -> dict[int, list[list[bytes]]]:
        """What the index holds per replica and tier (tests compare it with the replicas)."""
        return {r: [sorted(t) for t in s.tiers] for r, s in self.index.replicas.items()
                if not s.resyncing}

    async def check_integrity(self) -> None:
        self.index.check_integrity()

    async def shutdown(self) -> None:
        """Stops every replica (each writes its SSD tier), in parallel."""
        await self._ready()
        await self.replicas.stop()


# Stats that are not summed over replicas: averaged, recomputed, or per replica only.
_NOT_SUMMED = {"kv_usage", "prefix_cache_hit_rate", "cpu_tier_usage", "ssd_tier_usage",
               "max_model_len", "block_size", "dead"}


def aggregate_stats(per_replica: list[dict]) -> dict:
    """One engine's stats keys over many: counts summed, usage recomputed from the sums, the
    rest (backend, limits) from the first replica."""
    out: dict = {}
    for stats in per_replica:
        for key, value in stats.items():
            if key in _NOT_SUMMED or isinstance(value, bool) \
                    or not isinstance(value, (int, float)):
                out.setdefault(key, value)
            else:
                out[key] = out.get(key, 0) + value
    total = out.get("num_total_blocks", 0)
    if total:
        out["kv_usage"] = 1.0 - out.get("num_free_blocks", 0) / total
    queried = out.get("prefix_cache_queried_tokens", 0)
    out["prefix_cache_hit_rate"] = out.get("prefix_cache_hit_tokens", 0) / queried \
        if queried else 0.0
    for tier in ("cpu", "ssd"):
        usages = [s[f"{tier}_tier_usage"] for s in per_replica if f"{tier}_tier_usage" in s]
        if usages:
            out[f"{tier}_tier_usage"] = sum(usages) / len(usages)
    out["dead"] = None
    return out

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
import enum
import logging
import time
from dataclasses import dataclass, field

import ray

from tierserve.deploy.kv_index import KVIndex
from tierserve.deploy.replicas import (
    kill_replica, node_of, replica_config, start_replica, stop_replica,
)
from tierserve.deploy.routing import Candidate, KVAware, LoadTracker, RouteQuery, make_policy
from tierserve.kvcache.hashing import BlockHasher
from tierserve.runtime.config import EngineConfig
from tierserve.runtime.executor import EngineDeadError
from tierserve.scheduler.kv_events import KVEventCodec
from tierserve.scheduler.messages import MalformedFrameError

__all__ = ["Router", "ReplicaState", "router_name"]

log = logging.getLogger("tierserve.router")

# A request finding no live replica waits this long for one to (re)start before failing.
_NO_REPLICA_WAIT_S = 120.0
# Restart back-off of a replica that fails to start: doubling from the first, up to the cap.
_RESTART_BACKOFF_S = (1.0, 30.0)
# How long a scaled-away replica may take to finish its requests before it is stopped anyway
# (its clients then continue their streams on other replicas).
DRAIN_TIMEOUT_S = 600.0
# Route times kept for the stats' mean and percentiles.
_ROUTE_SAMPLES = 4096


def router_name(name: str) -> str:
    return f"tierserve-router-{name}"


class ReplicaState(enum.IntEnum):
    STARTING = 0
    LIVE = 1
    DOWN = 2  # dead; restarting
    DRAINING = 3  # being scaled away: routed nothing, stopped once idle
    HEALING = 4  # its engine rebuilds its workers: routed nothing meanwhile


@dataclass(slots=True, eq=False)
class _Replica:
    id: int
    state: ReplicaState = ReplicaState.STARTING
    actor: object = None
    pg: object = None
    node: str | None = None
    generation: int = 0  # bumped at every (re)start; event tags carry it
    load: LoadTracker = field(default_factory=LoadTracker)
    restarts: int = 0
    error: str | None = None
    task: asyncio.Task | None = None  # its start, restart or drain
    snapshot: asyncio.Task | None = None


class Router:
    def __init__(self, config: EngineConfig, uid: str, name: str | None,
                 namespace: str | None) -> None:
        self.config = replica_config(config)
        self.uid, self.name, self.namespace = uid, name, namespace
        self.index = KVIndex()
        hasher = BlockHasher(config.block_size, config.prefix_caching_hash_algo,
                             config.hash_seed)
        self.policy = make_policy(config.routing_policy, self.index, hasher,
                                  config.max_num_batched_tokens)
        self._hasher = hasher
        self._chain = KVAware(self.index, hasher, config.max_num_batched_tokens).chain
        self.replicas: dict[int, _Replica] = {}
        self._codec = KVEventCodec()
        self._live = asyncio.Event()
        self._route_us: collections.deque[float] = collections.deque(maxlen=_ROUTE_SAMPLES)
        self._routed = 0
        self._dropped_frames = 0
        self._stopping = False

    # ------------------------------------------------------------------ replicas

    async def start(self) -> int:
        """Starts data_parallel_size replicas; returns once every one serves (or raises the
        first start's error, the others stopped)."""
        for _ in range(self.config.data_parallel_size):
            self._add_replica()
        results = await asyncio.gather(*(r.task for r in self.replicas.values()),
                                       return_exceptions=True)
        errors = [e for e in results if isinstance(e, BaseException)]
        if errors:
            await self.shutdown()
            raise errors[0]
        return len(self.replicas)

    def _add_replica(self) -> _Replica:
        rid = next(i for i in range(len(self.replicas) + 1) if i not in self.replicas)
        replica = self.replicas[rid] = _Replica(rid)
        replica.task = asyncio.get_running_loop().create_task(self._start(replica, first=True))
        return replica

    async def _start(self, replica: _Replica, first: bool = False) -> None:
        """(Re)starts a replica until it serves; a first start's failure is raised."""
        delay = _RESTART_BACKOFF_S[0]
        while not self._stopping:
            replica.state, replica.generation = ReplicaState.STARTING, replica.generation + 1
            taken = collections.Counter(r.node for r in self.replicas.values() if r.node)
            try:
                replica.actor, replica.pg = await asyncio.to_thread(
                    start_replica, self.config, self.uid, self.name, replica.id,
                    self.namespace, replica.pg, taken)
                replica.node = await asyncio.to_thread(node_of, replica.pg)
                me = ray.get_runtime_context().current_actor
                await replica.actor.subscribe_kv_events.remote(
                    me, (replica.id, replica.generation))
            except Exception as e:
                replica.error = f"{type(e).__name__}: {e}"
                if first:
                    raise
                log.warning("replica %d did not start (%s); retrying in %.0f s", replica.id,
                            replica.error, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, _RESTART_BACKOFF_S[1])
                continue
            self.index.add_replica(replica.id)
            replica.load = LoadTracker()
            replica.state, replica.error = ReplicaState.LIVE, None
            self._fetch_snapshot(replica)  # what it holds already (its SSD tier)
            self._live.set()
            asyncio.get_running_loop().create_task(self._watch(replica, replica.generation))
            return

    async def _watch(self, replica: _Replica, generation: int) -> None:
        """Follows the replica's state until it dies: healing replicas are routed nothing."""
        healing = False
        while True:
            try:
                state, reason = await replica.actor.watch.remote(healing)
            except Exception as e:  # the actor died
                state, reason = "dead", f"{type(e).__name__}: {e}"
            if self._stopping or replica.generation != generation:
                return
            if state == "dead":
                self._down(replica, reason)
                return
            healing = state == "healing"
            if replica.state in (ReplicaState.LIVE, ReplicaState.HEALING):
                replica.state = ReplicaState.HEALING if healing else ReplicaState.LIVE
                self._refresh_live()

    def _down(self, replica: _Replica, reason: str) -> None:
        """The replica can no longer serve: route it nothing from now on, forget what it
        held, and restart it (a draining one is just removed)."""
        if replica.state in (ReplicaState.DOWN, ReplicaState.STARTING):
            return
        # A healing engine that died was not serving either: it restarts like a live one.
        log.warning("replica %d is down: %s", replica.id, reason)
        draining = replica.state == ReplicaState.DRAINING
        replica.state, replica.error = ReplicaState.DOWN, reason
        if replica.id in self.index.replicas:
            self.index.remove_replica(replica.id)
        self.policy.forget(replica.id)
        self._refresh_live()
        if draining:
            return  # its drain task removes it
        replica.restarts += 1
        loop = asyncio.get_running_loop()
        replica.task = loop.create_task(self._restart(replica))

    async def _restart(self, replica: _Replica) -> None:
        tp = self.config.tensor_parallel_size
        await asyncio.to_thread(kill_replica, replica.actor, self.uid, replica.id, tp,
                                self.namespace)
        replica.actor = None
        await self._start(replica)

    def _refresh_live(self) -> None:
        if any(r.state == ReplicaState.LIVE for r in self.replicas.values()):
            self._live.set()
        else:
            self._live.clear()

    async def replica_failed(self, replica_id: int, generation: int, reason: str) -> None:
        """A client saw the replica fail (its stream broke): stop routing to it now."""
        replica = self.replicas.get(replica_id)
        if replica is not None and replica.generation == generation \
                and replica.state in (ReplicaState.LIVE, ReplicaState.HEALING):
            self._down(replica, f"reported by a client: {reason}")

    async def scale(self, size: int, drain_timeout_s: float = DRAIN_TIMEOUT_S) -> dict:
        """Adds replicas, or drains the highest-numbered ones (routed nothing, stopped once
        their requests finished or drain_timeout_s passed); returns when done."""
        if size < 1:
            raise ValueError(f"a deployment needs at least one replica, got {size}")
        serving = [r for r in self.replicas.values() if r.state != ReplicaState.DRAINING]
        tasks = []
        if size > len(serving):
            tasks = [self._add_replica().task for _ in range(size - len(serving))]
        for replica in sorted(serving, key=lambda r: r.id, reverse=True)[:len(serving) - size]:
            replica.state = ReplicaState.DRAINING
            replica.task = asyncio.get_running_loop().create_task(
                self._drain(replica, drain_timeout_s))
            tasks.append(replica.task)
        self._refresh_live()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        errors = [f"{type(e).__name__}: {e}" for e in results if isinstance(e, BaseException)]
        return {"replicas": len(self.replicas), "errors": errors}

    async def _drain(self, replica: _Replica, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while replica.state == ReplicaState.DRAINING and time.monotonic() < deadline:
            if replica.load.outstanding == 0:
                break
            await asyncio.sleep(0.2)
        await asyncio.to_thread(stop_replica, replica.actor, replica.pg, self.uid, replica.id,
                                self.config.tensor_parallel_size, self.namespace)
        if replica.id in self.index.replicas:
            self.index.remove_replica(replica.id)
        self.policy.forget(replica.id)
        del self.replicas[replica.id]

    # ------------------------------------------------------------------ KV events

    async def kv_events(self, tag: tuple[int, int], frames: list[bytes]) -> None:
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

    def _fetch_snapshot(self, replica: _Replica) -> None:
        if replica.snapshot is not None and not replica.snapshot.done():
            return
        replica.snapshot = asyncio.get_running_loop().create_task(
            self._snapshot(replica, replica.generation))

    async def _snapshot(self, replica: _Replica, generation: int) -> None:
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
        if not self._live.is_set():
            try:
                await asyncio.wait_for(self._live.wait(), _NO_REPLICA_WAIT_S)
            except asyncio.TimeoutError:
                raise EngineDeadError(f"no replica of this deployment serves: "
                                      f"{self._errors()}") from None
        live = [r for r in self.replicas.values() if r.state == ReplicaState.LIVE]
        out = []
        for query in queries:
            t0 = time.perf_counter()
            candidates = [Candidate(r.id, r.load) for r in live if r.id not in query.exclude] \
                or [Candidate(r.id, r.load) for r in live]
            choice = self.policy.pick(query, candidates)
            replica = self.replicas[choice.replica]
            replica.load.route(choice.uncached_tokens)
            self._route_us.append((time.perf_counter() - t0) * 1e6)
            out.append((replica.id, replica.generation, replica.actor))
        self._routed += len(queries)
        return out

    async def set_policy(self, name: str) -> str:
        """Switches the routing policy (for comparisons); returns the one it replaced."""
        old = self.policy.name
        self.policy = make_policy(name, self.index, self._hasher,
                                  self.config.max_num_batched_tokens)
        return old

    async def explain(self, query: RouteQuery) -> dict[int, list[int]]:
        """What each live replica holds of the query's prompt, as the index says: blocks
        found on the device, in the CPU tier and on SSD (routes nothing)."""
        live = [r.id for r in self.replicas.values() if r.state == ReplicaState.LIVE]
        found = self.index.match(self._chain(query.prompt_token_ids, query.cache_salt), live)
        return {r: [m.device, m.cpu, m.ssd] for r, m in found.items()}

    def _errors(self) -> str:
        return "; ".join(f"replica {r.id}: {r.error}" for r in self.replicas.values()
                         if r.error) or "none started"

    # ------------------------------------------------------------------ views

    async def replica_actors(self) -> dict[int, tuple[int, object]]:
        """Live replicas: id -> (generation, engine actor)."""
        return {r.id: (r.generation, r.actor) for r in self.replicas.values()
                if r.state == ReplicaState.LIVE}

    async def health(self) -> bool:
        if not any(r.state == ReplicaState.LIVE for r in self.replicas.values()):
            raise EngineDeadError(f"no replica of this deployment serves: {self._errors()}")
        return True

    async def describe(self) -> dict:
        """The router's own view: each replica's state, node, restarts, load, index size."""
        route_us = sorted(self._route_us)
        return {
            "policy": self.policy.name, "routed": self._routed, "indexed_blocks": len(self.index),
            "route_us_mean": sum(route_us) / len(route_us) if route_us else 0.0,
            "route_us_p99": route_us[int(0.99 * (len(route_us) - 1))] if route_us else 0.0,
            "dropped_event_frames": self._dropped_frames,
            "replicas": {r.id: {
                "state": r.state.name.lower(), "node": r.node, "replica_restarts": r.restarts,
                "error": r.error, "generation": r.generation,
                "outstanding": r.load.outstanding, "in_transit": r.load.in_transit,
                "indexed_blocks": [len(t) for t in self.index.replicas[r.id].tiers]
                if r.id in self.index.replicas else [0, 0, 0],
                "event_resyncs": self.index.replicas[r.id].resyncs
                if r.id in self.index.replicas else 0,
            } for r in sorted(self.replicas.values(), key=lambda r: r.id)},
        }

    async def _each(self, method: str, *args, timeout_s: float = 30.0) -> dict[int, object]:
        """method(*args) on every live replica, at once; replica -> result (an exception
        for one that failed)."""
        live = [r for r in self.replicas.values() if r.state == ReplicaState.LIVE]
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
                return dict(res, data_parallel_size=len(self.replicas),
                            routing_policy=self.policy.name,
                            max_queued_requests=res["max_queued_requests"] * len(self.replicas))
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
            out["dead"] = f"no replica of this deployment serves: {self._errors()}"
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
        self._stopping = True
        tp = self.config.tensor_parallel_size
        await asyncio.gather(*(asyncio.to_thread(
            stop_replica, r.actor, r.pg, self.uid, r.id, tp, self.namespace)
            for r in self.replicas.values()), return_exceptions=True)
        for r in self.replicas.values():
            if r.task is not None and not r.task.done():
                r.task.cancel()
        self.replicas.clear()
        self._live.clear()


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

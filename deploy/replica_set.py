"""The lifecycle of a replicated deployment's replicas, for its router (deploy/router.py).

Replicas start at once and spread over the nodes (deploy/replicas.py). Each one's state is
followed by a `watch` call kept pending on its engine actor: its death is seen at once (the
call fails), and so is its engine healing its workers. A dead replica is routed nothing,
restarted on its placement group (with its SSD tier folder) and rejoins; `scale` adds
replicas or drains and removes some. A router that Ray restarted adopts the replicas of its
named deployment that still run, by name, instead of starting new ones.

The router hears of each replica coming up and going down through two callbacks, run on its
event loop: `on_up(replica)` once the replica serves (subscribed to its KV events under the
tag (id, generation)), `on_down(replica)` once it no longer does.
"""
from __future__ import annotations

import asyncio
import collections
import enum
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import ray

from tierserve.deploy.replicas import (
    kill_replica, node_of, replica_pg_name, replica_uid, start_replica, stop_replica,
)
from tierserve.deploy.routing import LoadTracker
from tierserve.runtime import envs
from tierserve.runtime.config import EngineConfig

__all__ = ["ReplicaSet", "Replica", "ReplicaState", "DRAIN_TIMEOUT_S"]

log = logging.getLogger("tierserve.replica_set")

# Restart back-off of a replica that fails to start: doubling from the first, up to the cap.
_RESTART_BACKOFF_S = (1.0, 30.0)
# How long a scaled-away replica may take to finish its requests before it is stopped anyway
# (its clients then continue their streams on other replicas).
DRAIN_TIMEOUT_S = 600.0


class ReplicaState(enum.IntEnum):
    STARTING = 0
    LIVE = 1
    DOWN = 2  # dead; restarting
    DRAINING = 3  # being scaled away: routed nothing, stopped once idle
    HEALING = 4  # its engine rebuilds its workers: routed nothing meanwhile


@dataclass(slots=True, eq=False)
class Replica:
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


class ReplicaSet:
    def __init__(self, config: EngineConfig, uid: str, name: str | None,
                 namespace: str | None, on_up: Callable[[Replica], None],
                 on_down: Callable[[Replica], None]) -> None:
        self.config, self.uid, self.name, self.namespace = config, uid, name, namespace
        self.on_up, self.on_down = on_up, on_down
        self.replicas: dict[int, Replica] = {}
        self.live = asyncio.Event()
        self.stopping = False

    def __iter__(self):
        return iter(self.replicas.values())

    def get(self, replica_id: int) -> Replica | None:
        return self.replicas.get(replica_id)

    def serving(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.state == ReplicaState.LIVE]

    def errors(self) -> str:
        return "; ".join(f"replica {r.id}: {r.error}" for r in self.replicas.values()
                         if r.error) or "none started"

    # ------------------------------------------------------------------ starting

    async def start(self, count: int) -> None:
        """Starts `count` replicas; raises the first start's error (all of them stopped)."""
        for _ in range(count):
            self._add()
        results = await asyncio.gather(*(r.task for r in self.replicas.values()),
                                       return_exceptions=True)
        errors = [e for e in results if isinstance(e, BaseException)]
        if errors:
            await self.stop()
            raise errors[0]

    def _add(self) -> Replica:
        rid = next(i for i in range(len(self.replicas) + 1) if i not in self.replicas)
        replica = self.replicas[rid] = Replica(rid)
        replica.task = asyncio.get_running_loop().create_task(self._start(replica, first=True))
        return replica

    async def _start(self, replica: Replica, first: bool = False) -> None:
        """(Re)starts a replica until it serves; a first start's failure is raised."""
        delay = _RESTART_BACKOFF_S[0]
        while not self.stopping:
            replica.state, replica.generation = ReplicaState.STARTING, replica.generation + 1
            taken = collections.Counter(r.node for r in self.replicas.values() if r.node)
            try:
                replica.actor, replica.pg = await asyncio.to_thread(
                    start_replica, self.config, self.uid, self.name, replica.id,
                    self.namespace, replica.pg, taken)
                await self._join(replica)
            except Exception as e:
                replica.error = f"{type(e).__name__}: {e}"
                if first:
                    raise
                log.warning("replica %d did not start (%s); retrying in %.0f s", replica.id,
                            replica.error, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, _RESTART_BACKOFF_S[1])
                continue
            return

    async def _join(self, replica: Replica) -> None:
        """A running replica joins: subscribed to its events, watched, serving."""
        replica.node = await asyncio.to_thread(node_of, replica.pg) \
            if replica.pg is not None else None
        me = ray.get_runtime_context().current_actor
        await replica.actor.subscribe_kv_events.remote(me, (replica.id, replica.generation))
        replica.load = LoadTracker()
        replica.state, replica.error = ReplicaState.LIVE, None
        self.on_up(replica)
        self.live.set()
        asyncio.get_running_loop().create_task(self._watch(replica, replica.generation))

    async def adopt(self) -> int:
        """After Ray restarted the router: takes over the named deployment's replicas that
        still run (a dead one restarts); returns how many it found."""
        prefix = replica_uid(self.uid, 0)[:-1]
        ns = self.namespace or envs.default_namespace()
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == ns and a["name"].startswith(prefix)
                 and a["name"][len(prefix):].isdigit()]
        base = int.from_bytes(os.urandom(3), "little") << 8  # tags unlike the old router's
        for actor_name in names:
            replica = Replica(int(actor_name[len(prefix):]), generation=base)
            self.replicas[replica.id] = replica
            try:
                replica.pg = ray.util.get_placement_group(replica_pg_name(self.name,
                                                                          replica.id))
                replica.actor = ray.get_actor(actor_name, namespace=ns)
                await replica.actor.health.remote()
                await self._join(replica)
            except Exception as e:
                replica.state = ReplicaState.LIVE  # so that _down restarts it
                self._down(replica, f"found dead by the restarted router: {e}")
        return len(names)

    # ------------------------------------------------------------------ failures

    async def _watch(self, replica: Replica, generation: int) -> None:
        """Follows the replica's state until it dies: healing replicas are routed nothing."""
        healing = False
        while True:
            try:
                state, reason = await replica.actor.watch.remote(healing)
            except Exception as e:  # the actor died
                state, reason = "dead", f"{type(e).__name__}: {e}"
            if self.stopping or replica.generation != generation:
                return
            if state == "dead":
                self._down(replica, reason)
                return
            healing = state == "healing"
            if replica.state in (ReplicaState.LIVE, ReplicaState.HEALING):
                replica.state = ReplicaState.HEALING if healing else ReplicaState.LIVE
                self._refresh_live()

    def failed(self, replica_id: int, generation: int, reason: str) -> None:
        """A client saw the replica fail (its stream broke)."""
        replica = self.replicas.get(replica_id)
        if replica is not None and replica.generation == generation \
                and replica.state in (ReplicaState.LIVE, ReplicaState.HEALING):
            self._down(replica, f"reported by a client: {reason}")

    def _down(self, replica: Replica, reason: str) -> None:
        """The replica can no longer serve (live, healing or draining): route it nothing
        from now on, and restart it (a draining one is just removed)."""
        if replica.state in (ReplicaState.DOWN, ReplicaState.STARTING):
            return
        log.warning("replica %d is down: %s", replica.id, reason)
        draining = replica.state == ReplicaState.DRAINING
        replica.state, replica.error = ReplicaState.DOWN, reason
        self.on_down(replica)
        self._refresh_live()
        if draining:
            return  # its drain task removes it
        replica.restarts += 1
        replica.task = asyncio.get_running_loop().create_task(self._restart(replica))

    async def _restart(self, replica: Replica) -> None:
        await asyncio.to_thread(kill_replica, replica.actor, self.uid, replica.id,
                                self.config.tensor_parallel_size, self.namespace)
        replica.actor = None
        await self._start(replica)

    def _refresh_live(self) -> None:
        if self.serving():
            self.live.set()
        else:
            self.live.clear()

    # ------------------------------------------------------------------ scaling

    async def scale(self, size: int, drain_timeout_s: float = DRAIN_TIMEOUT_S) -> dict:
        """Adds replicas, or drains the highest-numbered ones (routed nothing, stopped once
        their requests finished or drain_timeout_s passed); returns when done."""
        if size < 1:
            raise ValueError(f"a deployment needs at least one replica, got {size}")
        kept = [r for r in self.replicas.values() if r.state != ReplicaState.DRAINING]
        tasks = [self._add().task for _ in range(size - len(kept))]
        for replica in sorted(kept, key=lambda r: r.id, reverse=True)[:len(kept) - size]:
            replica.state = ReplicaState.DRAINING
            replica.task = asyncio.get_running_loop().create_task(
                self._drain(replica, drain_timeout_s))
            tasks.append(replica.task)
        self._refresh_live()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        errors = [f"{type(e).__name__}: {e}" for e in results if isinstance(e, BaseException)]
        return {"replicas": len(self.replicas), "errors": errors}

    async def _drain(self, replica: Replica, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while replica.state == ReplicaState.DRAINING and time.monotonic() < deadline:
            if replica.load.outstanding == 0:
                break
            await asyncio.sleep(0.2)
        await asyncio.to_thread(stop_replica, replica.actor, replica.pg, self.uid, replica.id,
                                self.config.tensor_parallel_size, self.namespace)
        if replica.state != ReplicaState.DOWN:
            self.on_down(replica)
        del self.replicas[replica.id]

    async def stop(self) -> None:
        """Stops every replica (each writes its SSD tier), in parallel."""
        self.stopping = True
        tp = self.config.tensor_parallel_size
        await asyncio.gather(*(asyncio.to_thread(
            stop_replica, r.actor, r.pg, self.uid, r.id, tp, self.namespace)
            for r in self.replicas.values()), return_exceptions=True)
        for r in self.replicas.values():
            if r.task is not None and not r.task.done():
                r.task.cancel()
        self.replicas.clear()
        self.live.clear()

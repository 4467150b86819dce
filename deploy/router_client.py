"""The client side of a replicated deployment: an engine client for `LLM` and `AsyncLLM`;
this module routes and streams its requests.

Requests arrive as token ids (the frontend's InputProcessor tokenized them, off every engine's
step loop: the router hashes token ids). Per call it asks the router (deploy/router.py) for a
replica per request in one actor call, and streams each replica's outputs straight from that
replica: no token passes through the router. Its requests carry an owner token of its own, so
its aborts and stops reach only what it started; a replica silent for the step timeout (its
process stopped or hung) counts as failed. A request whose replica dies mid-stream goes on
elsewhere (deploy/router_failover.py); the router's control calls (info, stats, health,
scale) are deploy/router_control.py's.
"""
from __future__ import annotations

import asyncio
import logging
import os
from typing import AsyncIterator, Iterator

import ray

from tierserve.deploy.loop_thread import LoopThread
from tierserve.deploy.router_control import RouterControl
from tierserve.deploy.router_failover import CONT_SEP, Call, Tracked
from tierserve.deploy.routing import RouteQuery
from tierserve.deploy.watchdog import Liveness, next_or_dead
from tierserve.runtime.client import HEARTBEAT_S
from tierserve.runtime.lora import adapter_digest
from tierserve.runtime.outputs import Outstanding
from tierserve.runtime.requests import check_request, rejection
from tierserve.runtime.tokenizer import load_model_tokenizer
from tierserve.scheduler.messages import ClientChannelCodec, EngineCoreOutput, EngineCoreRequest

__all__ = ["RouterClient"]

log = logging.getLogger("tierserve.router_client")


class RouterClient(RouterControl):
    """The engine client of a replicated deployment (module docstring). It pickles (as the
    router's handle), so a connected client travels into Ray tasks and actors."""

    def __init__(self, router, name: str | None = None, *, owned: bool = False) -> None:
        self.router = router
        self.name = name
        self._owned = owned
        self._codec = ClientChannelCodec()
        self._tokenizer = None
        self._loop: LoopThread | None = None
        self._owner = os.urandom(8).hex()
        self._calls: dict[str, Call] = {}  # caller request id -> its call
        info = self.info()
        self.vocab_size = info["vocab_size"]
        self.max_model_len = info["max_model_len"]
        self.step_timeout_s = info.get("step_timeout_s", 60.0)
        self._tokenizer_path = info["tokenizer_path"]

    def __reduce__(self):
        return (RouterClient, (self.router, self.name))

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_model_tokenizer(self._tokenizer_path)
        return self._tokenizer

    # ------------------------------------------------------------------ streaming

    async def generate(self, requests: list[EngineCoreRequest], *, hold: bool = False
                       ) -> AsyncIterator[list[EngineCoreOutput]]:
        """Each step's outputs (of every replica serving these requests) until every request
        finished; leaving early aborts the rest. hold: an offline batch, queued whole
        (AsyncEngine.generate)."""
        call = Call(self, hold)
        rejected = []
        for r in requests:
            if r.req_id in call.tracked:
                raise ValueError(f"request id {r.req_id!r} is used twice in one call")
            try:
                call.tracked[r.req_id] = Tracked(r, check_request(r))
            except Exception as e:
                rejected.append(rejection(r, e))
        call.left = len(call.tracked)
        for rid in call.tracked:
            self._calls[rid] = call
        if rejected:
            yield rejected
        try:
            await self._dispatch(call, [(t, t.continuations()) for t in call.tracked.values()])
            # A leg counts a request finished when it queues the output that finishes it:
            # the caller may not have read that output yet (it awaits between outputs).
            while call.left or not call.queue.empty():
                batch = await call.queue.get()
                if isinstance(batch, BaseException):
                    raise batch
                yield batch
        finally:
            for leg in list(call.legs):
                leg.cancel()
            if call.legs:
                await asyncio.gather(*call.legs, return_exceptions=True)
            for rid in call.tracked:
                self._calls.pop(rid, None)

    async def _dispatch(self, call: Call,
                        work: list[tuple[Tracked, list[EngineCoreRequest]]]) -> None:
        """Routes engine requests (in one router call) and starts a leg per replica."""
        reqs = [(t, r) for t, rs in work for r in rs]
        if not reqs:
            return
        queries = [RouteQuery(r.prompt_token_ids, r.cache_salt, sorted(t.failed_on),
                              _lora_digest(r)) for t, r in reqs]
        try:
            picks = await self.router.route.remote(queries)
        except Exception as e:  # no replica serves
            for t in {id(t): t for t, _ in reqs}.values():
                if not t.done:
                    call.fail(t, f"no replica could take the request: {_reason(e)}")
            return
        legs: dict[tuple[int, int], tuple[object, list]] = {}
        for (t, r), (replica, generation, actor) in zip(reqs, picks):
            legs.setdefault((replica, generation), (actor, []))[1].append(r)
        loop = asyncio.get_running_loop()
        for (replica, generation), (actor, ereqs) in legs.items():
            call.actors.update((r.req_id, actor) for r in ereqs)
            task = loop.create_task(self._leg(call, replica, generation, actor, ereqs))
            call.legs.add(task)
            task.add_done_callback(call.legs.discard)

    async def _leg(self, call: Call, replica: int, generation: int, actor,
                   ereqs: list[EngineCoreRequest]) -> None:
        """Streams these requests from one replica; what its failure leaves unfinished is
        continued elsewhere."""
        stream = actor.generate.options(num_returns="streaming").remote(ereqs, self._owner,
                                                                        call.hold)
        left = Outstanding(ereqs)
        alive = Liveness(self.step_timeout_s)
        beat = asyncio.get_running_loop().create_task(_heartbeat(actor, left, alive))
        failure, again = None, []
        try:
            while True:
                try:
                    ref = await next_or_dead(stream, alive)
                except StopAsyncIteration:
                    break
                batch = self._codec.decode(await ref).outputs
                alive.beat()
                left.update(batch)
                forward, retry = call.translate(batch, replica)
                again += retry
                if forward:
                    call.queue.put_nowait(forward)
        except asyncio.CancelledError:  # the caller left: free the replica's blocks now
            if left:
                ray.cancel(stream)
                actor.abort.remote(list(left), self._owner)
            raise
        except Exception as e:  # the replica's actor died or went silent, or its engine refused
            failure = _reason(e)
            if left:
                ray.cancel(stream)
                actor.abort.remote(list(left), self._owner)
        finally:
            beat.cancel()
        if failure is not None:
            again += list(left)
            self.router.replica_failed.remote(replica, generation, failure)
        if again:
            await self._dispatch(call, call.failover(replica, again,
                                                     failure or "its engine failed"))

    def stream_batch(self, requests: list[EngineCoreRequest]) -> Iterator[list[EngineCoreOutput]]:
        """generate() for synchronous callers (LLM), driven on a loop of its own."""
        if self._loop is None:
            self._loop = LoopThread("tierserve-router-client")
        yield from self._loop.iterate(self.generate(requests, hold=True))

    # ------------------------------------------------------------------ control

    def abort(self, request_ids: list[str]) -> None:
        """Aborts requests this client started, on the replicas serving them."""
        for rid in request_ids:
            call = self._calls.get(rid)
            if call is None:
                continue
            for eid, actor in call.actors.items():
                if eid.partition(CONT_SEP)[0] == rid:
                    actor.abort.remote([eid], self._owner)

    def stop(self, seqs: list[tuple[str, int]]) -> None:
        """Finishes samples a stop string ended, on the replica serving each (a sample that
        continued elsewhere alone runs as its own request there, sample 0)."""
        for rid, index in seqs:
            call = self._calls.get(rid)
            if call is None:
                continue
            own = f"{rid}{CONT_SEP}{index}"
            eid, eindex = (own, 0) if own in call.actors else (rid, index)
            actor = call.actors.get(eid)
            if actor is not None:
                actor.stop.remote([(eid, eindex)], self._owner)

    stop_sequences = stop

    def shutdown(self) -> None:
        """Stops an owned deployment (router and replicas); a connected client lets go."""
        if self._loop is not None:
            self._loop.stop()
            self._loop = None
        if not self._owned or self.router is None:
            return
        try:
            ray.get(self.router.shutdown.remote(), timeout=60)
        except Exception as e:
            log.warning("the router did not shut down cleanly: %s", e)
        ray.kill(self.router, no_restart=True)
        self.router = None


async def _heartbeat(actor, pending: Outstanding, alive: Liveness) -> None:
    """Renews the leases of a leg's unfinished requests while it streams; each answer shows
    the replica alive."""
    while True:
        await asyncio.sleep(HEARTBEAT_S)
        alive.watch(actor.renew.remote(list(pending)))


def _reason(e: BaseException) -> str:
    cause = getattr(e, "cause", None)
    return f"{type(cause or e).__name__}: {cause or e}"


def _lora_digest(request: EngineCoreRequest) -> int:
    """The digest the engines key the request's adapter by (0: none, or a folder that does
    not read, which the engine refuses on its own)."""
    if request.lora is None:
        return 0
    try:
        return adapter_digest(request.lora.path)
    except (OSError, ValueError):
        return 0

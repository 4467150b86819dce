"""The client side of a replicated deployment: an engine client for `LLM` and `AsyncLLM`.

Requests arrive as token ids (the frontend's InputProcessor tokenized them, off every engine's
step loop: the router hashes token ids). Per call it asks the router (deploy/router.py) for a
replica per request in one actor call, and streams each replica's outputs straight from that
replica: no token passes through the router. Its requests carry an owner token of its own, so
its aborts and stops reach only what it started; a replica silent for the step timeout (its
process stopped or hung) counts as failed.

A request whose replica dies mid-stream (its actor fails, or its engine reports itself dead)
goes on elsewhere as a continuation: the prompt plus every token already streamed, the
remaining max_tokens, the same seed, routed again away from the failed replica; the caller's
stream continues with no token missing or repeated (greedy output equals an undisturbed run).
A request with n samples continues each unfinished sample as a request of its own (sample i
with seed + i, as the engine forks it). What a continuation cannot carry over: a seeded
sampler's random stream restarts from the seed, penalties and bad words count the streamed
tokens as prompt, and a structured output that has begun fails (its grammar's state died with
the replica).
"""
from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterator

import msgspec
import ray

from tierserve.deploy.routing import RouteQuery
from tierserve.deploy.watchdog import Liveness, next_or_dead
from tierserve.runtime.client import HEARTBEAT_S
from tierserve.runtime.requests import rejection
from tierserve.runtime.tokenizer import load_model_tokenizer
from tierserve.runtime.errors import EngineDeadError
from tierserve.runtime.outputs import Outstanding
from tierserve.runtime.requests import check_request
from tierserve.scheduler.messages import ClientChannelCodec, EngineCoreOutput, EngineCoreRequest
from tierserve.scheduler.params import ErrorKind, FinishReason

__all__ = ["RouterClient"]

log = logging.getLogger("tierserve.router_client")

# Engine id of sample i's continuation, for a request with several samples: rid + SEP + i
# (the engine reserves \x1f for its own sample ids).
_CONT_SEP = "\x1e"
# A request moves to another replica at most this many times before it fails.
MAX_FAILOVERS = 8


@dataclass(slots=True, eq=False)
class _Tracked:
    """One caller request across the replicas that serve it."""

    request: EngineCoreRequest
    prompt_ids: list[int]
    tokens: dict[int, list[int]] = field(default_factory=dict)  # per sample, streamed
    finished: set[int] = field(default_factory=set)
    announced: bool = False
    cached: int | None = None
    failovers: int = 0
    failed_on: set[int] = field(default_factory=set)

    @property
    def n(self) -> int:
        return self.request.sampling_params.n

    @property
    def done(self) -> bool:
        return len(self.finished) >= self.n

    @property
    def continuable(self) -> bool:
        """A grammar's state lives on the replica that died: a structured output that has
        begun cannot go on elsewhere."""
        return self.request.sampling_params.structured_outputs is None or \
            not any(self.tokens.values())

    def continuations(self) -> list[EngineCoreRequest]:
        """What is left of it, as requests to route again."""
        req, params = self.request, self.request.sampling_params
        if not any(self.tokens.values()) and not self.finished:  # nothing streamed yet
            return [msgspec.structs.replace(req, prompt_token_ids=self.prompt_ids)]
        out = []
        for index in range(self.n):
            if index in self.finished:
                continue
            streamed = self.tokens.get(index, [])
            seed = params.seed
            if seed is not None and index > 0:
                seed = (seed + index) % 2**64
            left = None if params.max_tokens is None else params.max_tokens - len(streamed)
            # The prompt's logprobs went out with the first output.
            sample = msgspec.structs.replace(
                params, n=1, seed=seed, max_tokens=left, prompt_logprobs=None,
                min_tokens=max(0, params.min_tokens - len(streamed)))
            rid = req.req_id if self.n == 1 else f"{req.req_id}{_CONT_SEP}{index}"
            out.append(EngineCoreRequest(rid, sample, prompt_token_ids=self.prompt_ids + streamed,
                                         priority=req.priority, cache_salt=req.cache_salt,
                                         label=req.label))
        return out


class _Call:
    """One generate() call: its requests, the legs (one replica stream each) serving them,
    and the queue the caller reads."""

    def __init__(self, client: "RouterClient") -> None:
        self.client = client
        self.tracked: dict[str, _Tracked] = {}
        self.queue: asyncio.Queue = asyncio.Queue()
        self.legs: set[asyncio.Task] = set()
        self.left = 0  # caller requests not finished
        self.actors: dict[str, object] = {}  # engine id -> the replica actor serving it

    def owner(self, o: EngineCoreOutput) -> tuple[_Tracked, int]:
        rid, sep, index = o.req_id.partition(_CONT_SEP)
        return self.tracked[rid], int(index) if sep else o.index

    def translate(self, batch: list[EngineCoreOutput], replica: int | None
                  ) -> tuple[list[EngineCoreOutput], list[str]]:
        """The outputs to forward (in caller terms), and the engine ids to continue elsewhere
        (their replica's engine is dead, or full while another replica is not); outputs made
        here (replica None) are forwarded as they are."""
        forward, again = [], []
        for o in batch:
            t, index = self.owner(o)
            if o.error and replica is not None and self._retry(t, o, replica):
                again.append(o.req_id)
                continue
            o.req_id, o.index = t.request.req_id, index
            if o.prompt_token_ids:
                o.prompt_token_ids = [] if t.announced else t.prompt_ids
                t.announced = True
            if t.cached is None:
                t.cached = o.num_cached_tokens
            o.num_cached_tokens = t.cached
            t.tokens.setdefault(index, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                was_done = t.done
                t.finished.update(range(t.n) if o.error else (index,))
                self.left -= t.done and not was_done
            forward.append(o)
        return forward, again

    def _retry(self, t: _Tracked, o: EngineCoreOutput, replica: int) -> bool:
        kind = o.error_kind
        if kind == ErrorKind.ENGINE_DEAD:
            return t.failovers < MAX_FAILOVERS
        if kind == ErrorKind.OVERLOADED:  # another replica may have room
            return replica not in t.failed_on and t.failovers < MAX_FAILOVERS
        return False

    def fail(self, t: _Tracked, message: str) -> None:
        self.emit([EngineCoreOutput(t.request.req_id, finish_reason=FinishReason.ERROR,
                                    error=message, error_kind=ErrorKind.ENGINE_DEAD)])

    def emit(self, outputs: list[EngineCoreOutput]) -> None:
        """Outputs made here, not by a replica."""
        forward, _ = self.translate(outputs, None)
        self.queue.put_nowait(forward)


class RouterClient:
    """The engine client of a replicated deployment (module docstring). It pickles (as the
    router's handle), so a connected client travels into Ray tasks and actors."""

    def __init__(self, router, name: str | None = None, *, owned: bool = False) -> None:
        self.router = router
        self.name = name
        self._owned = owned
        self._codec = ClientChannelCodec()
        self._tokenizer = None
        self._loop: _LoopThread | None = None
        self._owner = os.urandom(8).hex()
        self._calls: dict[str, _Call] = {}  # caller request id -> its call
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

    async def generate(self, requests: list[EngineCoreRequest]
                       ) -> AsyncIterator[list[EngineCoreOutput]]:
        """Each step's outputs (of every replica serving these requests) until every request
        finished; leaving early aborts the rest."""
        call = _Call(self)
        rejected = []
        for r in requests:
            if r.req_id in call.tracked:
                raise ValueError(f"request id {r.req_id!r} is used twice in one call")
            try:
                call.tracked[r.req_id] = _Tracked(r, check_request(r))
            except Exception as e:
                rejected.append(rejection(r, e))
        call.left = len(call.tracked)
        for rid in call.tracked:
            self._calls[rid] = call
        if rejected:
            yield rejected
        try:
            await self._dispatch(call, [(t, t.continuations()) for t in call.tracked.values()])
            while call.left:
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

    async def _dispatch(self, call: _Call,
                        work: list[tuple[_Tracked, list[EngineCoreRequest]]]) -> None:
        """Routes engine requests (in one router call) and starts a leg per replica."""
        reqs = [(t, r) for t, rs in work for r in rs]
        if not reqs:
            return
        queries = [RouteQuery(r.prompt_token_ids, r.cache_salt, sorted(t.failed_on))
                   for t, r in reqs]
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

    async def _leg(self, call: _Call, replica: int, generation: int, actor,
                   ereqs: list[EngineCoreRequest]) -> None:
        """Streams these requests from one replica; what its failure leaves unfinished is
        continued elsewhere."""
        stream = actor.generate.options(num_returns="streaming").remote(ereqs, self._owner)
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
            await self._continue(call, replica, again, failure or "its engine failed")

    async def _continue(self, call: _Call, replica: int, engine_ids: list[str],
                        reason: str) -> None:
        work = []
        for t in {id(t): t for t in (call.tracked[e.partition(_CONT_SEP)[0]]
                                     for e in engine_ids)}.values():
            if t.done:
                continue
            t.failovers += 1
            t.failed_on.add(replica)
            if t.failovers > MAX_FAILOVERS:
                call.fail(t, f"the request failed on {t.failovers} replicas; last: {reason}")
                continue
            if not t.continuable:
                call.fail(t, f"the replica serving this structured output failed ({reason}); "
                             f"its grammar cannot continue elsewhere")
                continue
            log.info("continuing %r elsewhere: replica %d failed (%s)", t.request.req_id,
                     replica, reason)
            todo = []
            for c in t.continuations():
                if c.sampling_params.max_tokens == 0:  # its last token came, its end did not
                    call.emit([EngineCoreOutput(c.req_id, finish_reason=FinishReason.LENGTH)])
                else:
                    todo.append(c)
            work.append((t, todo))
        await self._dispatch(call, work)

    def stream_batch(self, requests: list[EngineCoreRequest]) -> Iterator[list[EngineCoreOutput]]:
        """generate() for synchronous callers (LLM), driven on a loop of its own."""
        if self._loop is None:
            self._loop = _LoopThread()
        yield from self._loop.iterate(self.generate(requests))

    # ------------------------------------------------------------------ control

    def abort(self, request_ids: list[str]) -> None:
        """Aborts requests this client started, on the replicas serving them."""
        for rid in request_ids:
            call = self._calls.get(rid)
            if call is None:
                continue
            for eid, actor in call.actors.items():
                if eid.partition(_CONT_SEP)[0] == rid:
                    actor.abort.remote([eid], self._owner)

    def stop(self, seqs: list[tuple[str, int]]) -> None:
        """Finishes samples a stop string ended, on the replica serving each (a sample that
        continued elsewhere alone runs as its own request there, sample 0)."""
        for rid, index in seqs:
            call = self._calls.get(rid)
            if call is None:
                continue
            own = f"{rid}{_CONT_SEP}{index}"
            eid, eindex = (own, 0) if own in call.actors else (rid, index)
            actor = call.actors.get(eid)
            if actor is not None:
                actor.stop.remote([(eid, eindex)], self._owner)

    stop_sequences = stop

    def abort_now(self, names: list[str]) -> list[str]:
        """The operator's abort, on every replica: requests named by engine id or label."""
        refs = [a.abort_named.remote(list(names)) for a in self._actors()]
        found = []
        for got in ray.get(refs, timeout=60):
            found += got
        return list(dict.fromkeys(found))

    def _actors(self) -> list:
        return [actor for _, actor in _get(self.router.replica_actors.remote()).values()]

    def list_requests(self) -> list[dict]:
        return _get(self.router.list_requests.remote())

    def stats(self) -> dict:
        return _get(self.router.stats.remote())

    async def stats_async(self) -> dict:
        return await _get_async(self.router.stats.remote())

    def info(self) -> dict:
        return _get(self.router.info.remote())

    def health(self) -> bool:
        return _get(self.router.health.remote())

    async def health_async(self) -> bool:
        return await _get_async(self.router.health.remote())

    def reset_prefix_cache(self) -> bool:
        return _get(self.router.reset_prefix_cache.remote())

    def scale(self, size: int) -> dict:
        return _get(self.router.scale.remote(size))

    def describe(self) -> dict:
        return _get(self.router.describe.remote())

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


# A call to the router waits this long at most (it answers, or asks every replica within 30 s).
_CALL_TIMEOUT_S = 60.0


def _get(ref):
    try:
        return ray.get(ref, timeout=_CALL_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError as e:
        raise EngineDeadError(f"the router did not answer in {_CALL_TIMEOUT_S:.0f} s") from e
    except ray.exceptions.RayError as e:
        raise _router_error(e) from e


async def _get_async(ref):
    """_get without a thread, for an event loop (its caller may set a shorter deadline)."""
    try:
        return await asyncio.wait_for(asyncio.wrap_future(ref.future()), _CALL_TIMEOUT_S)
    except ray.exceptions.RayError as e:
        raise _router_error(e) from e


def _router_error(e: BaseException) -> Exception:
    """The router's own exception (EngineDeadError, ValueError: messages of ours), or one
    saying it is gone; Ray's text (pids, addresses, actor ids) goes to the log only."""
    if isinstance(e, ray.exceptions.RayActorError):
        log.warning("the router is gone: %s", e)
        return EngineDeadError("the router is gone")
    cause = getattr(e, "cause", None)
    if isinstance(cause, (EngineDeadError, ValueError)):
        return (EngineDeadError if isinstance(cause, EngineDeadError) else ValueError)(str(cause))
    log.error("the router failed a call", exc_info=e)
    return RuntimeError(f"the router failed the call ({type(cause or e).__name__})")


class _LoopThread:
    """An event loop on a daemon thread, to drive async generators for sync callers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                        name="tierserve-router-client")
        self._thread.start()

    def iterate(self, agen) -> Iterator:
        out: queue.Queue = queue.Queue()
        done = object()

        async def pump():
            try:
                async for item in agen:
                    out.put(item)
            except BaseException as e:
                out.put(e)
            finally:
                out.put(done)

        future = asyncio.run_coroutine_threadsafe(pump(), self.loop)
        try:
            while True:
                item = out.get()
                if item is done:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not future.done():
                future.cancel()
                try:
                    future.result(timeout=30)
                except BaseException:
                    pass

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)

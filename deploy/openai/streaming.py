"""A body's engine requests as one stream of (prompt index, delta), with queue accounting and
metrics; and the watch that aborts a body's requests when its client goes away, from the moment
it is admitted (before its first token too: the engine aborts a request wherever it is)."""
from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from tierserve.deploy.openai.admission import Admission
from tierserve.deploy.openai.errors import ApiError, error_of
from tierserve.deploy.openai.metrics import Metrics, Tracker
from tierserve.deploy.openai.responses import Fold, Piece
from tierserve.deploy.openai.tenants import Tenant
from tierserve.runtime.client import AsyncLLM, DuplicateRequestError
from tierserve.runtime.errors import EngineDeadError
from tierserve.runtime.lora import LoRARequest
from tierserve.runtime.outputs import RequestOutput
from tierserve.scheduler.params import SamplingParams

__all__ = ["EngineStream", "until_disconnect", "ClientGone", "disconnected",
           "gather_until_disconnect", "fold_whole", "fold_pieces"]

log = logging.getLogger("tierserve.http")


class ClientGone(Exception):
    """The client disconnected before its response began."""


class EngineStream:
    """The deltas of a body's engine requests (one per prompt), merged as they come; closing
    it aborts what has not finished. `first()` waits for the first delta, so that an error
    there becomes the response's status. The engine's request ids are `id_prefix` + the
    body's ids: a client's own request_id, prefixed by its namespace (tenant or address),
    names its request only among that namespace's."""

    def __init__(self, engine: AsyncLLM, prompts: list, params: SamplingParams, base_id: str,
                 priority: int, cache_salt: str | None, admission: Admission,
                 metrics: Metrics, tenant: Tenant | None = None, id_prefix: str = "",
                 lora_request: LoRARequest | None = None) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.admission, self.metrics = admission, metrics
        self.base_id = base_id
        self.tenant = tenant
        admission.admit(len(prompts))
        self.tasks = [asyncio.ensure_future(self._pump(
            i, params.n, engine.generate(p, params, request_id=id_prefix + (
                f"{base_id}-{i}" if len(prompts) > 1 else base_id), priority=priority,
                cache_salt=cache_salt, lora_request=lora_request)))
            for i, p in enumerate(prompts)]
        self.remaining = len(prompts)
        self.head: tuple[int, RequestOutput] | None = None

    async def _pump(self, i: int, n: int, gen: AsyncIterator[RequestOutput]) -> None:
        t = self.tenant
        tracker = Tracker(self.metrics, t.name if t else "", t.charge if t else None)
        started = False
        finished: set[int] = set()  # the samples whose finishing delta came
        try:
            async for delta in gen:
                if not started and (delta.prompt_token_ids or delta.error):
                    started = True
                    self.admission.started()
                    tracker.prompt(delta)
                tracker.outputs(delta)
                finished.update(c.index for c in delta.outputs if c.finish_reason is not None)
                await self.queue.put((i, delta))
            tracker.done()
        except asyncio.CancelledError:  # the client left: its unfinished samples are aborted
            tracker.aborted(n - len(finished))
            raise
        except DuplicateRequestError as e:  # this client's request_id is taken: 409
            failed = RequestOutput.failed("", None, [], str(e))
            failed.error_kind = "conflict"
            await self.queue.put((i, failed))
        except Exception as e:  # the engine is gone: this prompt fails, the stream ends
            failed = RequestOutput.failed("", None, [], str(e))
            failed.error_kind = "engine_dead" if isinstance(e, EngineDeadError) else "internal"
            await self.queue.put((i, failed))
            log.warning("request %s failed: %s", i, e)
        finally:
            if not started:
                self.admission.started()
            await gen.aclose()
            await self.queue.put((i, None))

    async def _next(self) -> tuple[int, RequestOutput] | None:
        while self.remaining:
            i, delta = await self.queue.get()
            if delta is not None:
                return i, delta
            self.remaining -= 1
        return None

    async def first(self, request: Request) -> RequestOutput | None:
        """Waits for the first delta and keeps it for iteration; returns it (None: no delta
        will come). A client that leaves meanwhile (its prompt still tokenizing, queued, or
        prefilling) closes the stream, aborting its requests, and raises ClientGone."""
        head = asyncio.ensure_future(self._next())
        watch = asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait({head, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if not head.done():
            head.cancel()
            await self.aclose()
            raise ClientGone
        self.head = head.result()
        return self.head[1] if self.head is not None else None

    async def __aiter__(self):
        if self.head is not None:
            head, self.head = self.head, None
            yield head
        while (item := await self._next()) is not None:
            yield item

    async def aclose(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def until_disconnect(request: Request, work, stream: EngineStream):
    """The response of `work`, unless the client goes away first: then its requests are
    aborted (their blocks freed) and nothing is sent."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return Response(status_code=499)
    finally:
        watch.cancel()
        await stream.aclose()


async def fold_whole(stream: EngineStream, fold: Fold) -> Fold:
    """Folds in every delta of a body's stream; a failed delta's ApiError is raised."""
    async for i, delta in stream:
        if delta.error:
            raise error_of(delta)
        fold.add(i, delta)
    return fold


async def fold_pieces(stream: EngineStream, fold: Fold) -> AsyncIterator[Piece | ApiError]:
    """A body's stream folded in as it comes: the pieces each delta makes (Fold.add), and,
    where a delta failed, its ApiError last."""
    async for i, delta in stream:
        if delta.error:
            yield error_of(delta)
            return
        for piece in fold.add(i, delta):
            yield piece


async def gather_until_disconnect(request: Request, coros) -> list | None:
    """The results of `coros` (gathered), or None when the client goes away first: then they
    are cancelled, which aborts their engine requests."""
    work = asyncio.ensure_future(asyncio.gather(*coros))
    watch = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            return None
        return work.result()
    finally:
        watch.cancel()


async def disconnected(request: Request) -> None:
    """Returns once the client has gone (the body was read before: nothing else comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass

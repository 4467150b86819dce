"""A body's engine requests as one stream of (prompt index, delta), with queue accounting and
metrics; and the watch that aborts a full response's requests when its client goes away."""
from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from tierserve.deploy.openai.admission import Admission
from tierserve.deploy.openai.metrics import Metrics, Tracker
from tierserve.deploy.openai.tenants import Tenant
from tierserve.runtime.client import AsyncLLM
from tierserve.runtime.executor import EngineDeadError
from tierserve.runtime.outputs import RequestOutput
from tierserve.scheduler.params import SamplingParams

__all__ = ["EngineStream", "until_disconnect"]

log = logging.getLogger("tierserve.http")


class EngineStream:
    """The deltas of a body's engine requests (one per prompt), merged as they come; closing
    it aborts what has not finished. `first()` waits for the first delta, so that an error
    there becomes the response's status."""

    def __init__(self, engine: AsyncLLM, prompts: list, params: SamplingParams, base_id: str,
                 priority: int, cache_salt: str | None, admission: Admission,
                 metrics: Metrics, tenant: Tenant | None = None) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.admission, self.metrics = admission, metrics
        self.base_id = base_id
        self.tenant = tenant
        admission.admit(len(prompts))
        self.tasks = [asyncio.ensure_future(self._pump(
            i, engine.generate(p, params, request_id=f"{base_id}-{i}" if len(prompts) > 1
                               else base_id, priority=priority, cache_salt=cache_salt)))
            for i, p in enumerate(prompts)]
        self.remaining = len(prompts)
        self.head: tuple[int, RequestOutput] | None = None

    async def _pump(self, i: int, gen: AsyncIterator[RequestOutput]) -> None:
        t = self.tenant
        tracker = Tracker(self.metrics, t.name if t else "", t.charge if t else None)
        started = False
        try:
            async for delta in gen:
                if not started and (delta.prompt_token_ids or delta.error):
                    started = True
                    self.admission.started()
                    tracker.prompt(delta)
                tracker.outputs(delta)
                await self.queue.put((i, delta))
            tracker.done()
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

    async def first(self) -> RequestOutput | None:
        """Waits for the first delta and keeps it for iteration; returns it (None: no delta
        will come)."""
        self.head = await self._next()
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

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
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

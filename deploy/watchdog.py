"""A client's view of whether its engine answers: a stream from an engine whose process is
stopped or hung would otherwise wait forever, since nothing arrives to say so.

A stream's heartbeat (its lease renewals) is a call the engine answers even between outputs;
while calls go unanswered for the step timeout, the engine is unresponsive and the stream
fails. Waiting in a queue behind other requests is not silence: the engine still answers.
"""
from __future__ import annotations

import asyncio
import time

from tierserve.runtime.errors import EngineDeadError

__all__ = ["Liveness", "next_or_dead"]


class Liveness:
    """When the engine last answered, and a future that fails once it has been silent for
    `timeout_s`. Used on one event loop."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.last = time.monotonic()
        self.dead: asyncio.Future = asyncio.get_running_loop().create_future()

    def beat(self) -> None:
        self.last = time.monotonic()

    def watch(self, ref) -> None:
        """Called at each heartbeat with its call's ObjectRef: an answer is a beat; silence
        past the timeout fails `dead`."""
        asyncio.wrap_future(ref.future()).add_done_callback(self._answered)
        silent = time.monotonic() - self.last
        if silent > self.timeout_s and not self.dead.done():
            self.dead.set_exception(EngineDeadError(
                f"the engine is unresponsive: no answer for {silent:.0f} s (step timeout "
                f"{self.timeout_s:.0f} s)"))

    def _answered(self, fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self.beat()


async def next_or_dead(stream, alive: Liveness):
    """The stream's next item, or the EngineDeadError of an unresponsive engine;
    StopAsyncIteration at the end."""
    item = asyncio.ensure_future(stream.__anext__())
    done, _ = await asyncio.wait({item, alive.dead}, return_when=asyncio.FIRST_COMPLETED)
    if item in done:
        return item.result()
    item.cancel()
    alive.dead.result()  # raises

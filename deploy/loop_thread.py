"""An event loop on a daemon thread, so that synchronous callers (LLM) can iterate the async
generators an engine client streams with."""
from __future__ import annotations

import asyncio
import queue
import threading
from typing import Iterator

__all__ = ["LoopThread"]


class LoopThread:
    """An event loop on a daemon thread, to drive async generators for sync callers."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name=name)
        self._thread.start()

    def iterate(self, agen) -> Iterator:
        """The generator's items, in the caller's thread; leaving early cancels it."""
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

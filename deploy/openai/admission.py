"""What a request passes before the engine sees it: the body's size and read-time limits (an
ASGI layer, so an oversized or trickled body is never buffered whole) and the bound on requests
waiting for a first token."""
from __future__ import annotations

import asyncio
import time

import msgspec

from tierserve.deploy.openai.errors import ApiError, error_json

__all__ = ["Admission", "BodyLimit"]

_encode = msgspec.json.Encoder().encode


class Admission:
    """Counts requests with no first token yet; refuses past the bound, so admitted requests
    keep a bounded time to first token past saturation."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.pending = 0

    def admit(self, n: int) -> None:
        if self.pending + n > self.limit:
            raise ApiError(503, f"the server's queue is full ({self.limit} requests wait for "
                           f"a first token); try again later")
        self.pending += n

    def started(self) -> None:
        self.pending -= 1


class BodyLimit:
    """Reads a request body up to the limit before the app sees it: a longer one is answered
    413 without buffering the rest, one that has not arrived whole within `timeout_s` 408."""

    def __init__(self, app, limit: int, timeout_s: float = 30.0) -> None:
        self.app, self.limit, self.timeout_s = app, limit, timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(send, 413, f"the request body is over {self.limit} bytes")
        chunks, size, more = [], 0, True
        deadline = time.monotonic() + self.timeout_s
        while more:
            try:
                msg = await asyncio.wait_for(receive(), deadline - time.monotonic())
            except asyncio.TimeoutError:
                return await self._refuse(send, 408, f"the request body did not arrive within "
                                          f"{self.timeout_s:g} s")
            if msg["type"] != "http.request":
                return  # the client left before sending its body
            body = msg.get("body", b"")
            size += len(body)
            if size > self.limit:
                return await self._refuse(send, 413, f"the request body is over {self.limit} "
                                          f"bytes")
            chunks.append(body)
            more = msg.get("more_body", False)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(send, status: int, message: str) -> None:
        body = _encode(error_json(status, message))
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

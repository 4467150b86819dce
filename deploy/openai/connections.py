"""The server's connections: uvicorn's h11 protocol, with the limits it lacks against slow or
greedy clients.

- A request head (request line and headers) must arrive whole within `header_timeout_s` of the
  connection opening, or of its last response on a kept-alive connection; else 408 and close.
  uvicorn's timeout_keep_alive covers only a connection that sends nothing at all, and h11
  bounds a head's size, not its pace.
- At most `max_connections_per_client` open connections per client address; one more is
  answered 429 and closed at once, before it can hold anything.
- Bodies are read by admission.BodyLimit, within `body_timeout_s`.
Every such answer is OpenAI's error JSON.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import msgspec
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from tierserve.deploy.openai.errors import error_json

__all__ = ["ConnectionLimits", "protocol_class", "uvicorn_config"]

_encode = msgspec.json.Encoder().encode
_REASONS = {408: b"Request Timeout", 429: b"Too Many Requests"}
# A request head larger than this is refused by h11 (400).
MAX_HEAD_BYTES = 64 << 10


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float = 10.0
    max_connections_per_client: int = 256

    def __post_init__(self) -> None:
        if not self.header_timeout_s > 0 or self.max_connections_per_client < 1:
            raise ValueError("header_timeout_s must be > 0 and max_connections_per_client >= 1")


def protocol_class(limits: ConnectionLimits) -> type:
    """An h11 protocol class enforcing `limits`, with its own count of open connections per
    client address (one server's; protocol objects all run on its event loop)."""
    open_by_host: dict[str, int] = {}

    class GuardedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None
        _host = ""

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._host = self.client[0] if self.client else ""
            n = open_by_host.get(self._host, 0)
            open_by_host[self._host] = n + 1
            if n >= limits.max_connections_per_client:
                self._refuse(429, f"more than {limits.max_connections_per_client} open "
                             f"connections from this address")
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._head_timer is not None and self._head_in():
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self._head_in():  # kept alive: the next head has its own deadline
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            left = open_by_host.get(self._host, 1) - 1
            if left > 0:
                open_by_host[self._host] = left
            else:
                open_by_host.pop(self._host, None)
            super().connection_lost(exc)

        def _head_in(self) -> bool:
            """Whether a request's head has arrived and its response is not done."""
            return self.cycle is not None and not self.cycle.response_complete

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(limits.header_timeout_s, self._too_slow)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _too_slow(self) -> None:
            self._head_timer = None
            if not self._head_in() and not self.transport.is_closing():
                self._refuse(408, f"the request head did not arrive within "
                             f"{limits.header_timeout_s:g} s")

        def _refuse(self, status: int, message: str) -> None:
            body = _encode(error_json(status, message))
            self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s"
                                 % (status, _REASONS[status], len(body), body))
            self.transport.close()

    return GuardedH11Protocol


def uvicorn_config(app, host: str, port: int, limits: ConnectionLimits,
                   **options) -> uvicorn.Config:
    """uvicorn's config for the app, with the guarded protocol and h11's head-size bound."""
    return uvicorn.Config(app, host=host, port=port, http=protocol_class(limits),
                          h11_max_incomplete_event_size=MAX_HEAD_BYTES, **options)

"""OpenAI's error JSON and the statuses that answer each failure.

An error body never carries a traceback, a pid, an address or an actor id: a server-side
failure (5xx) is logged here in full under a correlation id, and its body has the scrubbed
message and that id (also in the X-Correlation-Id header), so an operator can find the log
line a client quotes.
"""
from __future__ import annotations

import logging
import re
import uuid

from fastapi.responses import JSONResponse

from tierserve.runtime.outputs import RequestOutput

__all__ = ["ApiError", "BadField", "param_of", "HTTP_STATUS", "ERROR_TYPE", "error_json",
           "error_response", "error_of", "param_path", "scrub", "server_error",
           "CORRELATION_HEADER"]

log = logging.getLogger("tierserve.http")

# An error kind (RequestOutput.error_kind) and the HTTP status that answers it.
HTTP_STATUS = {"bad_request": 400, "conflict": 409, "overloaded": 503, "engine_dead": 503,
               "internal": 500}
ERROR_TYPE = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
              405: "MethodNotAllowedError", 408: "RequestTimeoutError", 409: "ConflictError",
              413: "RequestTooLargeError", 422: "UnprocessableEntityError",
              429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError"}
CORRELATION_HEADER = "x-correlation-id"

# What a message from deeper down (Ray, the OS, a worker) may carry that a client must not see.
_SCRUB = [
    (re.compile(r"\x1b\[[0-9;]*[A-Za-z]"), ""),                            # ANSI colours
    (re.compile(r"\b(?:tcp|ipc|inproc|unix|http)s?://\S+"), "<address>"),
    (re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b"), "<address>"),     # IPv4[:port]
    (re.compile(r"(?<![\w:])(?:[0-9a-fA-F]{0,4}:){2,7}[0-9a-fA-F]{0,4}(?![\w:])"), "<address>"),
    (re.compile(r"\b0x[0-9a-fA-F]{6,}\b"), "<address>"),                     # memory
    (re.compile(r"\bpid[=: ]\s*\d+", re.I), "pid=<hidden>"),
    (re.compile(r"\b[0-9a-fA-F]{20,}\b"), "<id>"),                             # actor, node ids
    (re.compile(r"(?:/[\w.-]+){2,}"), "<path>"),                             # file paths
]
_MAX_MESSAGE = 500


class BadField(ValueError):
    """A request field with a value the server cannot serve (the message names it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


_PARAM = re.compile(r"^(?:SamplingParams\.)?([a-z_]+)(?:\[\d+\])?(?:\.[a-z_]+)?\b")


def param_of(message: str) -> str | None:
    """The field a ValueError from SamplingParams or the engine's checks names first."""
    m = _PARAM.match(message)
    return m.group(1) if m else None


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.headers = headers


def error_json(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPE.get(status, "Error"),
                      "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_json(status, message, param), status_code=status, headers=headers)


def error_of(delta: RequestOutput) -> ApiError:
    """The ApiError of a failed engine request's delta."""
    status = HTTP_STATUS.get(delta.error_kind or "internal", 500)
    message = delta.error or "request failed"
    if status >= 500:
        return server_error(status, message)
    param = param_of(message) if status == 400 else None
    # A completions body sends token ids in `prompt`.
    return ApiError(status, message, "prompt" if param == "prompt_token_ids" else param)


def scrub(message: str) -> str:
    """The message without a traceback, addresses, pids, ids or paths, and not too long."""
    message = message.split("Traceback (most recent call last)")[0]
    for pattern, replacement in _SCRUB:
        message = pattern.sub(replacement, message)
    message = " ".join(message.split())
    return message if len(message) <= _MAX_MESSAGE else message[:_MAX_MESSAGE - 3] + "..."


def server_error(status: int, message: str, exc: BaseException | None = None) -> ApiError:
    """A 5xx: logged in full under a new correlation id, answered scrubbed, with the id."""
    cid = uuid.uuid4().hex[:16]
    log.error("HTTP %d, correlation id %s: %s", status, cid, message, exc_info=exc)
    return ApiError(status, f"{scrub(message)} (correlation id {cid})",
                    headers={CORRELATION_HEADER: cid})


def param_path(loc: list[str]) -> str | None:
    """pydantic's error location as a field path: messages.0.content -> messages[0].content;
    a union's branch names (str, list[int], ...) are dropped."""
    out = ""
    for part in loc:
        if part.isdigit():
            out += f"[{part}]"
        elif part.isidentifier():
            out += ("." if out else "") + part
        else:
            break
    return out or None

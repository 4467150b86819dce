"""OpenAI's error JSON and the statuses that answer each failure."""
from __future__ import annotations

import re

from fastapi.responses import JSONResponse

from tierserve.runtime.outputs import RequestOutput

__all__ = ["ApiError", "BadField", "param_of", "HTTP_STATUS", "ERROR_TYPE", "error_json", "error_response", "error_of",
           "param_path"]

# An error kind (RequestOutput.error_kind) and the HTTP status that answers it.
HTTP_STATUS = {"bad_request": 400, "overloaded": 503, "engine_dead": 503, "internal": 500}
ERROR_TYPE = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
              413: "RequestTooLargeError", 429: "RateLimitError", 500: "InternalServerError",
              503: "ServiceUnavailableError"}


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
    return ApiError(status, delta.error or "request failed",
                    param_of(delta.error or "") if status == 400 else None)


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

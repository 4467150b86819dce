"""Validation of a client's request at the engine's door, types included.

A request reaches the EngineCore from Python callers, Ray actor calls and (later) HTTP, so
nothing about its fields can be assumed: every check here raises ValueError naming the field,
and a request that passes can be tokenized, scheduled, encoded on the wire and decoded by the
workers. Token ids are checked against the vocabulary by the scheduler.
"""
from __future__ import annotations

import operator

from tierserve.scheduler.messages import EngineCoreRequest
from tierserve.scheduler.params import SamplingParams
from tierserve.workers.structured import check_structured

__all__ = ["check_request", "token_ids", "MAX_INT64"]

MAX_INT64 = 2**63 - 1
_CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


def check_request(request: EngineCoreRequest) -> None:
    if not isinstance(request.req_id, str) or not request.req_id:
        raise ValueError(f"request_id must be a non-empty string, got {request.req_id!r}")
    _check_text("request_id", request.req_id)
    given = [name for name in ("prompt", "prompt_token_ids", "messages")
             if getattr(request, name) is not None]
    if len(given) != 1:
        raise ValueError("a request takes exactly one of prompt, prompt_token_ids and messages; "
                         f"got {', '.join(given) if given else 'none'}")
    if request.prompt is not None:
        if not isinstance(request.prompt, str):
            raise ValueError(f"prompt must be a string, got {type(request.prompt).__name__}")
        _check_text("prompt", request.prompt)
    if request.messages is not None:
        check_messages(request.messages)
    if not isinstance(request.sampling_params, SamplingParams):
        raise ValueError(f"sampling_params must be SamplingParams, got "
                         f"{type(request.sampling_params).__name__}")
    # Checked when built, and again here: fields can be set past the constructor.
    request.sampling_params.__post_init__()
    if request.sampling_params.structured_outputs is not None:
        check_structured(request.sampling_params.structured_outputs)
    if type(request.priority) is not int or abs(request.priority) > MAX_INT64:
        raise ValueError(f"priority must be an int, got {request.priority!r}")
    if request.cache_salt is not None:
        if not isinstance(request.cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {request.cache_salt!r}")
        _check_text("cache_salt", request.cache_salt)


def check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if role not in _CHAT_ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(_CHAT_ROLES)}, "
                             f"got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string, got "
                             f"{type(content).__name__}")
        _check_text(f"messages[{i}].content", content)
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise ValueError(f"messages[{i}] has unknown keys: {', '.join(sorted(map(str, extra)))}")
        if "name" in m and not isinstance(m["name"], str):
            raise ValueError(f"messages[{i}].name must be a string")


def token_ids(ids, field: str = "prompt_token_ids") -> list[int]:
    """ids as a list of Python ints (numpy integers accepted); bools, floats, strings and
    values outside int64 are refused."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise ValueError(f"{field} must be a list of token ids, got {type(ids).__name__}")
    out = []
    for i, t in enumerate(ids):
        if isinstance(t, bool):
            raise ValueError(f"{field}[{i}] is a bool, not a token id")
        try:
            value = operator.index(t)
        except TypeError:
            raise ValueError(f"{field}[{i}] must be an int, got {type(t).__name__}") from None
        if not -MAX_INT64 - 1 <= value <= MAX_INT64:
            raise ValueError(f"{field}[{i}] = {value} is outside int64")
        out.append(value)
    return out


def _check_text(field: str, text: str) -> None:
    """UTF-8 encodable: a lone surrogate (from a bad decode) cannot be tokenized or sent."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{field} is not valid Unicode text: {e.reason} at position "
                         f"{e.start}") from None

"""Validation of a request, types included, in the two places it is checked.

A user's prompt (text, chat messages or token ids) is checked in the client's process, before
any text work (`check_prompt`, `token_ids`); the EngineCore takes token ids only and checks
what reaches it again at its door (`check_request`), since it is also reached by Ray actor calls
that no client of ours made. Nothing about a field can be assumed: every check raises
ValueError naming the field, and a request that passes can be scheduled, encoded on the wire
and decoded by the workers. Token ids are checked against the vocabulary by the scheduler too.
"""
from __future__ import annotations

import json
import logging
import operator
from dataclasses import dataclass
from typing import Required, TypedDict

from tierserve.runtime.errors import EngineDeadError
from tierserve.scheduler.messages import EngineCoreOutput, EngineCoreRequest
from tierserve.scheduler.params import (
    ErrorKind, FinishReason, QueueFullError, SamplingParams,
)
from tierserve.workers.grammar import check_structured

__all__ = ["check_request", "check_prompt", "check_messages", "message_content", "check_params",
           "token_ids", "prompt_fields", "Prompt", "CHAT_OPTIONS", "check_chat_options", "MAX_INT64",
           "rejection", "TextPrompt", "TokensPrompt"]

log = logging.getLogger("tierserve.engine")

MAX_INT64 = 2**63 - 1
_CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


class TextPrompt(TypedDict, total=False):
    """vLLM's text prompt (a dict: LLM.generate and AsyncLLM.generate take plain dicts too)."""

    prompt: Required[str]
    cache_salt: str


class TokensPrompt(TypedDict, total=False):
    """vLLM's token-id prompt."""

    prompt_token_ids: Required[list[int]]
    cache_salt: str


@dataclass(slots=True)
class Prompt:
    """Exactly one of text, token_ids and messages (chat, rendered by the model's template,
    with `chat`'s options: CHAT_OPTIONS' names, vLLM's)."""

    text: str | None = None
    token_ids: list | None = None
    messages: list | None = None
    chat: dict | None = None
    # vLLM's prompt-dict key (TokensPrompt / TextPrompt): the request's cache salt.
    cache_salt: str | None = None
    # Whether the tokenizer adds its special tokens (BOS) to a text or a rendered chat; None:
    # yes for text, no for chat (whose template writes them), as vLLM encodes each.
    add_special_tokens: bool | None = None


# What a chat prompt may say about its rendering, beside its messages (vLLM's LLM.chat
# arguments and chat-completion fields).
CHAT_OPTIONS = ("add_generation_prompt", "continue_final_message", "chat_template",
                "chat_template_kwargs", "tools")


# vLLM's prompt-dict keys of images, audio and their processors.
_MULTI_MODAL_KEYS = {"multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids"}


def prompt_fields(prompt) -> Prompt:
    """A prompt as text, token ids, chat messages, or a dict of prompt / prompt_token_ids /
    messages (prompt_token_ids may come with `prompt`, their text, which the output reports);
    ValueError for anything else (check_prompt checks the values)."""
    if isinstance(prompt, str):
        return Prompt(text=prompt)
    if isinstance(prompt, dict):
        media = sorted(set(prompt) & _MULTI_MODAL_KEYS)
        if media:
            raise ValueError(f"{', '.join(media)}: multi-modal inputs are not supported; the "
                             f"models served here (Llama family) take text only")
        unknown = set(prompt) - {"prompt", "prompt_token_ids", "messages", "cache_salt",
                                 "add_special_tokens", *CHAT_OPTIONS}
        if unknown or not prompt:
            raise ValueError(f"a prompt dict takes prompt, prompt_token_ids or messages (with "
                             f"{', '.join(CHAT_OPTIONS)}), cache_salt and add_special_tokens; "
                             f"got {sorted(map(str, prompt)) or 'nothing'}")
        given = [k for k in ("prompt", "prompt_token_ids", "messages") if prompt.get(k) is not None]
        if given == ["prompt", "prompt_token_ids"]:  # vLLM's TokensPrompt with the ids' text
            given = ["prompt_token_ids"]
        if len(given) != 1:
            raise ValueError("a request takes exactly one of prompt, prompt_token_ids and "
                             f"messages; got {', '.join(given) if given else 'none'}")
        chat = {k: prompt[k] for k in CHAT_OPTIONS if prompt.get(k) is not None}
        if chat and given != ["messages"]:
            raise ValueError(f"{', '.join(chat)} go with messages only")
        special = prompt.get("add_special_tokens")
        if special is not None and (type(special) is not bool or given == ["prompt_token_ids"]):
            raise ValueError("add_special_tokens is true or false, for a prompt or messages")
        return Prompt(prompt.get("prompt"), prompt.get("prompt_token_ids"), prompt.get("messages"),
                      chat or None, prompt.get("cache_salt"), special)
    if isinstance(prompt, (list, tuple)):
        if prompt and all(isinstance(m, dict) for m in prompt):
            return Prompt(messages=list(prompt))
        return Prompt(token_ids=list(prompt))
    raise ValueError(f"a prompt is a string, a list of token ids, a list of chat messages or a "
                     f"dict, got {type(prompt).__name__}")


def check_prompt(prompt: Prompt) -> None:
    """The prompt's own checks (types, Unicode), before anything tokenizes it."""
    if prompt.text is not None:
        if not isinstance(prompt.text, str):
            raise ValueError(f"prompt must be a string, got {type(prompt.text).__name__}")
        _check_text("prompt", prompt.text)
    elif prompt.messages is not None:
        prompt.messages = check_messages(prompt.messages)
        check_chat_options(prompt.chat or {})


def check_params(params, priority, cache_salt) -> None:
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
    # Checked when built, and again here: fields can be set past the constructor.
    params.__post_init__()
    if params.structured_outputs is not None:
        check_structured(params.structured_outputs)
    if type(priority) is not int or abs(priority) > MAX_INT64:
        raise ValueError(f"priority must be an int, got {priority!r}")
    if cache_salt is not None:
        if not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {cache_salt!r}")
        _check_text("cache_salt", cache_salt)


def check_request(request: EngineCoreRequest) -> list[int]:
    """The engine's door: the request's token ids as Python ints, or ValueError."""
    if not isinstance(request.req_id, str) or not request.req_id:
        raise ValueError(f"request_id must be a non-empty string, got {request.req_id!r}")
    _check_text("request_id", request.req_id)
    if not isinstance(request.label, str):
        raise ValueError(f"label must be a string, got {type(request.label).__name__}")
    _check_text("label", request.label)
    check_params(request.sampling_params, request.priority, request.cache_salt)
    if request.sampling_params.bad_words:
        raise ValueError("bad_words are text, which the engine never reads: the frontend "
                         "tokenizes them into bad_words_token_ids")
    return token_ids(request.prompt_token_ids)


def check_messages(messages) -> list[dict]:
    """The messages as the chat template takes them, from the shapes vLLM's LLM.chat takes
    (OpenAI's): content a string, text parts (joined) or None (a tool-call turn's); an
    assistant's tool_calls (their arguments as dicts, as templates read them) and a tool
    reply's tool_call_id go to the template. ValueError names the first bad field."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    return [_message(i, m) for i, m in enumerate(messages)]


def _message(i: int, m) -> dict:
    if not isinstance(m, dict):
        raise ValueError(f"messages[{i}] must be a dict, got {type(m).__name__}")
    role = m.get("role")
    if role not in _CHAT_ROLES:
        raise ValueError(f"messages[{i}].role must be one of {', '.join(_CHAT_ROLES)}, "
                         f"got {role!r}")
    extra = set(m) - _MESSAGE_KEYS
    if extra:
        raise ValueError(f"messages[{i}] has unknown keys: {', '.join(sorted(map(str, extra)))}")
    out = {"role": role, "content": message_content(i, m.get("content"))}
    for key in ("name", "tool_call_id"):
        if key in m:
            if not isinstance(m[key], str):
                raise ValueError(f"messages[{i}].{key} must be a string")
            out[key] = m[key]
    if m.get("tool_calls") is not None:
        out["tool_calls"] = _tool_calls(i, m["tool_calls"])
    return out


_MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id"}


def message_content(i: int, content) -> str:
    """messages[i]'s content as one text: a string, text parts joined, or None ("")."""
    if content is None:
        return ""
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text"
                   and isinstance(p.get("text"), str) for p in content):
            raise ValueError(f"messages[{i}].content: only text content parts "
                             f"({{'type': 'text', 'text': ...}}) are supported")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ValueError(f"messages[{i}].content must be a string or text parts, got "
                         f"{type(content).__name__}")
    _check_text(f"messages[{i}].content", content)
    return content


def _tool_calls(i: int, calls) -> list[dict]:
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise ValueError(f"{where} must be a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{where}[{j}] must be {{'function': {{'name', 'arguments'}}}}")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise ValueError(f"{where}[{j}].function.arguments is not JSON") from None
        out.append({**call, "function": {**fn, "arguments": args}})
    return out


def check_chat_options(chat: dict) -> None:
    for name in ("add_generation_prompt", "continue_final_message"):
        if name in chat and type(chat[name]) is not bool:
            raise ValueError(f"{name} must be true or false")
    if chat.get("add_generation_prompt") and chat.get("continue_final_message"):
        raise ValueError("add_generation_prompt and continue_final_message cannot both be "
                         "true: the last message is either answered or continued")
    template = chat.get("chat_template")
    if template is not None and (not isinstance(template, str) or not template.strip()):
        raise ValueError("chat_template must be a non-empty string (a Jinja template)")
    kwargs = chat.get("chat_template_kwargs")
    if kwargs is not None and (not isinstance(kwargs, dict)
                               or not all(isinstance(k, str) for k in kwargs)):
        raise ValueError("chat_template_kwargs must be a dict with string keys")
    tools = chat.get("tools")
    if tools is not None and (not isinstance(tools, list)
                              or not all(isinstance(t, dict) for t in tools)):
        raise ValueError("tools must be a list of tool dicts (OpenAI's function tools)")


def token_ids(ids, field: str = "prompt_token_ids", vocab_size: int | None = None) -> list[int]:
    """ids as a list of Python ints (numpy integers accepted); bools, floats, strings and
    values outside int64 (or, given vocab_size, outside [0, vocab_size)) are refused."""
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
        if vocab_size is not None and not 0 <= value < vocab_size:
            raise ValueError(f"{field}[{i}] = {value} is out of range [0, {vocab_size})")
        out.append(value)
    return out


def _check_text(field: str, text: str) -> None:
    """UTF-8 encodable: a lone surrogate (from a bad decode) cannot be tokenized or sent."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{field} is not valid Unicode text: {e.reason} at position "
                         f"{e.start}") from None


def rejection(request: EngineCoreRequest, error: Exception) -> EngineCoreOutput:
    """The one output of a request that could not be added: bad input says what was wrong;
    anything else is logged as the engine's bug, and still fails this request alone."""
    kind = (ErrorKind.OVERLOADED if isinstance(error, QueueFullError) else
            ErrorKind.ENGINE_DEAD if isinstance(error, EngineDeadError) else
            ErrorKind.BAD_REQUEST if isinstance(error, ValueError) else ErrorKind.INTERNAL)
    if kind == ErrorKind.INTERNAL:
        log.error("request %r could not be added", request.req_id, exc_info=error)
    message = str(error) if kind != ErrorKind.INTERNAL else (
        f"internal error adding the request: {type(error).__name__}: {error}")
    return EngineCoreOutput(str(request.req_id), finish_reason=FinishReason.ERROR, error=message,
                            error_kind=kind)

"""OpenAI's Responses API body (`POST /v1/responses`) and what it becomes: the conversation of
its `input` items (after a stored `previous_response_id`'s, behind its `instructions`) as a chat
body, which the chat endpoint's own code turns into a prompt and SamplingParams.

Items are text: messages (roles user, assistant, system, developer; content a string or
input_text / output_text parts), function_call and function_call_output. A response's own
`output` items may be sent back as input (its reasoning items are not re-read). Anything else
(images, files, hosted tools) is a 400 naming the item.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tierserve.deploy.openai.errors import BadField
from tierserve.deploy.openai.protocol import ChatCompletionRequest

__all__ = ["ResponsesRequest", "chat_body", "input_messages", "LOGPROBS_INCLUDE"]

# The one `include` value with a meaning here: logprobs on output_text.
LOGPROBS_INCLUDE = "message.output_text.logprobs"
_TEXT_PARTS = ("input_text", "output_text", "text")
# Chat-body fields whose errors name a Responses field of another name.
_RENAMED = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
            "messages": "input", "response_format": "text.format", "logprobs": "top_logprobs",
            "reasoning_effort": "reasoning"}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_obfuscation: bool = False  # never obfuscated: the stream is the client's own


class ResponsesRequest(BaseModel):
    """OpenAI's fields with a meaning for a text model, then vLLM's extensions."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[dict] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    text: dict | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: str = "disabled"
    background: bool = False
    reasoning: dict | None = None
    # OpenAI's fields that change nothing this server answers (as chat's); max_tool_calls
    # bounds hosted tools' calls, of which there are none.
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    max_tool_calls: int | None = None
    # Refused unless null: prompt templates and conversations stored with OpenAI.
    prompt: dict | None = None
    conversation: str | dict | None = None
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    cache_salt: str | None = None
    priority: int = 0
    request_id: str | None = None


def input_messages(body: ResponsesRequest) -> list[dict]:
    """The body's input items as chat messages (the chat body's shape)."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    out: list[dict] = []
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise BadField(where, "an input item is an object")
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, where))
        elif kind == "function_call":
            call = {"id": _str(item, "call_id", where), "type": "function", "function": {
                "name": _str(item, "name", where), "arguments": _str(item, "arguments", where)}}
            if out and out[-1]["role"] == "assistant":  # one turn's calls, one message
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "reasoning":  # a response's reasoning sent back: not re-read
            continue
        elif kind == "function_call_output":
            _str(item, "call_id", where)
            output = item.get("output")
            content = output if isinstance(output, str) else _text_of(output, f"{where}.output")
            out.append({"role": "tool", "content": content, "tool_call_id": item["call_id"]})
        else:
            raise BadField(f"{where}.type", f"input item type {kind!r} is not supported: "
                                            f"message, function_call, function_call_output")
    return out


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise BadField(f"{where}.role", f"a message's role is user, assistant, system or "
                                        f"developer, got {role!r}")
    content = item.get("content")
    text = content if isinstance(content, str) else _text_of(content, f"{where}.content")
    return {"role": "system" if role == "developer" else role, "content": text}


def _text_of(parts, where: str) -> str:
    if not isinstance(parts, list):
        raise BadField(where, "content is a string or a list of text parts")
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS \
                or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise BadField(f"{where}[{j}]", f"only text content parts are supported (input_text"
                                            f", output_text), got {kind!r}")
        texts.append(part["text"])
    return "".join(texts)


def _str(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise BadField(f"{where}.{key}", f"{item.get('type')} needs {key} (a string)")
    return value


def chat_body(body: ResponsesRequest, history: list[dict]) -> ChatCompletionRequest:
    """The chat body that serves this Responses body: `history` (a stored response's
    conversation) then the input, behind the instructions as a system message."""
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else
                []) + history + input_messages(body)
    _refuse_unsupported(body)
    unknown = sorted(set(body.include or ()) - {LOGPROBS_INCLUDE})
    if unknown:
        raise BadField("include", f"include takes {LOGPROBS_INCLUDE!r} only, got {unknown}")
    logprobs = body.top_logprobs is not None or LOGPROBS_INCLUDE in (body.include or ())
    fields = dict(
        model=body.model, messages=messages, max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature, top_p=body.top_p, seed=body.seed, top_k=body.top_k,
        min_p=body.min_p, repetition_penalty=body.repetition_penalty,
        cache_salt=body.cache_salt, priority=body.priority, request_id=body.request_id,
        logprobs=logprobs, top_logprobs=(body.top_logprobs or 0) if logprobs else None,
        response_format=_response_format(body.text), tools=_chat_tools(body.tools),
        tool_choice=_chat_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls, stream=body.stream,
        reasoning_effort=(body.reasoning or {}).get("effort"))
    try:
        return ChatCompletionRequest(**fields)
    except ValidationError as e:
        first = e.errors()[0]
        loc = [str(p) for p in first.get("loc", ())]
        raise BadField(renamed(loc[0] if loc else "input"), f"{'.'.join(loc)}: "
                                                            f"{first.get('msg')}") from None


def _refuse_unsupported(body: ResponsesRequest) -> None:
    if body.truncation != "disabled":
        raise BadField("truncation", f"truncation is 'disabled' (a conversation longer than the "
                                     f"context is refused), got {body.truncation!r}")
    if body.background:
        raise BadField("background", "background responses are not supported: stream it, or "
                                     "wait for it")
    unknown = sorted(set(body.reasoning or ()) - {"effort", "summary", "generate_summary"})
    if unknown:
        raise BadField("reasoning", f"reasoning takes effort and summary, got {unknown}")
    for name in ("prompt", "conversation"):
        if getattr(body, name) is not None:
            raise BadField(name, f"{name} refers to what OpenAI stores; send the input itself "
                                 f"(or previous_response_id)")


def renamed(param: str | None) -> str | None:
    """A chat field's name as this body calls it (its tools are flat: tools[i].parameters)."""
    if param is not None and param.startswith("tools["):
        return param.replace(".function.", ".")
    return _RENAMED.get(param, param)


def _response_format(text: dict | None) -> dict | None:
    """`text.format` (flat: {type, name, schema, strict}) as chat's response_format."""
    if not text:
        return None
    unknown = set(text) - {"format", "verbosity"}
    if unknown:
        raise BadField("text", f"text takes format (and verbosity), got {sorted(unknown)}")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise BadField("text.format", "text.format is an object with a type")
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise BadField("text.format", "text.format.schema must be a JSON schema object")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"),
                                                       "schema": fmt["schema"]}}
    if fmt.get("type") in ("text", "json_object"):
        return {"type": fmt["type"]}
    raise BadField("text.format", f"text.format.type must be text, json_object or "
                                  f"json_schema, got {fmt.get('type')!r}")


def _chat_tools(tools: list[dict] | None) -> list | None:
    """Function tools (flat: {type, name, parameters, ...}) as chat's nested ones."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        if kind != "function" or not isinstance(tool.get("name"), str):
            raise BadField(f"tools[{i}]", f"only function tools ({{\"type\": \"function\", "
                                          f"\"name\", \"parameters\"}}) are supported, got "
                                          f"{kind!r}")
        out.append({"type": "function", "function": {
            "name": tool["name"], "parameters": tool.get("parameters"),
            "description": tool.get("description")}})
    return out


def _chat_tool_choice(choice):
    """{"type": "function", "name"} as chat's {"type": "function", "function": {"name"}}."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice

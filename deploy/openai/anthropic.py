"""Anthropic's Messages API (`POST /v1/messages`, what the `anthropic` client and tools built on
it send), as vLLM serves it: a body runs as the chat completion of its conversation, through
the server's admission, tenants and metrics, whole or streamed as Anthropic's events.

`system`, `messages` (text, `tool_use` and `tool_result` blocks; earlier `thinking` blocks are
dropped), `max_tokens`, `stop_sequences`, `temperature`, `top_p`, `top_k`, `tools` with
`tool_choice` (auto, any, tool, none; `disable_parallel_tool_use`), `metadata`. A reply's
calls come back as `tool_use` blocks with `stop_reason: "tool_use"`; a stop sequence that ends
it is left out of its text and named in `stop_sequence`.
"""
from __future__ import annotations

import json
import uuid
from typing import Literal

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tierserve.deploy.openai.errors import ApiError, BadField
from tierserve.deploy.openai.protocol import ChatCompletionRequest, chat_prompt, sampling_params
from tierserve.deploy.openai.responses import Fold
from tierserve.deploy.openai.streaming import (
    ClientGone, EngineStream, fold_pieces, fold_whole, until_disconnect,
)
from tierserve.deploy.openai.structured import ToolPlan, parse_tool_calls, tool_plan
from tierserve.deploy.openai.tenants import Tenant
from tierserve.deploy.openai.tokenize import chat_prompt_tokens

__all__ = ["MessagesRequest", "messages_response", "CountTokensRequest", "count_tokens_response"]

_encode = msgspec.json.Encoder().encode
_STOP = {"length": "max_tokens", "stop": "end_turn", "repetition": "end_turn"}


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int
    messages: list[dict] = Field(min_length=1)
    system: str | list[dict] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    metadata: dict | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here


class CountTokensRequest(BaseModel):
    """`POST /v1/messages/count_tokens`: the fields of a message that make its prompt."""

    model_config = ConfigDict(extra="forbid")
    model: str
    messages: list[dict] = Field(min_length=1)
    system: str | list[dict] | None = None
    tools: list[dict] | None = None
    tool_choice: dict | None = None


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadField(where, "content is a string or a list of blocks")
    texts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" \
                or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise BadField(f"{where}[{j}]", f"only text blocks are supported here, got {kind!r}")
        texts.append(block["text"])
    return "".join(texts)


def _messages(body: MessagesRequest) -> list[dict]:
    out = [] if body.system is None else [{"role": "system",
                                           "content": _text(body.system, "system")}]
    for i, m in enumerate(body.messages):
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise BadField(f"messages[{i}].role", f"role is user or assistant, got {role!r}")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise BadField(f"messages[{i}].content", "content is a string or a list of blocks")
        text, calls = [], []
        for j, block in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            if kind == "text" and isinstance(block.get("text"), str):
                text.append(block["text"])
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("name"), str) or not isinstance(
                        block.get("input", {}), dict):
                    raise BadField(where, "a tool_use block is {\"id\", \"name\", \"input\": "
                                          "{...}}")
                calls.append({"id": str(block.get("id")), "type": "function", "function": {
                    "name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
            elif kind == "tool_result" and role == "user":
                result = block.get("content", "")
                out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id")),
                            "content": _text(result, f"{where}.content")})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue  # an earlier turn's reasoning is not re-read
            else:
                raise BadField(where, f"a {role} message takes text, "
                                      f"{'tool_use' if role == 'assistant' else 'tool_result'}"
                                      f" blocks here, got {kind!r}")
        if text or calls:
            out.append({"role": role, "content": "".join(text) or None,
                        **({"tool_calls": calls} if calls else {})})
    return out


def _chat(body: MessagesRequest) -> ChatCompletionRequest:
    tools = choice = None
    parallel = True
    if body.tools:
        tools = []
        for i, t in enumerate(body.tools):
            if not isinstance(t.get("name"), str) or t.get("type") not in (None, "custom"):
                raise BadField(f"tools[{i}]", "a tool is {\"name\", \"input_schema\"} (client "
                                              "tools only)")
            tools.append({"type": "function", "function": {
                "name": t["name"], "description": t.get("description"),
                "parameters": t.get("input_schema")}})
    if body.tool_choice:
        kind = body.tool_choice.get("type")
        choice = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
        if kind == "tool":
            choice = {"type": "function", "function": {"name": body.tool_choice.get("name")}}
        if choice is None:
            raise BadField("tool_choice", f"tool_choice.type is auto, any, tool or none, got "
                                          f"{kind!r}")
        parallel = not body.tool_choice.get("disable_parallel_tool_use", False)
    stops = body.stop_sequences or None
    try:
        return ChatCompletionRequest(
            model=body.model, messages=_messages(body), max_tokens=body.max_tokens,
            temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, stop=stops,
            include_stop_str_in_output=bool(stops), tools=tools, tool_choice=choice,
            parallel_tool_calls=parallel, stream=body.stream)
    except ValidationError as e:  # e.g. messages whose blocks leave no message
        first = e.errors()[0]
        loc = [str(p) for p in first.get("loc", ())]
        raise BadField(loc[0] if loc else "messages", f"{'.'.join(loc)}: "
                                                      f"{first.get('msg')}") from None


class MessageBuilder:
    """The message object and events of one body."""

    def __init__(self, model: str, tools: ToolPlan | None, stops: list[str]) -> None:
        self.id, self.model = f"msg_{uuid.uuid4().hex}", model
        self.tools = tools if tools is not None and tools.mode != "none" else None
        self.stops = stops
        self._sent = 0

    @staticmethod
    def _split_stop(c) -> tuple[str, str | None]:
        """The choice's text without the stop sequence that ended it (its stop_reason; the
        request keeps it in the text), and that sequence."""
        stop = c.stop_reason if c.finish_reason == "stop" else None
        if isinstance(stop, str) and c.text.endswith(stop):
            return c.text[:-len(stop)], stop
        return c.text, None

    def blocks(self, fold: Fold) -> tuple[list[dict], str, str | None]:
        c = fold.choices[0]
        text, stop = self._split_stop(c)
        if self.tools is not None:
            calls, content = parse_tool_calls(self.tools, text)
            if calls and c.finish_reason == "length" and not all(
                    isinstance(_json_or_none(call["function"]["arguments"]), dict)
                    for call in calls):
                calls = []  # a call cut short by max_tokens: the text as it is
            if calls:
                head = [{"type": "text", "text": content}] if content else []
                return head + [{"type": "tool_use", "id": f"toolu_{call['id'][5:]}",
                                "name": call["function"]["name"],
                                "input": _tool_input(call["function"]["arguments"])}
                               for call in calls], "tool_use", None
        reason = "stop_sequence" if stop is not None else _STOP.get(c.finish_reason,
                                                                    "end_turn")
        return [{"type": "text", "text": text}], reason, stop

    def message(self, fold: Fold, final: bool) -> dict:
        content, reason, stop = self.blocks(fold) if final else ([], None, None)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": reason, "stop_sequence": stop,
                # Anthropic's input_tokens leave the cache reads out (total input is
                # input_tokens + cache_read_input_tokens), as vLLM's do.
                "usage": {"input_tokens": sum(fold.prompt_tokens) - sum(fold.cached_tokens),
                          "output_tokens": fold.completion_tokens if final else 0,
                          "cache_read_input_tokens": sum(fold.cached_tokens)}}

    @staticmethod
    def event(kind: str, **fields) -> bytes:
        return b"event: " + kind.encode() + b"\ndata: " + _encode({"type": kind, **fields}) + \
            b"\n\n"

    def text_delta(self, fold: Fold, final: bool) -> list[bytes]:
        """Text as it comes, when no tool may be called (held back: a stop sequence that may
        still end it)."""
        if self.tools is not None:
            return []
        c = fold.choices[0]
        final = final or c.finish_reason is not None
        text = self._split_stop(c)[0] if final else c.text
        hold = 0 if final else max((len(s) - 1 for s in self.stops), default=0)
        end = max(self._sent, len(text) - hold)
        out = []
        if self._sent == 0 and end > 0:
            out.append(self.event("content_block_start", index=0,
                                  content_block={"type": "text", "text": ""}))
        if end > self._sent:
            out.append(self.event("content_block_delta", index=0, delta={
                "type": "text_delta", "text": text[self._sent:end]}))
            self._sent = end
        return out

    def closing(self, fold: Fold) -> list[bytes]:
        content, reason, stop = self.blocks(fold)
        out = self.text_delta(fold, True)
        if self.tools is None:
            if self._sent == 0:  # an empty reply still has its text block
                out.append(self.event("content_block_start", index=0,
                                      content_block={"type": "text", "text": ""}))
            out.append(self.event("content_block_stop", index=0))
        else:
            for i, block in enumerate(content):
                start = dict(block, input={}) if block["type"] == "tool_use" else \
                    dict(block, text="")
                delta = {"type": "input_json_delta", "partial_json": json.dumps(
                    block["input"])} if block["type"] == "tool_use" else \
                    {"type": "text_delta", "text": block["text"]}
                out += [self.event("content_block_start", index=i, content_block=start),
                        self.event("content_block_delta", index=i, delta=delta),
                        self.event("content_block_stop", index=i)]
        return out + [self.event("message_delta", delta={"stop_reason": reason,
                                                         "stop_sequence": stop},
                                 usage={"output_tokens": fold.completion_tokens}),
                      self.event("message_stop")]


async def messages_response(server, body: MessagesRequest, request: Request,
                            tenant: Tenant | None) -> Response:
    server.check_model(body.model)
    chat = _chat(body)
    tools = tool_plan(chat.tools, chat.tool_choice, chat.parallel_tool_calls,
                      server.tool_format)
    prompt = chat_prompt(chat, server.config.chat_template, server.tool_format)
    params = sampling_params(chat, tools, server.generation_defaults)
    builder = MessageBuilder(server.model_name(body.model), tools, body.stop_sequences or [])
    try:
        stream = await server.start("chat", [prompt], chat, params, builder.id, request, tenant)
    except ClientGone:
        return Response(status_code=499)
    fold = Fold(1, 1, False)
    if body.stream:
        return StreamingResponse(_events(stream, fold, builder), media_type="text/event-stream")
    return await until_disconnect(request, _whole(stream, fold, builder), stream)


async def count_tokens_response(server, body: CountTokensRequest) -> dict:
    """`input_tokens`: the prompt tokens a message of these fields has (its usage's
    input_tokens + cache_read_input_tokens)."""
    server.check_model(body.model)
    chat = _chat(MessagesRequest(max_tokens=1, **body.model_dump()))
    prompt = chat_prompt(chat, server.config.chat_template, server.tool_format)
    return {"input_tokens": await chat_prompt_tokens(server, prompt)}


async def _whole(stream: EngineStream, fold: Fold, builder: MessageBuilder) -> JSONResponse:
    return JSONResponse(builder.message(await fold_whole(stream, fold), True))


async def _events(stream: EngineStream, fold: Fold, builder: MessageBuilder):
    try:
        started = False
        async for piece in fold_pieces(stream, fold):
            if isinstance(piece, ApiError):
                yield builder.event("error", error={"type": "api_error",
                                                    "message": piece.message})
                return
            if not started:
                started = True
                yield builder.event("message_start", message=builder.message(fold, False))
            for event in builder.text_delta(fold, False):
                yield event
        for event in builder.closing(fold):
            yield event
    finally:
        await stream.aclose()


def _json_or_none(text: str):
    try:
        return json.loads(text or "{}")
    except ValueError:
        return None


def _tool_input(arguments: str) -> dict:
    """A tool_use block's input: Anthropic's is an object, so arguments that are not one (a
    forced call cut short by max_tokens, a model writing a bare value) come as
    {"arguments": <the text>}, never as the request's failure."""
    value = _json_or_none(arguments)
    if value is None:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}

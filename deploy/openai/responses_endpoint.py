"""OpenAI's Responses API: `POST /v1/responses` (whole or streamed), and the stored responses'
`GET` and `DELETE /v1/responses/{id}`. A body runs as the chat body it translates to
(responses_protocol.py), through the server's admission, tenants and metrics as chat does."""
from __future__ import annotations

import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tierserve.deploy.openai.errors import ApiError, BadField
from tierserve.deploy.openai.protocol import chat_prompt, sampling_params
from tierserve.deploy.openai.reasoning import constrained_after_reasoning, parses_reasoning
from tierserve.deploy.openai.responses import Fold
from tierserve.deploy.openai.responses_output import ResponseBuilder, conversation_of
from tierserve.deploy.openai.responses_protocol import (
    ResponsesRequest, chat_body, input_messages, renamed,
)
from tierserve.deploy.openai.responses_store import ResponseStore
from tierserve.deploy.openai.streaming import (
    ClientGone, EngineStream, fold_pieces, fold_whole, until_disconnect,
)
from tierserve.deploy.openai.structured import tool_plan
from tierserve.deploy.openai.tenants import Tenant, namespace_of

__all__ = ["ResponsesEndpoint"]


class ResponsesEndpoint:
    def __init__(self, server, store: ResponseStore) -> None:
        self.server, self.store = server, store

    async def create(self, body: ResponsesRequest, request: Request, tenant: Tenant | None):
        server = self.server
        server.check_model(body.model)
        namespace = namespace_of(request, tenant)
        history = self._history(namespace, body.previous_response_id)
        chat = chat_body(body, history)
        try:
            tools = tool_plan(chat.tools, chat.tool_choice, chat.parallel_tool_calls,
                              server.tool_format)
            prompt = chat_prompt(chat, server.config.chat_template, server.tool_format,
                                 thinks=server.config.reasoning_parser is not None,
                                 trust_template=server.config.trust_request_chat_template)
            params = sampling_params(chat, tools, server.generation_defaults)
        except BadField as e:
            raise BadField(renamed(e.param), str(e)) from None
        rid = f"resp_{uuid.uuid4().hex}"
        reasoning = server.config.reasoning_parser is not None
        if reasoning:
            params = await constrained_after_reasoning(
                server.tokenizer, prompt, params,
                tools is not None and tools.mode in ("named", "required"))
            reasoning = parses_reasoning(params)
        builder = ResponseBuilder(rid, server.model_name(body.model), body, params, tools,
                                  server.decode_token, params.logprobs or 0, reasoning)
        try:
            stream = await server.start("chat", [prompt], chat, params, body.request_id or rid,
                                        request, tenant)
        except ClientGone:
            return Response(status_code=499)
        fold = Fold(1, 1, params.logprobs is not None)
        # What a later turn continues from: without the instructions, as OpenAI keeps it.
        turn = (namespace, history + input_messages(body)) if body.store else None
        if body.stream:
            return StreamingResponse(self._events(stream, fold, builder, turn),
                                     media_type="text/event-stream")
        return await until_disconnect(request, self._full(stream, fold, builder, turn), stream)

    def _history(self, namespace: str, previous: str | None) -> list[dict]:
        if previous is None:
            return []
        stored = self.store.get(namespace, previous)
        if stored is None:
            raise ApiError(404, f"previous_response_id {previous!r}: no stored response of "
                                f"this client has that id", "previous_response_id")
        return stored.messages

    def _keep(self, turn, response: dict) -> None:
        if turn is not None and response["status"] in ("completed", "incomplete"):
            namespace, messages = turn
            self.store.put(namespace, response, messages + conversation_of(response["output"]))

    async def _full(self, stream: EngineStream, fold: Fold, builder: ResponseBuilder, turn):
        response = builder.full(await fold_whole(stream, fold))
        self._keep(turn, response)
        return JSONResponse(response)

    async def _events(self, stream: EngineStream, fold: Fold, builder: ResponseBuilder, turn):
        try:
            for event in builder.opening():
                yield event
            async for piece in fold_pieces(stream, fold):
                if isinstance(piece, ApiError):
                    for event in builder.failed(piece, fold):
                        yield event
                    return
                for event in builder.piece(piece, fold):
                    yield event
            for event in builder.closing(fold):
                yield event
            self._keep(turn, builder.full(fold))
        finally:
            await stream.aclose()

    def retrieve(self, rid: str, request: Request, tenant: Tenant | None) -> dict:
        stored = self.store.get(namespace_of(request, tenant), rid)
        if stored is None:
            raise ApiError(404, f"no stored response of this client has the id {rid!r}")
        return stored.response

    def delete(self, rid: str, request: Request, tenant: Tenant | None) -> dict:
        if not self.store.delete(namespace_of(request, tenant), rid):
            raise ApiError(404, f"no stored response of this client has the id {rid!r}")
        return {"id": rid, "object": "response", "deleted": True}

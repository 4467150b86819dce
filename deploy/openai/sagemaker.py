"""SageMaker's hosting contract, as vLLM serves it: `GET` / `POST /ping` is /health, and
`POST /invocations` is the endpoint its body's shape names: chat completions (`messages`),
completions (`prompt`) or embeddings (`input`), validated and answered as there."""
from __future__ import annotations

import json

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from tierserve.deploy.openai.embeddings import EmbeddingRequest, embeddings_response
from tierserve.deploy.openai.errors import ApiError
from tierserve.deploy.openai.protocol import ChatCompletionRequest, CompletionRequest

__all__ = ["sagemaker_routes"]


def sagemaker_routes(app: FastAPI, server, auth: Depends) -> None:
    @app.get("/ping")
    @app.post("/ping")
    async def ping():
        return await server.health()

    @app.post("/invocations")
    async def invocations(request: Request, tenant=auth):
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            raise ApiError(400, f"the body is not JSON: {e}") from None
        kind = next((k for k in ("messages", "prompt", "input")
                     if isinstance(body, dict) and k in body), None)
        if kind is None:
            raise ApiError(400, "an invocation is a chat (messages), completion (prompt) or "
                                "embedding (input) body")
        model = {"messages": ChatCompletionRequest, "prompt": CompletionRequest,
                 "input": EmbeddingRequest}[kind]
        try:
            parsed = model.model_validate(body)
        except ValidationError as e:  # answered as the endpoint's own bodies are
            raise RequestValidationError(e.errors()) from None
        if kind == "messages":
            return await server.chat(parsed, request, tenant)
        if kind == "prompt":
            return await server.completions(parsed, request, tenant)
        return await embeddings_response(server, parsed, request, tenant)

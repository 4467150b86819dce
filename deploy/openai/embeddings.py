"""`POST /v1/embeddings` (OpenAI's): each input's vector (runtime/pooling.py, through
AsyncLLM.encode), as floats or base64 float32, through the server's admission and tenants."""
from __future__ import annotations

import base64
import struct

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from tierserve.deploy.openai.errors import ApiError, BadField, param_of
from tierserve.deploy.openai.protocol import prompts_of
from tierserve.deploy.openai.streaming import gather_until_disconnect
from tierserve.deploy.openai.tenants import Tenant
from tierserve.runtime.pooling import PoolingParams

__all__ = ["EmbeddingRequest", "embeddings_response", "embed_all"]


class EmbeddingRequest(BaseModel):
    """OpenAI's fields, then vLLM's."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None
    normalize: bool = True
    truncate_prompt_tokens: int | None = None
    cache_salt: str | None = None
    priority: int = 0


async def embeddings_response(server, body: EmbeddingRequest, request: Request,
                              tenant: Tenant | None) -> Response:
    server.check_model(body.model)
    if body.encoding_format not in ("float", "base64"):
        raise BadField("encoding_format", f"encoding_format is float or base64, got "
                                          f"{body.encoding_format!r}")
    try:
        pooling = PoolingParams(normalize=body.normalize, dimensions=body.dimensions)
    except ValueError as e:
        raise BadField("dimensions", str(e).replace("PoolingParams.", "")) from None
    prompts = prompts_of(body.input, "input")
    outputs = await embed_all(server, prompts, body, request, tenant, "input", pooling)
    if outputs is None:  # the client left: its requests are aborted
        return Response(status_code=499)
    data = [{"object": "embedding", "index": i,
             "embedding": _encoded(o.outputs.embedding, body.encoding_format)}
            for i, o in enumerate(outputs)]
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return JSONResponse({"object": "list", "data": data, "model": server.model_name(body.model),
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def embed_all(server, prompts: list, body, request: Request, tenant: Tenant | None,
                    field: str, pooling: PoolingParams | None = None) -> list | None:
    """The prompts' embeddings (a body's model, truncate_prompt_tokens, priority and
    cache_salt), through the admission and the tenant's checks; None when the client left
    (its requests are then aborted). A bad prompt is a 400 naming `field`."""
    lora = server.check_model(body.model)
    server.check_prompts("embedding", prompts, tenant)
    salt = body.cache_salt if tenant is None else tenant.cache_salt(body.cache_salt)
    server.admission.admit(len(prompts))
    try:
        outputs = await gather_until_disconnect(request, (
            _one(server.engine, p, pooling, body, salt, lora) for p in prompts))
    except ValueError as e:
        message = str(e)
        raise ApiError(400, message, "dimensions" if param_of(message) == "dimensions"
                       else field) from None
    finally:
        for _ in prompts:
            server.admission.started()
    if outputs is not None:
        server.metrics.served_whole(tenant, sum(len(o.prompt_token_ids) for o in outputs), 0,
                                    ["length"] * len(outputs))
    return outputs


async def _one(engine, prompt, pooling: PoolingParams | None, body, salt, lora):
    outs = [out async for out in engine.encode(
        prompt, pooling, truncate_prompt_tokens=body.truncate_prompt_tokens,
        priority=body.priority, cache_salt=salt, lora_request=lora)]
    return outs[-1]


def _encoded(vec: list[float], encoding: str):
    """OpenAI's base64: the float32 values little-endian, base64 encoded."""
    if encoding == "float":
        return vec
    return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()

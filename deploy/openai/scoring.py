"""vLLM's `/score` and `/rerank` (Jina's and Cohere's shape) with an embedding model: each
pair's cosine similarity of the two texts' embeddings (runtime/pooling.py), each distinct text
embedded once, through the server's admission and tenants as /v1/embeddings."""
from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from tierserve.deploy.openai.embeddings import embed_all
from tierserve.deploy.openai.errors import BadField
from tierserve.deploy.openai.tenants import Tenant
from tierserve.runtime.pooling import cosine, score_pairs

__all__ = ["ScoreRequest", "RerankRequest", "score_response", "rerank_response"]


class ScoreRequest(BaseModel):
    """vLLM's: text_1 against each of text_2 (one to N), or N against N in order."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None
    cache_salt: str | None = None
    priority: int = 0
    user: str | None = None


class RerankDocument(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str


class RerankRequest(BaseModel):
    """Jina's and Cohere's rerank fields (vLLM's /rerank): the documents by relevance to the
    query, the top_n first (0: all)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int = 0
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    cache_salt: str | None = None
    priority: int = 0
    user: str | None = None


async def _cosines(server, texts_1: list[str], texts_2: list[str], body, request: Request,
                   tenant: Tenant | None) -> tuple[list[float], int] | None:
    """Each pair's score and the prompt tokens embedded; None when the client left."""
    try:
        pairs = score_pairs(texts_1, texts_2)
    except ValueError as e:
        raise BadField("text_2", str(e)) from None
    distinct = list(dict.fromkeys(texts_1 + texts_2))
    outputs = await embed_all(server, distinct, body, request, tenant, "input")
    if outputs is None:
        return None
    vectors = {text: o.outputs.embedding for text, o in zip(distinct, outputs)}
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return [cosine(vectors[texts_1[i]], vectors[texts_2[j]]) for i, j in pairs], tokens


async def score_response(server, body: ScoreRequest, request: Request,
                         tenant: Tenant | None) -> Response:
    texts_1 = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    texts_2 = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    scored = await _cosines(server, texts_1, texts_2, body, request, tenant)
    if scored is None:
        return Response(status_code=499)
    scores, tokens = scored
    return JSONResponse({
        "id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
        "model": server.model_name(body.model),
        "data": [{"index": k, "object": "score", "score": s} for k, s in enumerate(scores)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def rerank_response(server, body: RerankRequest, request: Request,
                          tenant: Tenant | None) -> Response:
    if body.top_n < 0:
        raise BadField("top_n", f"top_n must be >= 0 (0: every document), got {body.top_n}")
    docs = [d if isinstance(d, str) else d.text for d in body.documents]
    if not docs:
        raise BadField("documents", "documents must hold at least one document")
    scored = await _cosines(server, [body.query], docs, body, request, tenant)
    if scored is None:
        return Response(status_code=499)
    scores, tokens = scored
    order = sorted(range(len(docs)), key=lambda k: -scores[k])
    results = [{"index": k, "relevance_score": scores[k]} |
               ({"document": {"text": docs[k]}} if body.return_documents else {})
               for k in order[:body.top_n or len(docs)]]
    return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "model": server.model_name(body.model),
                         "usage": {"total_tokens": tokens}, "results": results})

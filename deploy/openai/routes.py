"""The server's routes: completions, chat and responses (full or streamed), embeddings,
scores and reranking, models, health, metrics.

Every call to the engine has a deadline: /health answers within HEALTH_DEADLINE_S whatever
the engine does (503 "engine unresponsive" when it cannot tell), /metrics serves the last
values read, with their age, and a stream fails once its engine has been silent for the step
timeout (runtime/client.py, deploy/watchdog.py)."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from tierserve.deploy.openai.admission import Admission, BodyLimit
from tierserve.deploy.openai.anthropic import (
    CountTokensRequest, MessagesRequest, count_tokens_response, messages_response,
)
from tierserve.deploy.openai.beam import beam_response
from tierserve.deploy.openai.connections import uvicorn_config
from tierserve.deploy.openai.embeddings import EmbeddingRequest, embeddings_response
from tierserve.deploy.openai.scoring import (
    RerankRequest, ScoreRequest, rerank_response, score_response,
)
from tierserve.deploy.openai.errors import (
    ApiError,
    error_json,
    error_of,
    error_response,
    scrub,
    server_error,
)
from tierserve.deploy.openai.handlers import error_handlers
from tierserve.deploy.openai.lora_admin import lora_admin_routes
from tierserve.deploy.openai.metrics import Metrics
from tierserve.deploy.openai.protocol import (
    BadField,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    chat_prompt,
    completion_prompts,
    sampling_params,
)
from tierserve.deploy.openai.reasoning import (
    constrained_after_reasoning,
    parses_reasoning,
)
from tierserve.deploy.openai.responses import Fold, Responder, sse
from tierserve.deploy.openai.responses_endpoint import ResponsesEndpoint
from tierserve.deploy.openai.responses_protocol import ResponsesRequest
from tierserve.deploy.openai.responses_store import ResponseStore
from tierserve.deploy.openai.sagemaker import sagemaker_routes
from tierserve.deploy.openai.server_config import ServerConfig
from tierserve.deploy.openai.streaming import (
    ClientGone, EngineStream, fold_pieces, fold_whole, until_disconnect,
)
from tierserve.deploy.openai.structured import ToolPlan, tool_plan
from tierserve.deploy.openai.tenants import Tenant, namespace_of
from tierserve.deploy.openai.tokenize import (
    detokenize_response, token_text, tokenize_response,
)
from tierserve.deploy.openai.tool_parsers import TOOL_CALL_PARSERS
from tierserve.runtime import envs
from tierserve.runtime.client import AsyncLLM
from tierserve.runtime.errors import EngineDeadError
from tierserve.runtime.lora import LoRARequest
from tierserve.runtime.processor import check_text_bytes
from tierserve.scheduler.params import SamplingParams

__all__ = ["OpenAIServer", "build_app", "serve_http"]

log = logging.getLogger("tierserve.http")

# /health answers within 2 s: the engine gets this long to say it serves.
HEALTH_DEADLINE_S = 1.5
# /metrics reads the engine's stats for this long at most, else serves the last ones.
STATS_DEADLINE_S = 1.0


class OpenAIServer:
    def __init__(self, engine: AsyncLLM, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        # "": requests without a tenant (no keys, or refused before authentication).
        self.metrics = Metrics(("",) + (tuple(config.keys.tenants) if config.keys is not None
                                        else ()))
        self.admission = Admission(config.max_queued_requests)
        self.created = int(time.time())
        info = engine.info()
        self.max_model_len, self.vocab_size = info.get("max_model_len"), info.get("vocab_size")
        # What a body's unset sampling fields take (the model's generation config).
        self.generation_defaults = info.get("generation_defaults") or {}
        tok = self.tokenizer = engine.tokenizer
        self.decode_token = (lambda t: tok.decode([t], skip_special_tokens=False)) \
            if tok is not None else str
        self.responses = ResponsesEndpoint(self, ResponseStore(config.response_store_bytes))
        # The engine's named LoRA adapters (lora_modules): a body's model field picks one.
        self.adapters = {m["name"]: LoRARequest(m["name"], m["id"], m["path"])
                         for m in info.get("lora_modules") or ()}
        # What an adapter added at run time is checked against (None: no LoRA).
        self.lora_check = info.get("lora_check")
        # How the model writes tool calls (tool_parsers.py).
        self.tool_format = TOOL_CALL_PARSERS[config.tool_call_parser]

    def check_model(self, name: str | None) -> LoRARequest | None:
        """The LoRA adapter a body's model field names (None: the base model); 404 for a
        name this server does not serve."""
        if name is None or name == self.config.served_model_name:
            return None
        adapter = self.adapters.get(name)
        if adapter is None:
            served = ", ".join(map(repr, [self.config.served_model_name, *self.adapters]))
            raise ApiError(404, f"the model {name!r} does not exist; this server serves "
                           f"{served}", "model")
        return adapter

    def model_name(self, name: str | None) -> str:
        """The model a response names: the adapter asked for, else the served model."""
        return name if name in self.adapters else self.config.served_model_name

    def authenticate(self, request: Request) -> Tenant | None:
        """The request's tenant (None without keys); 401 without a valid key."""
        keys = self.config.keys
        if keys is None:
            return None
        header = request.headers.get("authorization")
        if header is None and "x-api-key" in request.headers:  # Anthropic's clients' header
            header = f"Bearer {request.headers['x-api-key']}"
        tenant = keys.authenticate(header)
        request.state.tenant = tenant.name
        return tenant

    async def generate(self, kind: str, prompts: list, body, request: Request,
                       tenant: Tenant | None, tools: ToolPlan | None = None,
                       echo: list[str] | None = None):
        """Runs a body's prompts; the response, streamed or whole. `echo`: each prompt's
        text, which its choices begin with."""
        if body.use_beam_search:
            return await beam_response(self, kind, prompts, body, request, tenant, echo)
        params = sampling_params(body, tools, self.generation_defaults)
        thinking = kind == "chat" and self.config.reasoning_parser is not None
        if thinking:
            params = await constrained_after_reasoning(
                self.tokenizer, prompts[0], params,
                tools is not None and tools.mode in ("named", "required"))
        base_id = body.request_id or f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-" \
                                     f"{uuid.uuid4().hex}"
        options = body.stream_options
        include_usage = options is not None and options.include_usage
        echo_logprobs = echo is not None and params.logprobs is not None
        reasoning = thinking and parses_reasoning(params)
        responder = Responder(kind, base_id, int(time.time()), self.model_name(body.model),
                              self.decode_token, params.logprobs or 0, include_usage, tools,
                              echo_logprobs, body.prompt_logprobs is not None, reasoning,
                              options is not None and options.continuous_usage_stats,
                              body.return_token_ids, params.logprob_token_ids)
        fold = Fold(len(prompts), params.n, params.logprobs is not None, echo,
                    prompt_only=echo is not None and body.max_tokens == 0)
        try:
            stream = await self.start(kind, prompts, body, params, base_id, request, tenant)
        except ClientGone:
            return Response(status_code=499)
        if body.stream:
            return StreamingResponse(self._chunks(stream, fold, responder),
                                     media_type="text/event-stream")
        return await until_disconnect(request, self._full(stream, fold, responder), stream)

    async def start(self, kind: str, prompts: list, body, params: SamplingParams, base_id: str,
                    request: Request, tenant: Tenant | None) -> EngineStream:
        """Admits a body's prompts and waits for their first output: their stream, or the
        error of the first (ClientGone when the client leaves first)."""
        self.check_prompts(kind, prompts, tenant)
        salt = body.cache_salt if tenant is None else tenant.cache_salt(body.cache_salt)
        stream = EngineStream(self.engine, prompts, params, base_id, body.priority, salt,
                              self.admission, self.metrics, tenant,
                              namespace_of(request, tenant) if body.request_id else "",
                              self.check_model(body.model))
        first = await stream.first(request)
        if first is not None and first.error:
            await stream.aclose()
            raise error_of(first)
        return stream

    async def _full(self, stream: EngineStream, fold: Fold, responder: Responder):
        return JSONResponse(responder.full(await fold_whole(stream, fold)))

    async def _chunks(self, stream: EngineStream, fold: Fold, responder: Responder):
        if stream.head is not None:  # the opening chunks can carry its prompt's ids
            fold.note_prompt(*stream.head)
        try:
            for chunk in responder.opening(fold):
                yield chunk
            async for piece in fold_pieces(stream, fold):
                if isinstance(piece, ApiError):
                    yield sse(error_json(piece.status, piece.message, piece.param))
                    break
                for chunk in responder.piece(piece, fold):
                    yield chunk
            for chunk in responder.closing(fold):
                yield chunk
        finally:
            await stream.aclose()

    async def completions(self, body: CompletionRequest, request: Request,
                          tenant: Tenant | None):
        self.check_model(body.model)
        prompts = completion_prompts(body)
        echo = None
        if body.echo:
            echo = [p if isinstance(p, str) else p["prompt"] if isinstance(p, dict)
                    else token_text(self, p) for p in prompts]
        return await self.generate("completion", prompts, body, request, tenant, echo=echo)

    def check_prompts(self, kind: str, prompts: list, tenant: Tenant | None) -> None:
        """What a body's prompts pass before they queue: their number, their texts' bytes
        (no retry could fit either), the tenant's rate. `kind`: completion, chat or
        embedding (whose inputs are in `input`)."""
        if len(prompts) > self.config.max_queued_requests:
            field = "input" if kind == "embedding" else "prompt"
            raise BadField(field, f"{field} holds {len(prompts)} prompts; at most "
                           f"{self.config.max_queued_requests} (max_queued_requests) fit a "
                           f"body")
        self._check_text_bytes(kind, prompts)
        if tenant is not None:
            tenant.admit(len(prompts))

    def _check_text_bytes(self, kind: str, prompts: list) -> None:
        if self.tokenizer is None or self.max_model_len is None:
            return
        for p in prompts:
            if isinstance(p, dict) and isinstance(p.get("prompt"), str):
                p = p["prompt"]  # a text prompt with its add_special_tokens
            if isinstance(p, str):
                field = "input" if kind == "embedding" else "prompt"
                nbytes = len(p.encode())
            elif kind == "chat":
                field, nbytes = "messages", sum(len(m["content"].encode())
                                                for m in p["messages"])
            else:
                continue
            try:
                check_text_bytes(field, nbytes, self.max_model_len,
                                 self.tokenizer.max_token_bytes)
            except ValueError as e:
                raise BadField(field, str(e)) from None

    async def chat(self, body: ChatCompletionRequest, request: Request, tenant: Tenant | None):
        self.check_model(body.model)
        tools = tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls,
                          self.tool_format)
        prompt = chat_prompt(body, self.config.chat_template, self.tool_format,
                             thinks=self.config.reasoning_parser is not None,
                             trust_template=self.config.trust_request_chat_template)
        return await self.generate("chat", [prompt], body, request, tenant, tools)

    async def metrics_text(self) -> bytes:
        collector = self.metrics.engine
        try:
            collector.update(await asyncio.wait_for(self.engine.get_stats(), STATS_DEADLINE_S))
        except asyncio.TimeoutError:
            collector.update(None)  # unresponsive: the last values, their age growing
        except EngineDeadError as e:
            collector.update(dict(collector.stats, dead=scrub(str(e))))
        except Exception as e:
            log.warning("could not read the engine's stats: %s", e)
            collector.update(None)
        return generate_latest(self.metrics.registry)

    async def health(self) -> Response:
        try:
            await asyncio.wait_for(self.engine.check_health(), HEALTH_DEADLINE_S)
        except asyncio.TimeoutError:
            return error_response(503, f"engine unresponsive: no answer within "
                                  f"{HEALTH_DEADLINE_S:g} s")
        except EngineDeadError as e:
            return error_response(503, f"the engine is dead: {scrub(str(e))}")
        except Exception as e:
            err = server_error(503, f"the engine cannot be reached: {e}", e)
            return error_response(503, err.message, headers=err.headers)
        return Response(status_code=200)

    def models(self) -> dict:
        return {"object": "list", "data": [self.model_card(name) for name in
                                           (self.config.served_model_name, *self.adapters)]}

    def model_card(self, name: str) -> dict:
        """vLLM's card: an adapter's root is its folder and its parent the base model."""
        adapter = self.check_model(name)
        card = {"id": name, "object": "model", "created": self.created,
                "owned_by": "tierserve", "root": name, "parent": None,
                "max_model_len": self.max_model_len}
        if adapter is not None:
            card.update(root=adapter.lora_path, parent=self.config.served_model_name)
        return card


def build_app(engine: AsyncLLM, config: ServerConfig):
    """The ASGI app: FastAPI routes behind the body-size limit."""
    server = OpenAIServer(engine, config)
    app = FastAPI(title="tierserve", docs_url=None, redoc_url=None)
    app.state.server = server
    error_handlers(app, server.metrics)

    # The key is checked (a dependency) before the body is parsed: no key, no 400 either.
    auth = Depends(server.authenticate)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request, tenant: Tenant | None = auth):
        return await server.completions(body, request, tenant)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request, tenant: Tenant | None = auth):
        return await server.chat(body, request, tenant)

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request, tenant: Tenant | None = auth):
        return await messages_response(server, body, request, tenant)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest, tenant: Tenant | None = auth):
        return await count_tokens_response(server, body)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request, tenant: Tenant | None = auth):
        return await embeddings_response(server, body, request, tenant)

    @app.post("/v1/score")
    @app.post("/score")
    async def score(body: ScoreRequest, request: Request, tenant: Tenant | None = auth):
        return await score_response(server, body, request, tenant)

    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    @app.post("/rerank")
    async def rerank(body: RerankRequest, request: Request, tenant: Tenant | None = auth):
        return await rerank_response(server, body, request, tenant)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request, tenant: Tenant | None = auth):
        return await server.responses.create(body, request, tenant)

    @app.get("/v1/responses/{rid}")
    async def stored_response(rid: str, request: Request, tenant: Tenant | None = auth):
        return server.responses.retrieve(rid, request, tenant)

    @app.delete("/v1/responses/{rid}")
    async def delete_response(rid: str, request: Request, tenant: Tenant | None = auth):
        return server.responses.delete(rid, request, tenant)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest,
                       tenant: Tenant | None = auth):
        return await tokenize_response(server, body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, tenant: Tenant | None = auth):
        return await detokenize_response(server, body)

    @app.get("/v1/models")
    async def models(tenant: Tenant | None = auth):
        return server.models()

    @app.get("/v1/models/{name:path}")
    async def model(name: str, tenant: Tenant | None = auth):
        return server.model_card(name)

    if config.allow_runtime_lora_updating:
        lora_admin_routes(app, server, auth)
    sagemaker_routes(app, server, auth)

    @app.get("/health")
    async def health():
        return await server.health()

    @app.get("/version")
    async def version():  # vLLM's route and shape
        import tierserve
        return {"version": tierserve.__version__}

    @app.get("/metrics")
    async def metrics():
        return Response(await server.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    return BodyLimit(app, config.max_body_bytes, config.body_timeout_s)


def serve_http(engine: AsyncLLM, config: ServerConfig, host: str, port: int,
               log_level: str | None = None, access_log: bool = True) -> None:
    """Runs the server in the foreground until interrupted; uvicorn logs at `log_level`
    (default: TIERSERVE_LOG_LEVEL's), a line per request unless access_log is off."""
    app = build_app(engine, config)
    log.info("serving %s on http://%s:%d/v1", config.served_model_name, host, port)
    uvicorn.Server(uvicorn_config(app, host, port, config.connections,
                                  log_level=log_level or envs.log_level().lower(),
                                  access_log=access_log, timeout_graceful_shutdown=5)).run()

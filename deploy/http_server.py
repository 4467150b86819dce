"""`tierserve api-server`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of an
engine client (an in-process AsyncEngine or a Ray deployment), with Prometheus metrics.

Admission is bounded: the server counts its requests that have no first token yet and answers
503 at once past `max_queued_requests`, so the TTFT of admitted requests stays bounded past
saturation instead of growing with an unbounded queue. A client that disconnects (streaming or
not) aborts its requests, which frees their blocks.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

import msgspec
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tierserve.deploy.openai_protocol import (
    BadField, ChatCompletionRequest, CompletionRequest, chat_logprobs, chat_messages,
    completion_logprobs, completion_prompts, param_of, sampling_params,
)
from tierserve.runtime import envs
from tierserve.runtime.client import AsyncLLM
from tierserve.runtime.executor import EngineDeadError
from tierserve.runtime.outputs import CompletionOutput, RequestOutput
from tierserve.scheduler.params import SamplingParams

__all__ = ["build_app", "serve_http", "ServerConfig", "HTTP_STATUS"]

log = logging.getLogger("tierserve.http")

# An error kind (RequestOutput.error_kind) and the HTTP status that answers it.
HTTP_STATUS = {"bad_request": 400, "overloaded": 503, "engine_dead": 503, "internal": 500}
_ERROR_TYPE = {400: "BadRequestError", 404: "NotFoundError", 413: "RequestTooLargeError",
               500: "InternalServerError", 503: "ServiceUnavailableError"}
_encode = msgspec.json.Encoder().encode
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    max_queued_requests: int = 256
    max_body_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ValueError("served_model_name must be a non-empty string")
        if self.max_queued_requests < 1 or self.max_body_bytes < 1:
            raise ValueError("max_queued_requests and max_body_bytes must be >= 1")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": _ERROR_TYPE.get(status, "Error"),
                                   "param": param, "code": status}}, status_code=status)


# ---------------------------------------------------------------------------- metrics

class _EngineCollector:
    """Gauges and counters read from the engine's stats, fetched once per scrape."""

    def __init__(self) -> None:
        self.stats: dict = {}

    def collect(self):
        s = self.stats
        yield _gauge("num_requests_running", "requests in the running batch",
                     s.get("num_running", 0))
        yield _gauge("num_requests_waiting", "requests waiting for admission (or an SSD load)",
                     s.get("num_waiting", 0) + s.get("num_loading", 0))
        usage = GaugeMetricFamily("tierserve:kv_cache_usage_perc",
                                  "share of each KV tier in use (1 = full)", labels=["tier"])
        usage.add_metric(["device"], s.get("kv_usage", 0.0))
        for tier in ("cpu", "ssd"):
            if f"{tier}_tier_usage" in s:
                usage.add_metric([tier], s[f"{tier}_tier_usage"])
        yield usage
        yield _gauge("kv_cache_free_blocks", "device KV blocks no request holds (cached ones "
                     "included)", s.get("num_free_blocks", 0))
        yield _gauge("kv_cache_total_blocks", "device KV blocks in the pool",
                     s.get("num_total_blocks", 0))
        yield _counter("prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                       s.get("prefix_cache_queried_tokens", 0))
        yield _counter("prefix_cache_hits", "prompt tokens served from the prefix cache",
                       s.get("prefix_cache_hit_tokens", 0))
        yield _counter("num_preemptions", "requests preempted", s.get("num_preemptions", 0))
        for name in ("promotions", "demotions", "loads", "spills"):
            if f"tier_{name}" in s:
                yield _counter(f"kv_tier_{name}", f"KV tier block {name}", s[f"tier_{name}"])
        yield _gauge("engine_dead", "1 once the engine cannot serve", int(bool(s.get("dead"))))


def _gauge(name: str, doc: str, value) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"tierserve:{name}", doc, value=value)


def _counter(name: str, doc: str, value) -> CounterMetricFamily:
    return CounterMetricFamily(f"tierserve:{name}", doc, value=value)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.engine = _EngineCollector()
        r.register(self.engine)
        self.ttft = Histogram("tierserve:time_to_first_token_seconds", "time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tierserve:inter_token_latency_seconds",
                             "time between a request's tokens", buckets=_LATENCY_BUCKETS,
                             registry=r)
        self.e2e = Histogram("tierserve:e2e_request_latency_seconds", "request latency",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("tierserve:prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = Counter("tierserve:generation_tokens", "generated tokens",
                                         registry=r)
        self.finished = Counter("tierserve:request_success", "finished requests",
                                ["finished_reason"], registry=r)
        self.refused = Counter("tierserve:requests_refused", "requests answered with an error "
                               "status", ["status"], registry=r)


# ---------------------------------------------------------------------------- one request

@dataclass
class _Tracker:
    """One engine request's timing, for the latency histograms."""

    metrics: Metrics
    start: float = field(default_factory=time.perf_counter)
    last: float | None = None

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        if self.last is None:
            self.metrics.ttft.observe(now - self.start)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now
        self.metrics.generation_tokens.inc(n)


class _Admission:
    """Counts requests with no first token yet; refuses past the bound."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.pending = 0

    def admit(self, n: int) -> None:
        if self.pending + n > self.limit:
            raise ApiError(503, f"the server's queue is full ({self.limit} requests wait for "
                           f"a first token); try again later")
        self.pending += n


class _Stream:
    """The deltas of a body's engine requests (one per prompt), merged as they come, with
    queue accounting and metrics; closing it aborts what has not finished."""

    def __init__(self, engine: AsyncLLM, prompts: list, params: SamplingParams, base_id: str,
                 body, admission: _Admission, metrics: Metrics) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.admission, self.metrics = admission, metrics
        self.base_id = base_id
        admission.admit(len(prompts))
        self.tasks = [asyncio.ensure_future(self._pump(
            i, engine.generate(p, params, request_id=f"{base_id}-{i}" if len(prompts) > 1
                               else base_id, priority=body.priority, cache_salt=body.cache_salt)))
            for i, p in enumerate(prompts)]
        self.remaining = len(prompts)

    async def _pump(self, i: int, gen: AsyncIterator[RequestOutput]) -> None:
        tracker, started = _Tracker(self.metrics), False
        try:
            async for delta in gen:
                if not started and (delta.prompt_token_ids or delta.error):
                    started = True
                    self._started()
                    self.metrics.prompt_tokens.inc(len(delta.prompt_token_ids))
                tracker.tokens(sum(len(c.token_ids) for c in delta.outputs))
                for c in delta.outputs:
                    if c.finish_reason is not None:
                        self.metrics.finished.labels(c.finish_reason).inc()
                await self.queue.put((i, delta))
            self.metrics.e2e.observe(time.perf_counter() - tracker.start)
        except Exception as e:  # the engine is gone: this prompt fails, the stream ends
            failed = RequestOutput.failed("", None, [], str(e))
            failed.error_kind = "engine_dead" if isinstance(e, EngineDeadError) else "internal"
            await self.queue.put((i, failed))
            log.warning("request %s failed: %s", i, e)
        finally:
            if not started:
                self._started()
            await gen.aclose()
            await self.queue.put((i, None))

    def _started(self) -> None:
        self.admission.pending -= 1

    async def __aiter__(self):
        while self.remaining:
            i, delta = await self.queue.get()
            if delta is None:
                self.remaining -= 1
                continue
            yield i, delta

    async def aclose(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def _error_of(delta: RequestOutput) -> ApiError:
    status = HTTP_STATUS.get(delta.error_kind or "internal", 500)
    return ApiError(status, delta.error or "request failed",
                    param_of(delta.error or "") if status == 400 else None)


# ---------------------------------------------------------------------------- the app

class OpenAIServer:
    def __init__(self, engine: AsyncLLM, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.metrics = Metrics()
        self.admission = _Admission(config.max_queued_requests)
        self.created = int(time.time())
        info = engine.info()
        self.max_model_len = info.get("max_model_len")
        tok = engine.tokenizer
        self._decode_one = (lambda t: tok.decode([t], skip_special_tokens=False)) \
            if tok is not None else str

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.served_model_name:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves "
                           f"{self.config.served_model_name!r}", "model")

    async def start(self, prompts: list, body, prefix: str) -> tuple[_Stream, SamplingParams]:
        params = sampling_params(body)
        base_id = body.request_id or f"{prefix}-{uuid.uuid4().hex}"
        return _Stream(self.engine, prompts, params, base_id, body, self.admission,
                       self.metrics), params

    async def first(self, stream: _Stream) -> tuple[int, RequestOutput] | None:
        """The stream's first delta; an error there is the response's status."""
        async for item in stream:
            if item[1].error:
                await stream.aclose()
                raise _error_of(item[1])
            return item
        return None

    # ------------------------------------------------------------------ completions

    async def completions(self, body: CompletionRequest, request: Request):
        self.check_model(body.model)
        prompts = completion_prompts(body)
        stream, params = await self.start(prompts, body, "cmpl")
        rid, created = stream.base_id, int(time.time())
        head = await self.first(stream)
        if body.stream:
            return StreamingResponse(self._completion_chunks(stream, head, params, body, rid,
                                                             created),
                                     media_type="text/event-stream")
        return await _until_disconnect(request, self._completion_full(
            stream, head, params, len(prompts), rid, created), stream)

    async def _completion_full(self, stream, head, params, num_prompts, rid, created):
        n = params.n
        results: dict[int, RequestOutput] = {}
        texts = [[""] * n for _ in range(num_prompts)]
        tokens = [[[] for _ in range(n)] for _ in range(num_prompts)]
        lps = [[[] for _ in range(n)] for _ in range(num_prompts)]
        reasons = [[None] * n for _ in range(num_prompts)]
        prompt_tokens = [0] * num_prompts
        async for i, delta in _chain(head, stream):
            if delta.error:
                raise _error_of(delta)
            if delta.prompt_token_ids:
                prompt_tokens[i] = len(delta.prompt_token_ids)
            for c in delta.outputs:
                texts[i][c.index] += c.text
                tokens[i][c.index] += c.token_ids
                if c.logprobs is not None:
                    lps[i][c.index] += c.logprobs
                if c.finish_reason is not None:
                    reasons[i][c.index] = c.finish_reason
            results[i] = delta
        choices = []
        for i in range(num_prompts):
            for j in range(n):
                c = CompletionOutput(j, texts[i][j], tokens[i][j], None,
                                     lps[i][j] if params.logprobs is not None else None,
                                     reasons[i][j])
                choices.append({"index": i * n + j, "text": c.text,
                                "logprobs": completion_logprobs(c, self._decode_one,
                                                                params.logprobs or 0),
                                "finish_reason": c.finish_reason})
        completion = sum(len(t) for row in tokens for t in row)
        return JSONResponse({"id": rid, "object": "text_completion", "created": created,
                             "model": self.config.served_model_name, "choices": choices,
                             "usage": _usage(sum(prompt_tokens), completion)})

    async def _completion_chunks(self, stream, head, params, body, rid, created):
        n, usage = params.n, [0, 0]
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        offsets: dict[int, int] = {}
        try:
            async for i, delta in _chain(head, stream):
                if delta.error:
                    yield _sse({"error": {"message": delta.error, "code": _error_of(delta).status}})
                    break
                usage[0] += len(delta.prompt_token_ids)
                for c in delta.outputs:
                    usage[1] += len(c.token_ids)
                    if not (c.text or c.token_ids or c.finish_reason):
                        continue
                    index = i * n + c.index
                    lp = completion_logprobs(c, self._decode_one, params.logprobs or 0,
                                             offsets.get(index, 0))
                    offsets[index] = offsets.get(index, 0) + len(c.text)
                    chunk = {"id": rid, "object": "text_completion", "created": created,
                             "model": self.config.served_model_name,
                             "choices": [{"index": index, "text": c.text, "logprobs": lp,
                                          "finish_reason": c.finish_reason}]}
                    if include_usage:
                        chunk["usage"] = None
                    yield _sse(chunk)
            if include_usage:
                yield _sse({"id": rid, "object": "text_completion", "created": created,
                            "model": self.config.served_model_name, "choices": [],
                            "usage": _usage(*usage)})
            yield b"data: [DONE]\n\n"
        finally:
            await stream.aclose()

    # ------------------------------------------------------------------ chat

    async def chat(self, body: ChatCompletionRequest, request: Request):
        self.check_model(body.model)
        messages = chat_messages(body)
        stream, params = await self.start([messages], body, "chatcmpl")
        rid, created = stream.base_id, int(time.time())
        head = await self.first(stream)
        if body.stream:
            return StreamingResponse(self._chat_chunks(stream, head, params, body, rid, created),
                                     media_type="text/event-stream")
        return await _until_disconnect(request, self._chat_full(stream, head, params, rid,
                                                                created), stream)

    async def _chat_full(self, stream, head, params, rid, created):
        n = params.n
        final = RequestOutput.start(rid, None, params.logprobs is not None, n)
        async for _, delta in _chain(head, stream):
            if delta.error:
                raise _error_of(delta)
            if delta.prompt_token_ids:
                final.prompt_token_ids = delta.prompt_token_ids
            for c in delta.outputs:
                out = final.outputs[c.index]
                out.text += c.text
                out.token_ids += c.token_ids
                if c.logprobs is not None and out.logprobs is not None:
                    out.logprobs += c.logprobs
                if c.finish_reason is not None:
                    out.finish_reason = c.finish_reason
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": chat_logprobs(c, self._decode_one, params.logprobs or 0),
                    "finish_reason": c.finish_reason} for c in final.outputs]
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": created,
            "model": self.config.served_model_name, "choices": choices,
            "usage": _usage(len(final.prompt_token_ids),
                            sum(len(c.token_ids) for c in final.outputs))})

    async def _chat_chunks(self, stream, head, params, body, rid, created):
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        base = {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": self.config.served_model_name}
        usage = [0, 0]
        try:
            for index in range(params.n):
                chunk = dict(base, choices=[{"index": index, "delta": {"role": "assistant",
                                                                       "content": ""},
                                             "logprobs": None, "finish_reason": None}])
                if include_usage:
                    chunk["usage"] = None
                yield _sse(chunk)
            async for _, delta in _chain(head, stream):
                if delta.error:
                    yield _sse({"error": {"message": delta.error,
                                          "code": _error_of(delta).status}})
                    break
                usage[0] += len(delta.prompt_token_ids)
                for c in delta.outputs:
                    usage[1] += len(c.token_ids)
                    if not (c.text or c.finish_reason or c.token_ids):
                        continue
                    chunk = dict(base, choices=[{
                        "index": c.index, "delta": {"content": c.text} if c.text else {},
                        "logprobs": chat_logprobs(c, self._decode_one, params.logprobs or 0),
                        "finish_reason": c.finish_reason}])
                    if include_usage:
                        chunk["usage"] = None
                    yield _sse(chunk)
            if include_usage:
                yield _sse(dict(base, choices=[], usage=_usage(*usage)))
            yield b"data: [DONE]\n\n"
        finally:
            await stream.aclose()

    # ------------------------------------------------------------------ the rest

    async def metrics_text(self) -> bytes:
        self.metrics.engine.stats = await self._stats()
        return generate_latest(self.metrics.registry)

    async def _stats(self) -> dict:
        try:
            return await asyncio.to_thread(self.engine.stats)
        except Exception as e:
            return {"dead": f"the engine cannot be reached: {e}"}

    async def health(self) -> Response:
        stats = await self._stats()
        if stats.get("dead"):
            return error_response(503, f"the engine is dead: {stats['dead']}")
        return Response(status_code=200)

    def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.config.served_model_name, "object": "model", "created": self.created,
            "owned_by": "tierserve", "root": self.config.served_model_name,
            "max_model_len": self.max_model_len}]}


async def _chain(head, stream: _Stream):
    if head is not None:
        yield head
    async for item in stream:
        yield item


async def _until_disconnect(request: Request, work, stream: _Stream):
    """The response of `work`, unless the client goes away first: then its requests are
    aborted (their blocks freed) and nothing is sent."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return Response(status_code=499)
    finally:
        watch.cancel()
        await stream.aclose()


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _sse(obj) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


class _BodyLimit:
    """Reads a request body up to the limit before the app sees it: a longer one is answered
    413 without buffering the rest."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(send)
        chunks, size, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":
                return  # the client left before sending its body
            body = msg.get("body", b"")
            size += len(body)
            if size > self.limit:
                return await self._refuse(send)
            chunks.append(body)
            more = msg.get("more_body", False)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send) -> None:
        body = _encode({"error": {"message": f"the request body is over {self.limit} bytes",
                                  "type": _ERROR_TYPE[413], "param": None, "code": 413}})
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def build_app(engine: AsyncLLM, config: ServerConfig):
    """The ASGI app: FastAPI routes behind the body-size limit."""
    server = OpenAIServer(engine, config)
    app = FastAPI(title="tierserve", docs_url=None, redoc_url=None)
    app.state.server = server

    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        server.metrics.refused.labels(str(e.status)).inc()
        return error_response(e.status, e.message, e.param)

    @app.exception_handler(BadField)
    async def _bad_field(_, e: BadField):
        server.metrics.refused.labels("400").inc()
        return error_response(400, str(e), e.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, e: RequestValidationError):
        server.metrics.refused.labels("400").inc()
        first = e.errors()[0] if e.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = _param_path(loc)
        return error_response(400, f"{param or 'body'}: {first.get('msg', 'invalid request')}",
                              param)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await server.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        return await server.chat(body, request)

    @app.get("/v1/models")
    async def models():
        return server.models()

    @app.get("/health")
    async def health():
        return await server.health()

    @app.get("/metrics")
    async def metrics():
        return Response(await server.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    return _BodyLimit(app, config.max_body_bytes)


def _param_path(loc: list[str]) -> str | None:
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


def serve_http(engine: AsyncLLM, config: ServerConfig, host: str, port: int) -> None:
    """Runs the server in the foreground until interrupted."""
    app = build_app(engine, config)
    log.info("serving %s on http://%s:%d/v1", config.served_model_name, host, port)
    uvicorn.run(app, host=host, port=port, log_level=envs.log_level().lower(),
                timeout_graceful_shutdown=5)

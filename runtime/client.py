"""The client API: `AsyncLLM` (streaming) here and `LLM` (offline batches, llm.py), over any
transport.

An engine client is what the two need of an engine, wherever it runs: in this process (an
EngineCore for `LLM`, an AsyncEngine for `AsyncLLM`) or behind a transport (deploy/'s Ray
actor). runtime/ never imports a transport: the one for remote engines is injected with
`set_deployments` (the `tierserve` package registers the Ray one), so `LLM(...,
tensor_parallel_size=2)`, `AsyncLLM(...)` and `connect(name)` reach it without this package
depending on Ray.

Engines take and emit token ids; `LLM` and `AsyncLLM` do the text work in this process
(processor.py). Request ids are the client's: the engine sees ids this object makes, unique to
it, and a caller's `request_id` names its request only here (a second unfinished request of
the same `request_id` is a DuplicateRequestError), so no caller can reach another's request.
"""
from __future__ import annotations

import asyncio
import itertools
import os
import threading
from typing import AsyncIterator, Callable, Iterator, Protocol

import msgspec

from tierserve.runtime.beam_search import (
    BeamSearch, BeamSearchOutput, BeamSearchParams, round_requests, step_params, take_round,
)
from tierserve.runtime.config import EngineConfig
from tierserve.runtime.lora import LoRARequest
from tierserve.runtime.pooling import (
    EmbeddingRequestOutput, PoolingParams, embed_params, embedding_of,
)
from tierserve.runtime.outputs import (
    CompletionOutput, RequestOutput, StreamInterval, floats_of, logprob_dict, prompt_logprobs_of,
)
from tierserve.scheduler.messages import EngineCoreOutput, EngineCoreRequest
from tierserve.scheduler.params import (
    ErrorKind, FinishReason, RequestOutputKind, SamplingParams,
)

__all__ = ["EngineClient", "SyncEngineClient", "AsyncEngineClient", "Deployments",
           "set_deployments", "deployments", "AsyncLLM", "connect", "to_delta",
           "DuplicateRequestError", "engine_ids", "CLIENT_LEASE_S", "HEARTBEAT_S"]

# A remote client renews the leases of the requests it streams every HEARTBEAT_S; the engine
# aborts a request whose lease (CLIENT_LEASE_S) ran out: its client is gone.
CLIENT_LEASE_S = 6.0
HEARTBEAT_S = 1.5


class EngineClient(Protocol):
    vocab_size: int
    max_model_len: int

    @property
    def tokenizer(self): ...

    def stats(self) -> dict: ...

    def info(self) -> dict: ...

    def reset_prefix_cache(self) -> bool: ...

    def shutdown(self) -> None: ...


class SyncEngineClient(EngineClient, Protocol):
    def stream_batch(self, requests: list[EngineCoreRequest]
                     ) -> Iterator[list[EngineCoreOutput]]:
        """Each step's outputs until every request finished; closing the iterator aborts the
        rest."""

    def stop_sequences(self, seqs: list[tuple[str, int]]) -> None:
        """Finishes samples (request id, sample index) a stop string ended; each one's
        finishing output comes through its stream."""


class AsyncEngineClient(EngineClient, Protocol):
    def generate(self, requests: list[EngineCoreRequest]
                 ) -> AsyncIterator[list[EngineCoreOutput]]:
        """Each step's outputs until every request finished; leaving early aborts the rest."""

    def abort(self, request_ids: list[str]) -> None:
        """Aborts requests this client started (never another client's)."""

    def stop(self, seqs: list[tuple[str, int]]) -> None:
        """stop_sequences, for requests this client started."""

    def list_requests(self) -> list[dict]: ...


class Deployments(Protocol):
    """A transport to engines in other processes (deploy/ provides the Ray one)."""

    def start(self, config: EngineConfig) -> SyncEngineClient | AsyncEngineClient:
        """An anonymous engine owned by this process; its shutdown stops it."""

    def connect(self, name: str, namespace: str | None) -> AsyncEngineClient:
        """The running named deployment; ValueError when there is none."""


_deployments: Deployments | None = None


def set_deployments(transport: Deployments) -> None:
    global _deployments
    _deployments = transport


def deployments() -> Deployments:
    if _deployments is None:
        raise RuntimeError("no transport for remote engines is registered; `import tierserve` "
                           "registers the Ray one")
    return _deployments


class DuplicateRequestError(ValueError):
    """A request_id that names an unfinished request of the same client."""


def engine_ids() -> Iterator[str]:
    """Request ids for an engine, unique to this call: a random prefix and a count."""
    prefix = os.urandom(6).hex()
    return (f"{prefix}-{i}" for i in itertools.count())


class AsyncLLM:
    """`AsyncLLM(model, **options)`: an engine of its own (in this process, or on Ray when
    tensor_parallel_size > 1 or distributed=True) that many concurrent callers stream from;
    `connect(name)` gives one on a running deployment. It pickles into Ray tasks and actors
    when its engine is on Ray."""

    def __init__(self, model: str | None = None, *, client: AsyncEngineClient | None = None,
                 name: str | None = None, **options) -> None:
        if client is None:
            config = EngineConfig.from_kwargs(model=model, **options)
            if config.use_ray:
                client = deployments().start(config)
            else:
                from tierserve.runtime.async_engine import AsyncEngine
                client = AsyncEngine(config)
        elif model is not None or options:
            raise ValueError("pass either a client or engine options, not both")
        self.engine = client
        self.name = name
        self._ids = engine_ids()
        # The caller's request_id of each unfinished request -> its engine id.
        self._live: dict[str, str] = {}
        self._processors = None  # (InputProcessor, OutputProcessor), made on first use
        self._processors_lock = threading.Lock()
        self._defaults: dict | None = None

    def __reduce__(self):
        return (_rebuild, (self.engine, self.name))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def processors(self):
        """The input and output processors (processor.py), made on first use off the event
        loop: loading a remote engine's tokenizer takes a while."""
        if self._processors is None:
            from tierserve.runtime.processor import text_pool
            await asyncio.get_running_loop().run_in_executor(text_pool(), self._make_processors)
        return self._processors

    def _make_processors(self) -> None:
        from tierserve.runtime.processor import InputProcessor, OutputProcessor
        with self._processors_lock:  # concurrent first calls wait for one load
            if self._processors is not None:
                return
            tok = self.engine.tokenizer
            if tok is not None:
                tok.max_token_bytes  # noqa: B018 (computed once, here, off the event loop)
            self._processors = (InputProcessor(tok, self.engine.vocab_size,
                                               self.engine.max_model_len), OutputProcessor(tok))

    def get_default_sampling_params(self) -> SamplingParams:
        """What a prompt without sampling parameters gets: the model's generation config
        (engine option generation_config), else vLLM's defaults."""
        if self._defaults is None:
            self._defaults = self.engine.info().get("generation_defaults", {})
        return SamplingParams(**self._defaults)

    async def generate(self, prompt: str | list[int] | list[dict] | dict,
                       sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, priority: int = 0,
                       cache_salt: str | None = None,
                       lora_request: LoRARequest | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Yields RequestOutput deltas (the new tokens and text of each step; with
        sampling_params.output_kind CUMULATIVE the request so far each step, FINAL_ONLY the
        finished request alone). A prompt is text, token ids, a list of chat messages, or a
        prompt dict (LLM.generate's). request_id is the third argument, as in vLLM's
        AsyncLLM.generate, and optional. Leaving the loop early aborts the request. A bad
        prompt or parameter gives one delta with `error` set; a request_id naming an
        unfinished request of this client raises DuplicateRequestError. lora_request: the
        LoRA adapter to run with (enable_lora)."""
        if request_id is not None and request_id in self._live:
            raise DuplicateRequestError(f"request_id {request_id!r} names an unfinished "
                                        f"request")
        rid = next(self._ids)
        name = rid if request_id is None else request_id
        self._live[name] = rid
        try:
            params = sampling_params or self.get_default_sampling_params()
            async for delta in self._generate(rid, name, prompt, params, priority, cache_salt,
                                              request_id or "", lora_request):
                yield delta
        finally:
            del self._live[name]

    async def _generate(self, rid: str, name: str, prompt, params: SamplingParams,
                        priority: int, cache_salt: str | None, label: str,
                        lora_request: LoRARequest | None) -> AsyncIterator[RequestOutput]:
        inputs, outputs = await self.processors()
        try:
            done = await inputs.process_async(rid, prompt, params, priority, cache_salt, label,
                                              lora_request)
        except ValueError as e:
            yield RequestOutput.failed(name, prompt if isinstance(prompt, str) else None, [],
                                       str(e))
            return
        request = done.request
        outputs.add(request)
        kind = params.output_kind
        # The request so far, for outputs other than deltas.
        view = None if kind == RequestOutputKind.DELTA else RequestOutput.start(
            name, done.prompt, params.logprobs is not None, params.n,
            params.prompt_logprobs is not None)
        stream = self.engine.generate([request])
        interval = params.stream_interval or 1
        batcher = StreamInterval(interval) if interval > 1 else None
        fresh, shown = 0, False  # tokens since the cumulative view was last yielded
        try:
            async for batch in stream:
                batch, stopped = outputs.process(batch)
                if stopped:
                    self.engine.stop(stopped)
                decode, finished = outputs.decoder(rid), outputs.finished(rid)
                if view is None:
                    for o in batch:
                        delta = to_delta(request, o, name, done.prompt, decode)
                        if batcher is not None and (delta := batcher.push(delta)) is None:
                            continue
                        delta.finished = finished  # every sample has finished
                        yield delta
                else:
                    for o in batch:
                        view.add(o, decode)
                        fresh += len(o.new_token_ids)
                    if batch and (finished or kind == RequestOutputKind.CUMULATIVE
                                  and (fresh >= interval or not shown)):
                        fresh, shown = 0, True
                        yield view.snapshot()
                if finished:
                    return
        finally:
            outputs.remove(rid)
            await stream.aclose()

    async def encode(self, prompt, pooling_params: PoolingParams | None = None,
                     request_id: str | None = None, *, truncate_prompt_tokens: int | None = None,
                     priority: int = 0, cache_salt: str | None = None,
                     lora_request: LoRARequest | None = None
                     ) -> AsyncIterator[EmbeddingRequestOutput]:
        """vLLM's AsyncLLM.encode for embeddings (runtime/pooling.py): yields the prompt's
        vector once it is computed. A bad prompt raises ValueError."""
        params = msgspec.structs.replace(embed_params(pooling_params, truncate_prompt_tokens),
                                         output_kind=RequestOutputKind.FINAL_ONLY)
        last = None
        async for last in self.generate(prompt, params, request_id, priority=priority,
                                        cache_salt=cache_salt, lora_request=lora_request):
            pass
        yield embedding_of(last, pooling_params)

    async def beam_search(self, prompt, params: BeamSearchParams, *, priority: int = 0,
                          cache_salt: str | None = None,
                          lora_request: LoRARequest | None = None) -> BeamSearchOutput:
        """LLM.beam_search for one prompt: each round's beams run as concurrent requests
        (cancelling the call aborts them). A bad prompt raises ValueError."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be BeamSearchParams, got {type(params).__name__}")
        inputs, _ = await self.processors()
        probe = SamplingParams(max_tokens=1)
        done = await inputs.process_async(next(self._ids), prompt, probe, priority, cache_salt,
                                          lora_request=lora_request)
        tok = self.engine.tokenizer
        search = BeamSearch(list(done.request.prompt_token_ids), params,
                            tok.eos_token_id if tok is not None else None)
        step = SamplingParams(**step_params(params), output_kind=RequestOutputKind.FINAL_ONLY)

        async def last(ids: list[int]) -> RequestOutput:
            out = None
            async for out in self.generate({"prompt_token_ids": ids}, step, priority=priority,
                                           cache_salt=cache_salt, lora_request=lora_request):
                pass
            return out

        for _ in range(params.max_tokens):
            live, seqs = round_requests([search], self.engine.max_model_len)
            if not live:
                break
            take_round(live, await asyncio.gather(*(last(q) for q in seqs)))
        return BeamSearchOutput(search.result(tok.decode if tok else None))

    async def abort(self, request_id: str) -> None:
        """Aborts this client's unfinished request of that request_id, if there is one."""
        rid = self._live.get(request_id)
        if rid is not None:
            self.engine.abort([rid])

    async def check_health(self) -> None:
        """Returns when the engine answers that it serves; EngineDeadError when it cannot.
        Wrap it in a timeout: an engine that does not answer makes it wait."""
        await _maybe_async(self.engine, "health")

    async def get_stats(self) -> dict:
        """stats() without blocking the event loop (wrap it in a timeout)."""
        return await _maybe_async(self.engine, "stats")

    def list_requests(self) -> list[dict]:
        """The engine's unfinished requests (id, status, tokens, age), oldest first."""
        return self.engine.list_requests()

    def stats(self) -> dict:
        return self.engine.stats()

    def info(self) -> dict:
        return self.engine.info()

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stops an engine this object started; a connected deployment keeps running."""
        self.engine.shutdown()

    def __enter__(self) -> "AsyncLLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


async def _maybe_async(engine, method: str):
    """engine.<method>_async() where the client has one (a remote engine: awaited without a
    thread), else engine.<method>() (in this process: it answers at once)."""
    fn = getattr(engine, method + "_async", None)
    if fn is not None:
        return await fn()
    return getattr(engine, method)()


def _rebuild(client: AsyncEngineClient, name: str | None) -> AsyncLLM:
    return AsyncLLM(client=client, name=name)


def connect(name: str, namespace: str | None = None) -> AsyncLLM:
    """An AsyncLLM on the named deployment; raises ValueError when there is none."""
    return AsyncLLM(client=deployments().connect(name, namespace), name=name)


def to_delta(request: EngineCoreRequest, o: EngineCoreOutput, request_id: str,
             prompt: str | None, decode: Callable[[int], str] | None = None) -> RequestOutput:
    reason = str(FinishReason(o.finish_reason)) if o.finish_reason is not None else None
    logprobs = None
    if request.sampling_params.logprobs is not None:
        logprobs = [logprob_dict(lp, decode) for lp in o.logprobs]
    completion = CompletionOutput(o.index, o.new_text, list(o.new_token_ids), None, logprobs,
                                  reason, o.stop_reason)
    return RequestOutput(request_id, prompt, list(o.prompt_token_ids), [completion],
                         finished=reason is not None, num_cached_tokens=o.num_cached_tokens,
                         num_tier_cached_tokens=o.num_tier_cached_tokens,
                         error=o.error or None,
                         error_kind=str(ErrorKind(o.error_kind or ErrorKind.INTERNAL))
                         if o.error else None,
                         prompt_logprobs=prompt_logprobs_of(o.prompt_logprobs, decode)
                         if o.prompt_logprobs or (o.prompt_token_ids and request.sampling_params
                                                  .prompt_logprobs is not None) else None,
                         embedding=floats_of(o.pooled) if o.pooled else None)

"""The client API: `AsyncLLM` (streaming) here and `LLM` (offline batches, llm.py), over any
transport.

An engine client is what the two need of an engine, wherever it runs: in this process (an
EngineCore for `LLM`, an AsyncEngine for `AsyncLLM`) or behind a transport (deploy/'s Ray
actor). runtime/ never imports a transport: the one for remote engines is injected with
`set_deployments` (the `tierserve` package registers the Ray one), so `LLM(...,
tensor_parallel_size=2)`, `AsyncLLM(...)` and `connect(name)` reach it without this package
depending on Ray.
"""
from __future__ import annotations

import itertools
import os
from typing import AsyncIterator, Iterator, Protocol

from tierserve.runtime.config import EngineConfig
from tierserve.runtime.outputs import (
    CompletionOutput, Outstanding, RequestOutput, logprob_dict, prompt_logprobs_of,
)
from tierserve.scheduler.messages import EngineCoreOutput, EngineCoreRequest
from tierserve.scheduler.params import ErrorKind, FinishReason, SamplingParams

__all__ = ["EngineClient", "SyncEngineClient", "AsyncEngineClient", "Deployments",
           "set_deployments", "deployments", "AsyncLLM", "connect", "make_request", "prompt_fields",
           "to_delta",
           "CLIENT_LEASE_S", "HEARTBEAT_S"]

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


class AsyncEngineClient(EngineClient, Protocol):
    def generate(self, requests: list[EngineCoreRequest]
                 ) -> AsyncIterator[list[EngineCoreOutput]]:
        """Each step's outputs until every request finished; leaving early aborts the rest."""

    def abort(self, request_ids: list[str]) -> None: ...

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
        self._ids = itertools.count()
        self._prefix = os.urandom(3).hex()
        self._defaults: dict | None = None

    def __reduce__(self):
        return (_rebuild, (self.engine, self.name))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What a prompt without sampling parameters gets: the model's generation config
        (engine option generation_config), else vLLM's defaults."""
        if self._defaults is None:
            self._defaults = self.engine.info().get("generation_defaults", {})
        return SamplingParams(**self._defaults)

    def _next_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    async def generate(self, prompt: str | list[int] | list[dict],
                       sampling_params: SamplingParams | None = None, *,
                       request_id: str | None = None, priority: int = 0,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yields RequestOutput deltas (the new tokens and text of each step). A prompt is text,
        token ids, or a list of chat messages. Leaving the loop early aborts the request."""
        request = make_request(request_id or self._next_id(), prompt,
                               sampling_params or self.get_default_sampling_params(), priority,
                               cache_salt)
        stream = self.engine.generate([request])
        left = Outstanding([request])
        try:
            async for batch in stream:
                for o in batch:
                    left.update((o,))
                    delta = to_delta(request, o)
                    delta.finished = not left  # every sample has finished
                    yield delta
        finally:
            await stream.aclose()

    async def abort(self, request_id: str) -> None:
        self.engine.abort([request_id])

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


def _rebuild(client: AsyncEngineClient, name: str | None) -> AsyncLLM:
    return AsyncLLM(client=client, name=name)


def connect(name: str, namespace: str | None = None) -> AsyncLLM:
    """An AsyncLLM on the named deployment; raises ValueError when there is none."""
    return AsyncLLM(client=deployments().connect(name, namespace), name=name)


def prompt_fields(prompt) -> dict:
    """EngineCoreRequest fields for a prompt: text, token ids, chat messages, or a dict of
    prompt / prompt_token_ids / messages; ValueError for anything else (the engine checks the
    values themselves)."""
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, dict):
        unknown = set(prompt) - {"prompt", "prompt_token_ids", "messages"}
        if unknown or not prompt:
            raise ValueError(f"a prompt dict takes prompt, prompt_token_ids or messages; got "
                             f"{sorted(map(str, prompt)) or 'nothing'}")
        return dict(prompt)
    if isinstance(prompt, (list, tuple)):
        if prompt and all(isinstance(m, dict) for m in prompt):
            return {"messages": list(prompt)}
        return {"prompt_token_ids": list(prompt)}
    raise ValueError(f"a prompt is a string, a list of token ids, a list of chat messages or a "
                     f"dict, got {type(prompt).__name__}")


def make_request(rid: str, prompt, params: SamplingParams, priority: int,
                 cache_salt: str | None) -> EngineCoreRequest:
    return EngineCoreRequest(rid, params, priority=priority, cache_salt=cache_salt,
                             **prompt_fields(prompt))


def to_delta(request: EngineCoreRequest, o: EngineCoreOutput) -> RequestOutput:
    reason = str(FinishReason(o.finish_reason)) if o.finish_reason is not None else None
    logprobs = None
    if request.sampling_params.logprobs is not None:
        logprobs = [logprob_dict(lp) for lp in o.logprobs]
    completion = CompletionOutput(o.index, o.new_text, list(o.new_token_ids), None, logprobs,
                                  reason)
    return RequestOutput(o.req_id, request.prompt, list(o.prompt_token_ids), [completion],
                         finished=reason is not None, num_cached_tokens=o.num_cached_tokens,
                         num_tier_cached_tokens=o.num_tier_cached_tokens,
                         error=o.error or None,
                         error_kind=str(ErrorKind(o.error_kind or ErrorKind.INTERNAL))
                         if o.error else None,
                         prompt_logprobs=prompt_logprobs_of(o.prompt_logprobs)
                         if o.prompt_logprobs else None)

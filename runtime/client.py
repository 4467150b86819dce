"""Client handles on an engine running as a Ray actor.

`EngineHandle` streams RequestOutput deltas from any process, Ray job, task or actor (it
pickles: it is just the actor handle). Leaving or cancelling the stream aborts the request, which
frees its blocks. `connect(name)` finds a named deployment started by `tierserve.serve`.
"""
from __future__ import annotations

import itertools
import os
from typing import AsyncIterator

import ray

from tierserve.runtime import envs
from tierserve.runtime.executor import EngineDeadError
from tierserve.runtime.outputs import CompletionOutput, RequestOutput, logprob_dict
from tierserve.scheduler.messages import ClientChannelCodec, EngineCoreOutput, EngineCoreRequest
from tierserve.scheduler.params import FinishReason, SamplingParams

__all__ = ["EngineHandle", "connect", "ensure_ray", "actor_name"]

_ACTOR_PREFIX = "tierserve-engine-"


def actor_name(name: str) -> str:
    return _ACTOR_PREFIX + name


def ensure_ray(namespace: str | None = None) -> None:
    """Joins the cluster RAY_ADDRESS names (or this job's), else starts a local instance."""
    if not ray.is_initialized():
        ray.init(address=envs.ray_address(), namespace=namespace or envs.default_namespace(),
                 log_to_driver=False)


class EngineHandle:
    def __init__(self, actor, name: str | None = None) -> None:
        self.actor = actor
        self.name = name
        self._codec = ClientChannelCodec()
        self._ids = itertools.count()
        self._prefix = os.urandom(3).hex()

    def __reduce__(self):
        return (EngineHandle, (self.actor, self.name))

    def _next_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    async def generate(self, prompt: str | list[int] | list[dict],
                       sampling_params: SamplingParams | None = None, *,
                       request_id: str | None = None, priority: int = 0,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yields RequestOutput deltas (the new tokens and text of each step). A prompt is text,
        token ids, or a list of chat messages."""
        request = make_request(request_id or self._next_id(), prompt,
                               sampling_params or SamplingParams(), priority, cache_salt)
        stream = self.actor.generate.options(num_returns="streaming").remote([request])
        finished = False
        try:
            async for ref in stream:
                for o in self._codec.decode(await ref).outputs:
                    delta = to_delta(request, o)
                    finished = delta.finished
                    yield delta
        except ray.exceptions.RayActorError as e:
            raise EngineDeadError(f"the engine actor died: {e}") from e
        finally:
            if not finished:
                ray.cancel(stream)
                self.actor.abort.remote([request.req_id])

    def stream_batch(self, requests: list[EngineCoreRequest]):
        """Synchronous stream of EngineCoreOutput lists for many requests (offline LLM)."""
        stream = self.actor.generate.options(num_returns="streaming").remote(requests)
        done = False
        try:
            for ref in stream:
                yield self._codec.decode(ray.get(ref)).outputs
            done = True
        except ray.exceptions.RayActorError as e:
            raise EngineDeadError(f"the engine actor died: {e}") from e
        finally:
            if not done:
                ray.cancel(stream)
                self.actor.abort.remote([r.req_id for r in requests])

    async def abort(self, request_id: str) -> None:
        await self.actor.abort.remote([request_id])

    def stats(self) -> dict:
        return ray.get(self.actor.stats.remote())

    def info(self) -> dict:
        return ray.get(self.actor.info.remote())

    def reset_prefix_cache(self) -> bool:
        return ray.get(self.actor.call.remote("reset_prefix_cache"))


def make_request(rid: str, prompt, params: SamplingParams, priority: int,
                 cache_salt: str | None) -> EngineCoreRequest:
    if isinstance(prompt, str):
        fields = {"prompt": prompt}
    elif prompt and isinstance(prompt[0], dict):
        fields = {"messages": list(prompt)}
    else:
        fields = {"prompt_token_ids": list(prompt)}
    return EngineCoreRequest(rid, params, priority=priority, cache_salt=cache_salt, **fields)


def to_delta(request: EngineCoreRequest, o: EngineCoreOutput) -> RequestOutput:
    reason = str(FinishReason(o.finish_reason)) if o.finish_reason is not None else None
    logprobs = None
    if request.sampling_params.logprobs is not None:
        logprobs = [logprob_dict(lp) for lp in o.logprobs]
    completion = CompletionOutput(0, o.new_text, list(o.new_token_ids), None, logprobs, reason)
    return RequestOutput(o.req_id, request.prompt, list(o.prompt_token_ids), [completion],
                         finished=reason is not None, num_cached_tokens=o.num_cached_tokens,
                         error=o.error or None)


def connect(name: str, namespace: str | None = None) -> EngineHandle:
    """A handle on the named deployment; raises ValueError when there is none."""
    ensure_ray(namespace)
    try:
        actor = ray.get_actor(actor_name(name), namespace=namespace or envs.default_namespace())
    except ValueError:
        raise ValueError(f"no tierserve deployment named {name!r} in namespace "
                         f"{namespace or envs.default_namespace()!r}") from None
    return EngineHandle(actor, name)


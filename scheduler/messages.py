"""Wire messages between the EngineCore and the workers, and from the EngineCore to clients.

Every message is a msgspec Struct encoded as a msgpack array (array_like) with defaults omitted.
Each channel has one tagged union and one decoder, built once:
  to workers    ToWorker   = SchedulerOutput | ResetWorkerCache | ShutdownWorker
  from workers  FromWorker = ModelRunnerOutput | WorkerError
  to clients    EngineCoreOutputs (a batch of per-request deltas)

Invariant 5: a step's SchedulerOutput is O(scheduled requests + new blocks). A prompt travels
once, in NewRequestData; afterwards a request costs its id, its new token ids, its new block ids
and its computed-token count.
"""
from __future__ import annotations

from typing import Union

import msgspec

from tierserve.scheduler.params import SamplingParams

__all__ = [
    "NewRequestData", "CachedRequestData", "SchedulerOutput", "ResetWorkerCache",
    "ShutdownWorker", "SampleLogprobs", "ModelRunnerOutput", "WorkerError", "EngineCoreOutput",
    "EngineCoreOutputs", "EngineCoreRequest", "ToWorker", "FromWorker", "MalformedFrameError", "WorkerChannelCodec",
    "EngineChannelCodec", "ClientChannelCodec",
]

_WIRE = dict(array_like=True, omit_defaults=True, gc=False)


class NewRequestData(msgspec.Struct, **_WIRE):
    """Sent once per request, the step it is first scheduled."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int = 0


class CachedRequestData(msgspec.Struct, **_WIRE):
    """Diffs for requests the workers already hold, as parallel arrays (struct of arrays keeps a
    decode request at a handful of bytes)."""

    req_ids: list[str] = []
    # Tokens appended since the last message (the previous step's sampled token, usually one).
    new_token_ids: list[list[int]] = []
    # Appended to the request's block table; replaces it for resumed requests.
    new_block_ids: list[list[int]] = []
    # Tokens whose KV is already in the pool, before this step's tokens.
    num_computed_tokens: list[int] = []
    # Indices into req_ids of requests resumed after preemption.
    resumed: list[int] = []


class SchedulerOutput(msgspec.Struct, tag=1, **_WIRE):
    step_id: int
    scheduled_new_reqs: list[NewRequestData] = []
    scheduled_cached_reqs: CachedRequestData = msgspec.field(default_factory=CachedRequestData)
    # Tokens this step per scheduled request: new requests first, then cached, in order.
    num_scheduled_tokens: list[int] = []
    # The workers drop these requests' state.
    finished_req_ids: list[str] = []
    # The workers keep these requests' tokens but forget their blocks until they resume.
    preempted_req_ids: list[str] = []

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def scheduled_req_ids(self) -> list[str]:
        return [r.req_id for r in self.scheduled_new_reqs] + self.scheduled_cached_reqs.req_ids


class ResetWorkerCache(msgspec.Struct, tag=2, **_WIRE):
    """Drops every request's state on the workers (after reset_prefix_cache or a restart)."""


class ShutdownWorker(msgspec.Struct, tag=3, **_WIRE):
    pass


class SampleLogprobs(msgspec.Struct, **_WIRE):
    """Logprobs of one sampled token: the sampled token first, then the top-n."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int = 0


class ModelRunnerOutput(msgspec.Struct, tag=11, **_WIRE):
    step_id: int
    # One per scheduled request, in SchedulerOutput order; -1 where a prefill chunk did not
    # reach the end of the known tokens, so nothing was sampled.
    sampled_token_ids: list[int] = []
    # Aligned with sampled_token_ids where any request asked for logprobs; None elsewhere.
    logprobs: list[SampleLogprobs | None] = []


class WorkerError(msgspec.Struct, tag=12, **_WIRE):
    step_id: int
    rank: int
    message: str


class EngineCoreOutput(msgspec.Struct, **_WIRE):
    """One request's delta for one step, as streamed to its client."""

    req_id: str
    new_token_ids: list[int] = []
    # Detokenized text of new_token_ids (filled by the EngineCore; may lag behind the tokens
    # while a stop string could still be forming).
    new_text: str = ""
    # A FinishReason value once the request has finished.
    finish_reason: int | None = None
    logprobs: list[SampleLogprobs] = []
    num_cached_tokens: int = 0
    error: str = ""
    # Set on a request's first output only.
    prompt_token_ids: list[int] = []


class EngineCoreRequest(msgspec.Struct, **_WIRE):
    """A client's request. Exactly one of prompt, prompt_token_ids, messages is set."""

    req_id: str
    sampling_params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    # Chat messages ({"role", "content"}), rendered with the model's chat template.
    messages: list[dict[str, str]] | None = None
    priority: int = 0
    cache_salt: str | None = None


class EngineCoreOutputs(msgspec.Struct, **_WIRE):
    outputs: list[EngineCoreOutput] = []


ToWorker = Union[SchedulerOutput, ResetWorkerCache, ShutdownWorker]
FromWorker = Union[ModelRunnerOutput, WorkerError]


class MalformedFrameError(ValueError):
    """A frame that does not decode to the channel's message types."""


class _Codec:
    __slots__ = ("_encoder", "_decoder", "_name")

    def __init__(self, decode_type, name: str) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(decode_type)
        self._name = name

    def encode(self, msg) -> bytes:
        return self._encoder.encode(msg)

    def decode(self, frame: bytes | memoryview):
        try:
            return self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as e:
            raise MalformedFrameError(f"malformed {self._name} frame ({len(frame)} bytes): {e}") from e


class WorkerChannelCodec(_Codec):
    """EngineCore -> workers."""

    def __init__(self) -> None:
        super().__init__(ToWorker, "to-worker")


class EngineChannelCodec(_Codec):
    """Workers -> EngineCore."""

    def __init__(self) -> None:
        super().__init__(FromWorker, "from-worker")


class ClientChannelCodec(_Codec):
    """EngineCore -> clients."""

    def __init__(self) -> None:
        super().__init__(EngineCoreOutputs, "engine-output")

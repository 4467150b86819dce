"""Wire messages between the EngineCore and the workers, and from the EngineCore to clients.

Every message is a msgspec Struct encoded as a msgpack array (array_like) with defaults omitted.
Each channel has one tagged union and one decoder, built once:
  to workers    ToWorker   = SchedulerOutput | FlushTiers | ShutdownWorker
  from workers  FromWorker = ModelRunnerOutput | WorkerError
  to clients    EngineCoreOutputs (a batch of per-request deltas)

Invariant 5: a step's SchedulerOutput is O(scheduled requests + new blocks). A prompt travels
once, in NewRequestData; afterwards a request costs its id, its new token ids, its new block ids
and its computed-token count.
"""
from __future__ import annotations

import hashlib
from typing import Union

import msgspec

from tierserve.kvcache.tier_index import ASYNC_KINDS, CopyKind
from tierserve.scheduler.params import LoRARef, SamplingParams

__all__ = [
    "NewRequestData", "CachedRequestData", "SchedulerOutput", "TierCopyBatch", "CopyKind",
    "ASYNC_KINDS", "FlushTiers",
    "ShutdownWorker", "SampleLogprobs", "ModelRunnerOutput", "WorkerError", "EngineCoreOutput",
    "EngineCoreOutputs", "EngineCoreRequest", "ToWorker", "FromWorker", "MalformedFrameError", "WorkerChannelCodec",
    "EngineChannelCodec", "ClientChannelCodec", "req_ids_digest",
]

_WIRE = dict(array_like=True, omit_defaults=True, gc=False)


class NewRequestData(msgspec.Struct, **_WIRE):
    """Sent once per request, the step it is first scheduled."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int = 0
    # The last num_output_tokens of prompt_token_ids are the request's outputs so far (a
    # request re-sent to new workers after a restart): penalties count them as outputs, and
    # a seeded generator continues past the draws that sampled them.
    num_output_tokens: int = 0
    # The adapter the request runs with; a rank loads it from its folder on first sight.
    lora: LoRARef | None = None


class CachedRequestData(msgspec.Struct, **_WIRE):
    """Diffs for requests the workers already hold, as flat parallel arrays: no per-request
    containers, so a decode request costs a few bytes and decodes without allocating."""

    req_ids: list[str] = []
    # Every request's new tokens (usually last step's one sample), concatenated.
    new_token_ids: list[int] = []
    # Tokens per request in new_token_ids; empty when every request has exactly one.
    num_new_tokens: list[int] = []
    # Block ids appended to (for resumed requests: replacing) a block table, and the index in
    # req_ids of the request each one belongs to, in table order.
    new_block_ids: list[int] = []
    new_block_owners: list[int] = []
    # Indices into req_ids of requests resumed after preemption, and how many of their tokens
    # are in the pool (prefix hits). For every other request the worker knows that count: it
    # is last step's count plus last step's scheduled tokens.
    resumed: list[int] = []
    resumed_num_computed: list[int] = []

    def add(self, req_id: str, new_tokens: list[int], new_blocks: list[int],
            num_computed: int | None = None) -> None:
        """num_computed is given for resumed requests only."""
        i = len(self.req_ids)
        self.req_ids.append(req_id)
        if self.num_new_tokens or len(new_tokens) != 1:
            if not self.num_new_tokens:  # every earlier request had exactly one
                self.num_new_tokens = [1] * i
            self.num_new_tokens.append(len(new_tokens))
        self.new_token_ids.extend(new_tokens)
        if new_blocks:
            self.new_block_ids.extend(new_blocks)
            self.new_block_owners.extend([i] * len(new_blocks))
        if num_computed is not None:
            self.resumed.append(i)
            self.resumed_num_computed.append(num_computed)

    def unpack(self) -> list[tuple[str, list[int], list[int], int | None]]:
        """Per request: (req_id, new token ids, new block ids, num computed if resumed)."""
        n = len(self.req_ids)
        counts = self.num_new_tokens or [1] * n
        blocks: list[list[int]] = [[] for _ in range(n)]
        for block_id, owner in zip(self.new_block_ids, self.new_block_owners):
            blocks[owner].append(block_id)
        resumed = dict(zip(self.resumed, self.resumed_num_computed))
        out, start = [], 0
        for i, rid in enumerate(self.req_ids):
            end = start + counts[i]
            out.append((rid, self.new_token_ids[start:end], blocks[i], resumed.get(i)))
            start = end
        return out


class TierCopyBatch(msgspec.Struct, **_WIRE):
    """One kind of KV tier copy of one step (kvcache/tier_steps.py CopyBatch), executed by every
    rank on its own head shard. A step's batches run in list order, before the forward:
    device -> CPU first (before a block id is reused), then the forked samples' block copies,
    then CPU -> device (before a block is read), then the asynchronous copies are queued.
    Ids mean the same place on every rank.

      kind            src                 dst
      DEVICE_TO_CPU   device block ids    CPU slot ids
      CPU_TO_DEVICE   CPU slot ids        device block ids
      SSD_TO_CPU      -                   CPU slot ids      (asynchronous)
      CPU_TO_SSD      CPU slot ids        -                 (asynchronous)
      DEVICE_TO_SSD   device block ids    -                 (a shutdown's flush)

    An SSD side is named by the block's hash (entries are content-addressed); keys hold the
    blocks' hashed keys (token ids and extra keys), which an entry stores and a load checks
    (b"" where hits are not verified). Asynchronous copies are numbered first_seq,
    first_seq + 1, ... within their kind."""

    kind: CopyKind
    src: list[int] = []
    dst: list[int] = []
    first_seq: int = 0
    hashes: list[bytes] = []
    keys: list[bytes] = []

    def __len__(self) -> int:
        return max(len(self.src), len(self.dst))


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
    tier_copies: list[TierCopyBatch] = []
    # Copy-on-write of forked samples: device block copy_src[i] is copied to copy_dst[i] after
    # the tier copies and before the forward (the source's owner writes it this step).
    copy_src: list[int] = []
    copy_dst: list[int] = []
    # Speculative decoding: each scheduled request's draft tokens (num_spec_tokens[i] of them,
    # in scheduled order; empty when no request has drafts), computed after its last known
    # token and counted in num_scheduled_tokens.
    spec_token_ids: list[int] = []
    num_spec_tokens: list[int] = []

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def scheduled_req_ids(self) -> list[str]:
        return [r.req_id for r in self.scheduled_new_reqs] + self.scheduled_cached_reqs.req_ids


class ShutdownWorker(msgspec.Struct, tag=3, **_WIRE):
    pass


class FlushTiers(msgspec.Struct, tag=4, **_WIRE):
    """A clean shutdown's last message: write these cached blocks (DEVICE_TO_SSD and CPU_TO_SSD
    batches) to the SSD folder, stopping at the deadline (seconds from receipt)."""

    step_id: int
    copies: list[TierCopyBatch] = []
    deadline_s: float = 30.0


class SampleLogprobs(msgspec.Struct, **_WIRE):
    """Logprobs of one sampled token: the sampled token first, then the top-n, then the
    request's logprob_token_ids, whose ranks are `chosen_ranks` (the top-n's are 1..n)."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int = 0
    chosen_ranks: list[int] = []


class ModelRunnerOutput(msgspec.Struct, tag=11, **_WIRE):
    step_id: int
    # One per scheduled request, in SchedulerOutput order; -1 where a prefill chunk did not
    # reach the end of the known tokens, so nothing was sampled.
    sampled_token_ids: list[int] = []
    # Aligned with sampled_token_ids where any request asked for logprobs; None elsewhere.
    logprobs: list[SampleLogprobs | None] = []
    # Aligned the same way where a request asked for prompt logprobs: one per prompt token
    # this step's chunk predicted (the token first, then the top-n); None elsewhere.
    prompt_logprobs: list[list[SampleLogprobs] | None] = []
    # Asynchronous tier copies, per kind in ASYNC_KINDS order (SSD_TO_CPU, CPU_TO_SSD): every
    # rank has completed those with seq < tier_done[i] (-1: no news); tier_failed holds
    # (CopyKind, seq) pairs, flat, of copies that failed on some rank.
    tier_done: list[int] = []
    tier_failed: list[int] = []
    # The answer to a FlushTiers: how many of its blocks rank 0 wrote.
    flushed_blocks: int = 0
    # Speculative decoding: how many of each scheduled request's drafts were accepted (they
    # precede sampled_token_ids[i] in its output); empty when the step had no drafts.
    num_accepted: list[int] = []
    # req_ids_digest of the step's scheduled request ids: the engine checks that a reply
    # answers the requests it scheduled, in its order.
    req_ids_digest: bytes = b""
    # Aligned with sampled_token_ids where a request asked for pooling (Pooling): its pooled
    # hidden state, float32 bytes; b"" elsewhere.
    pooled: list[bytes] = []


def req_ids_digest(req_ids: list[str]) -> bytes:
    """8 bytes naming an ordered list of request ids (ids never contain NUL)."""
    return hashlib.blake2b("\0".join(req_ids).encode(), digest_size=8).digest()


class WorkerError(msgspec.Struct, tag=12, **_WIRE):
    step_id: int
    rank: int
    message: str


class EngineCoreOutput(msgspec.Struct, **_WIRE):
    """One request's delta for one step, as streamed to its client."""

    req_id: str
    new_token_ids: list[int] = []
    # Text of new_token_ids, filled by the client's OutputProcessor (runtime/processor.py);
    # the engine leaves it empty: it emits token ids only. It may lag behind the tokens while
    # a stop string could still be forming.
    new_text: str = ""
    # A FinishReason value once the request has finished.
    finish_reason: int | None = None
    logprobs: list[SampleLogprobs] = []
    num_cached_tokens: int = 0
    error: str = ""
    # Set by the client's OutputProcessor on a request's first output only.
    prompt_token_ids: list[int] = []
    # Which of the request's n samples this delta belongs to.
    index: int = 0
    # An ErrorKind value when error is set.
    error_kind: int = 0
    # With the first output, when asked for: prompt tokens 1.. given the ones before.
    prompt_logprobs: list[SampleLogprobs] = []
    # Of num_cached_tokens, those the CPU tier held (loaded from SSD or demoted there).
    num_tier_cached_tokens: int = 0
    # An embedding request's pooled hidden state (float32 bytes), with its finishing output.
    pooled: bytes = b""
    # With finish_reason STOP, what stopped it (vLLM's stop_reason): the stop_token_ids entry
    # (the engine), or the stop string (the client's OutputProcessor); None for EOS.
    stop_reason: int | str | None = None


class EngineCoreRequest(msgspec.Struct, **_WIRE):
    """A request as the engine takes it: token ids, which the client's InputProcessor made
    from the user's text or chat messages (runtime/processor.py)."""

    # The engine's id: unique among the engine's requests, chosen by the client's process.
    req_id: str
    sampling_params: SamplingParams
    prompt_token_ids: list[int] = []
    priority: int = 0
    cache_salt: str | None = None
    # The caller's own name for the request (its request_id, namespaced by its frontend),
    # shown by list_requests and matched by an operator's abort; never used to route outputs.
    label: str = ""
    # The LoRA adapter to run with (enable_lora); None: the base model.
    lora: LoRARef | None = None


class EngineCoreOutputs(msgspec.Struct, **_WIRE):
    outputs: list[EngineCoreOutput] = []


ToWorker = Union[SchedulerOutput, FlushTiers, ShutdownWorker]
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

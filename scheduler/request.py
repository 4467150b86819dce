"""A request as the scheduler sees it: tokens, status, progress and its block-hash chain."""
from __future__ import annotations

import time

from tierserve.kvcache import BlockHash, BlockHasher, encode_extra_keys
from tierserve.scheduler.params import LoRARef, RequestStatus, SamplingParams

__all__ = ["Request", "SAMPLE_SEP", "seq_id"]

# Sample i > 0 of request R runs as its own sequence, id R + SAMPLE_SEP + i; a request id
# cannot contain SAMPLE_SEP, so sequence ids never collide with request ids.
SAMPLE_SEP = "\x1f"


def seq_id(request_id: str, index: int) -> str:
    return request_id if index == 0 else f"{request_id}{SAMPLE_SEP}{index}"


class Request:
    __slots__ = (
        "request_id", "sampling_params", "eos_token_id", "arrival_time", "priority", "cache_salt",
        "all_token_ids", "output_token_ids", "num_prompt_tokens", "status", "num_computed_tokens",
        "num_cached_tokens", "num_tier_cached_tokens", "num_preemptions", "num_sent_tokens",
        "block_hashes", "block_keys",
        "_hasher", "_extra_first", "_extra", "max_output_tokens",
        "family_id", "index", "num_output_placeholders",
        "first_token_time", "cached_by_tier", "ssd_loaded_blocks", "admitted_at",
        "spec_token_ids", "lora",
    )

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, *, eos_token_id: int | None = None,
                 arrival_time: float | None = None, priority: int = 0,
                 cache_salt: str | None = None, lora: LoRARef | None = None,
                 hasher: BlockHasher | None = None, keep_keys: bool = True,
                 family_id: str | None = None, index: int = 0) -> None:
        self.request_id = request_id
        # The client's request id and which of its samples this sequence is.
        self.family_id = request_id if family_id is None else family_id
        self.index = index
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        # The LoRA adapter the request runs with (None: the base model).
        self.lora = lora
        self.all_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_prompt_tokens = len(prompt_token_ids)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Prompt tokens served from the prefix cache at first admission (reported to the user).
        self.num_cached_tokens = -1
        # ... of which the CPU tier held (loaded there from SSD, or demoted there).
        self.num_tier_cached_tokens = 0
        # ... found in the device pool, the CPU tier (demoted there) and on SSD (loaded from
        # there while it waited).
        self.cached_by_tier = (0, 0, 0)
        # Blocks loaded from SSD for it while it waited (CPU hits by the time it is admitted).
        self.ssd_loaded_blocks = 0
        # time.monotonic() when it was first scheduled, and when its first output token was
        # appended (None: not yet).
        self.admitted_at: float | None = None
        self.first_token_time: float | None = None
        self.num_preemptions = 0
        # How many of all_token_ids the workers hold; the next message carries the rest.
        self.num_sent_tokens = 0
        # Async scheduling: tokens a step in flight will sample, not yet known here. The
        # workers append them themselves; the scheduler already schedules their positions.
        self.num_output_placeholders = 0
        # Speculation: the drafts the step in flight computes after its last known token.
        self.spec_token_ids: list[int] = []
        # Unbounded until the scheduler clamps it to max_model_len.
        self.max_output_tokens = sampling_params.max_tokens
        self.block_hashes: list[BlockHash] = []
        self.block_keys: list[bytes] | None = [] if keep_keys else None
        self._hasher = hasher
        # Salt goes into the first block only; the chain carries it to every later block.
        self._extra_first = encode_extra_keys(cache_salt=cache_salt)
        self._extra = encode_extra_keys(lora_id=None if lora is None else lora.digest)
        self._hash_new_blocks()

    def fork(self, index: int, sampling_params: SamplingParams) -> "Request":
        """Sample `index` of this request, before any output: the same prompt, hash chain,
        salt and limits, nothing computed."""
        assert not self.output_token_ids, "a request forks before its first output"
        child = Request(seq_id(self.family_id, index), self.all_token_ids, sampling_params,
                        eos_token_id=self.eos_token_id, arrival_time=self.arrival_time,
                        priority=self.priority, cache_salt=self.cache_salt, lora=self.lora,
                        family_id=self.family_id, index=index)
        child.max_output_tokens = self.max_output_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.num_tier_cached_tokens = self.num_tier_cached_tokens
        child.cached_by_tier = self.cached_by_tier
        child._hasher, child._extra_first, child._extra = (self._hasher, self._extra_first,
                                                           self._extra)
        child.block_hashes = self.block_hashes[:]
        child.block_keys = None if self.block_keys is None else self.block_keys[:]
        return child

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        if self._hasher is not None and len(self.all_token_ids) % self._hasher.block_size == 0:
            self._hash_new_blocks()

    def _hash_new_blocks(self) -> None:
        if self._hasher is None:
            return
        start = len(self.block_hashes)
        parent = self.block_hashes[-1] if start else None
        hashes, keys = self._hasher.hash_blocks(self.all_token_ids, start, parent,
                                                self._extra_first, self._extra)
        self.block_hashes.extend(hashes)
        if self.block_keys is not None:
            self.block_keys.extend(keys)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")

"""A request as the scheduler sees it: tokens, status, progress and its block-hash chain."""
from __future__ import annotations

import time

from tierserve.kvcache import BlockHash, BlockHasher, encode_extra_keys
from tierserve.scheduler.params import RequestStatus, SamplingParams

__all__ = ["Request"]


class Request:
    __slots__ = (
        "request_id", "sampling_params", "eos_token_id", "arrival_time", "priority", "cache_salt",
        "all_token_ids", "output_token_ids", "num_prompt_tokens", "status", "num_computed_tokens",
        "num_cached_tokens", "num_preemptions", "num_sent_tokens", "block_hashes", "block_keys",
        "_hasher", "_extra_first", "_extra", "max_output_tokens", "swapped_slots",
        "num_swapped_tokens",
    )

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, *, eos_token_id: int | None = None,
                 arrival_time: float | None = None, priority: int = 0,
                 cache_salt: str | None = None, lora_id: int | None = None,
                 hasher: BlockHasher | None = None, keep_keys: bool = True) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.all_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_prompt_tokens = len(prompt_token_ids)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Prompt tokens served from the prefix cache at first admission (reported to the user).
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # How many of all_token_ids the workers hold; the next message carries the rest.
        self.num_sent_tokens = 0
        # Unbounded until the scheduler clamps it to max_model_len.
        self.max_output_tokens = sampling_params.max_tokens
        # Swap preemption: the CPU tier slots holding its first num_swapped_tokens tokens' KV.
        self.swapped_slots: list[int] | None = None
        self.num_swapped_tokens = 0
        self.block_hashes: list[BlockHash] = []
        self.block_keys: list[bytes] | None = [] if keep_keys else None
        self._hasher = hasher
        # Salt goes into the first block only; the chain carries it to every later block.
        self._extra_first = encode_extra_keys(cache_salt=cache_salt)
        self._extra = encode_extra_keys(lora_id=lora_id)
        self._hash_new_blocks()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        self.output_token_ids.append(token_id)
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

"""Checks of what a Scheduler is built with and of each request it is given, against its
limits: a bad value raises ValueError naming it, before anything changes, so that bad input
fails that request alone (or the engine's start, for a bad limit).
"""
from __future__ import annotations

import array

from tierserve.kvcache import KVCacheManager
from tierserve.scheduler.params import SamplingParams
from tierserve.scheduler.request import SAMPLE_SEP

__all__ = ["check_limits", "check_request"]


def check_limits(kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, long_prefill_token_threshold: int,
                 step_time_target_s: float) -> None:
    for name, value in (("max_num_seqs", max_num_seqs),
                        ("max_num_batched_tokens", max_num_batched_tokens),
                        ("max_model_len", max_model_len)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if long_prefill_token_threshold < 0:
        raise ValueError("long_prefill_token_threshold must be >= 0 (0 disables it)")
    # A prompt must fit beside the admission watermark, or it could never be admitted.
    pool_tokens = (kv.pool.num_usable_blocks - kv.watermark_blocks) * kv.block_size
    if max_model_len > pool_tokens:
        raise ValueError(f"max_model_len {max_model_len} does not fit the KV pool "
                         f"({pool_tokens} tokens); lower it or give the cache more memory")
    if step_time_target_s < 0:
        raise ValueError("step_time_target_s must be >= 0 (0 disables it)")


def check_request(request_id: str, prompt: list[int], sampling_params: SamplingParams,
                  max_model_len: int, vocab_size: int | None) -> None:
    """A new request's id, prompt and sampling parameters (whether its id is free is the
    caller's to check)."""
    if SAMPLE_SEP in request_id:
        raise ValueError(f"request id {request_id!r} contains {SAMPLE_SEP!r}, which is "
                         f"reserved for sample ids")
    if not isinstance(sampling_params, SamplingParams):
        raise ValueError(f"sampling_params must be SamplingParams, got "
                         f"{type(sampling_params).__name__}")
    check_prompt(prompt, max_model_len, vocab_size)
    check_token_ids(sampling_params.token_ids_named(), vocab_size)


def check_token_ids(ids: list[int], vocab_size: int | None) -> None:
    """Token ids the sampling parameters name, against the vocabulary."""
    if ids and vocab_size is not None and max(ids) >= vocab_size:
        raise ValueError(f"token id {max(ids)} in the sampling parameters is out of range "
                         f"[0, {vocab_size})")


def check_prompt(prompt: list[int], max_model_len: int, vocab_size: int | None) -> None:
    if not prompt:
        raise ValueError("prompt is empty")
    if len(prompt) > max_model_len:
        raise ValueError(f"prompt has {len(prompt)} tokens, more than max_model_len "
                         f"{max_model_len}")
    try:
        array.array("q", prompt)
    except (TypeError, OverflowError) as e:
        raise ValueError(f"prompt token ids must be ints: {e}") from None
    lo, hi = min(prompt), max(prompt)
    if lo < 0 or (vocab_size is not None and hi >= vocab_size):
        bad = lo if lo < 0 else hi
        raise ValueError(f"token id {bad} is out of range [0, {vocab_size})")

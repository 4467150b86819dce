"""Building an engine from its config: the model check before anything starts, the workers'
spec, the tokenizer loading beside them, and the scheduler, tier policy and request log over
what the workers report.
EngineCore (runtime/engine_core.py) runs what these build.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import threading
import time
from typing import Callable

from tierserve.kvcache import BlockHasher, KVCacheManager, KVEventRecorder, TierIndex, TierPolicy
from tierserve.runtime import envs
from tierserve.runtime.config import EngineConfig
from tierserve.runtime.executor import WorkerInfo
from tierserve.runtime.generation_config import generation_defaults
from tierserve.runtime.request_log import LOG_VERSION, MAGIC, LogHeader, RequestLog
from tierserve.runtime.tokenizer import load_model_tokenizer, tokenizer_json_file
from tierserve.scheduler import Scheduler
from tierserve.workers.kv_fingerprint import kv_fingerprint
from tierserve.workers.model.config import ModelConfig
from tierserve.workers.model.layers import partition_heads
from tierserve.workers.model.loader import default_model_path, load_model_config
from tierserve.workers.tier_ssd import SsdFolder
from tierserve.workers.worker import WorkerSpec, resolve_device

__all__ = ["make_worker_spec", "check_model", "make_scheduler", "make_request_log",
           "Background", "start_tokenizer"]

log = logging.getLogger("tierserve.engine")

# Longest context a default config admits, whatever the model's positions allow.
_DEFAULT_MAX_MODEL_LEN = 8192
# A collective's own timeout is a backstop for a dead peer: it must outlast the step timeout,
# so that a stuck rank is found by the engine (which replaces every rank) and not first by a
# peer's collective error, which races it.
_COLLECTIVE_TIMEOUT_FACTOR = 2.0


def make_worker_spec(config: EngineConfig) -> WorkerSpec:
    """What every worker is started with: the config resolved to a device, a dtype and a model
    path, and the SSD tier's KV fingerprint."""
    device = resolve_device(config.device)
    dtype = config.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    model = config.model or default_model_path()
    return WorkerSpec(
        model=model, dtype=dtype, device=device,
        block_size=config.block_size, tensor_parallel_size=config.tensor_parallel_size,
        max_num_batched_tokens=config.max_num_batched_tokens, seed=config.seed,
        kv_cache_memory_bytes=config.kv_cache_memory_bytes,
        gpu_memory_utilization=config.gpu_memory_utilization,
        num_kv_blocks=config.num_kv_blocks,
        cpu_threads=None if config.cpus_per_worker is None else math.ceil(config.cpus_per_worker),
        collective_timeout_s=_COLLECTIVE_TIMEOUT_FACTOR * config.step_timeout_s,
        cpu_kernels=envs.cpu_kernels(),
        cpu_isa=config.cpu_isa if config.cpu_isa is not None else envs.cpu_isa(),
        cache_dir=envs.cache_dir(), quantized_linears=config.quantized_linears,
        quantization=config.quantization, enforce_eager=config.enforce_eager,
        debug_stall=envs.debug_stall(), debug_crash=envs.debug_crash(),
        debug_late_copies=envs.debug_late_copies(),
        kv_offload_cpu_bytes=config.kv_offload_cpu_bytes,
        kv_offload_ssd_path=config.kv_offload_ssd_path,
        kv_offload_ssd_bytes=config.kv_offload_ssd_bytes,
        kv_fingerprint=kv_fingerprint_of(config, model, dtype),
        # The input batch's first capacity (None: the model's length is not known yet; it grows).
        max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
        async_scheduling=config.pipelined,
        max_loaded_loras=(config.max_cpu_loras or config.max_loras) if config.enable_lora else 0,
        max_lora_rank=config.max_lora_rank)


def kv_fingerprint_of(config: EngineConfig, model: str, dtype: str) -> str:
    """The KV fingerprint naming SSD entries ("" without an SSD tier: nothing is hashed)."""
    if not config.kv_offload_ssd_path or not config.kv_offload_cpu_bytes:
        return ""
    t0 = time.perf_counter()
    fp = kv_fingerprint(model, load_model_config(model), dtype=dtype,
                        block_size=config.block_size, cache_dir=envs.cache_dir(),
                        hash_id=f"{config.prefix_caching_hash_algo}:{config.hash_seed}",
                        quantization=config.quantization)
    log.info("KV fingerprint %s in %.3f s", fp[:16], time.perf_counter() - t0)
    return fp


def check_model(config: EngineConfig) -> ModelConfig:
    """The model's config, read before anything starts; a model path that does not exist or
    does not parse, a TP size its heads cannot split over, or a max_model_len beyond its
    positions is a ValueError naming the option."""
    path = config.model or default_model_path()
    if not os.path.exists(path):
        raise ValueError(f"model: {path!r} does not exist")
    try:
        model = load_model_config(path)
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"model: cannot read the model config of {path!r}: "
                         f"{type(e).__name__}: {e}") from e
    except ValueError as e:
        raise ValueError(f"model: {e}") from e
    try:
        partition_heads(model.num_attention_heads, model.num_key_value_heads,
                        config.tensor_parallel_size)
    except ValueError as e:
        raise ValueError(f"tensor_parallel_size: {e}") from None
    if config.max_model_len is not None and not config.allow_long_max_model_len \
            and config.max_model_len > model.max_position_embeddings:
        raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the model's "
                         f"max_position_embeddings ({model.max_position_embeddings}); set "
                         f"allow_long_max_model_len=True to force it")
    generation_defaults(config.generation_config, path, config.override_generation_config)
    return model


def pool_too_small(config: EngineConfig, info: WorkerInfo, usable_tokens: int) -> str:
    """The error of a max_model_len the KV pool cannot hold, naming settings that fit."""
    blocks = -(-config.max_model_len // config.block_size) + 1
    while True:  # usable blocks (less the null block) beside the admission watermark
        probe = KVCacheManager(blocks, config.block_size, False)
        if (probe.pool.num_usable_blocks - probe.watermark_blocks) * config.block_size \
                >= config.max_model_len:
            break
        blocks += 1
    fix = f"num_kv_blocks={blocks}" if config.num_kv_blocks is not None else \
        f"kv_cache_memory_bytes={blocks * info.kv_block_bytes}"
    return (f"max_model_len {config.max_model_len} does not fit the KV pool ({usable_tokens} "
            f"tokens in {info.num_blocks} blocks); set {fix}, or max_model_len="
            f"{usable_tokens}" if usable_tokens > 0 else
            f"max_model_len {config.max_model_len} does not fit the KV pool ({info.num_blocks} "
            f"blocks); set {fix}")


class Background:
    """fn(*args) on a thread of its own; result() waits for it and re-raises its error."""

    def __init__(self, fn: Callable, *args) -> None:
        self.seconds = 0.0
        self._result = self._error = None
        self._thread = threading.Thread(target=self._run, args=(fn, args), daemon=True,
                                        name="tierserve-start")
        self._thread.start()

    def _run(self, fn: Callable, args: tuple) -> None:
        t0 = time.perf_counter()
        try:
            self._result = fn(*args)
        except BaseException as e:  # handed to the caller of result()
            self._error = e
        self.seconds = time.perf_counter() - t0

    def wait(self) -> None:
        self._thread.join()

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


def start_tokenizer(spec: WorkerSpec, path: str) -> tuple[WorkerSpec, Background]:
    """The tokenizer at path, loading in the background, and the spec naming the tokenizer.json
    the workers compile a structured-output grammar from."""
    # Where that file exists (a folder's, or a GGUF's cached conversion), the tokenizer (and
    # transformers, which it imports) loads while the workers load their weights: Python
    # work beside work that runs in torch, mostly without the GIL.
    tokenizer_file = tokenizer_json_file(path, envs.cache_dir())
    tokenizer = Background(load_model_tokenizer, path)
    if tokenizer_file is None:  # converted (and cached) first: a GGUF's first start
        tokenizer.wait()
        tokenizer_file = tokenizer_json_file(path, envs.cache_dir())
    return dataclasses.replace(spec, tokenizer_file=tokenizer_file), tokenizer


def make_tiers(config: EngineConfig, info: WorkerInfo, model: ModelConfig,
               spec: WorkerSpec) -> TierPolicy:
    """The tier policy over the CPU slots the ranks allocated and the SSD folder; a tier
    layer of capacity 0 where the engine has no tiers."""
    mode, bs = config.preemption_mode, config.block_size
    if not info.cpu_slots or not config.enable_prefix_caching:
        return TierPolicy(block_size=bs, preemption_mode=mode)
    ssd_blocks, probe = 0, None
    if config.kv_offload_ssd_path:
        folder = SsdFolder(config.kv_offload_ssd_path, spec.kv_fingerprint,
                           model.num_key_value_heads, config.kv_offload_ssd_bytes)
        ranges = sorted(set(info.kv_head_ranges))
        # One block in the folder: every distinct head range's entry.
        ssd_blocks = config.kv_offload_ssd_bytes // (info.kv_block_bytes * len(ranges))
        probe = lambda block_hash: folder.has_block(block_hash, ranges)  # noqa: E731
    index = TierIndex(info.cpu_slots, ssd_blocks, ssd_probe=probe,
                      verify_hits=config.verify_prefix_hits)
    policy = TierPolicy(index, block_size=bs, preemption_mode=mode,
                        block_bytes=info.kv_block_bytes)
    policy.costs.copy_bytes_per_s = info.copy_bytes_per_s
    return policy


def make_scheduler(config: EngineConfig, info: WorkerInfo, model: ModelConfig,
                   spec: WorkerSpec, events: KVEventRecorder | None = None) -> Scheduler:
    """The scheduler over a KV pool of the blocks the workers allocated; a max_model_len the
    pool cannot hold is a ValueError naming settings that fit."""
    kv = KVCacheManager(info.num_blocks, config.block_size, config.enable_prefix_caching,
                        config.verify_prefix_hits,
                        tiers=make_tiers(config, info, model, spec), events=events)
    usable_tokens = (kv.pool.num_usable_blocks - kv.watermark_blocks) * config.block_size
    if config.max_model_len is not None and config.max_model_len > usable_tokens:
        raise ValueError(pool_too_small(config, info, usable_tokens))
    max_model_len = config.max_model_len or min(
        info.max_position_embeddings, _DEFAULT_MAX_MODEL_LEN, usable_tokens)
    hasher = BlockHasher(config.block_size, config.prefix_caching_hash_algo, config.hash_seed)
    return Scheduler(kv, hasher, max_num_seqs=config.max_num_seqs,
                     max_num_batched_tokens=config.max_num_batched_tokens,
                     max_model_len=max_model_len,
                     long_prefill_token_threshold=config.long_prefill_token_threshold,
                     policy=config.scheduling_policy, vocab_size=info.vocab_size,
                     max_queued_requests=config.max_queued_requests,
                     async_scheduling=config.pipelined,
                     speculative_config=config.speculative_config,
                     step_time_target_s=config.step_time_target_ms / 1e3,
                     max_loras=config.max_loras)


def make_request_log(config: EngineConfig, spec: WorkerSpec, info: WorkerInfo,
                     index: TierIndex) -> RequestLog | None:
    """The request log, where configured (None otherwise)."""
    if config.request_log_path is None:
        return None
    header = LogHeader(
        MAGIC, LOG_VERSION, config.block_size, hash_algo=config.prefix_caching_hash_algo,
        hash_seed=config.hash_seed, model=spec.model, dtype=spec.dtype,
        tensor_parallel_size=config.tensor_parallel_size,
        kv_block_bytes=info.kv_block_bytes, num_blocks=info.num_blocks,
        cpu_slots=index.cpu.num_slots, ssd_entries=index.ssd.capacity,
        kv_head_ranges=len(set(info.kv_head_ranges)) or 1,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        copy_bytes_per_s=info.copy_bytes_per_s)
    return RequestLog(config.request_log_path, header, with_tokens=config.request_log_tokens,
                      max_bytes=config.request_log_max_bytes, keep=config.request_log_keep)

"""What an engine reports of itself. LoadReporter owns what a router reads: the KV event
stream (batches of the hashes entering and leaving each tier, sequenced within a random epoch;
snapshots for a resync) and the load, which every batch carries. engine_stats and engine_info
describe an engine to an operator from its public attributes.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from tierserve.kvcache import KVEventRecorder
from tierserve.scheduler import Scheduler
from tierserve.scheduler.kv_events import (
    KV_EVENTS_VERSION, KVEventBatch, KVSnapshot, ReplicaLoad,
)

if TYPE_CHECKING:
    from tierserve.runtime.engine_core import EngineCore

__all__ = ["LoadReporter", "engine_stats", "engine_info"]


class LoadReporter:
    """The event stream's position (epoch, sequence number) and the count of requests added."""

    def __init__(self, scheduler: Scheduler, recorder: KVEventRecorder | None) -> None:
        self._scheduler = scheduler
        self._recorder = recorder  # None where the engine publishes no events
        self._epoch = int.from_bytes(os.urandom(8), "little") >> 1
        self._seq = -1
        # Every request offered, valid or not.
        self._requests_added = 0

    def count_request(self) -> None:
        self._requests_added += 1

    def take(self) -> KVEventBatch | None:
        """The next KV event batch: the tiers' changes since the last one, and the load now
        (None when this engine publishes no events)."""
        if self._recorder is None:
            return None
        stored, removed = self._recorder.take()
        self._seq += 1
        return KVEventBatch(KV_EVENTS_VERSION, self._epoch, self._seq, stored, removed,
                            self.load())

    def snapshot(self) -> tuple[KVEventBatch, KVSnapshot]:
        """The batch of changes not yet taken, then every tier's hashes as of that batch;
        publish the batch first."""
        if self._recorder is None:
            raise RuntimeError("this engine publishes no KV events (kv_events is off)")
        batch = self.take()
        cpu, ssd = self._scheduler.tiers.index.held_hashes()
        tiers = [self._scheduler.kv.pool.cached_hashes(), cpu, ssd]
        return batch, KVSnapshot(KV_EVENTS_VERSION, self._epoch, batch.seq, tiers, batch.load)

    def load(self) -> ReplicaLoad:
        """O(unfinished requests, and the waiting ones' prompt blocks)."""
        sched = self._scheduler
        queued = sched.queued_prefill_tokens()
        costs = sched.tiers.costs
        cpu_block_s = costs.block_bytes / costs.copy_bytes_per_s if costs.copy_bytes_per_s \
            and sched.tiers.enabled else 0.0
        pool = sched.kv.pool
        return ReplicaLoad(len(sched.running), len(sched.waiting) + sched.tiers.num_loading,
                           queued, pool.num_free_blocks, pool.num_usable_blocks,
                           self._requests_added, costs.prefill_tokens_per_s, cpu_block_s)


def engine_stats(core: EngineCore) -> dict:
    """The scheduler's counters, the model's and backend's facts, the restart record and the
    transport's own stats."""
    stats = core.scheduler.stats()
    stats["max_model_len"] = core.max_model_len
    stats["block_size"] = core.config.block_size
    stats["weight_bytes"] = core.weight_bytes
    stats["decode_weight_bytes"] = core.decode_weight_bytes
    if core.backends:
        stats["cpu_backend"] = core.backends[0]["name"]
        stats["backend"] = dict(core.backends[0])
    stats.update(restarts=core.restarts, restart_reason=core.restart_reason,
                 restart_s=round(core.restart_s, 3),
                 worker_start_s=round(core.worker_start_s, 3),
                 worker_phases=dict(core.executor.phases))
    stats.update(core.executor.stats())
    if core.config.enable_lora:
        stats.update(lora_stats(core.scheduler, core.config.max_loras))
    return stats


def lora_stats(scheduler, max_loras: int) -> dict:
    """The adapters of the running requests and of the waiting ones, by name (vLLM's
    lora_requests_info)."""
    def names(requests) -> list[str]:
        return sorted({r.lora.name for r in requests if r.lora is not None})
    return {"lora_running_adapters": names(scheduler.running),
            "lora_waiting_adapters": names(scheduler.waiting), "max_loras": max_loras}


def engine_info(core: EngineCore) -> dict:
    """What stays fixed for the engine's life: the model, limits, hashing, backends, generation
    defaults and how long the start took."""
    config = core.config
    return {"model": config.model, "max_model_len": core.max_model_len,
            "max_queued_requests": config.max_queued_requests,
            "vocab_size": core.vocab_size, "tokenizer_path": core.tokenizer_path,
            "tensor_parallel_size": config.tensor_parallel_size,
            "step_timeout_s": config.step_timeout_s,
            "block_size": config.block_size,
            "hash": {"algorithm": config.prefix_caching_hash_algo,
                     "seed": config.hash_seed,
                     "enabled": config.enable_prefix_caching},
            "backends": [dict(b) for b in core.backends],
            "generation_defaults": dict(core.generation_defaults),
            "enable_lora": config.enable_lora,
            "lora_check": None if core.adapters is None else core.adapters.describe(),
            "lora_modules": [{"name": m.lora_name, "id": m.lora_int_id, "path": m.lora_path}
                             for m in (config.lora_modules.modules if config.lora_modules
                                       else ())],
            "startup_s": {k: round(v, 3) for k, v in core.startup.items()}}

"""Wires one rank's KV tiers below its pool: the CPU slots its share of the offload budget buys,
the SSD folder every engine on the node shares, and the TierCopier that executes the engine's
copies on them. Sizing and wiring only: what to copy is always the engine's decision."""
from __future__ import annotations

import logging

import torch

from tierserve.workers.kv_pool import kv_cache_bytes_per_block
from tierserve.workers.model_runner import ModelRunner
from tierserve.workers.tier_copier import TierCopier
from tierserve.workers.tier_ssd import SsdFolder, kv_head_range
from tierserve.workers.worker_spec import TierReport, WorkerSpec

__all__ = ["attach_tiers"]

# The Worker's log: a rank's start reads as one stream, whichever module it is in.
log = logging.getLogger("tierserve.worker")


def attach_tiers(runner: ModelRunner, spec: WorkerSpec, rank: int, dtype: torch.dtype,
                 known: bool = False) -> TierReport:
    """Gives the runner its tier copier, where the spec has a CPU tier (without one the runner
    keeps its empty copier). known: the engine already knows the copy bandwidth (a rank
    replacing a lost one), so it is not measured again."""
    cfg = runner.model.config
    tp = spec.tensor_parallel_size
    heads = kv_head_range(cfg.num_key_value_heads, tp, rank)
    block_bytes = kv_cache_bytes_per_block(cfg, tp, spec.block_size, dtype)
    cpu_slots = spec.kv_offload_cpu_bytes // block_bytes
    if cpu_slots == 0:
        return TierReport(0, heads, 0.0)
    ssd = None
    if spec.kv_offload_ssd_path:
        ssd = SsdFolder(spec.kv_offload_ssd_path, spec.kv_fingerprint,
                        cfg.num_key_value_heads, spec.kv_offload_ssd_bytes)
    # Ranks sharing a replicated KV head hold the same KV: the first of them writes it.
    replicas = max(1, tp // cfg.num_key_value_heads)
    copier = TierCopier(runner.kv_caches, cpu_slots, runner.device, ssd=ssd, heads=heads,
                        writer=rank % replicas == 0, late=spec.debug_late_copies)
    runner.tiers = copier
    if known:
        return TierReport(cpu_slots, heads, 0.0)
    log.info("rank %d: a CPU tier of %d slots%s", rank, cpu_slots,
             f", SSD folder {ssd.dir}" if ssd is not None else "")
    return TierReport(cpu_slots, heads, copier.measure_copy_bandwidth())

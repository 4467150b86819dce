"""What the tiers measure: the rates behind swap-vs-recompute (CostModel) and the counters the
engine's stats report (TierStats).
"""
from __future__ import annotations

from dataclasses import dataclass

from tierserve.kvcache.tier_index import TierIndex

__all__ = ["CostModel", "TierStats"]


@dataclass(slots=True)
class CostModel:
    """Measured rates behind swap-vs-recompute (the seeds' table): a block's bytes over the
    copy bandwidth, out and back, against prefilling its tokens again. Zero: not measured."""

    block_bytes: int = 0
    copy_bytes_per_s: float = 0.0
    prefill_tokens_per_s: float = 0.0

    def swap_is_cheaper(self, num_blocks: int, num_tokens: int) -> bool:
        if not (self.block_bytes and self.copy_bytes_per_s and self.prefill_tokens_per_s):
            return True  # a memcpy is cheaper than a forward on every device we know
        swap_s = 2 * num_blocks * self.block_bytes / self.copy_bytes_per_s
        return swap_s < num_tokens / self.prefill_tokens_per_s

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A step's throughput, averaged over steps."""
        rate = num_tokens / seconds
        self.prefill_tokens_per_s = rate if not self.prefill_tokens_per_s else (
            0.8 * self.prefill_tokens_per_s + 0.2 * rate)


@dataclass(slots=True)
class TierStats:
    cpu_hit_blocks: int = 0
    ssd_hit_blocks: int = 0
    promotions: int = 0  # CPU -> device blocks
    demotions: int = 0  # device -> CPU blocks
    demotions_dropped: int = 0  # evicted device blocks the CPU tier had no room for
    loads: int = 0  # SSD -> CPU blocks (completed)
    spills: int = 0  # CPU -> SSD blocks (completed)
    cpu_dropped: int = 0  # cached CPU blocks dropped without an SSD copy
    ssd_dropped: int = 0  # SSD blocks the record forgot for room
    checksum_failures: int = 0  # SSD entries that failed their checks (or vanished) on load
    spill_failures: int = 0  # SSD writes that failed
    swap_outs: int = 0  # preempted requests swapped to the CPU tier
    swap_ins: int = 0
    bytes_copied: int = 0

    def report(self, index: TierIndex, num_loading: int) -> dict:
        """The engine stats' tier entries: the tiers' usage, then these counters."""
        s, cpu, ssd = self, index.cpu, index.ssd
        out = {"cpu_tier_usage": cpu.usage(), "cpu_tier_slots": cpu.num_slots}
        if ssd.capacity:
            out.update(ssd_tier_usage=ssd.usage(), ssd_tier_blocks=ssd.capacity,
                       tier_ssd_found_blocks=ssd.num_found)
        out.update(
            tier_cpu_hit_blocks=s.cpu_hit_blocks, tier_ssd_hit_blocks=s.ssd_hit_blocks,
            tier_promotions=s.promotions, tier_demotions=s.demotions,
            tier_demotions_dropped=s.demotions_dropped, tier_loads=s.loads,
            tier_spills=s.spills, tier_cpu_dropped=s.cpu_dropped, tier_ssd_dropped=s.ssd_dropped,
            tier_checksum_failures=s.checksum_failures, tier_spill_failures=s.spill_failures,
            tier_swap_outs=s.swap_outs,
            tier_swap_ins=s.swap_ins, tier_bytes_copied=s.bytes_copied,
            num_loading=num_loading)
        return out

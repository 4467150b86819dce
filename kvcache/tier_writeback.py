"""Write-back: the CPU tier's coldest dirty slots spilled to SSD (write-through, in the
background) until `headroom` slots are free or clean, so that a full CPU tier drops blocks that
are also on SSD; a bounded number of spills per step; and what a spill's completion changes.
"""
from __future__ import annotations

from tierserve.kvcache.tier_index import TierIndex
from tierserve.kvcache.tier_metrics import CostModel, TierStats
from tierserve.kvcache.tier_records import AsyncCopy, CopyKind, SlotState
from tierserve.kvcache.tier_steps import StepCopies

__all__ = ["MIN_SPILLS_PER_STEP", "MAX_SPILL_FAILURES", "WriteBack"]

# Spills a step starts at most: this many, plus two per block the step copies into the CPU
# tier, so that write-back keeps up with demotions while a step's host work grows with the
# step's own copies, never with the tier (a backlog is written over the next steps, idle ones
# included).
MIN_SPILLS_PER_STEP = 64
# Spills failing in a row (a full or read-only folder) turn write-back off for this engine.
MAX_SPILL_FAILURES = 8


class WriteBack:
    """Which dirty CPU slots to spill, and the spills' outcome (counted in `counters`)."""

    def __init__(self, index: TierIndex, counters: TierStats, costs: CostModel,
                 writeback_headroom: float) -> None:
        self._index = index
        self._counters = counters
        self._costs = costs
        # Cold CPU slots are written back to SSD until this many are free or clean (by default
        # all of them: write-through, in the background).
        self.headroom = max(1, int(writeback_headroom * index.cpu.num_slots))
        self.failures = 0  # in a row

    def need(self) -> int:
        """How many dirty CPU slots to spill for `headroom` free or clean ones (0: none can
        be, or write-back is off)."""
        index = self._index
        cpu = index.cpu
        if not index.ssd.capacity or self.failures >= MAX_SPILL_FAILURES \
                or not cpu.num_evictable_dirty:
            return 0
        room = cpu.num_free + cpu.num_clean + index.num_in_flight(CopyKind.CPU_TO_SSD)
        return max(self.headroom - room, 0)

    def start(self, step: StepCopies) -> None:
        """Spills the coldest dirty CPU slots, in `step`, until `headroom` slots are free or
        clean (at most the step's bound)."""
        need = min(self.need(), MIN_SPILLS_PER_STEP + 2 * len(step.fills))
        if need <= 0:
            return
        index = self._index
        cpu, ssd = index.cpu, index.ssd
        for slot in cpu.coldest_dirty(need):
            if ssd.find(slot.block_hash) is not None:
                cpu.mark_clean(slot)  # already in the folder (this engine's or another's)
                continue
            entry, forgotten = ssd.start_write(slot.block_hash, slot.hash_key, slot.tenant)
            if entry is None:
                return
            for block_hash in forgotten:
                self._counters.ssd_dropped += 1
                cpu.mark_dirty(block_hash)
            cpu.pin(slot)
            step.started.append(index.start(CopyKind.CPU_TO_SSD, slot, entry, slot.hash_key))

    def completed(self, copy: AsyncCopy, ok: bool) -> None:
        """The spill is done: on success the entry is served and the slot is clean."""
        cpu, ssd = self._index.cpu, self._index.ssd
        cpu.unpin(copy.slot)
        if ok:
            ssd.commit(copy.entry)
            slot = copy.slot
            if slot.state == SlotState.READY and slot.block_hash == copy.entry.block_hash:
                cpu.mark_clean(slot)
            self._counters.spills += 1
            self._counters.bytes_copied += self._costs.block_bytes
            self.failures = 0
        else:
            ssd.void(copy.entry)
            self._counters.spill_failures += 1
            self.failures += 1

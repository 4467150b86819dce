"""The tier index: where a block's KV lives below the device pool, and which copies fill or read it.

The only record of per-block tier state. It decides nothing (kvcache/tier_policy.py does); it
answers lookups and keeps its structures consistent as the policy moves blocks. Its parts:

  CpuTier   (kvcache/tier_cpu.py) a fixed array of slots whose ids mean the same place on every
            TP rank, like block ids, each FREE, FILLING or READY; cached (hit by hash) or owned
            by one swapped-out request. Its eviction order is kvcache/tier_cpu_eviction.py's.
  SsdTier   (kvcache/tier_ssd_record.py) the blocks this engine knows to be in the shared SSD
            folder, by block hash (no ids: the folder's entries are content-addressed files).
  in flight (here) the asynchronous copies (SSD -> CPU loads, CPU -> SSD spills), per kind in
            issue order, each with a sequence number of its kind.
The records they hold (CpuSlot, SsdEntry, AsyncCopy) are kvcache/tier_records.py's.

Eviction order in the CPU tier is two LRUs of evictable slots (READY, cached, no copy reading
it): clean ones (also on SSD: dropping them loses nothing) go first, coldest first, then dirty
ones. Tenants with a share (kvcache/tenants.py `share_of`: the same `@SHARE` in the cache salt
that caps the device pool) come before that rule, in each tier (`TierShares`): when a slot or an
SSD record entry must go to make room, the allocating tenant's own coldest goes first if it
holds its share or more, else the coldest of a tenant holding more than its share; only then the
plain LRU rule. So a tenant flooding the tiers pushes out its own blocks, not others'. Every
operation is O(1) in the tier's size (check_integrity, clear and drop_worker_memory excepted):
host work per step does not grow with the tiers.

KV events (kvcache/events.py): with a recorder given to `record_events`, each tier reports the
hashes it starts and stops holding (CPU: indexed and READY; SSD: recorded and READY), from
the few places where that changes (each tier's `_report`).

drop_worker_memory() is what a worker rebuild needs: the CPU slots and the copies in flight
lived in the dead workers' memory and are forgotten; the SSD record is kept (its files outlive
the workers).
"""
from __future__ import annotations

from collections import deque
from typing import Iterable

from tierserve.kvcache.block import BlockHash
from tierserve.kvcache.events import KVEventRecorder
from tierserve.kvcache.tier_cpu import CpuTier
from tierserve.kvcache.tier_records import (
    ASYNC_KINDS, AsyncCopy, CopyKind, CpuSlot, SlotState, SsdEntry,
)
from tierserve.kvcache.tier_ssd_record import SsdProbe, SsdTier

__all__ = ["SlotState", "CopyKind", "ASYNC_KINDS", "CpuSlot", "CpuTier", "SsdEntry", "SsdTier",
           "AsyncCopy", "TierIndex"]


class TierIndex:
    """The CPU tier, the SSD record, and the asynchronous copies in flight between them."""

    def __init__(self, cpu_slots: int = 0, ssd_blocks: int = 0, *,
                 ssd_probe: SsdProbe | None = None, verify_hits: bool = True) -> None:
        if ssd_blocks and not cpu_slots:
            raise ValueError("an SSD tier needs a CPU tier: SSD blocks go through it")
        self.cpu = CpuTier(cpu_slots, verify_hits)
        self.ssd = SsdTier(ssd_blocks, ssd_probe, verify_hits)
        self._next_seq = {kind: 0 for kind in ASYNC_KINDS}
        # Per kind, in seq order: the workers complete each kind in issue order.
        self._in_flight: dict[CopyKind, deque[AsyncCopy]] = {k: deque() for k in ASYNC_KINDS}
        self._loads: dict[BlockHash, AsyncCopy] = {}  # loads in flight, by block hash

    @property
    def enabled(self) -> bool:
        return bool(self.cpu.slots)

    def record_events(self, recorder: KVEventRecorder | None) -> None:
        """The KV-event hook: both tiers report the hashes they start and stop holding to
        `recorder` (None: to nobody)."""
        self.cpu.events = self.ssd.events = recorder

    def held_hashes(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """(CPU, SSD) hashes held now: a KV-event snapshot's lower tiers."""
        return self.cpu.held_hashes(), self.ssd.held_hashes()

    def num_in_flight(self, kind: CopyKind) -> int:
        return len(self._in_flight[kind])

    def in_flight(self, kind: CopyKind) -> Iterable[AsyncCopy]:
        """The copies of `kind` in flight, in issue order."""
        return self._in_flight[kind]

    def has_in_flight(self) -> bool:
        return any(self._in_flight.values())

    def load_of(self, block_hash: BlockHash) -> AsyncCopy | None:
        return self._loads.get(block_hash)

    def start(self, kind: CopyKind, slot: CpuSlot, entry: SsdEntry,
              key: bytes | None) -> AsyncCopy:
        """Records an asynchronous copy: a load fills `slot` from `entry` (both pinned or
        filling), a spill fills `entry` from `slot`."""
        copy = AsyncCopy(kind, self._next_seq[kind], slot, entry, key)
        self._next_seq[kind] += 1
        self._in_flight[kind].append(copy)
        if kind == CopyKind.SSD_TO_CPU:
            self._loads[entry.block_hash] = copy
        return copy

    def completed(self, kind: CopyKind, upto: int) -> list[AsyncCopy]:
        """Removes and returns the copies of `kind` with seq < upto (issue order)."""
        queue, done = self._in_flight[kind], []
        while queue and queue[0].seq < upto:
            copy = queue.popleft()
            if kind == CopyKind.SSD_TO_CPU and self._loads.get(copy.entry.block_hash) is copy:
                del self._loads[copy.entry.block_hash]
            done.append(copy)
        return done

    def drop_worker_memory(self) -> list[AsyncCopy]:
        """The workers died: their CPU slots and the copies in flight are gone; the SSD record
        stays (entries whose spill was in flight are forgotten). Returns the dropped copies.
        Sequence numbers restart at 0, as the rebuilt workers' queues do."""
        dropped = [c for queue in self._in_flight.values() for c in queue]
        for queue in self._in_flight.values():
            queue.clear()
        self._loads.clear()
        self._next_seq = {kind: 0 for kind in ASYNC_KINDS}
        self.cpu.drop_all()
        self.ssd.drop_in_flight()
        return dropped

    def check_integrity(self) -> None:
        self.cpu.check_integrity()
        self.ssd.check_integrity()
        for kind, queue in self._in_flight.items():
            seqs = [c.seq for c in queue]
            assert seqs == sorted(seqs) and all(s < self._next_seq[kind] for s in seqs)
            for copy in queue:
                if kind == CopyKind.SSD_TO_CPU:
                    assert copy.slot.state == SlotState.FILLING and copy.entry.readers > 0
                else:
                    assert copy.slot.readers > 0 and copy.entry.state == SlotState.FILLING

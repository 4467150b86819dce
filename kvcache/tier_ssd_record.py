"""The SSD tier's record: the blocks this engine knows to be in the SSD folder, by block hash,
coldest first, and the KV events of the hashes it starts and stops holding.

The folder (workers/tier_ssd.py) is shared by every engine on it and its entries are
content-addressed files, so there are no ids: a hash the record lacks is probed in the folder
(an entry another engine wrote is learnt on a miss). The record is bounded by the folder's
capacity; forgetting a hash deletes nothing. A tenant's share (`TierShares`) is of this record,
not of the folder.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from tierserve.kvcache.block import BlockHash
from tierserve.kvcache.events import KVEventRecorder, KVTier
from tierserve.kvcache.tenants import TierShares
from tierserve.kvcache.tier_records import SlotState, SsdEntry

__all__ = ["SsdProbe", "SsdTier"]

# Says whether the folder holds a block (every head range an engine's ranks need).
SsdProbe = Callable[[BlockHash], bool]


def _idle(entry: SsdEntry) -> bool:
    return not entry.busy


class SsdTier:
    """The blocks this engine knows to be in the shared SSD folder, coldest first."""

    def __init__(self, capacity: int, probe: SsdProbe | None = None,
                 verify_hits: bool = True) -> None:
        if capacity < 0:
            raise ValueError(f"the SSD tier's capacity must be >= 0 blocks, got {capacity}")
        self.capacity = capacity
        self.verify_hits = verify_hits
        self._probe = probe if capacity else None
        self._entries: OrderedDict[BlockHash, SsdEntry] = OrderedDict()
        self.num_collisions = 0
        self.num_found = 0  # hashes learnt from the folder on a miss
        self.events: KVEventRecorder | None = None
        # The record's entries per tenant with a share, busy or not, coldest first: a share is
        # of this record (what this engine accounts for), not of the shared folder.
        self.shares = TierShares(capacity)

    def __len__(self) -> int:
        return len(self._entries)

    def usage(self) -> float:
        return len(self._entries) / self.capacity if self.capacity else 0.0

    def lookup(self, block_hash: BlockHash, key: bytes | None, tenant: str | None = None
               ) -> SsdEntry | None:
        """The READY entry of this hash: known, or found in the folder now (for `tenant`)."""
        entry = self._entries.get(block_hash)
        if entry is None:
            entry = self.find(block_hash, tenant)
        if entry is None or entry.state != SlotState.READY:
            return None
        if self.verify_hits and entry.hash_key is not None and entry.hash_key != key:
            self.num_collisions += 1
            return None
        return entry

    def find(self, block_hash: BlockHash, tenant: str | None = None) -> SsdEntry | None:
        """The known entry of this hash, else (probing the folder) one another engine wrote,
        then recorded as `tenant`'s: the hash carries the salt, so it is that tenant's block."""
        entry = self._entries.get(block_hash)
        if entry is not None or self._probe is None or not self._probe(block_hash):
            return entry
        self.num_found += 1
        return self._add(SsdEntry(block_hash, tenant=self.shares.tracked(tenant)))

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self._entries

    def touch(self, entry: SsdEntry) -> None:
        if entry.block_hash in self._entries:
            self._entries.move_to_end(entry.block_hash)
            if entry.tenant is not None:
                self.shares.touch(entry.tenant, 0, entry.block_hash)

    def start_write(self, block_hash: BlockHash, key: bytes | None, tenant: str | None = None
                    ) -> tuple[SsdEntry | None, list[BlockHash]]:
        """A FILLING entry for a spill of `tenant`'s block, and the hashes the record forgot
        to make room; (None, []) when the record is full of entries in use."""
        if not self.capacity:
            return None, []
        tenant = self.shares.tracked(tenant)
        forgotten = self._make_room(tenant)
        if forgotten is None:
            return None, []
        entry = SsdEntry(block_hash, key, SlotState.FILLING, tenant=tenant)
        return self._add(entry), forgotten

    def commit(self, entry: SsdEntry) -> None:
        assert entry.state == SlotState.FILLING
        entry.state = SlotState.READY
        if entry.release_pending:
            self._maybe_forget(entry)
        elif self._entries.get(entry.block_hash) is entry:
            self._report(entry.block_hash, True)

    def void(self, entry: SsdEntry) -> None:
        """A copy of the entry failed (written or read): never served again."""
        self._unrecord(entry)
        entry.state = SlotState.READY
        self.release(entry)

    def release(self, entry: SsdEntry) -> None:
        """Forgets the entry (once no copy uses it); the file is the folder's to delete."""
        self._unrecord(entry)
        entry.release_pending = True
        self._maybe_forget(entry)

    def held_hashes(self) -> list[BlockHash]:
        """Every hash the record holds (a KV-event snapshot)."""
        return [h for h, e in self._entries.items() if e.state == SlotState.READY]

    def pin(self, entry: SsdEntry) -> None:
        entry.readers += 1

    def unpin(self, entry: SsdEntry) -> None:
        assert entry.readers > 0
        entry.readers -= 1
        if entry.release_pending:
            self._maybe_forget(entry)

    def clear(self) -> None:
        """Forgets every idle entry (reset_prefix_cache); the shared folder keeps them."""
        for entry in [e for e in self._entries.values() if not e.busy]:
            self.release(entry)

    def drop_in_flight(self) -> None:
        """Entries whose spill was in flight may or may not be whole: forgotten. Loads in
        flight are gone: no entry is read."""
        for entry in list(self._entries.values()):
            entry.readers = 0
            if entry.state == SlotState.FILLING:
                self.void(entry)

    # ---------------------------------------------------------------- internals

    def _add(self, entry: SsdEntry) -> SsdEntry:
        self._entries[entry.block_hash] = entry
        if entry.tenant is not None:
            self.shares.hold(entry.tenant)
            self.shares.add(entry.tenant, 0, entry.block_hash, entry)
        if entry.state == SlotState.READY:
            self._report(entry.block_hash, True)
        return entry

    def _unrecord(self, entry: SsdEntry) -> None:
        if self._entries.get(entry.block_hash) is entry:
            del self._entries[entry.block_hash]
            if entry.tenant is not None:
                self.shares.remove(entry.tenant, 0, entry.block_hash)
                self.shares.drop(entry.tenant)
            if entry.state == SlotState.READY:
                self._report(entry.block_hash, False)

    def _make_room(self, tenant: str | None) -> list[BlockHash] | None:
        """Forgets an idle entry if the record is full (the one `TierShares.victim` names for
        `tenant`, else the coldest); None if none can go."""
        if len(self._entries) < self.capacity:
            return []
        victim = self.shares.victim(tenant, _idle) if self.shares.lanes else None
        if victim is None:
            victim = next((e for e in self._entries.values() if not e.busy), None)
            if victim is None:
                return None
        self.release(victim)
        return [victim.block_hash]

    def _maybe_forget(self, entry: SsdEntry) -> None:
        if not entry.busy:
            entry.release_pending = False

    def _report(self, block_hash: BlockHash, held: bool) -> None:
        """The record starts (or stops) holding the hash: a KV event."""
        if self.events is not None:
            (self.events.stored if held else self.events.removed)(KVTier.SSD, block_hash)

    # ---------------------------------------------------------------- integrity

    def check_integrity(self) -> None:
        assert len(self._entries) <= self.capacity
        held: dict[str, int] = {}
        lanes: dict[str, list[list[BlockHash]]] = {}
        for block_hash, entry in self._entries.items():
            assert entry.block_hash == block_hash and not entry.release_pending
            if entry.tenant is not None:
                assert self.shares.cap(entry.tenant) is not None
                held[entry.tenant] = held.get(entry.tenant, 0) + 1
                lanes.setdefault(entry.tenant, [[]])[0].append(block_hash)
        self.shares.check(held, lanes)

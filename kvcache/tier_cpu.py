"""The CPU tier: a fixed array of slots whose ids mean the same place on every TP rank, like
block ids, their free list and their hash map, and the KV events of the hashes it starts and
stops holding. The order in which evictable slots go is kvcache/tier_cpu_eviction.py's.

A slot is FREE, FILLING (a copy into it is in flight) or READY. A READY slot is cached (in the
hash map, evictable when no copy reads it) or owned by one swapped-out request (private, never
hit). A slot that a copy reads (pinned) or fills is never reused or freed; a release asked for
meanwhile happens when the last such copy completes. Every operation is O(1) in the number of
slots (check_integrity, cached_slots, held_hashes, clear and drop_all excepted).
"""
from __future__ import annotations

from tierserve.kvcache.block import BlockHash
from tierserve.kvcache.events import KVEventRecorder, KVTier
from tierserve.kvcache.tenants import TierShares
from tierserve.kvcache.tier_cpu_eviction import CpuEvictionOrder
from tierserve.kvcache.tier_records import CpuSlot, SlotState

__all__ = ["CpuTier"]


class CpuTier:
    """The CPU tier's slots, hash map and eviction order."""

    def __init__(self, num_slots: int, verify_hits: bool = True) -> None:
        if num_slots < 0:
            raise ValueError(f"the CPU tier's size must be >= 0, got {num_slots}")
        self.verify_hits = verify_hits
        self.slots = [CpuSlot(i) for i in range(num_slots)]
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() gives slot 0 first
        self._index: dict[BlockHash, CpuSlot] = {}
        self.num_clean = 0  # READY cached clean slots, busy or not
        self.num_collisions = 0
        self.events: KVEventRecorder | None = None
        # Indexed slots per tenant with a share, and its evictable ones (lane 0 clean, 1 dirty).
        self.shares = TierShares(num_slots, num_lanes=2)
        # Evictable slots (READY, cached, not busy, kept).
        self._evictable = CpuEvictionOrder(self.shares)

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_slots if self.slots else 0.0

    @property
    def num_evictable_dirty(self) -> int:
        return self._evictable.num_dirty

    def available(self) -> int:
        """Slots `allocate` could hand out now: free ones and evictable cached ones."""
        return len(self._free) + len(self._evictable)

    def lookup(self, block_hash: BlockHash, key: bytes | None) -> CpuSlot | None:
        """The READY cached slot of this hash (its stored key equal to `key` when verifying)."""
        slot = self._index.get(block_hash)
        if slot is None or slot.state != SlotState.READY:
            return None
        if self.verify_hits and slot.hash_key != key:
            self.num_collisions += 1
            return None
        return slot

    def get(self, block_hash: BlockHash) -> CpuSlot | None:
        """The slot indexed under this hash, READY or filling."""
        return self._index.get(block_hash)

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self._index

    def touch(self, slot: CpuSlot) -> None:
        """A hit: the slot becomes the hottest of its LRU."""
        self._evictable.touch(slot)

    def allocate(self, block_hash: BlockHash | None, key: bytes | None, owner: str | None = None,
                 tenant: str | None = None
                 ) -> tuple[CpuSlot | None, tuple[BlockHash, bool] | None]:
        """A slot to copy into, FILLING, for `tenant`'s block: a free one, else the slot
        `TierShares.victim` names, else the coldest evictable one (clean first). Returns
        (slot, evicted), `evicted` the dropped slot's (hash, clean), or (None, None) when
        every slot is busy or owned."""
        evicted = None
        tenant = self.shares.tracked(tenant) if owner is None and block_hash is not None \
            else None
        if self._free:
            slot = self.slots[self._free.pop()]
        else:
            slot = self._evictable.victim(tenant)
            if slot is None:
                return None, None
            evicted = (slot.block_hash, slot.clean)
            self._unindex(slot)
            self._set_clean(slot, False)
        slot.state = SlotState.FILLING
        slot.block_hash, slot.hash_key, slot.owner = block_hash, key, owner
        slot.tenant = tenant
        if owner is None and block_hash is not None:
            # Indexed at once, so that a second copy of the same block is never started; a
            # lookup sees it only when READY.
            self._index[block_hash] = slot
            if tenant is not None:
                self.shares.hold(tenant)
        return slot, evicted

    def commit(self, slot: CpuSlot, clean: bool = False) -> None:
        """FILLING -> READY: a cached slot becomes evictable, the hottest."""
        assert slot.state == SlotState.FILLING, f"cpu slot {slot.slot} is not filling"
        slot.state = SlotState.READY
        if slot.release_pending:
            self._maybe_free(slot)
            return
        if self._index.get(slot.block_hash) is slot:
            self._report(slot.block_hash, True)
        self._set_clean(slot, clean)
        self._settle(slot)

    def void(self, slot: CpuSlot) -> None:
        """A copy into the slot failed: it is freed (once nothing else uses it)."""
        assert slot.state == SlotState.FILLING
        self._unindex(slot)  # while FILLING: it never held the block
        slot.state = SlotState.READY
        self.release(slot)

    def release(self, slot: CpuSlot) -> bool:
        """Frees the slot now, or (while a copy reads or fills it) when the copy completes;
        True when it was freed now."""
        if slot.state == SlotState.FREE:
            return True
        self._unindex(slot)  # no lookup finds it from now on
        self._set_clean(slot, False)
        if slot.busy:
            slot.release_pending = True
            return False
        self._free_slot(slot)
        return True

    def pin(self, slot: CpuSlot) -> None:
        """A copy (or a request waiting to be admitted) reads the slot: not evictable."""
        slot.readers += 1
        self._evictable.leave(slot)

    def unpin(self, slot: CpuSlot) -> None:
        assert slot.readers > 0, f"cpu slot {slot.slot} unpinned too often"
        slot.readers -= 1
        if slot.release_pending:
            self._maybe_free(slot)
        elif not slot.busy:
            self._settle(slot)  # evictable again, as the hottest: it was just used

    def mark_clean(self, slot: CpuSlot) -> None:
        """The slot's block is also on SSD."""
        if slot.state == SlotState.READY and slot.cached and not slot.clean:
            self._reclassify(slot, True)

    def mark_dirty(self, block_hash: BlockHash) -> None:
        """The SSD copy of this hash is gone: a CPU copy of it is the only one."""
        slot = self._index.get(block_hash)
        if slot is not None and slot.clean:
            self._reclassify(slot, False)

    def coldest_dirty(self, n: int) -> list[CpuSlot]:
        """Up to n evictable dirty slots, coldest first (write-back candidates)."""
        return self._evictable.coldest_dirty(n)

    def eviction_order(self) -> list[int]:
        """Evictable slot ids in the order `allocate` takes them (tests)."""
        return self._evictable.order()

    def cached_slots(self) -> list[CpuSlot]:
        """Every READY cached slot, busy or not (a shutdown's flush; O(size))."""
        return [s for s in self._index.values() if s.state == SlotState.READY]

    def held_hashes(self) -> list[BlockHash]:
        """Every hash the tier holds (a KV-event snapshot)."""
        return [h for h, s in self._index.items() if s.state == SlotState.READY]

    def clear(self) -> None:
        """Drops every evictable slot (reset_prefix_cache); busy ones stay."""
        for slot in self._evictable.slots():
            self.release(slot)

    def drop_all(self) -> None:
        """Every slot FREE, copies and pins or not: the memory holding them is gone."""
        for block_hash, slot in self._index.items():
            if slot.state == SlotState.READY:
                self._report(block_hash, False)
        for slot in self.slots:
            slot.readers = 0
            if slot.state != SlotState.FREE:
                slot.release_pending = False
                self._free_slot(slot)
        self._index.clear()
        self._evictable.clear()
        self.shares.clear()
        self.num_clean = 0

    # ---------------------------------------------------------------- internals

    def _set_clean(self, slot: CpuSlot, clean: bool) -> None:
        counted = slot.clean and slot.state == SlotState.READY and slot.cached
        slot.clean = clean
        now = clean and slot.state == SlotState.READY and slot.cached
        self.num_clean += now - counted

    def _reclassify(self, slot: CpuSlot, clean: bool) -> None:
        """Moves the slot to the other LRU (as its hottest) if it was evictable."""
        in_lru = self._evictable.leave(slot)
        self._set_clean(slot, clean)
        if in_lru:
            self._settle(slot)

    def _settle(self, slot: CpuSlot) -> None:
        """Enters an idle READY cached slot in its LRU as the hottest."""
        if slot.state == SlotState.READY and slot.cached and not slot.busy:
            self._evictable.enter(slot)

    def _maybe_free(self, slot: CpuSlot) -> None:
        if not slot.busy:
            self._free_slot(slot)

    def _free_slot(self, slot: CpuSlot) -> None:
        self._set_clean(slot, False)
        slot.state = SlotState.FREE
        slot.block_hash = slot.hash_key = slot.owner = slot.tenant = None
        slot.release_pending = False
        self._free.append(slot.slot)

    def _unindex(self, slot: CpuSlot) -> None:
        if slot.block_hash is not None and self._index.get(slot.block_hash) is slot:
            del self._index[slot.block_hash]
            if slot.tenant is not None:
                self.shares.drop(slot.tenant)
            if slot.state == SlotState.READY:
                self._report(slot.block_hash, False)
        self._evictable.leave(slot)

    def _report(self, block_hash: BlockHash, held: bool) -> None:
        """The tier starts (or stops) holding the hash: a KV event."""
        if self.events is not None:
            (self.events.stored if held else self.events.removed)(KVTier.CPU, block_hash)

    # ---------------------------------------------------------------- integrity

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "cpu tier: a slot is free twice"
        num_clean = 0
        for slot in self.slots:
            self._check_slot(slot, free)
            num_clean += slot.clean and slot.state == SlotState.READY and slot.cached
        assert num_clean == self.num_clean, f"cpu tier: {self.num_clean} clean counted, " \
                                            f"{num_clean} found"
        for block_hash, slot in self._index.items():
            assert slot.block_hash == block_hash and slot.owner is None
            assert slot.state in (SlotState.FILLING, SlotState.READY)
        self._check_shares()

    def _check_slot(self, slot: CpuSlot, free: set[int]) -> None:
        assert (slot.state == SlotState.FREE) == (slot.slot in free), (
            f"cpu slot {slot.slot}: free list and state disagree")
        if slot.state == SlotState.FREE:
            assert slot.readers == 0 and slot.block_hash is None and slot.owner is None
            assert not slot.clean
        evictable = (slot.state == SlotState.READY and slot.cached and not slot.busy
                     and not slot.release_pending)
        in_lru = self._evictable.contains(slot.slot, slot.clean)
        assert in_lru == evictable, f"cpu slot {slot.slot}: in an LRU iff evictable"
        assert not self._evictable.contains(slot.slot, not slot.clean)
        if slot.release_pending:
            assert slot.busy and self._index.get(slot.block_hash) is not slot

    def _check_shares(self) -> None:
        held: dict[str, int] = {}
        for slot in self._index.values():
            if slot.tenant is not None:
                assert self.shares.cap(slot.tenant) is not None
                held[slot.tenant] = held.get(slot.tenant, 0) + 1
        lanes = self._evictable.tenant_lanes()
        for slot in self.slots:
            assert slot.tenant is None or slot.cached, f"cpu slot {slot.slot}: a private tenant"
        self.shares.check(held, lanes)

"""The CPU tier's eviction order: its evictable slots (READY, cached, no copy reading them) in
two LRUs, clean ones (also on SSD: dropping them loses nothing) before dirty ones, each coldest
first; and the same slots, per tenant with a share, in the tier's `TierShares` lanes (lane 0
clean, lane 1 dirty), which name the victim before the plain LRU rule does. Every operation is
O(1) but `slots` and `tenant_lanes` (O(evictable slots)).
"""
from __future__ import annotations

from collections import OrderedDict

from tierserve.kvcache.tenants import TierShares
from tierserve.kvcache.tier_records import CpuSlot

__all__ = ["CpuEvictionOrder"]


class CpuEvictionOrder:
    """Which evictable CPU slot goes first. The CPU tier says when a slot enters or leaves."""

    def __init__(self, shares: TierShares) -> None:
        self._shares = shares  # the tier's: it also counts the slots each tenant has indexed
        self._clean: OrderedDict[int, CpuSlot] = OrderedDict()
        self._dirty: OrderedDict[int, CpuSlot] = OrderedDict()

    def __len__(self) -> int:
        return len(self._clean) + len(self._dirty)

    @property
    def num_dirty(self) -> int:
        return len(self._dirty)

    def _lru(self, clean: bool) -> OrderedDict[int, CpuSlot]:
        return self._clean if clean else self._dirty

    def contains(self, slot_id: int, clean: bool) -> bool:
        """Whether the slot is in the clean (or the dirty) LRU."""
        return slot_id in self._lru(clean)

    def enter(self, slot: CpuSlot) -> None:
        """The slot becomes evictable, the hottest of its LRU."""
        self._lru(slot.clean)[slot.slot] = slot
        if slot.tenant is not None:
            self._shares.add(slot.tenant, not slot.clean, slot.slot, slot)

    def leave(self, slot: CpuSlot) -> bool:
        """The slot is not evictable (any more); True if it was."""
        if self._lru(slot.clean).pop(slot.slot, None) is None:
            return False
        if slot.tenant is not None:
            self._shares.remove(slot.tenant, not slot.clean, slot.slot)
        return True

    def touch(self, slot: CpuSlot) -> None:
        """A hit: an evictable slot becomes the hottest of its LRU."""
        lru = self._lru(slot.clean)
        if slot.slot in lru:
            lru.move_to_end(slot.slot)
            if slot.tenant is not None:
                self._shares.touch(slot.tenant, not slot.clean, slot.slot)

    def victim(self, tenant: str | None) -> CpuSlot | None:
        """The slot to evict for `tenant`'s block: the one `TierShares.victim` names, else the
        coldest (clean first); None when no slot is evictable. It stays in the order."""
        slot = self._shares.victim(tenant) if self._shares.lanes else None
        if slot is None:
            lru = self._clean or self._dirty
            if not lru:
                return None
            slot = next(iter(lru.values()))
        return slot

    def coldest_dirty(self, n: int) -> list[CpuSlot]:
        """Up to n evictable dirty slots, coldest first (write-back candidates)."""
        out = []
        for slot in self._dirty.values():
            if len(out) == n:
                break
            out.append(slot)
        return out

    def order(self) -> list[int]:
        """Evictable slot ids in the order `victim` takes them without shares."""
        return list(self._clean) + list(self._dirty)

    def slots(self) -> list[CpuSlot]:
        """Every evictable slot, clean ones first, coldest first (a copy: safe to release)."""
        return [*self._clean.values(), *self._dirty.values()]

    def clear(self) -> None:
        """Forgets every slot (the tier clears its shares itself)."""
        self._clean.clear()
        self._dirty.clear()

    def tenant_lanes(self) -> dict[str, list[list[int]]]:
        """Per tenant with a share, its evictable slot ids by lane, coldest first (integrity
        checks compare them with the shares' lanes)."""
        lanes: dict[str, list[list[int]]] = {}
        for lane, lru in enumerate((self._clean, self._dirty)):
            for slot in lru.values():
                if slot.tenant is not None:
                    lanes.setdefault(slot.tenant, [[], []])[lane].append(slot.slot)
        return lanes

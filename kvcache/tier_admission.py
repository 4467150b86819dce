"""Admission through the tiers: what the policy reads of a request (TieredRequest), a block of
its prefix found below the device pool (TierHit), what the tiers add to its admission
(TierAdmission), and the requests waiting for SSD loads before they can be admitted
(LoadWaits).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from tierserve.kvcache.block import BlockHash
from tierserve.kvcache.tier_cpu import CpuTier
from tierserve.kvcache.tier_records import AsyncCopy, CpuSlot, SsdEntry

__all__ = ["TieredRequest", "TierHit", "TierAdmission", "NO_ADMISSION", "LoadWaits"]


class TieredRequest(Protocol):
    """What the policy reads from a request (scheduler.Request satisfies it)."""

    request_id: str
    block_hashes: list[BlockHash]
    block_keys: list[bytes] | None
    cache_salt: str | None  # its tenant's share of each tier (kvcache/tenants.py)

    @property
    def num_tokens(self) -> int: ...


@dataclass(slots=True)
class TierHit:
    """One block of a prefix found below the device pool."""

    tier: str  # "cpu" or "ssd"
    slot: CpuSlot | SsdEntry
    key: bytes | None  # the request's hashed key of the block


@dataclass(slots=True)
class TierAdmission:
    """What the tiers add to a waiting request's admission."""

    cpu_hits: list[CpuSlot] = field(default_factory=list)  # pinned until promoted or refused
    wait: bool = False  # the request waits for SSD loads; admit others meanwhile
    defer: bool = False  # its SSD hits cannot load yet (no CPU slot free): try next step


# The answer of a policy with no tiers; never changed.
NO_ADMISSION = TierAdmission()


class LoadWaits:
    """The requests waiting for SSD loads: each one's loads in flight, by seq, and the CPU
    slots pinned for it (its CPU hits and load targets), so that what it waits for is still
    there when it is admitted. A load in flight names its waiters (AsyncCopy.waiters)."""

    def __init__(self, cpu: CpuTier) -> None:
        self._cpu = cpu
        self._requests: dict[str, TieredRequest] = {}
        self._loads_of: dict[str, dict[int, AsyncCopy]] = {}  # request -> its loads, by seq
        self._held: dict[str, list[CpuSlot]] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def ids(self) -> set[str]:
        return set(self._requests)

    def join(self, request_id: str, copy: AsyncCopy) -> None:
        """The request waits for this load (started for it or for another request)."""
        copy.waiters.add(request_id)
        self._loads_of.setdefault(request_id, {})[copy.seq] = copy

    def wait(self, req: TieredRequest, held: list[CpuSlot]) -> None:
        """The request waits for the loads it joined, holding these pinned slots (and any
        held for it already)."""
        self._held.setdefault(req.request_id, []).extend(held)
        self._requests[req.request_id] = req

    def release_held(self, request_id: str) -> None:
        """The slots held for the request are unpinned."""
        for slot in self._held.pop(request_id, ()):
            self._cpu.unpin(slot)

    def forget(self, request_id: str) -> None:
        """The request left: its loads go on, for the cache; its held slots are let go."""
        if self._requests.pop(request_id, None) is not None:
            self.release_held(request_id)
            for copy in self._loads_of.pop(request_id, {}).values():
                copy.waiters.discard(request_id)

    def loaded(self, copy: AsyncCopy) -> list[TieredRequest]:
        """The load completed (or failed): the waiting requests it was the last load of."""
        ready = []
        for rid in copy.waiters:
            mine = self._loads_of.get(rid)
            if mine is not None:
                mine.pop(copy.seq, None)
                if not mine:
                    del self._loads_of[rid]
                    ready.append(self._requests.pop(rid))
        return ready

    def clear(self) -> list[TieredRequest]:
        """Forgets every wait, pins included (the slots are gone); returns the requests."""
        waiting = list(self._requests.values())
        self._requests.clear()
        self._loads_of.clear()
        self._held.clear()
        return waiting

    def held_slots(self) -> list[CpuSlot]:
        return [s for held in self._held.values() for s in held]

    def check(self, load_seqs: set[int]) -> None:
        """Every waiting request waits on loads in flight (`load_seqs`), and only those."""
        assert set(self._loads_of) == set(self._requests), "requests waiting on no load"
        for rid, mine in self._loads_of.items():
            assert mine and set(mine) <= load_seqs, f"{rid}: stale loads"

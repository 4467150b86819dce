"""Swap preemption's record: the requests swapped out to CPU slots they own, and how many of
each one's tokens those slots hold. Whether a preempted request swaps is the policy's choice
(its preemption mode and CostModel).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tierserve.kvcache.tier_cpu import CpuTier
from tierserve.kvcache.tier_records import CpuSlot

__all__ = ["PREEMPTION_MODES", "SwappedRequests"]

PREEMPTION_MODES = ("auto", "recompute", "swap")


@dataclass(slots=True)
class _Swapped:
    slots: list[CpuSlot]
    num_tokens: int


class SwappedRequests:
    """The swapped-out requests, by id. Their slots stay theirs (never hit, never evicted)
    until they swap back in or leave."""

    def __init__(self, cpu: CpuTier) -> None:
        self._cpu = cpu
        self._swapped: dict[str, _Swapped] = {}

    def add(self, request_id: str, slots: list[CpuSlot], num_tokens: int) -> None:
        self._swapped[request_id] = _Swapped(slots, num_tokens)

    def tokens(self, request_id: str) -> int:
        """How many of the request's tokens its slots hold (0: not swapped out)."""
        swapped = self._swapped.get(request_id)
        return swapped.num_tokens if swapped is not None else 0

    def take(self, request_id: str) -> Sequence[CpuSlot]:
        """The slots of a request swapping back in, which is swapped out no more."""
        return self._swapped.pop(request_id).slots

    def release(self, request_id: str) -> None:
        """The request's swapped-out KV is given up: its slots are released (once any copy of
        them completes)."""
        swapped = self._swapped.pop(request_id, None)
        for slot in swapped.slots if swapped is not None else ():
            self._cpu.release(slot)

    def clear(self) -> None:
        """Forgets every swapped-out request (its slots are gone)."""
        self._swapped.clear()

    def check(self) -> None:
        for rid, swapped in self._swapped.items():
            assert all(s.owner == rid for s in swapped.slots), f"{rid}: a swapped slot changed"

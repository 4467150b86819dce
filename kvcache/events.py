"""KV events: which block hashes entered and left each tier of one engine.

A replica's router keeps, per tier, the set of block hashes the replica holds. The recorder
collects the net change of those sets between two `take()` calls (one batch per engine step):
a hash that entered and left within a batch is in neither list, one that left and came back is
in neither either. The owners of each tier's contents report to it:

  device  BlockPool: a hash enters when its first block is cached, leaves when its last cached
          block is evicted (several blocks may share a hash; the set holds it once)
  cpu/ssd the tier index: a hash enters when its slot becomes READY, leaves when it is dropped

Callers report transitions only (`stored` for a hash the tier did not hold, `removed` for one
it held), so the net change is exact. Torch-, Ray- and msgspec-free: the wire form of a batch
lives in scheduler/kv_events.py.
"""
from __future__ import annotations

import enum

from tierserve.kvcache.block import BlockHash

__all__ = ["KVTier", "KVEventRecorder", "NUM_TIERS"]


class KVTier(enum.IntEnum):
    """A tier's index in a batch's per-tier lists; lower is faster to serve a hit from."""

    DEVICE = 0
    CPU = 1
    SSD = 2


NUM_TIERS = len(KVTier)


class KVEventRecorder:
    __slots__ = ("_stored", "_removed")

    def __init__(self) -> None:
        # Insertion-ordered sets (dicts) per tier.
        self._stored: list[dict[BlockHash, None]] = [{} for _ in range(NUM_TIERS)]
        self._removed: list[dict[BlockHash, None]] = [{} for _ in range(NUM_TIERS)]

    def stored(self, tier: int, block_hash: BlockHash) -> None:
        """The tier did not hold the hash and now does."""
        removed = self._removed[tier]
        if block_hash in removed:
            del removed[block_hash]  # held before this batch, and again now: no change
        else:
            self._stored[tier][block_hash] = None

    def removed(self, tier: int, block_hash: BlockHash) -> None:
        """The tier held the hash and no longer does."""
        stored = self._stored[tier]
        if block_hash in stored:
            del stored[block_hash]  # entered within this batch: no change
        else:
            self._removed[tier][block_hash] = None

    def __bool__(self) -> bool:
        return any(self._stored) or any(self._removed)

    def take(self) -> tuple[list[list[BlockHash]], list[list[BlockHash]]]:
        """(stored, removed) per tier since the last take; the recorder starts empty again."""
        stored = [list(s) for s in self._stored]
        removed = [list(r) for r in self._removed]
        for d in self._stored:
            d.clear()
        for d in self._removed:
            d.clear()
        return stored, removed

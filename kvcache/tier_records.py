"""The KV tiers' records: a CPU slot, an SSD entry, an asynchronous copy between them, and the
states and kinds they carry. The tiers (kvcache/tier_cpu.py, kvcache/tier_ssd_record.py) and the
index (kvcache/tier_index.py) own and change them; the policy reads them.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tierserve.kvcache.block import BlockHash

__all__ = ["SlotState", "CopyKind", "ASYNC_KINDS", "CpuSlot", "SsdEntry", "AsyncCopy"]


class SlotState(enum.IntEnum):
    FREE = 0
    FILLING = 1
    READY = 2


class CopyKind(enum.IntEnum):
    """What one batch of tier copies moves (the wire carries it: scheduler/messages.py)."""

    DEVICE_TO_CPU = 1  # demote an evicted cached block; swap out a preempted request
    CPU_TO_DEVICE = 2  # promote a prefix hit; swap a request back in
    SSD_TO_CPU = 3  # load an SSD hit (asynchronous)
    CPU_TO_SSD = 4  # spill a cold CPU slot (asynchronous)
    DEVICE_TO_SSD = 5  # a clean shutdown's flush of the pool's cached blocks


# The asynchronous kinds, in the order a reply reports their progress (ModelRunnerOutput).
ASYNC_KINDS = (CopyKind.SSD_TO_CPU, CopyKind.CPU_TO_SSD)


@dataclass(slots=True, eq=False)
class CpuSlot:
    slot: int
    state: SlotState = SlotState.FREE
    block_hash: BlockHash | None = None
    hash_key: bytes | None = None
    readers: int = 0  # copies in flight (or held for a request) reading this slot
    owner: str | None = None  # the swapped-out request that owns it (then never hit)
    clean: bool = False  # also on SSD: dropping it loses nothing
    release_pending: bool = False  # free it when its copies complete
    tenant: str | None = None  # the tenant with a share that cached it (None: no share)

    @property
    def busy(self) -> bool:
        return self.readers > 0 or self.state == SlotState.FILLING

    @property
    def cached(self) -> bool:
        return self.owner is None and self.block_hash is not None


@dataclass(slots=True, eq=False)
class SsdEntry:
    block_hash: BlockHash
    # The hashed key the block was written with; None when learnt from the folder (the load
    # then checks the key the entry's header holds).
    hash_key: bytes | None = None
    state: SlotState = SlotState.READY
    readers: int = 0  # loads in flight
    release_pending: bool = False
    tenant: str | None = None  # the tenant with a share that wrote or found it (None: no share)

    @property
    def busy(self) -> bool:
        return self.readers > 0 or self.state == SlotState.FILLING


@dataclass(slots=True, eq=False)
class AsyncCopy:
    kind: CopyKind
    seq: int
    slot: CpuSlot  # filled (a load) or read (a spill)
    entry: SsdEntry  # read (a load) or filled (a spill)
    key: bytes | None  # the hashed key a load checks the entry against
    waiters: set[str] = field(default_factory=set)  # requests waiting for a load

"""The tier index: where a block's KV lives below the device pool, and which copies fill or read it.

The only record of per-block tier state. It decides nothing (kvcache/tier_policy.py does); it
answers lookups and keeps its structures consistent as the policy moves blocks.

  CpuTier   a fixed array of slots whose ids mean the same place on every TP rank, like block
            ids. A slot is FREE, FILLING (a copy into it is in flight) or READY. A READY slot is
            cached (in the hash map, evictable when no copy reads it) or owned by one
            swapped-out request (private, never hit). A slot that a copy reads (pinned) or
            fills is never reused or freed; a release asked for meanwhile happens when the last
            such copy completes.
  SsdTier   the blocks this engine knows to be in the SSD folder, by block hash. The folder is
            shared by every engine on it and its entries are content-addressed files, so there
            are no ids: a hash the record lacks is probed in the folder (an entry another
            engine wrote is learnt on a miss). The record is bounded by the folder's capacity;
            forgetting a hash deletes nothing.
  in flight the asynchronous copies (SSD -> CPU loads, CPU -> SSD spills), per kind in issue
            order, each with a sequence number of its kind.

Eviction order in the CPU tier is two LRUs of evictable slots (READY, cached, no copy reading
it): clean ones (also on SSD: dropping them loses nothing) go first, coldest first, then dirty
ones. Every operation is O(1) in the tier's size (check_integrity, clear and
drop_worker_memory excepted): host work per step does not grow with the tiers.

KV events (kvcache/events.py): with a recorder given to `record_events`, each tier reports the
hashes it starts and stops holding (CPU: indexed and READY; SSD: recorded and READY), from
the few places where that changes (`_report`).

drop_worker_memory() is what a worker rebuild needs: the CPU slots and the copies in flight
lived in the dead workers' memory and are forgotten; the SSD record is kept (its files outlive
the workers).
"""
from __future__ import annotations

import enum
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

from tierserve.kvcache.block import BlockHash
from tierserve.kvcache.events import KVEventRecorder, KVTier

__all__ = ["SlotState", "CopyKind", "ASYNC_KINDS", "CpuSlot", "CpuTier", "SsdEntry", "SsdTier",
           "AsyncCopy", "TierIndex"]


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

    @property
    def busy(self) -> bool:
        return self.readers > 0 or self.state == SlotState.FILLING

    @property
    def cached(self) -> bool:
        return self.owner is None and self.block_hash is not None


class CpuTier:
    """The CPU tier's slots, hash map and eviction order."""

    def __init__(self, num_slots: int, verify_hits: bool = True) -> None:
        if num_slots < 0:
            raise ValueError(f"the CPU tier's size must be >= 0, got {num_slots}")
        self.verify_hits = verify_hits
        self.slots = [CpuSlot(i) for i in range(num_slots)]
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() gives slot 0 first
        self._index: dict[BlockHash, CpuSlot] = {}
        # Evictable slots (READY, cached, not busy, kept), coldest first.
        self._clean: OrderedDict[int, CpuSlot] = OrderedDict()
        self._dirty: OrderedDict[int, CpuSlot] = OrderedDict()
        self.num_clean = 0  # READY cached clean slots, busy or not
        self.num_collisions = 0
        self.events: KVEventRecorder | None = None

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
        return len(self._dirty)

    def available(self) -> int:
        """Slots `allocate` could hand out now: free ones and evictable cached ones."""
        return len(self._free) + len(self._clean) + len(self._dirty)

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
        lru = self._clean if slot.clean else self._dirty
        if slot.slot in lru:
            lru.move_to_end(slot.slot)

    def allocate(self, block_hash: BlockHash | None, key: bytes | None, owner: str | None = None
                 ) -> tuple[CpuSlot | None, tuple[BlockHash, bool] | None]:
        """A slot to copy into, FILLING: a free one, else the coldest evictable one (clean
        first). Returns (slot, evicted), `evicted` the dropped slot's (hash, clean), or
        (None, None) when every slot is busy or owned."""
        evicted = None
        if self._free:
            slot = self.slots[self._free.pop()]
        else:
            lru = self._clean or self._dirty
            if not lru:
                return None, None
            _, slot = lru.popitem(last=False)
            evicted = (slot.block_hash, slot.clean)
            self._set_clean(slot, False)
            self._unindex(slot)
        slot.state = SlotState.FILLING
        slot.block_hash, slot.hash_key, slot.owner = block_hash, key, owner
        if owner is None and block_hash is not None:
            # Indexed at once, so that a second copy of the same block is never started; a
            # lookup sees it only when READY.
            self._index[block_hash] = slot
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
        (self._clean if slot.clean else self._dirty).pop(slot.slot, None)

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
            in_lru = self._dirty.pop(slot.slot, None) is not None
            self._set_clean(slot, True)
            if in_lru:
                self._clean[slot.slot] = slot

    def mark_dirty(self, block_hash: BlockHash) -> None:
        """The SSD copy of this hash is gone: a CPU copy of it is the only one."""
        slot = self._index.get(block_hash)
        if slot is not None and slot.clean:
            in_lru = self._clean.pop(slot.slot, None) is not None
            self._set_clean(slot, False)
            if in_lru:
                self._dirty[slot.slot] = slot

    def coldest_dirty(self, n: int) -> list[CpuSlot]:
        """Up to n evictable dirty slots, coldest first (write-back candidates)."""
        out = []
        for slot in self._dirty.values():
            if len(out) == n:
                break
            out.append(slot)
        return out

    def eviction_order(self) -> list[int]:
        """Evictable slot ids in the order `allocate` takes them (tests)."""
        return list(self._clean) + list(self._dirty)

    def cached_slots(self) -> list[CpuSlot]:
        """Every READY cached slot, busy or not (a shutdown's flush; O(size))."""
        return [s for s in self._index.values() if s.state == SlotState.READY]

    def clear(self) -> None:
        """Drops every evictable slot (reset_prefix_cache); busy ones stay."""
        for lru in (self._clean, self._dirty):
            for slot in list(lru.values()):
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
        self._clean.clear()
        self._dirty.clear()
        self.num_clean = 0

    # ---------------------------------------------------------------- internals

    def _set_clean(self, slot: CpuSlot, clean: bool) -> None:
        counted = slot.clean and slot.state == SlotState.READY and slot.cached
        slot.clean = clean
        now = clean and slot.state == SlotState.READY and slot.cached
        self.num_clean += now - counted

    def _settle(self, slot: CpuSlot) -> None:
        """Enters an idle READY cached slot in its LRU as the hottest."""
        if slot.state == SlotState.READY and slot.cached and not slot.busy:
            (self._clean if slot.clean else self._dirty)[slot.slot] = slot

    def _maybe_free(self, slot: CpuSlot) -> None:
        if not slot.busy:
            self._free_slot(slot)

    def _free_slot(self, slot: CpuSlot) -> None:
        self._set_clean(slot, False)
        slot.state = SlotState.FREE
        slot.block_hash = slot.hash_key = slot.owner = None
        slot.release_pending = False
        self._free.append(slot.slot)

    def _unindex(self, slot: CpuSlot) -> None:
        if slot.block_hash is not None and self._index.get(slot.block_hash) is slot:
            del self._index[slot.block_hash]
            if slot.state == SlotState.READY:
                self._report(slot.block_hash, False)
        self._clean.pop(slot.slot, None)
        self._dirty.pop(slot.slot, None)

    def _report(self, block_hash: BlockHash, held: bool) -> None:
        """The tier starts (or stops) holding the hash: a KV event."""
        if self.events is not None:
            (self.events.stored if held else self.events.removed)(KVTier.CPU, block_hash)

    def held_hashes(self) -> list[BlockHash]:
        """Every hash the tier holds (a KV-event snapshot)."""
        return [h for h, s in self._index.items() if s.state == SlotState.READY]

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "cpu tier: a slot is free twice"
        num_clean = 0
        for slot in self.slots:
            assert (slot.state == SlotState.FREE) == (slot.slot in free), (
                f"cpu slot {slot.slot}: free list and state disagree")
            if slot.state == SlotState.FREE:
                assert slot.readers == 0 and slot.block_hash is None and slot.owner is None
                assert not slot.clean
            evictable = (slot.state == SlotState.READY and slot.cached and not slot.busy
                         and not slot.release_pending)
            in_lru = slot.slot in (self._clean if slot.clean else self._dirty)
            assert in_lru == evictable, f"cpu slot {slot.slot}: in an LRU iff evictable"
            assert slot.slot not in (self._dirty if slot.clean else self._clean)
            if slot.release_pending:
                assert slot.busy and self._index.get(slot.block_hash) is not slot
            num_clean += slot.clean and slot.state == SlotState.READY and slot.cached
        assert num_clean == self.num_clean, f"cpu tier: {self.num_clean} clean counted, " \
                                            f"{num_clean} found"
        for block_hash, slot in self._index.items():
            assert slot.block_hash == block_hash and slot.owner is None
            assert slot.state in (SlotState.FILLING, SlotState.READY)


@dataclass(slots=True, eq=False)
class SsdEntry:
    block_hash: BlockHash
    # The hashed key the block was written with; None when learnt from the folder (the load
    # then checks the key the entry's header holds).
    hash_key: bytes | None = None
    state: SlotState = SlotState.READY
    readers: int = 0  # loads in flight
    release_pending: bool = False

    @property
    def busy(self) -> bool:
        return self.readers > 0 or self.state == SlotState.FILLING


# Says whether the folder holds a block (every head range an engine's ranks need).
SsdProbe = Callable[[BlockHash], bool]


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

    def __len__(self) -> int:
        return len(self._entries)

    def usage(self) -> float:
        return len(self._entries) / self.capacity if self.capacity else 0.0

    def lookup(self, block_hash: BlockHash, key: bytes | None) -> SsdEntry | None:
        """The READY entry of this hash: known, or found in the folder now."""
        entry = self._entries.get(block_hash)
        if entry is None:
            entry = self.find(block_hash)
        if entry is None or entry.state != SlotState.READY:
            return None
        if self.verify_hits and entry.hash_key is not None and entry.hash_key != key:
            self.num_collisions += 1
            return None
        return entry

    def find(self, block_hash: BlockHash) -> SsdEntry | None:
        """The known entry of this hash, else (probing the folder) one another engine wrote."""
        entry = self._entries.get(block_hash)
        if entry is not None or self._probe is None or not self._probe(block_hash):
            return entry
        self.num_found += 1
        return self._add(SsdEntry(block_hash))

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self._entries

    def touch(self, entry: SsdEntry) -> None:
        if entry.block_hash in self._entries:
            self._entries.move_to_end(entry.block_hash)

    def start_write(self, block_hash: BlockHash, key: bytes | None
                    ) -> tuple[SsdEntry | None, list[BlockHash]]:
        """A FILLING entry for a spill, and the hashes the record forgot to make room; (None,
        []) when the record is full of entries in use."""
        if not self.capacity:
            return None, []
        forgotten = self._make_room()
        if forgotten is None:
            return None, []
        return self._add(SsdEntry(block_hash, key, SlotState.FILLING)), forgotten

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

    def _unrecord(self, entry: SsdEntry) -> None:
        if self._entries.get(entry.block_hash) is entry:
            del self._entries[entry.block_hash]
            if entry.state == SlotState.READY:
                self._report(entry.block_hash, False)

    def _report(self, block_hash: BlockHash, held: bool) -> None:
        """The record starts (or stops) holding the hash: a KV event."""
        if self.events is not None:
            (self.events.stored if held else self.events.removed)(KVTier.SSD, block_hash)

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

    def _add(self, entry: SsdEntry) -> SsdEntry:
        self._entries[entry.block_hash] = entry
        if entry.state == SlotState.READY:
            self._report(entry.block_hash, True)
        return entry

    def _make_room(self) -> list[BlockHash] | None:
        """Forgets the coldest idle entries until one more fits; None if none can go."""
        forgotten = []
        if len(self._entries) < self.capacity:
            return forgotten
        for entry in self._entries.values():
            if not entry.busy:
                self.release(entry)
                forgotten.append(entry.block_hash)
                return forgotten
        return None

    def _maybe_forget(self, entry: SsdEntry) -> None:
        if not entry.busy:
            entry.release_pending = False

    def check_integrity(self) -> None:
        assert len(self._entries) <= self.capacity
        for block_hash, entry in self._entries.items():
            assert entry.block_hash == block_hash and not entry.release_pending


@dataclass(slots=True, eq=False)
class AsyncCopy:
    kind: CopyKind
    seq: int
    slot: CpuSlot  # filled (a load) or read (a spill)
    entry: SsdEntry  # read (a load) or filled (a spill)
    key: bytes | None  # the hashed key a load checks the entry against
    waiters: set[str] = field(default_factory=set)  # requests waiting for a load


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

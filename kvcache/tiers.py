"""The tier index: which block hashes live in the CPU and SSD tiers, and the copies between them.

Each tier is a fixed array of slots (CPU slots, SSD entries) whose ids mean the same place on
every TP rank, like block ids. A slot is FREE, FILLING (a copy into it is in flight) or READY
(its KV is in place). A READY slot is either cached (in the tier's hash map and LRU, evictable
when no copy reads it) or owned by one swapped-out request (private, never hit). Copies that
read a slot pin it (`readers`); a slot that is pinned or filling is never reused or freed: a
release asked for meanwhile happens when the last copy completes.

The TierManager decides every move, the workers only execute them:
  demote    device block -> CPU slot, when a cached device block is evicted (synchronous: done
            by the workers at the start of the step, before the block is rewritten)
  promote   CPU slot -> device block, for a prefix hit in the CPU tier (synchronous)
  load      SSD entry -> CPU slot, for a prefix hit on SSD (asynchronous: the request waits,
            the step goes on)
  spill     CPU slot -> SSD entry, writing back cold CPU slots so they can be dropped (async)
  swap      a preempted request's device blocks -> CPU slots it owns, and back on resume
Synchronous copies complete with the step that carries them; asynchronous ones carry a sequence
number of their kind (loads and spills count separately, and run on separate queues, so that a
load is never stuck behind a backlog of write-backs) and complete when the workers acknowledge
it (every rank, in issue order within the kind).
"""
from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from tierserve.kvcache.block import BlockHash

__all__ = ["SlotState", "TierSlot", "SlotTier", "TierManager", "TierHit", "TierStats",
           "AsyncCopy", "CopyKind", "StepCopies"]


class SlotState(enum.IntEnum):
    FREE = 0
    FILLING = 1
    READY = 2


@dataclass(slots=True, eq=False)
class TierSlot:
    slot: int
    state: SlotState = SlotState.FREE
    block_hash: BlockHash | None = None
    hash_key: bytes | None = None
    readers: int = 0  # in-flight copies reading this slot
    owner: str | None = None  # the swapped-out request that owns it (then never hit)
    clean: bool = False  # a CPU slot whose block is also on SSD: dropping it loses nothing
    release_pending: bool = False  # free it when its in-flight copies complete

    @property
    def busy(self) -> bool:
        return self.readers > 0 or self.state == SlotState.FILLING


class SlotTier:
    """One tier's slots, hash map and LRU (coldest first) of cached READY slots."""

    def __init__(self, name: str, num_slots: int, verify_hits: bool = True) -> None:
        if num_slots < 0:
            raise ValueError(f"{name} tier size must be >= 0, got {num_slots}")
        self.name = name
        self.verify_hits = verify_hits
        self.slots = [TierSlot(i) for i in range(num_slots)]
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() gives slot 0 first
        self._index: dict[BlockHash, TierSlot] = {}
        self._lru: OrderedDict[int, TierSlot] = OrderedDict()
        self.num_collisions = 0

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_slots if self.slots else 0.0

    def lookup(self, block_hash: BlockHash, key: bytes | None) -> TierSlot | None:
        """The READY cached slot of this hash (its stored key equal to `key` when verifying)."""
        slot = self._index.get(block_hash)
        if slot is None or slot.state != SlotState.READY:
            return None
        if self.verify_hits and slot.hash_key != key:
            self.num_collisions += 1
            return None
        return slot

    def contains(self, block_hash: BlockHash) -> bool:
        """Whether the hash has a slot here, READY or filling."""
        return block_hash in self._index

    def touch(self, slot: TierSlot) -> None:
        if slot.slot in self._lru:
            self._lru.move_to_end(slot.slot)

    def allocate(self, block_hash: BlockHash | None, key: bytes | None,
                 owner: str | None = None) -> tuple[TierSlot | None, TierSlot | None]:
        """A slot to copy into, FILLING: a free one, else the coldest evictable cached one
        (preferring a clean one). Returns (slot, evicted) where `evicted` is the dropped slot's
        former content (its hash and key on a detached TierSlot), or (None, None) when every
        slot is busy or owned."""
        evicted = None
        if self._free:
            slot = self.slots[self._free.pop()]
        else:
            slot = self._coldest_evictable()
            if slot is None:
                return None, None
            evicted = TierSlot(slot.slot, SlotState.READY, slot.block_hash, slot.hash_key,
                               clean=slot.clean)
            self._unindex(slot)
        slot.state = SlotState.FILLING
        slot.block_hash, slot.hash_key, slot.owner, slot.clean = block_hash, key, owner, False
        if owner is None and block_hash is not None:
            # Indexed at once, so that a second copy of the same block is never started; a
            # lookup sees it only when READY.
            self._index[block_hash] = slot
        return slot, evicted

    def available(self) -> int:
        """Slots `allocate` could hand out now: free ones and evictable cached ones."""
        return self.num_free + sum(1 for s in self._lru.values() if not s.busy)

    def _coldest_evictable(self) -> TierSlot | None:
        first_dirty = None
        for slot in self._lru.values():
            if slot.busy:
                continue
            if slot.clean:
                return slot
            if first_dirty is None:
                first_dirty = slot
        return first_dirty

    def commit(self, slot: TierSlot) -> None:
        """FILLING -> READY: a cached slot joins the LRU as the hottest."""
        assert slot.state == SlotState.FILLING, f"{self.name} slot {slot.slot} is not filling"
        slot.state = SlotState.READY
        if slot.release_pending:
            if not slot.busy:
                self.release(slot)
        elif slot.owner is None and slot.block_hash is not None:
            self._lru[slot.slot] = slot

    def release(self, slot: TierSlot) -> bool:
        """Frees the slot now, or (while a copy reads or fills it) when the copy completes;
        True when it was freed now."""
        if slot.state == SlotState.FREE:
            return True
        self._unindex(slot)  # no lookup finds it from now on
        if slot.busy:
            slot.release_pending = True
            return False
        slot.state = SlotState.FREE
        slot.block_hash = slot.hash_key = slot.owner = None
        slot.clean = slot.release_pending = False
        self._free.append(slot.slot)
        return True

    def pin(self, slot: TierSlot) -> None:
        slot.readers += 1

    def unpin(self, slot: TierSlot) -> None:
        assert slot.readers > 0, f"{self.name} slot {slot.slot} unpinned too often"
        slot.readers -= 1
        if slot.release_pending and not slot.busy:
            self.release(slot)

    def cached_slots(self) -> Iterable[TierSlot]:
        """READY cached slots, coldest first."""
        return list(self._lru.values())

    def coldest_ids(self) -> list[int]:
        return list(self._lru)

    def clear(self) -> list[TierSlot]:
        """Drops every cached slot that no copy uses; returns them (as they were)."""
        dropped = []
        for slot in list(self._lru.values()):
            if not slot.busy:
                dropped.append(TierSlot(slot.slot, slot.state, slot.block_hash, slot.hash_key))
                self.release(slot)
        return dropped

    def reset(self) -> None:
        """Every slot FREE and nothing indexed: the memory behind the tier is gone."""
        self.slots = [TierSlot(i) for i in range(self.num_slots)]
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._index.clear()
        self._lru.clear()

    def _unindex(self, slot: TierSlot) -> None:
        if slot.block_hash is not None and self._index.get(slot.block_hash) is slot:
            del self._index[slot.block_hash]
        self._lru.pop(slot.slot, None)

    def restore(self, slot_id: int, block_hash: BlockHash, key: bytes | None) -> bool:
        """Marks a slot READY and cached with a block found at start-up (SSD after a restart);
        False when the slot is taken or the hash already has one."""
        slot = self.slots[slot_id]
        if slot.state != SlotState.FREE or block_hash in self._index:
            return False
        self._free.remove(slot_id)
        slot.state, slot.block_hash, slot.hash_key = SlotState.READY, block_hash, key
        self._index[block_hash] = slot
        self._lru[slot_id] = slot
        return True

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), f"{self.name}: a slot is free twice"
        for slot in self.slots:
            assert (slot.state == SlotState.FREE) == (slot.slot in free), (
                f"{self.name} slot {slot.slot}: free list and state disagree")
            if slot.state == SlotState.FREE:
                assert slot.readers == 0 and slot.block_hash is None and slot.owner is None
            in_lru = slot.slot in self._lru
            assert in_lru == (slot.state == SlotState.READY and slot.owner is None
                              and slot.block_hash is not None and not slot.release_pending), (
                f"{self.name} slot {slot.slot}: in the LRU iff READY, cached and kept")
            if slot.release_pending:
                assert slot.busy and self._index.get(slot.block_hash) is not slot
        for block_hash, slot in self._index.items():
            assert slot.block_hash == block_hash and slot.owner is None
            assert slot.state in (SlotState.FILLING, SlotState.READY)


class CopyKind(enum.IntEnum):
    """Asynchronous copies (the synchronous device <-> CPU ones travel as plain id pairs)."""

    LOAD = 1  # SSD entry -> CPU slot
    SPILL = 2  # CPU slot -> SSD entry


@dataclass(slots=True)
class AsyncCopy:
    seq: int
    kind: CopyKind
    cpu_slot: int
    ssd_entry: int
    block_hash: BlockHash
    hash_key: bytes | None
    waiters: set[str] = field(default_factory=set)  # requests waiting for a LOAD


@dataclass(slots=True)
class StepCopies:
    """What one step asks of the workers, in execution order: swap-outs (device -> CPU),
    swap-ins (CPU -> device), then the asynchronous copies it starts."""

    out_blocks: list[int] = field(default_factory=list)
    out_slots: list[int] = field(default_factory=list)
    in_slots: list[int] = field(default_factory=list)
    in_blocks: list[int] = field(default_factory=list)
    started: list[AsyncCopy] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.out_blocks or self.in_slots or self.started)


@dataclass(slots=True)
class TierHit:
    """One block of a prefix found below the device pool."""

    tier: str  # "cpu" or "ssd"
    slot: TierSlot


@dataclass(slots=True)
class TierStats:
    cpu_hit_blocks: int = 0
    ssd_hit_blocks: int = 0
    promotions: int = 0  # CPU -> device blocks
    demotions: int = 0  # device -> CPU blocks
    demotions_dropped: int = 0  # evicted device blocks the CPU tier had no room for
    loads: int = 0  # SSD -> CPU blocks (completed)
    spills: int = 0  # CPU -> SSD blocks (completed)
    cpu_dropped: int = 0  # cached CPU blocks dropped without an SSD copy
    ssd_dropped: int = 0
    checksum_failures: int = 0  # SSD entries that failed their checks on load
    swap_outs: int = 0  # preempted requests swapped to the CPU tier
    swap_ins: int = 0
    bytes_copied: int = 0


class TierManager:
    """The CPU and SSD tiers of one engine, and the copies in flight between them."""

    def __init__(self, cpu_slots: int, ssd_slots: int = 0, *, block_bytes: int = 0,
                 verify_hits: bool = True, writeback_headroom: float = 1.0) -> None:
        if cpu_slots < 1:
            raise ValueError(f"the CPU tier needs at least one slot, got {cpu_slots}")
        self.cpu = SlotTier("cpu", cpu_slots, verify_hits)
        self.ssd = SlotTier("ssd", ssd_slots, verify_hits) if ssd_slots > 0 else None
        self.block_bytes = block_bytes  # one block on one rank, for bytes_copied
        # Cold CPU slots are written back to SSD until this share of the tier is free or clean
        # (by default all of it: write-through, in the background), so that demotions find a
        # slot to drop without losing a block.
        self.headroom = max(1, int(writeback_headroom * cpu_slots))
        self.stats = TierStats()
        self.copies = StepCopies()
        self._next_seq = {CopyKind.LOAD: 0, CopyKind.SPILL: 0}
        self.in_flight: dict[tuple[CopyKind, int], AsyncCopy] = {}
        # Synchronous copies of the step being executed, completed by `complete_step`.
        self._sync_fills: list[TierSlot] = []
        self._sync_reads: list[TierSlot] = []
        self._loading: dict[str, set[int]] = {}  # request -> its LOAD seqs in flight
        # CPU slots pinned for a request waiting on loads (its CPU hits and load targets), so
        # that what it waits for is still there when it is admitted.
        self._held: dict[str, list[TierSlot]] = {}
        self.ssd_writable = self.ssd is not None

    # ---------------------------------------------------------------- device -> CPU

    def demote(self, block_id: int, block_hash: BlockHash, key: bytes | None) -> bool:
        """Copies an evicted cached device block to the CPU tier (before the device block is
        rewritten, in this step). False when the block is already there, or no slot is free."""
        if self.cpu.contains(block_hash):
            return False
        slot, evicted = self.cpu.allocate(block_hash, key)
        if slot is None:
            self.stats.demotions_dropped += 1
            return False
        self._dropped_cpu(evicted)
        self.copies.out_blocks.append(block_id)
        self.copies.out_slots.append(slot.slot)
        self._sync_fills.append(slot)
        self.stats.demotions += 1
        return True

    def _dropped_cpu(self, evicted: TierSlot | None) -> None:
        if evicted is not None and not evicted.clean:
            self.stats.cpu_dropped += 1

    # ---------------------------------------------------------------- prefix hits

    def find(self, hashes: Sequence[BlockHash], keys: Sequence[bytes] | None, start: int,
             stop: int) -> list[TierHit]:
        """The chain's blocks [start, stop) found below the device, in order, up to the first
        miss: each in the CPU tier, else on SSD."""
        hits = []
        for i in range(start, stop):
            key = keys[i] if keys is not None else None
            slot = self.cpu.lookup(hashes[i], key)
            if slot is not None:
                hits.append(TierHit("cpu", slot))
                continue
            if self.ssd is None:
                break
            entry = self.ssd.lookup(hashes[i], key)
            if entry is None:
                break
            hits.append(TierHit("ssd", entry))
        return hits

    def pin_hits(self, hits: Sequence[TierHit]) -> None:
        for h in hits:
            self.cpu.pin(h.slot)

    def unpin_hits(self, hits: Sequence[TierHit]) -> None:
        for h in hits:
            self.cpu.unpin(h.slot)

    def promote(self, hits: Sequence[TierHit], block_ids: Sequence[int]) -> None:
        """CPU slots (pinned by pin_hits) -> the device blocks allocated for them, this step."""
        assert len(hits) == len(block_ids)
        for h, block_id in zip(hits, block_ids):
            assert h.tier == "cpu"
            self.copies.in_slots.append(h.slot.slot)
            self.copies.in_blocks.append(block_id)
            self._sync_reads.append(h.slot)
            self.cpu.touch(h.slot)
        self.stats.promotions += len(hits)
        self.stats.cpu_hit_blocks += len(hits)

    def start_loads(self, request_id: str, hits: Sequence[TierHit]) -> bool:
        """Starts loading the SSD blocks of `hits` into CPU slots for a waiting request. Its
        CPU hits and the load targets are held (pinned) for it until it is admitted or leaves.
        True when the request must now wait for loads."""
        started = False
        held = []
        for h in hits:
            if h.tier == "cpu":
                slot = h.slot
            else:
                copy = self._load(h.slot)
                if copy is None:
                    break  # no CPU room: the rest of the prefix is recomputed
                self.stats.ssd_hit_blocks += 1
                copy.waiters.add(request_id)
                self._loading.setdefault(request_id, set()).add(copy.seq)
                slot = self.cpu.slots[copy.cpu_slot]
                started = True
            self.cpu.pin(slot)
            held.append(slot)
        if started:
            self._held.setdefault(request_id, []).extend(held)
        else:  # nothing to wait for: these pins go (slots held in an earlier round stay)
            for slot in held:
                self.cpu.unpin(slot)
        return started

    def release_held(self, request_id: str) -> None:
        """The slots held for a waiting request go back to the LRU's care."""
        for slot in self._held.pop(request_id, ()):
            self.cpu.unpin(slot)

    def _load(self, entry: TierSlot) -> AsyncCopy | None:
        for copy in self.in_flight.values():  # already loading for another request
            if copy.kind == CopyKind.LOAD and copy.ssd_entry == entry.slot:
                return copy
        slot, evicted = self.cpu.allocate(entry.block_hash, entry.hash_key)
        if slot is None:
            return None
        self._dropped_cpu(evicted)
        self.ssd.pin(entry)
        return self._start(CopyKind.LOAD, slot.slot, entry.slot, entry.block_hash,
                           entry.hash_key)

    def is_loading(self, request_id: str) -> bool:
        return bool(self._loading.get(request_id))

    def could_load_later(self) -> bool:
        """Copies in flight will free or unpin CPU slots: a load refused now may start then."""
        return bool(self.in_flight) or bool(self._sync_fills)

    def forget_request(self, request_id: str) -> None:
        """A waiting request left (finished or aborted): its loads go on, for the cache."""
        self.release_held(request_id)
        for seq in self._loading.pop(request_id, ()):
            copy = self.in_flight.get((CopyKind.LOAD, seq))
            if copy is not None:
                copy.waiters.discard(request_id)

    # ---------------------------------------------------------------- write-back to SSD

    def write_back(self) -> None:
        """Spills the coldest dirty CPU slots until `headroom` slots are free or clean."""
        if self.ssd is None or not self.ssd_writable:
            return
        room = self.cpu.num_free + sum(1 for s in self.cpu.cached_slots() if s.clean)
        spilling = sum(1 for c in self.in_flight.values() if c.kind == CopyKind.SPILL)
        need = self.headroom - room - spilling
        if need <= 0:
            return
        for slot in self.cpu.cached_slots():
            if need <= 0:
                break
            if slot.clean or slot.busy:
                continue
            if self.ssd.contains(slot.block_hash):
                slot.clean = True  # already on SSD
                need -= 1
                continue
            entry, evicted = self.ssd.allocate(slot.block_hash, slot.hash_key)
            if entry is None:
                return
            if evicted is not None:
                self.stats.ssd_dropped += 1
                self._mark_dirty(evicted.block_hash)
            self.cpu.pin(slot)
            self._start(CopyKind.SPILL, slot.slot, entry.slot, slot.block_hash, slot.hash_key)
            need -= 1

    def _mark_dirty(self, block_hash: BlockHash | None) -> None:
        """An SSD entry was dropped: a CPU copy of it is no longer backed."""
        slot = self.cpu._index.get(block_hash) if block_hash is not None else None
        if slot is not None:
            slot.clean = False

    def _start(self, kind: CopyKind, cpu_slot: int, ssd_entry: int, block_hash: BlockHash,
               key: bytes | None) -> AsyncCopy:
        copy = AsyncCopy(self._next_seq[kind], kind, cpu_slot, ssd_entry, block_hash, key)
        self._next_seq[kind] += 1
        self.in_flight[kind, copy.seq] = copy
        self.copies.started.append(copy)
        return copy

    # ---------------------------------------------------------------- swap preemption

    def swap_out(self, request_id: str, block_ids: Sequence[int]) -> list[int] | None:
        """CPU slots owned by `request_id` for its blocks (copied this step), or None (and
        nothing changed) when the tier cannot take them all."""
        if self.cpu.available() < len(block_ids):
            return None
        reserved = []
        for block_id in block_ids:
            slot, evicted = self.cpu.allocate(None, None, owner=request_id)
            self._dropped_cpu(evicted)
            reserved.append(slot)
        for block_id, slot in zip(block_ids, reserved):
            self.copies.out_blocks.append(block_id)
            self.copies.out_slots.append(slot.slot)
            self._sync_fills.append(slot)
        self.stats.swap_outs += 1
        return [s.slot for s in reserved]

    def swap_in(self, slot_ids: Sequence[int], block_ids: Sequence[int]) -> None:
        """A swapped-out request resumes: its slots -> its new device blocks; the slots are
        released when the copies complete."""
        for slot_id, block_id in zip(slot_ids, block_ids):
            slot = self.cpu.slots[slot_id]
            self.copies.in_slots.append(slot_id)
            self.copies.in_blocks.append(block_id)
            self._sync_reads.append(slot)
            self.cpu.pin(slot)
            self.cpu.release(slot)  # pending until the copy completes
        self.stats.swap_ins += 1

    def release_owned(self, slot_ids: Iterable[int]) -> None:
        """A swapped-out request finished without resuming."""
        for slot_id in slot_ids:
            self.cpu.release(self.cpu.slots[slot_id])

    # ---------------------------------------------------------------- completion

    def take_copies(self) -> StepCopies:
        """This step's copies, for the SchedulerOutput; the next step starts a fresh list."""
        copies, self.copies = self.copies, StepCopies()
        return copies

    def complete_step(self, copies: StepCopies, ok: bool = True) -> None:
        """The workers ran (ok) or failed a step: its synchronous copies are complete (or
        void: the slots they filled are released)."""
        n_sync = len(copies.out_blocks) + len(copies.in_slots)
        fills, self._sync_fills = self._sync_fills, []
        reads, self._sync_reads = self._sync_reads, []
        for slot in fills:
            if ok:
                self.cpu.commit(slot)
            else:
                slot.state = SlotState.READY
                self.cpu.release(slot)
        for slot in reads:
            self.cpu.unpin(slot)
        if ok:
            self.stats.bytes_copied += n_sync * self.block_bytes

    def complete_async(self, upto: dict[CopyKind, int],
                       failed: Iterable[tuple[CopyKind, int]] = ()) -> list[str]:
        """Every rank completed the async copies of each kind with seq < upto[kind] (a kind not
        given: no news); `failed` ones, (kind, seq), failed their checks (a bad or missing SSD
        entry) or their I/O. Returns the requests whose loads are all done (they may be
        scheduled again)."""
        failed = set(failed)
        ready = []
        for key in [k for k in self.in_flight if k[1] < upto.get(k[0], -1)]:
            copy = self.in_flight.pop(key)
            if copy.kind == CopyKind.LOAD:
                ready += self._complete_load(copy, key not in failed)
            else:
                self._complete_spill(copy, key not in failed)
        return ready

    def _complete_load(self, copy: AsyncCopy, ok: bool) -> list[str]:
        slot, entry = self.cpu.slots[copy.cpu_slot], self.ssd.slots[copy.ssd_entry]
        self.ssd.unpin(entry)
        if ok:
            self.cpu.commit(slot)
            slot.clean = True
            self.stats.loads += 1
            self.stats.bytes_copied += self.block_bytes
        else:
            self.stats.checksum_failures += 1
            slot.state = SlotState.READY
            self.cpu.release(slot)
            self.ssd.release(entry)  # never served again
        ready = []
        for rid in copy.waiters:
            seqs = self._loading.get(rid)
            if seqs is not None:
                seqs.discard(copy.seq)
                if not seqs:
                    del self._loading[rid]
                    ready.append(rid)
        return ready

    def _complete_spill(self, copy: AsyncCopy, ok: bool) -> None:
        slot, entry = self.cpu.slots[copy.cpu_slot], self.ssd.slots[copy.ssd_entry]
        self.cpu.unpin(slot)
        if ok:
            self.ssd.commit(entry)
            if slot.state == SlotState.READY and slot.block_hash == copy.block_hash:
                slot.clean = True
            self.stats.spills += 1
            self.stats.bytes_copied += self.block_bytes
        else:
            entry.state = SlotState.READY
            self.ssd.release(entry)

    # ---------------------------------------------------------------- workers replaced

    def drop_worker_memory(self) -> None:
        """The workers were replaced (self-healing): their CPU slots and every copy in flight
        are gone, and so is each SSD entry whose write had not completed; the SSD entries
        written before stay, since the new workers open the same folder. Copies count from 0
        again, as the new workers' queues do."""
        for copy in sorted(self.in_flight.values(), key=lambda c: c.kind):
            entry = self.ssd.slots[copy.ssd_entry]
            if copy.kind == CopyKind.LOAD:
                self.ssd.unpin(entry)
            else:  # a spill never completed: its entry may be torn
                entry.state = SlotState.READY
                self.ssd.release(entry)
        self.in_flight.clear()
        self._next_seq = {CopyKind.LOAD: 0, CopyKind.SPILL: 0}
        self.copies = StepCopies()
        self._sync_fills, self._sync_reads = [], []
        self._loading.clear()
        self._held.clear()
        self.stats.cpu_dropped += sum(1 for s in self.cpu.cached_slots() if not s.clean)
        self.cpu.reset()

    # ---------------------------------------------------------------- views

    def has_in_flight(self) -> bool:
        return bool(self.in_flight)

    def clear(self) -> None:
        """reset_prefix_cache: forget every cached block of both tiers (busy ones stay)."""
        self.cpu.clear()
        if self.ssd is not None:
            self.ssd.clear()

    def usage(self) -> dict:
        out = {"cpu_tier_usage": self.cpu.usage(), "cpu_tier_slots": self.cpu.num_slots}
        if self.ssd is not None:
            out.update(ssd_tier_usage=self.ssd.usage(), ssd_tier_slots=self.ssd.num_slots)
        return out

    def check_integrity(self) -> None:
        self.cpu.check_integrity()
        if self.ssd is not None:
            self.ssd.check_integrity()
        readers = {s.slot: 0 for s in self.cpu.slots}
        for copy in self.in_flight.values():
            if copy.kind == CopyKind.SPILL:
                readers[copy.cpu_slot] += 1
        for slot in self._sync_reads:
            readers[slot.slot] += 1
        for held in self._held.values():
            for slot in held:
                readers[slot.slot] += 1
        for rid, seqs in self._loading.items():
            assert seqs and all((CopyKind.LOAD, s) in self.in_flight for s in seqs), \
                f"{rid}: stale loads"
        for slot in self.cpu.slots:
            # Pins come from in-flight spills, this step's swap-ins, and prefix hits the
            # scheduler holds between lookup and promotion (none between steps).
            assert slot.readers >= readers[slot.slot], f"cpu slot {slot.slot}: lost a pin"

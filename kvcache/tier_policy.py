"""The tier policy: every decision about the KV tiers, from the tier index and measured costs.

  demote    a cached device block the pool evicts -> a CPU slot (before the block is reused)
  promote   a prefix hit in the CPU tier -> fresh device blocks, before the forward reads them
  load      a prefix hit on SSD -> a CPU slot, in the background; the request waits (holding a
            sequence slot), then is admitted with CPU hits
  spill     the coldest dirty CPU slots -> SSD (write-through, a bounded number per step), so
            that a full CPU tier drops blocks that are also on SSD
  swap      a preempted request's blocks -> CPU slots it owns, and back when it resumes,
            where the preemption mode and the measured costs say swapping beats recomputing

The Scheduler asks; the policy answers from the index (kvcache/tier_index.py) and hands each
step's copies over as CopyBatches, one per kind, in the order the workers execute them.
Synchronous copies (device <-> CPU) complete with the step that carries them; asynchronous ones
(SSD) when the workers report their sequence numbers done.

Its state, one owner each: the steps' copies (kvcache/tier_steps.py), the requests waiting for
SSD loads and the slots held for them (kvcache/tier_admission.py), the swapped-out requests
(kvcache/tier_swap.py), write-back (kvcache/tier_writeback.py), the measured costs and the
counters (kvcache/tier_metrics.py).

A policy over an index of capacity 0 is "no tiers": every question has a constant answer.
"""
from __future__ import annotations

from typing import Iterable, Sequence

from tierserve.kvcache.block import BlockHash
from tierserve.kvcache.tenants import tenant_of
from tierserve.kvcache.tier_admission import (
    NO_ADMISSION, LoadWaits, TierAdmission, TieredRequest, TierHit,
)
from tierserve.kvcache.tier_index import TierIndex
from tierserve.kvcache.tier_metrics import CostModel, TierStats
from tierserve.kvcache.tier_records import ASYNC_KINDS, AsyncCopy, CopyKind, SsdEntry
from tierserve.kvcache.tier_steps import CopyBatch, CopySteps
from tierserve.kvcache.tier_swap import PREEMPTION_MODES, SwappedRequests
from tierserve.kvcache.tier_writeback import WriteBack

__all__ = ["PREEMPTION_MODES", "TierPolicy", "TierAdmission", "TierHit", "CopyBatch",
           "CostModel", "TierStats", "TieredRequest"]


class TierPolicy:
    def __init__(self, index: TierIndex | None = None, *, block_size: int,
                 preemption_mode: str = "auto", block_bytes: int = 0,
                 writeback_headroom: float = 1.0) -> None:
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, "
                             f"got {preemption_mode!r}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.index = index if index is not None else TierIndex()
        self.block_size = block_size
        self.preemption_mode = preemption_mode
        self.costs = CostModel(block_bytes)
        self.counters = TierStats()
        self._steps = CopySteps()
        self._waits = LoadWaits(self.index.cpu)
        self._swapped = SwappedRequests(self.index.cpu)
        self._writeback = WriteBack(self.index, self.counters, self.costs, writeback_headroom)

    @property
    def enabled(self) -> bool:
        return self.index.enabled

    @property
    def cpu(self):
        return self.index.cpu

    @property
    def ssd(self):
        return self.index.ssd

    @property
    def headroom(self) -> int:
        """CPU slots write-back keeps free or clean."""
        return self._writeback.headroom

    @headroom.setter
    def headroom(self, value: int) -> None:
        self._writeback.headroom = value

    # ---------------------------------------------------------------- device -> CPU

    def on_evict(self, block_id: int, block_hash: BlockHash, key: bytes | None,
                 tenant: str | None = None) -> None:
        """The pool evicts `tenant`'s cached block: demote it to the CPU tier (copied before
        the block is reused, in this step), unless it is there already or no slot can take
        it."""
        cpu = self.index.cpu
        if cpu.contains(block_hash) or not cpu.slots:
            return
        slot, evicted = cpu.allocate(block_hash, key, tenant=tenant)
        if slot is None:
            self.counters.demotions_dropped += 1
            return
        self._dropped(evicted)
        self._steps.current.to_cpu(block_id, slot)
        self.counters.demotions += 1

    def _dropped(self, evicted: tuple[BlockHash, bool] | None) -> None:
        if evicted is not None and not evicted[1]:
            self.counters.cpu_dropped += 1

    # ---------------------------------------------------------------- admission

    def find(self, req: TieredRequest, start: int) -> list[TierHit]:
        """The prefix continued below the device pool from block `start`: each block in the
        CPU tier, else on SSD, up to the first miss; never the whole prompt (its last token
        is computed for logits)."""
        stop = min((req.num_tokens - 1) // self.block_size, len(req.block_hashes))
        cpu, ssd, keys = self.index.cpu, self.index.ssd, req.block_keys
        tenant = tenant_of(req.cache_salt)
        hits = []
        for i in range(start, stop):
            block_hash, key = req.block_hashes[i], keys[i] if keys is not None else None
            slot = cpu.lookup(block_hash, key)
            if slot is not None:
                hits.append(TierHit("cpu", slot, key))
                continue
            load = self.index.load_of(block_hash)
            if load is not None and (load.key == key or not cpu.verify_hits):
                hits.append(TierHit("ssd", load.entry, key))  # joins the load in flight
                continue
            if cpu.contains(block_hash):
                break  # on its way into the CPU tier this step: the rest is recomputed
            entry = ssd.lookup(block_hash, key, tenant)
            if entry is None:
                break
            hits.append(TierHit("ssd", entry, key))
        return hits

    def admit(self, req: TieredRequest, num_device_hits: int) -> TierAdmission:
        """A waiting request's tier hits after its device hits: CPU ones are pinned for
        promotion this step; SSD ones start loading and the request waits, with its CPU hits
        and load targets held for it."""
        if not self.index.cpu.slots:
            return NO_ADMISSION
        hits = self.find(req, num_device_hits)
        if any(h.tier == "ssd" for h in hits):
            if self._start_loads(req, hits):
                return TierAdmission(wait=True)
            steps = self._steps
            if self.index.has_in_flight() or steps.current.fills or steps.num_sent:
                return TierAdmission(defer=True)  # copies in flight will free CPU slots
        cpu_hits = []
        for h in hits:
            if h.tier != "cpu":
                break  # a load could not start: the rest is recomputed
            self.index.cpu.pin(h.slot)
            cpu_hits.append(h.slot)
        return TierAdmission(cpu_hits)

    def admitted(self, request_id: str, admission: TierAdmission,
                 new_block_ids: Sequence[int]) -> None:
        """The admission fit: the first new blocks take the CPU hits (promoted this step), and
        the slots held for the request while it waited for loads are let go."""
        hits, step = admission.cpu_hits, self._steps.current
        for slot, block_id in zip(hits, new_block_ids):
            step.to_device(slot, block_id)
            self.index.cpu.touch(slot)
        self.counters.promotions += len(hits)
        self.counters.cpu_hit_blocks += len(hits)
        self._waits.release_held(request_id)

    def refused(self, admission: TierAdmission) -> None:
        """No room this step: the CPU hits are unpinned (slots held for a request that waited
        for loads stay held: it is still at the head of the queue)."""
        for slot in admission.cpu_hits:
            self.index.cpu.unpin(slot)

    def _start_loads(self, req: TieredRequest, hits: Sequence[TierHit]) -> bool:
        rid, started, held = req.request_id, False, []
        for h in hits:
            if h.tier == "cpu":
                slot = h.slot
            else:
                copy = self._load(h.slot, h.key)
                if copy is None:
                    break  # no CPU room: the rest of the prefix is recomputed
                self.counters.ssd_hit_blocks += 1
                self._waits.join(rid, copy)
                slot = copy.slot
                started = True
            self.index.cpu.pin(slot)
            held.append(slot)
        if started:
            self._waits.wait(req, held)
        else:  # nothing to wait for: these pins go (slots held in an earlier round stay)
            for slot in held:
                self.index.cpu.unpin(slot)
        return started

    def _load(self, entry: SsdEntry, key: bytes | None) -> AsyncCopy | None:
        index = self.index
        copy = index.load_of(entry.block_hash)
        if copy is not None:  # already loading for another request
            return copy
        # The entry's tenant is the request's: the salt is in the hash.
        slot, evicted = index.cpu.allocate(entry.block_hash, key, tenant=entry.tenant)
        if slot is None:
            return None
        self._dropped(evicted)
        index.ssd.pin(entry)
        index.ssd.touch(entry)
        copy = index.start(CopyKind.SSD_TO_CPU, slot, entry, key)
        self._steps.current.started.append(copy)
        return copy

    @property
    def num_loading(self) -> int:
        return len(self._waits)

    def is_loading(self, request_id: str) -> bool:
        return request_id in self._waits

    def loading_ids(self) -> set[str]:
        return self._waits.ids()

    # ---------------------------------------------------------------- swap preemption

    def try_swap_out(self, request_id: str, block_ids: Sequence[int],
                     num_computed_tokens: int) -> bool:
        """Swap preemption, where the mode and the costs say so and the CPU tier has room for
        every block holding the computed tokens: they go to CPU slots the request owns."""
        if self.preemption_mode == "recompute" or num_computed_tokens == 0:
            return False
        n = -(-num_computed_tokens // self.block_size)
        cpu = self.index.cpu
        if (self.preemption_mode == "auto" and not self.costs.swap_is_cheaper(
                n, num_computed_tokens)) or cpu.available() < n:
            return False
        slots = []
        for block_id in block_ids[:n]:
            slot, evicted = cpu.allocate(None, None, owner=request_id)
            self._dropped(evicted)
            slots.append(slot)
            self._steps.current.to_cpu(block_id, slot)
        self._swapped.add(request_id, slots, num_computed_tokens)
        self.counters.swap_outs += 1
        return True

    def swapped_tokens(self, request_id: str) -> int:
        """How many of a preempted request's tokens wait in the CPU tier (0: none)."""
        return self._swapped.tokens(request_id)

    def swap_in(self, request_id: str, new_block_ids: Sequence[int]) -> None:
        """The swapped-out request resumes: its slots -> its first new blocks; the slots are
        released when the copies complete."""
        slots = self._swapped.take(request_id)
        cpu, step = self.index.cpu, self._steps.current
        for slot, block_id in zip(slots, new_block_ids):
            step.to_device(slot, block_id)
            cpu.pin(slot)
            cpu.release(slot)  # pending until the copy completes
        self.counters.swap_ins += 1

    # ---------------------------------------------------------------- requests leaving

    def forget(self, request_id: str) -> None:
        """A request finished or was aborted: its loads go on, for the cache; slots held or
        owned for it are released (once any copy of them completes)."""
        self._waits.forget(request_id)
        self._swapped.release(request_id)

    # ---------------------------------------------------------------- steps

    def end_step(self, step_id: int) -> list[CopyBatch]:
        """Write-back, then the step's copies in execution order: device -> CPU (before a
        block is reused), CPU -> device (before the forward reads it), then the asynchronous
        copies the step starts."""
        if not self.index.cpu.slots:
            return []
        self._writeback.start(self._steps.current)
        return self._steps.close(step_id).batches()

    def complete(self, step_id: int, done: Sequence[int] = (),
                 failed: Sequence[int] = ()) -> list[TieredRequest]:
        """The workers ran the step: its synchronous copies are complete, and every rank
        completed the asynchronous copies of kind ASYNC_KINDS[i] with seq < done[i] (-1: no
        news); `failed` holds (kind, seq) pairs, flat, of those that failed. Returns the
        waiting requests whose loads all completed, to be scheduled again."""
        step = self._steps.finish(step_id)
        if step is not None:
            cpu = self.index.cpu
            for slot in step.fills:
                cpu.commit(slot)
            for slot in step.reads:
                cpu.unpin(slot)
            self.counters.bytes_copied += (len(step.fills) + len(step.reads)) * \
                self.costs.block_bytes
        if not done:
            return []
        bad = {(failed[i], failed[i + 1]) for i in range(0, len(failed), 2)}
        ready = []
        for kind, upto in zip(ASYNC_KINDS, done):
            for copy in self.index.completed(kind, upto):
                ok = (kind, copy.seq) not in bad
                if kind == CopyKind.SSD_TO_CPU:
                    ready += self._complete_load(copy, ok)
                else:
                    self._writeback.completed(copy, ok)
        return ready

    def step_failed(self, step_id: int) -> None:
        """The workers failed the step: its synchronous copies are void. A swapped-out
        request whose swap-out was one of them will recompute instead."""
        step = self._steps.finish(step_id)
        if step is None:
            return
        cpu = self.index.cpu
        for slot in step.reads:
            cpu.unpin(slot)
        owners = {slot.owner for slot in step.fills if slot.owner is not None}
        for slot in step.fills:
            cpu.void(slot)
        for owner in owners:
            self._swapped.release(owner)

    def _complete_load(self, copy: AsyncCopy, ok: bool) -> list[TieredRequest]:
        cpu, ssd = self.index.cpu, self.index.ssd
        ssd.unpin(copy.entry)
        if ok:
            cpu.commit(copy.slot, clean=True)
            self.counters.loads += 1
            self.counters.bytes_copied += self.costs.block_bytes
        else:
            self.counters.checksum_failures += 1
            cpu.void(copy.slot)
            ssd.void(copy.entry)  # never served again by this engine
        return self._waits.loaded(copy)

    def has_work(self) -> bool:
        """Copies in flight whose completion only a step can report, copies to send, or
        dirty CPU slots to write back (an idle engine finishes writing its blocks through to
        the shared folder, where other engines find them)."""
        return self.index.has_in_flight() or bool(self._steps.current) \
            or self._writeback.need() > 0

    # ---------------------------------------------------------------- shutdown, reset, loss

    def plan_flush(self, device_blocks: Iterable[tuple[int, BlockHash, bytes | None]]
                   ) -> list[CopyBatch]:
        """A clean shutdown: the cached device blocks and dirty CPU slots the SSD record lacks,
        to be written to the folder (no step is in flight)."""
        ssd = self.index.ssd
        if not ssd.capacity:
            return []
        device = CopyBatch(CopyKind.DEVICE_TO_SSD)
        cpu = CopyBatch(CopyKind.CPU_TO_SSD)
        for block_id, block_hash, key in device_blocks:
            if not ssd.contains(block_hash):
                device.add_write(block_id, block_hash, key)
        for slot in self.index.cpu.cached_slots():
            if not slot.clean and not ssd.contains(slot.block_hash):
                cpu.add_write(slot.slot, slot.block_hash, slot.hash_key)
        return [b for b in (device, cpu) if b.src]

    def clear(self) -> None:
        """reset_prefix_cache: the CPU tier's idle slots and the SSD record are forgotten (the
        shared folder keeps its entries: other engines may use them)."""
        self.index.cpu.clear()
        self.index.ssd.clear()

    def drop_worker_memory(self) -> list[TieredRequest]:
        """For a worker rebuild: everything that lived in the dead workers' memory is gone
        (CPU slots, copies in flight, swapped-out KV, this step's copies); the SSD record is
        kept. Returns the requests that waited for loads: they are waiting requests again.
        Swapped-out requests recompute (swapped_tokens is 0 for every request after this)."""
        self.index.drop_worker_memory()
        waiting = self._waits.clear()
        self._swapped.clear()
        self._steps.clear()
        return waiting

    # ---------------------------------------------------------------- views

    def stats(self) -> dict:
        if not self.enabled:
            return {}
        return self.counters.report(self.index, len(self._waits))

    def check_integrity(self) -> None:
        """The index's invariants, and that every pin has an owner: in-flight spills, held
        slots of waiting requests, and the reads of steps not yet complete."""
        index = self.index
        index.check_integrity()
        readers = {}
        pins = [c.slot for c in index.in_flight(CopyKind.CPU_TO_SSD)]
        pins += self._steps.reads()
        pins += self._waits.held_slots()
        for slot in pins:
            readers[slot.slot] = readers.get(slot.slot, 0) + 1
        for slot in index.cpu.slots:
            assert slot.readers >= readers.get(slot.slot, 0), f"cpu slot {slot.slot}: lost a pin"
        self._waits.check({c.seq for c in index.in_flight(CopyKind.SSD_TO_CPU)})
        self._swapped.check()

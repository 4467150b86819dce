"""The router's exact index of where each block hash lives: hash -> {replica: tiers}.

Built only from the replicas' KV event streams (scheduler/kv_events.py). Each replica's stream
is sequenced: a batch applies only if it is the next of the replica's current epoch. A gap, a
new epoch (the replica restarted) or a replica's first contact puts the replica in resync: its
batches are buffered until a snapshot arrives, which replaces what the index holds for it; the
buffered batches after the snapshot's seq are then applied in order.

Lookups are one dict get per block: the value packs, for each replica r, its tiers as three
bits at 3r (device, cpu, ssd). Beside it, each replica's own sets per tier (the same facts,
by replica) make removing a replica O(its blocks) and let `check_integrity` compare the two.
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field
from typing import Iterable

from tierserve.scheduler.kv_events import (
    NUM_TIERS, KVEventBatch, KVSnapshot, KVTier, ReplicaLoad,
)

__all__ = ["KVIndex", "ReplicaStream", "Match"]

_TIER_BITS = 3
_ALL_TIERS = (1 << _TIER_BITS) - 1


@dataclass(slots=True)
class ReplicaStream:
    """One replica's event stream as the index has applied it."""

    epoch: int | None = None
    next_seq: int = 0
    resyncing: bool = True  # nothing applies until a snapshot has
    buffered: list[KVEventBatch] = field(default_factory=list)
    tiers: list[set[bytes]] = field(default_factory=lambda: [set() for _ in range(NUM_TIERS)])
    load: ReplicaLoad = field(default_factory=ReplicaLoad)
    batches_applied: int = 0
    resyncs: int = 0


@dataclass(slots=True)
class Match:
    """How much of a prompt's chain one replica holds: the leading run of blocks it has in
    some tier, counted by the fastest tier holding each."""

    device: int = 0
    cpu: int = 0
    ssd: int = 0

    @property
    def blocks(self) -> int:
        return self.device + self.cpu + self.ssd


class KVIndex:
    def __init__(self) -> None:
        self._masks: dict[bytes, int] = {}
        self.replicas: dict[int, ReplicaStream] = {}

    def __len__(self) -> int:
        return len(self._masks)

    # ---------------------------------------------------------------- replicas

    def add_replica(self, replica: int) -> None:
        if replica in self.replicas:
            raise RuntimeError(f"replica {replica} is already indexed")
        self.replicas[replica] = ReplicaStream()

    def remove_replica(self, replica: int) -> None:
        """Forgets everything the replica held (it died, or was scaled away)."""
        stream = self.replicas.pop(replica)
        self._clear(replica, stream)

    def _clear(self, replica: int, stream: ReplicaStream) -> None:
        keep = ~(_ALL_TIERS << (_TIER_BITS * replica))
        masks = self._masks
        for held in stream.tiers:
            for h in held:
                m = masks.get(h)
                if m is not None:
                    m &= keep
                    if m:
                        masks[h] = m
                    else:
                        del masks[h]
            held.clear()

    # ---------------------------------------------------------------- the stream

    def receive(self, replica: int, frame: KVEventBatch | KVSnapshot) -> bool:
        """Applies a frame of the replica's stream; True while the replica needs a snapshot
        (first contact, a gap, or a restart), which the caller fetches (once) and passes
        here."""
        stream = self.replicas.get(replica)
        if stream is None:
            return False  # a replica removed while its frames were on their way
        if isinstance(frame, KVSnapshot):
            return self._apply_snapshot(replica, stream, frame)
        stream.load = frame.load
        if stream.resyncing:
            stream.buffered.append(frame)
            return True
        if frame.epoch == stream.epoch and frame.seq < stream.next_seq:
            return False  # a duplicate
        if frame.epoch != stream.epoch or frame.seq != stream.next_seq:
            return self._start_resync(stream, [frame])
        self._apply(replica, stream, frame)
        return False

    def needs_snapshot(self, replica: int) -> bool:
        stream = self.replicas.get(replica)
        return stream is not None and stream.resyncing

    def _start_resync(self, stream: ReplicaStream, buffered: list[KVEventBatch]) -> bool:
        stream.resyncing = True
        stream.buffered = buffered
        stream.resyncs += 1
        return True

    def _apply_snapshot(self, replica: int, stream: ReplicaStream, snap: KVSnapshot) -> bool:
        self._clear(replica, stream)
        base = _TIER_BITS * replica
        masks = self._masks
        for tier, hashes in enumerate(snap.tiers[:NUM_TIERS]):
            bit = 1 << (base + tier)
            held = stream.tiers[tier]
            for h in hashes:
                masks[h] = masks.get(h, 0) | bit
                held.add(h)
        stream.epoch, stream.next_seq, stream.resyncing = snap.epoch, snap.seq + 1, False
        buffered, stream.buffered = sorted(stream.buffered, key=lambda b: b.seq), []
        stream.load = snap.load
        for i, batch in enumerate(buffered):
            if batch.epoch != snap.epoch:
                return self._start_resync(stream, buffered[i:])  # restarted again
            if batch.seq < stream.next_seq:
                continue
            if batch.seq != stream.next_seq:
                return self._start_resync(stream, buffered[i:])
            self._apply(replica, stream, batch)
        return False

    def _apply(self, replica: int, stream: ReplicaStream, batch: KVEventBatch) -> None:
        base = _TIER_BITS * replica
        masks = self._masks
        for tier, hashes in enumerate(batch.stored[:NUM_TIERS]):
            bit = 1 << (base + tier)
            held = stream.tiers[tier]
            for h in hashes:
                masks[h] = masks.get(h, 0) | bit
                held.add(h)
        for tier, hashes in enumerate(batch.removed[:NUM_TIERS]):
            keep = ~(1 << (base + tier))
            held = stream.tiers[tier]
            for h in hashes:
                held.discard(h)
                m = masks.get(h)
                if m is not None:
                    m &= keep
                    if m:
                        masks[h] = m
                    else:
                        del masks[h]
        stream.next_seq = batch.seq + 1
        stream.batches_applied += 1

    # ---------------------------------------------------------------- lookups

    def match(self, hashes: Iterable[bytes], replicas: Iterable[int]) -> dict[int, Match]:
        """For each replica, the leading run of `hashes` it holds in some tier (a replica's
        prefix hit stops at its first miss); walks the chain only while some replica still
        matches, so `hashes` may be computed lazily. O(1) big-int operations per block
        whatever the number of replicas; tiers are counted once, at the end."""
        replicas = list(replicas)
        alive = sum(1 << (_TIER_BITS * r) for r in replicas)  # bit 3r: r still matches
        runs: dict[int, int] = {}
        found: list[int] = []
        masks = self._masks
        for h in hashes:
            m = masks.get(h)
            if m is None:
                break
            held = (m | m >> 1 | m >> 2) & alive
            if held != alive:
                for r in replicas:
                    if (alive & ~held) >> (_TIER_BITS * r) & 1:
                        runs[r] = len(found)
                alive = held
                if not alive:
                    break
            found.append(m)
        return {r: self._count(found[:runs.get(r, len(found))], _TIER_BITS * r)
                for r in replicas}

    @staticmethod
    def _count(run: list[int], shift: int) -> Match:
        if not run:
            return Match()
        if functools.reduce(operator.and_, run) >> shift & 1:  # all on the device
            return Match(device=len(run))
        bits = [m >> shift & _ALL_TIERS for m in run]
        device = sum(b & 1 for b in bits)
        cpu = sum(1 for b in bits if b & 2 and not b & 1)
        return Match(device, cpu, len(run) - device - cpu)

    def device_blocks(self, replica: int) -> int:
        """How many blocks the replica's device pool holds, as indexed."""
        stream = self.replicas.get(replica)
        return len(stream.tiers[KVTier.DEVICE]) if stream is not None else 0

    def tiers_of(self, block_hash: bytes) -> dict[int, list[KVTier]]:
        """Which replicas hold the hash, and in which tiers."""
        m = self._masks.get(block_hash, 0)
        out = {}
        for r in self.replicas:
            bits = (m >> (_TIER_BITS * r)) & _ALL_TIERS
            if bits:
                out[r] = [KVTier(t) for t in range(NUM_TIERS) if bits >> t & 1]
        return out

    def check_integrity(self, actual: dict[int, list[set[bytes]]] | None = None) -> None:
        """The packed masks equal the replicas' sets; with `actual` (replica -> per-tier sets
        of what it really holds), each replica not in resync holds exactly that."""
        expected: dict[bytes, int] = {}
        for r, stream in self.replicas.items():
            for tier, held in enumerate(stream.tiers):
                bit = 1 << (_TIER_BITS * r + tier)
                for h in held:
                    expected[h] = expected.get(h, 0) | bit
        assert expected == self._masks, "the packed index disagrees with the replicas' sets"
        for r, tiers in (actual or {}).items():
            stream = self.replicas[r]
            assert not stream.resyncing, f"replica {r} is waiting for a snapshot"
            for tier, (have, real) in enumerate(zip(stream.tiers, tiers)):
                assert have == set(real), (
                    f"replica {r} tier {KVTier(tier).name}: {len(have - set(real))} indexed "
                    f"but absent, {len(set(real) - have)} present but not indexed")

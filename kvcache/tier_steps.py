"""A step's tier copies: what the step being scheduled asks of the workers (StepCopies), the
steps sent until the workers complete them (CopySteps), and the batches, one kind each, that
carry them (CopyBatch). Synchronous copies (device <-> CPU) complete with the step that carries
them; asynchronous ones (SSD) are the index's to track (TierIndex.completed).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tierserve.kvcache.block import BlockHash
from tierserve.kvcache.tier_records import ASYNC_KINDS, AsyncCopy, CopyKind, CpuSlot

__all__ = ["CopyBatch", "StepCopies", "CopySteps"]


@dataclass(slots=True)
class CopyBatch:
    """One kind of copy of one step, as the wire carries it (scheduler/messages.py
    TierCopyBatch). src and dst are device block ids or CPU slot ids by kind; an SSD side is
    named by hashes (content-addressed) and has no ids. Asynchronous kinds number their
    copies first_seq, first_seq + 1, ..."""

    kind: CopyKind
    src: list[int] = field(default_factory=list)
    dst: list[int] = field(default_factory=list)
    first_seq: int = 0
    hashes: list[bytes] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)

    def add_write(self, source: int, block_hash: BlockHash, key: bytes | None) -> None:
        """One more block for a write to SSD: `source` is a device block or a CPU slot."""
        self.src.append(source)
        self.hashes.append(block_hash)
        self.keys.append(key or b"")


@dataclass(slots=True)
class StepCopies:
    """What the step being scheduled asks of the workers."""

    d2c_blocks: list[int] = field(default_factory=list)
    d2c_slots: list[int] = field(default_factory=list)
    c2d_slots: list[int] = field(default_factory=list)
    c2d_blocks: list[int] = field(default_factory=list)
    fills: list[CpuSlot] = field(default_factory=list)  # committed when the step completes
    reads: list[CpuSlot] = field(default_factory=list)  # unpinned when the step completes
    started: list[AsyncCopy] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.fills or self.reads or self.started)

    def to_cpu(self, block_id: int, slot: CpuSlot) -> None:
        """A device block -> a FILLING CPU slot (a demotion or a swap-out)."""
        self.d2c_blocks.append(block_id)
        self.d2c_slots.append(slot.slot)
        self.fills.append(slot)

    def to_device(self, slot: CpuSlot, block_id: int) -> None:
        """A pinned CPU slot -> a device block (a promotion or a swap-in)."""
        self.c2d_slots.append(slot.slot)
        self.c2d_blocks.append(block_id)
        self.reads.append(slot)

    def batches(self) -> list[CopyBatch]:
        """The step's copies in execution order: device -> CPU (before a block is reused),
        CPU -> device (before the forward reads it), then the asynchronous copies started."""
        batches = []
        if self.d2c_blocks:
            batches.append(CopyBatch(CopyKind.DEVICE_TO_CPU, self.d2c_blocks, self.d2c_slots))
        if self.c2d_slots:
            batches.append(CopyBatch(CopyKind.CPU_TO_DEVICE, self.c2d_slots, self.c2d_blocks))
        for kind in ASYNC_KINDS:
            copies = [c for c in self.started if c.kind == kind]
            if copies:
                batches.append(_async_batch(kind, copies))
        return batches


class CopySteps:
    """The copies of the step being scheduled (`current`), and those of the steps sent, by
    step id, whose synchronous copies the workers have yet to complete."""

    def __init__(self) -> None:
        self.current = StepCopies()
        self._sent: dict[int, StepCopies] = {}

    @property
    def num_sent(self) -> int:
        return len(self._sent)

    def close(self, step_id: int) -> StepCopies:
        """The current step is sent as `step_id`: its copies, kept until it completes where
        slots wait for it; a new current step begins."""
        step, self.current = self.current, StepCopies()
        if step.fills or step.reads:
            self._sent[step_id] = step
        return step

    def finish(self, step_id: int) -> StepCopies | None:
        """The sent step's copies (None: it had no synchronous ones), no longer kept."""
        return self._sent.pop(step_id, None)

    def reads(self) -> list[CpuSlot]:
        """The slots pinned for the reads of every step not yet complete, the current one's
        included."""
        return [s for step in (*self._sent.values(), self.current) for s in step.reads]

    def clear(self) -> None:
        self._sent.clear()
        self.current = StepCopies()


def _async_batch(kind: CopyKind, copies: list[AsyncCopy]) -> CopyBatch:
    first = copies[0].seq
    assert [c.seq for c in copies] == list(range(first, first + len(copies)))
    slots = [c.slot.slot for c in copies]
    batch = CopyBatch(kind, first_seq=first, hashes=[c.entry.block_hash for c in copies],
                      keys=[c.key or b"" for c in copies])
    if kind == CopyKind.SSD_TO_CPU:
        batch.dst = slots
    else:
        batch.src = slots
    return batch

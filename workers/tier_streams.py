"""How a rank's tier copies move bytes between its KV pool and its CPU tier slots.

One object per rank, chosen once (make_copy_stream):
  HostCopies  CPU pools: plain copies, complete when the call returns
  CudaCopies  a dedicated copy stream; device -> host straight into the pinned CPU tier,
              host -> device from it, each batch recording an event
  LateCopies  tests (TIERSERVE_DEBUG_LATE_COPIES): copies complete late and destinations read
              NaN until then, so that any read before the wait the protocol requires fails

The protocol, for every implementation. A batch returns a handle (an event):
  device_waits(h)  before the compute stream (the forward, the forked samples' block copies)
                   reads or writes a block the batch touched
  host_waits(h)    before this process reads (an SSD write, a checksum) or writes (an SSD
                   load) a CPU slot the batch touched
Batches on the copy stream run in issue order, and each first waits for the compute stream
(a block freed by a step still running is read or written only after it).

Shapes: a pool is per layer (K, V), each [num_blocks, block_size, kv_heads, head_dim]; the CPU
tier is [slots, layers, 2, block_size, kv_heads, head_dim], one slot contiguous.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

__all__ = ["CopyStream", "HostCopies", "CudaCopies", "LateCopies", "make_copy_stream"]


class CopyStream:
    def __init__(self, kv: list[tuple[torch.Tensor, torch.Tensor]], cpu: torch.Tensor,
                 device: torch.device) -> None:
        self.kv, self.cpu, self.device = kv, cpu, device

    def to_cpu(self, blocks: list[int], slots: list[int]):
        raise NotImplementedError

    def to_device(self, slots: list[int], blocks: list[int]):
        raise NotImplementedError

    def device_waits(self, handle) -> None:
        """The compute stream waits for the batch."""

    def host_waits(self, handle) -> None:
        """This thread waits for the batch."""

    def poison(self, slots: list[int]) -> None:
        """A copy into these slots starts elsewhere (an SSD load): only LateCopies marks them."""

    def synchronize(self) -> None:
        """Every batch issued so far has completed."""

    def end_step(self) -> None:
        """A step's copies are issued (LateCopies completes old batches)."""

    def _gather(self, block_idx: torch.Tensor, out: torch.Tensor) -> None:
        """out[i] = block i's KV, every layer: [n, layers, 2, block_size, heads, head_dim]."""
        for layer, (k, v) in enumerate(self.kv):
            out[:, layer, 0].copy_(k.index_select(0, block_idx))
            out[:, layer, 1].copy_(v.index_select(0, block_idx))

    def _scatter(self, src: torch.Tensor, block_idx: torch.Tensor) -> None:
        for layer, (k, v) in enumerate(self.kv):
            k.index_copy_(0, block_idx, src[:, layer, 0])
            v.index_copy_(0, block_idx, src[:, layer, 1])


class HostCopies(CopyStream):
    """CPU pools: every copy is done when the call returns."""

    def to_cpu(self, blocks, slots):
        block_idx = torch.tensor(blocks, dtype=torch.long)
        staged = torch.empty((len(blocks), *self.cpu.shape[1:]), dtype=self.cpu.dtype)
        self._gather(block_idx, staged)
        self.cpu.index_copy_(0, torch.tensor(slots, dtype=torch.long), staged)
        return None

    def to_device(self, slots, blocks):
        src = self.cpu.index_select(0, torch.tensor(slots, dtype=torch.long))
        self._scatter(src, torch.tensor(blocks, dtype=torch.long))
        return None


class CudaCopies(CopyStream):
    """A copy stream and an event per batch. Device -> host: the blocks are gathered on the
    copy stream into a device buffer, then each slot is one async copy into its pinned slot;
    host -> device the other way round. The device buffers are allocated on the copy stream,
    so the caching allocator reuses them only after the stream has passed their last use."""

    def __init__(self, kv, cpu, device) -> None:
        super().__init__(kv, cpu, device)
        assert cpu.numel() == 0 or cpu.is_pinned(), "the CPU tier must be pinned memory"
        self.stream = torch.cuda.Stream(device)

    def _begin(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def to_cpu(self, blocks, slots):
        self._begin()
        with torch.cuda.stream(self.stream):
            block_idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
            staged = torch.empty((len(blocks), *self.cpu.shape[1:]), dtype=self.cpu.dtype,
                                 device=self.device)
            self._gather(block_idx, staged)
            for i, slot in enumerate(slots):
                self.cpu[slot].copy_(staged[i], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def to_device(self, slots, blocks):
        self._begin()
        with torch.cuda.stream(self.stream):
            staged = torch.empty((len(slots), *self.cpu.shape[1:]), dtype=self.cpu.dtype,
                                 device=self.device)
            for i, slot in enumerate(slots):
                staged[i].copy_(self.cpu[slot], non_blocking=True)
            self._scatter(staged, torch.tensor(blocks, dtype=torch.long, device=self.device))
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def device_waits(self, handle) -> None:
        if handle is not None:
            torch.cuda.current_stream(self.device).wait_event(handle)

    def host_waits(self, handle) -> None:
        if handle is not None:
            handle.synchronize()

    def synchronize(self) -> None:
        self.stream.synchronize()
        torch.cuda.current_stream(self.device).synchronize()


@dataclass(eq=False)
class _LateOp:
    to_cpu: bool
    blocks: list[int]
    slots: list[int]
    staged: torch.Tensor | None = None  # the source, once the "device" has read it
    age: int = 0  # steps since issued


class LateCopies(CopyStream):
    """Test mode on CPU pools: copies complete late, like a GPU copy the host did not wait for.

    A batch only poisons its destination (NaN) when issued. device_waits(h) completes the
    device side of every batch up to h: sources of device -> host batches are read (so a block
    may be reused after it), host -> device batches land in the pool. Their host side lands
    only at host_waits(h), or when a later batch reads those slots (stream order), or eight
    steps later (end_step). Any reader that skips a wait reads NaN, or stale bytes."""

    _LAND_AFTER_STEPS = 8

    def __init__(self, kv, cpu, device) -> None:
        super().__init__(kv, cpu, device)
        self._ops: list[_LateOp] = []  # not landed, in issue order
        self._lock = threading.RLock()

    def to_cpu(self, blocks, slots):
        with self._lock:
            self.cpu[torch.tensor(slots, dtype=torch.long)] = float("nan")
            return self._issue(_LateOp(True, list(blocks), list(slots)))

    def to_device(self, slots, blocks):
        with self._lock:
            for op in self._ops:  # earlier batches on the stream read their blocks first
                if op.to_cpu:
                    self._read_source(op)
            for k, v in self.kv:
                idx = torch.tensor(blocks, dtype=torch.long)
                k[idx] = float("nan")
                v[idx] = float("nan")
            return self._issue(_LateOp(False, list(blocks), list(slots)))

    def poison(self, slots) -> None:
        with self._lock:
            self.cpu[torch.tensor(slots, dtype=torch.long)] = float("nan")

    def _issue(self, op: _LateOp) -> _LateOp:
        self._ops.append(op)
        return op

    def device_waits(self, handle) -> None:
        with self._lock:
            for op in self._upto(handle):
                if op.to_cpu:
                    self._read_source(op)
                else:
                    self._land_upto(op)

    def host_waits(self, handle) -> None:
        with self._lock:
            if handle is not None:
                self._land_upto(handle)

    def synchronize(self) -> None:
        with self._lock:
            if self._ops:
                self._land_upto(self._ops[-1])

    def end_step(self) -> None:
        """A step ran: batches issued long enough ago complete."""
        with self._lock:
            for op in self._ops:
                op.age += 1
            old = [op for op in self._ops if op.age >= self._LAND_AFTER_STEPS]
            if old:
                self._land_upto(old[-1])

    def _upto(self, handle) -> list[_LateOp]:
        if handle is None or handle not in self._ops:
            return []
        return self._ops[: self._ops.index(handle) + 1]

    def _read_source(self, op: _LateOp) -> None:
        if op.staged is None:
            staged = torch.empty((len(op.blocks), *self.cpu.shape[1:]), dtype=self.cpu.dtype)
            self._gather(torch.tensor(op.blocks, dtype=torch.long), staged)
            op.staged = staged

    def _land_upto(self, handle: _LateOp) -> None:
        """Completes every batch up to `handle`, in issue order (one stream)."""
        done = self._upto(handle)
        for op in done:
            if op.to_cpu:
                self._read_source(op)
                self.cpu.index_copy_(0, torch.tensor(op.slots, dtype=torch.long), op.staged)
            else:
                src = self.cpu.index_select(0, torch.tensor(op.slots, dtype=torch.long))
                self._scatter(src, torch.tensor(op.blocks, dtype=torch.long))
        del self._ops[: len(done)]


def make_copy_stream(kv, cpu: torch.Tensor, device: torch.device, late: bool) -> CopyStream:
    if device.type == "cuda":
        return CudaCopies(kv, cpu, device)
    return LateCopies(kv, cpu, device) if late else HostCopies(kv, cpu, device)

"""One rank's tier copier: it executes the tier copies each step carries, and decides nothing.

Its CPU tier is [slots, layers, 2 (K, V), block_size, kv_heads, head_dim] (pinned on CUDA),
one slot contiguous, so that an SSD entry of the rank's head range is one read or write. Each
step's TierCopyBatches (scheduler/messages.py) run in order before the forward: device <-> CPU
batches on the copy stream (workers/tier_streams.py), the compute stream waiting for them;
SSD loads and spills are queued on two background threads, each in issue order (a load never
waits behind a backlog of write-backs). Before a thread reads a slot (a spill, its checksum)
or writes one (a load), it waits for the last batch that touched the slot on the copy stream.

Every rank reports how far each asynchronous kind got; the ranks agree (one small all-reduce)
before rank 0 acknowledges them to the engine. Of the ranks sharing one replicated head range,
only the first writes its entries.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from tierserve.scheduler.messages import CopyKind, FlushTiers, TierCopyBatch
from tierserve.workers.backends.host_memory import mapped_zeros
from tierserve.workers.parallel import get_tp_size, tp_all_reduce_max
from tierserve.workers.tier_ssd import SsdFolder
from tierserve.workers.tier_streams import make_copy_stream

__all__ = ["TierCopier"]

log = logging.getLogger("tierserve.tier_copier")

# Async copies of a kind one TP agreement can report (failures travel as a bitmap this wide).
_WINDOW = 1024


@dataclass(slots=True)
class _Copy:
    seq: int
    kind: CopyKind
    slot: int
    block_hash: bytes
    key: bytes


class _Queue:
    """One kind of asynchronous copy on its own thread, completed in issue order."""

    def __init__(self, name: str, run: Callable[[_Copy], bool]) -> None:
        self._items: queue.SimpleQueue[_Copy | None] = queue.SimpleQueue()
        self._run = run
        self._lock = threading.Lock()
        self.done = 0  # every copy with seq < done has completed here
        self.failed: set[int] = set()
        self.issued = 0
        self.agreed = 0  # every rank has completed the copies with seq < agreed
        self._thread = threading.Thread(target=self._work, daemon=True, name=name)
        self._thread.start()

    def put(self, copy: _Copy) -> None:
        self.issued = copy.seq + 1
        self._items.put(copy)

    def _work(self) -> None:
        while True:
            copy = self._items.get()
            if copy is None:
                return
            try:
                ok = self._run(copy)
            except Exception:  # a bug, not I/O: the copy fails, the queue goes on
                log.exception("tier copy %s %d failed", copy.kind.name, copy.seq)
                ok = False
            with self._lock:
                if not ok:
                    self.failed.add(copy.seq)
                self.done = copy.seq + 1

    def progress(self, window: int | None) -> tuple[int, list[int]]:
        """(done, failed seqs below it), `done` kept within `window` of the last agreement."""
        with self._lock:
            done = self.done if window is None else min(self.done, self.agreed + window)
            return done, [s for s in self.failed if s < done]

    def settle(self, done: int) -> None:
        with self._lock:
            self.failed = {s for s in self.failed if s >= done}
        self.agreed = done

    def idle(self) -> bool:
        with self._lock:
            return self.done >= self.issued

    def close(self) -> None:
        self._items.put(None)
        self._thread.join(30)


class TierCopier:
    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], cpu_slots: int,
                 device: torch.device, *, ssd: SsdFolder | None = None,
                 heads: tuple[int, int] = (0, 0), writer: bool = True,
                 late: bool = False) -> None:
        k0 = kv_caches[0][0]
        self.kv = kv_caches
        self.device = device
        self.layout = [len(kv_caches), 2, *k0.shape[1:]]  # one slot
        self.dtype_name = str(k0.dtype).removeprefix("torch.")
        # Beside a CPU pool the tier is a lazy mapping on huge pages (as the pool): zeroing it
        # up front cost a start about 0.2 s a GiB, and resident memory it may never use.
        self.cpu = torch.zeros((cpu_slots, *self.layout), dtype=k0.dtype,
                               pin_memory=cpu_slots > 0) if device.type == "cuda" \
            else mapped_zeros((cpu_slots, *self.layout), k0.dtype)
        self.stream = make_copy_stream(kv_caches, self.cpu, device, late)
        self.ssd, self.heads, self.writer = ssd, tuple(heads), writer
        # The last copy-stream batch that touched each CPU slot (None where none is pending).
        self._slot_handles: dict[int, object] = {}
        self._handles_lock = threading.Lock()
        # Per kind, in ASYNC_KINDS order (loads, spills): the wire's tier_done follows it.
        self._queues = [] if ssd is None else [
            _Queue("tierserve-tier-loads", self._load),
            _Queue("tierserve-tier-spills", self._spill)]
        # Test mode: queued copies start one step late (TIERSERVE_DEBUG_LATE_COPIES).
        self._gate: list[tuple[_Queue, _Copy]] | None = [] if late else None

    @property
    def num_slots(self) -> int:
        return self.cpu.shape[0]

    @property
    def slot_bytes(self) -> int:
        return self.cpu[0].numel() * self.cpu.element_size() if self.num_slots else 0

    def _slot_bytes_view(self, slot: int) -> memoryview:
        return memoryview(self.cpu[slot].view(torch.uint8).numpy()).cast("B")

    # ---------------------------------------------------------------- a step's copies

    def run(self, batches: list[TierCopyBatch], between: Callable[[], None] | None = None
            ) -> None:
        """The step's batches in order; `between` (the forked samples' block copies, on the
        compute stream) after the device -> CPU ones. Returns when the compute stream waits
        for every device-side copy, so the forward may start."""
        self._open_gate()
        handles = []
        for batch in batches:
            if between is not None and batch.kind != CopyKind.DEVICE_TO_CPU:
                self._compute_waits(handles)
                between()
                between = None
            handles.append(self._run_batch(batch))
        self._compute_waits(handles)
        if between is not None:
            between()
        self.stream.end_step()

    def _run_batch(self, batch: TierCopyBatch):
        kind = batch.kind
        if kind == CopyKind.DEVICE_TO_CPU:
            handle = self.stream.to_cpu(batch.src, batch.dst)
            self._touched(batch.dst, handle)
        elif kind == CopyKind.CPU_TO_DEVICE:
            handle = self.stream.to_device(batch.src, batch.dst)
            self._touched(batch.src, handle)
        elif kind in (CopyKind.SSD_TO_CPU, CopyKind.CPU_TO_SSD):
            self._queue(batch)
            handle = None
        else:
            raise RuntimeError(f"a {kind.name} copy batch in a step")
        return handle

    def _compute_waits(self, handles: list) -> None:
        for handle in handles:
            self.stream.device_waits(handle)

    def _touched(self, slots: list[int], handle) -> None:
        if handle is None:
            return
        with self._handles_lock:
            for slot in slots:
                self._slot_handles[slot] = handle

    def _host_waits_slot(self, slot: int) -> None:
        with self._handles_lock:
            handle = self._slot_handles.get(slot)
        self.stream.host_waits(handle)

    def _queue(self, batch: TierCopyBatch) -> None:
        if not self._queues:
            raise RuntimeError("an SSD copy was sent to a rank without an SSD tier")
        load = batch.kind == CopyKind.SSD_TO_CPU
        slots = batch.dst if load else batch.src
        if load:
            self.stream.poison(slots)
        q = self._queues[0 if load else 1]
        for i, slot in enumerate(slots):
            copy = _Copy(batch.first_seq + i, batch.kind, slot, batch.hashes[i], batch.keys[i])
            if self._gate is not None:
                self._gate.append((q, copy))
            else:
                q.put(copy)

    def _open_gate(self) -> None:
        if self._gate:
            gated, self._gate = self._gate, []
            for q, copy in gated:
                q.put(copy)

    # ---------------------------------------------------------------- SSD loads and spills

    def _layout_of(self, heads: tuple[int, int]) -> list[int]:
        return [*self.layout[:3], heads[1] - heads[0], self.layout[4]]

    def _load(self, copy: _Copy) -> bool:
        self._host_waits_slot(copy.slot)
        why = self._read(copy.block_hash, copy.key or None, copy.slot)
        if why is not None:
            log.warning("SSD entry of block %s not loaded (%s): its tokens will be recomputed",
                        copy.block_hash.hex()[:16], why)
            return False
        return True

    def _read(self, block_hash: bytes, key: bytes | None, slot: int) -> str | None:
        """Fills the slot with this rank's head range of the block, from the entries holding
        it (one of exactly this range, or of a larger one, or several smaller ones)."""
        sources = self.ssd.sources(block_hash, self.heads)
        if sources is None:
            return "missing"
        a, b = self.heads
        for path, (lo, hi) in sources:
            if (lo, hi) == (a, b):
                return self.ssd.read(path, block_hash, (lo, hi), key, self.layout,
                                     self.dtype_name, self._slot_bytes_view(slot))
            layout = self._layout_of((lo, hi))
            staged = torch.empty(layout, dtype=self.cpu.dtype)
            why = self.ssd.read(path, block_hash, (lo, hi), key, layout, self.dtype_name,
                                memoryview(staged.view(torch.uint8).numpy()).cast("B"))
            if why is not None:
                return why
            first, last = max(a, lo), min(b, hi)
            self.cpu[slot, :, :, :, first - a:last - a] = staged[:, :, :, first - lo:last - lo]
        return None

    def _spill(self, copy: _Copy) -> bool:
        if not self.writer:
            return True  # the first rank of this replicated head range writes it
        self._host_waits_slot(copy.slot)
        try:
            self.ssd.write(copy.block_hash, self.heads, copy.key, self.layout, self.dtype_name,
                           self._slot_bytes_view(copy.slot))
            return True
        except OSError as e:
            log.warning("spill of block %s to SSD failed: %s", copy.block_hash.hex()[:16], e)
            return False

    def agree(self) -> tuple[list[int], list[int]]:
        """([loads done, spills done], failed (kind, seq) pairs, flat) of the async copies every
        rank has completed; ([], []) when nothing is pending. The same on every rank, which all
        call it each step: whether it talks is decided by what every rank has seen."""
        if not any(q.issued > q.agreed for q in self._queues):
            return [], []
        tp = get_tp_size() > 1
        progress = [q.progress(_WINDOW if tp else None) for q in self._queues]
        dones = [done for done, _ in progress]
        fails = [failed for _, failed in progress]
        if tp:
            # Per kind: [-done, failed bitmap of its window]; one MAX gives every rank the
            # minimum of `done` and the union of failures.
            t = torch.zeros((len(self._queues), _WINDOW + 1), dtype=torch.int32,
                            device=self.device if self.device.type == "cuda" else "cpu")
            for k, (q, done, failed) in enumerate(zip(self._queues, dones, fails)):
                t[k, 0] = -done
                for s in failed:
                    t[k, 1 + s - q.agreed] = 1
            values = tp_all_reduce_max(t).tolist()
            dones = [-row[0] for row in values]
            fails = [[q.agreed + i for i, bit in enumerate(row[1:]) if bit and q.agreed + i < d]
                     for q, row, d in zip(self._queues, values, dones)]
        flat = []
        for kind, q, done, failed in zip((CopyKind.SSD_TO_CPU, CopyKind.CPU_TO_SSD),
                                         self._queues, dones, fails):
            q.settle(done)
            for s in failed:
                flat += [int(kind), s]
        return dones, flat

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Waits until every queued async copy completed here (tests, shutdown)."""
        self._open_gate()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not all(q.idle() for q in self._queues):
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    # ---------------------------------------------------------------- shutdown

    def flush(self, msg: FlushTiers) -> int:
        """Writes the listed device blocks and CPU slots to the SSD folder until the deadline;
        returns how many it wrote (or, on a rank that does not write its range, would have)."""
        if self.ssd is None:
            return 0
        self.wait_idle(msg.deadline_s)
        self.stream.synchronize()
        deadline = time.monotonic() + msg.deadline_s
        written = 0
        for batch in msg.copies:
            for source, block_hash, key in zip(batch.src, batch.hashes, batch.keys):
                if time.monotonic() > deadline:
                    return written
                written += self._flush_one(batch.kind, source, block_hash, key)
        return written

    def _flush_one(self, kind: CopyKind, source: int, block_hash: bytes, key: bytes) -> bool:
        if kind == CopyKind.DEVICE_TO_SSD:
            payload = torch.empty(self.layout, dtype=self.cpu.dtype)
            for layer, (k, v) in enumerate(self.kv):
                payload[layer, 0].copy_(k[source])
                payload[layer, 1].copy_(v[source])
            view = memoryview(payload.view(torch.uint8).numpy()).cast("B")
        elif kind == CopyKind.CPU_TO_SSD:
            view = self._slot_bytes_view(source)
        else:
            raise RuntimeError(f"a {kind.name} copy in a flush")
        if not self.writer:
            return True
        try:
            self.ssd.write(block_hash, self.heads, key, self.layout, self.dtype_name, view)
            return True
        except OSError as e:
            log.warning("flush of block %s to SSD failed: %s", block_hash.hex()[:16], e)
            return False

    def measure_copy_bandwidth(self) -> float:
        """Bytes per second of a block-sized copy between the pool and the CPU tier."""
        k = self.kv[0][0]
        n = min(8, k.shape[0])
        src = k[:n]
        dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=self.device.type == "cuda")
        dst.copy_(src)  # warm
        t0 = time.perf_counter()
        for _ in range(4):
            dst.copy_(src)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = (time.perf_counter() - t0) / 4
        return src.numel() * src.element_size() / max(seconds, 1e-9)

    def close(self) -> None:
        self._open_gate()
        for q in self._queues:
            q.close()
        self._queues = []

"""One rank's KV tiers: a CPU tier beside its shard of the KV pool, and an SSD tier of files.

The rank decides nothing: it runs each step's TierOps (scheduler/messages.py) in order, before
the forward. Swap-outs (pool block -> CPU slot) and swap-ins (CPU slot -> pool block) are
synchronous: on CPU they are memcpys done there and then; on CUDA they run on a dedicated copy
stream into pinned memory, and the forward's stream waits for them. Loads (SSD entry -> CPU slot)
and spills (CPU slot -> SSD entry) run on two background threads, each in issue order (a load
never waits behind a backlog of write-backs); every rank reports how far each kind got and the
ranks agree (one small all-reduce) before rank 0 acknowledges them to the engine.

CPU tier layout: [slots, layers, 2 (K, V), block_size, kv_heads, head_dim], one slot contiguous,
so that an SSD entry is one read or write. An SSD entry is a file
  <ssd_path>/<model fingerprint>/rank<r>/<entry>.kv
holding a header (block hash, hashed key with its token ids, the rank's fingerprint: weights,
dtype, TP size and rank, block size, hash seed, layout; the payload's length and xxh3-128) and
the payload. It is written to a temporary name, fsynced and renamed; a load checks the header
against what the engine expects and the payload against its checksum, and a failed check is
reported, never served.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
from dataclasses import dataclass
from typing import Callable

import msgspec
import torch
import xxhash

from tierserve.scheduler.messages import FlushTiers, TierOps
from tierserve.workers.parallel import get_tp_size, tp_all_reduce_max

__all__ = ["TierStore", "SsdStore", "SsdHeader", "model_fingerprint", "tier_slots",
           "LOAD", "SPILL"]

log = logging.getLogger("tierserve.tiers")

LOAD, SPILL = 1, 2  # kvcache.tiers.CopyKind, as the wire carries it
_MAGIC = b"TSKV\x01\x00\x00\x00"
_PREFIX = struct.Struct("<8sI")  # magic, header length
_HEADER_SUM = struct.Struct("<Q")  # xxh3-64 of the header bytes
# Async copies of a kind one TP agreement can report (failures travel as a bitmap this wide).
_WINDOW = 1024


def tier_slots(kv_offload_cpu_bytes: int, kv_offload_ssd_bytes: int, block_bytes: int
               ) -> tuple[int, int]:
    """(CPU slots, SSD entries) of one rank for these byte budgets."""
    return kv_offload_cpu_bytes // block_bytes, kv_offload_ssd_bytes // block_bytes


def model_fingerprint(model_path: str, **fields) -> str:
    """A stable digest of what makes a block's KV: the weights' files (name, size, mtime) and the
    given fields (dtype, TP size and rank, block size, hash seed, layout)."""
    files = [model_path] if os.path.isfile(model_path) else sorted(
        os.path.join(model_path, f) for f in os.listdir(model_path)
        if f.endswith((".safetensors", ".gguf", ".bin")))
    weights = []
    for path in files:
        st = os.stat(path)
        weights.append([os.path.basename(path), st.st_size, st.st_mtime_ns])
    blob = json.dumps({"weights": weights, **fields}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


class SsdHeader(msgspec.Struct, array_like=True):
    fingerprint: str
    rank: int
    entry: int
    block_hash: bytes
    hash_key: bytes
    layout: list[int]  # [layers, 2, block_size, kv_heads, head_dim]
    dtype: str
    payload_len: int
    payload_xxh3: bytes  # xxh3-128 digest


class SsdStore:
    """One rank's SSD entries under <root>/<model fingerprint>/rank<r>/."""

    _encoder = msgspec.msgpack.Encoder()
    _decoder = msgspec.msgpack.Decoder(SsdHeader)

    def __init__(self, root: str, model_fp: str, rank_fp: str, rank: int, num_entries: int,
                 layout: list[int], dtype: torch.dtype) -> None:
        self.dir = os.path.join(root, model_fp[:32], f"rank{rank}")
        os.makedirs(self.dir, exist_ok=True)
        self.fingerprint, self.rank, self.num_entries = rank_fp, rank, num_entries
        self.layout, self.dtype = list(layout), str(dtype).removeprefix("torch.")

    def path(self, entry: int) -> str:
        return os.path.join(self.dir, f"{entry:08d}.kv")

    def write(self, entry: int, block_hash: bytes, key: bytes, payload: memoryview) -> None:
        header = self._encoder.encode(SsdHeader(
            self.fingerprint, self.rank, entry, block_hash, key, self.layout, self.dtype,
            payload.nbytes, xxhash.xxh3_128_digest(payload)))
        tmp = f"{self.path(entry)}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(_PREFIX.pack(_MAGIC, len(header)))
            f.write(header)
            f.write(_HEADER_SUM.pack(xxhash.xxh3_64_intdigest(header)))
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path(entry))

    def read(self, entry: int, block_hash: bytes, key: bytes, out: memoryview) -> str | None:
        """Reads the entry into `out`; None when every check passes, else why it failed."""
        try:
            with open(self.path(entry), "rb") as f:
                header = self._header(f)
                if isinstance(header, str):
                    return header
                why = self._mismatch(header, entry, block_hash, key, out.nbytes)
                if why:
                    return why
                if f.readinto(out) != out.nbytes:
                    return "truncated payload"
        except OSError as e:
            return f"unreadable: {e}"
        if xxhash.xxh3_128_digest(out) != header.payload_xxh3:
            return "payload checksum mismatch"
        return None

    def _header(self, f) -> SsdHeader | str:
        """The entry's header (the file positioned at its payload), or why it is unusable."""
        prefix = f.read(_PREFIX.size)
        if len(prefix) != _PREFIX.size:
            return "truncated header"
        magic, length = _PREFIX.unpack(prefix)
        if magic != _MAGIC or length > 1 << 20:
            return "not a tierserve KV entry"
        raw = f.read(length)
        check = f.read(_HEADER_SUM.size)
        if len(raw) != length or len(check) != _HEADER_SUM.size:
            return "truncated header"
        if xxhash.xxh3_64_intdigest(raw) != _HEADER_SUM.unpack(check)[0]:
            return "header checksum mismatch"
        try:
            return self._decoder.decode(raw)
        except msgspec.DecodeError as e:
            return f"malformed header: {e}"

    def _mismatch(self, h: SsdHeader, entry: int, block_hash: bytes | None, key: bytes | None,
                  nbytes: int) -> str | None:
        if h.fingerprint != self.fingerprint or h.rank != self.rank:
            return "another model, dtype, TP layout or hash seed"
        if h.layout != self.layout or h.dtype != self.dtype or h.payload_len != nbytes:
            return "another KV layout"
        if h.entry != entry:
            return "entry number mismatch"
        if block_hash is not None and (h.block_hash != block_hash or (key and h.hash_key != key)):
            return "another block"
        return None

    def scan(self, nbytes: int) -> list[tuple[int, bytes, bytes]]:
        """(entry, block hash, hashed key) of every entry whose header checks out and whose
        file is whole (payloads are checked when loaded)."""
        found = []
        for name in os.listdir(self.dir):
            if not name.endswith(".kv"):
                if ".tmp" in name:  # a write cut short by a crash
                    _remove(os.path.join(self.dir, name))
                continue
            try:
                entry = int(name[:-3])
            except ValueError:
                continue
            if entry >= self.num_entries:
                continue
            try:
                with open(self.path(entry), "rb") as f:
                    header = self._header(f)
                    whole = not isinstance(header, str) and (
                        os.fstat(f.fileno()).st_size == f.tell() + header.payload_len)
            except OSError:
                continue
            if whole and not self._mismatch(header, entry, None, None, nbytes):
                found.append((entry, header.block_hash, header.hash_key))
        return found


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


@dataclass(slots=True)
class _Copy:
    seq: int
    kind: int
    cpu_slot: int
    entry: int
    block_hash: bytes
    key: bytes


class _Queue:
    """One kind of asynchronous copy on its own thread, completed in issue order."""

    def __init__(self, name: str, run) -> None:
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
            ok = self._run(copy)
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


class TierStore:
    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], cpu_slots: int,
                 ssd: SsdStore | None, device: torch.device) -> None:
        k0 = kv_caches[0][0]
        self.kv = kv_caches
        self.device = device
        self.layout = [len(kv_caches), 2, *k0.shape[1:]]
        pinned = device.type == "cuda"
        self.cpu = torch.zeros((cpu_slots, *self.layout), dtype=k0.dtype, pin_memory=pinned)
        self.ssd = ssd
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # Per kind (LOAD, SPILL), in that order: the wire's tier_done follows it.
        self._queues = [] if ssd is None else [
            _Queue("tierserve-tier-loads", self._load), _Queue("tierserve-tier-spills",
                                                                 self._spill)]

    @property
    def slot_bytes(self) -> int:
        return self.cpu[0].numel() * self.cpu.element_size() if len(self.cpu) else 0

    def _slot_view(self, slot: int) -> memoryview:
        return memoryview(self.cpu[slot].view(torch.uint8).numpy()).cast("B")

    # ---------------------------------------------------------------- synchronous copies

    def run(self, ops: TierOps, between: Callable[[], None] | None = None) -> None:
        """This step's copies, in order: swap-outs, `between` (copies inside the pool: a
        block it writes may be swapped out first, one it reads may be swapped into after),
        swap-ins, then the async ones queued."""
        if ops.out_blocks:
            self._copy(ops.out_blocks, ops.out_slots, to_cpu=True)
        if between is not None:
            if self.copy_stream is not None and ops.out_blocks:
                torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
            between()
        if ops.in_slots:
            self._copy(ops.in_blocks, ops.in_slots, to_cpu=False)
        if self.copy_stream is not None and (ops.out_blocks or ops.in_slots):
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
        for i, seq in enumerate(ops.seqs):
            if self.ssd is None:
                raise RuntimeError("an SSD copy was sent to a rank without an SSD tier")
            kind = ops.kinds[i]
            self._queues[kind - 1].put(_Copy(seq, kind, ops.cpu_slots[i], ops.ssd_entries[i],
                                             ops.hashes[i], ops.keys[i]))

    def _copy(self, blocks: list[int], slots: list[int], to_cpu: bool) -> None:
        # [n] index tensors; each layer's K and V move as one gather or scatter.
        block_idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
        slot_idx = torch.tensor(slots, dtype=torch.long)
        stream = torch.cuda.stream(self.copy_stream) if self.copy_stream is not None else None
        if stream is not None:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            stream.__enter__()
        try:
            for layer, (k, v) in enumerate(self.kv):
                for which, pool in enumerate((k, v)):
                    if to_cpu:
                        # [n, block_size, kv_heads, head_dim]
                        self.cpu[slot_idx, layer, which] = pool.index_select(0, block_idx).to(
                            "cpu", non_blocking=True)
                    else:
                        pool.index_copy_(0, block_idx, self.cpu[slot_idx, layer, which].to(
                            self.device, non_blocking=True))
        finally:
            if stream is not None:
                stream.__exit__(None, None, None)

    # ---------------------------------------------------------------- asynchronous copies

    def _spill(self, copy: _Copy) -> bool:
        try:
            self.ssd.write(copy.entry, copy.block_hash, copy.key, self._slot_view(copy.cpu_slot))
            return True
        except OSError as e:
            log.warning("spill to SSD entry %d failed: %s", copy.entry, e)
            return False

    def _load(self, copy: _Copy) -> bool:
        why = self.ssd.read(copy.entry, copy.block_hash, copy.key,
                            self._slot_view(copy.cpu_slot))
        if why is not None:
            log.warning("SSD entry %d not loaded (%s): its tokens will be recomputed",
                        copy.entry, why)
            return False
        return True

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
        for k, (q, done, failed) in enumerate(zip(self._queues, dones, fails)):
            q.settle(done)
            for s in failed:
                flat += [k + 1, s]
        return dones, flat

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Waits until every queued async copy completed here (tests, shutdown)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not all(q.idle() for q in self._queues):
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    # ---------------------------------------------------------------- restart

    def scan(self) -> list[tuple[int, bytes, bytes]]:
        return [] if self.ssd is None else self.ssd.scan(self.slot_bytes)

    def flush(self, msg: FlushTiers) -> list[int]:
        """Writes the listed device blocks and CPU slots to their SSD entries until the
        deadline; returns the entries written."""
        if self.ssd is None:
            return []
        self.wait_idle(msg.deadline_s)
        deadline = time.monotonic() + msg.deadline_s
        written = []
        staging = torch.empty(self.layout, dtype=self.cpu.dtype)
        staged = memoryview(staging.view(torch.uint8).numpy()).cast("B")
        for block, entry, h, key in zip(msg.device_blocks, msg.device_entries,
                                        msg.device_hashes, msg.device_keys):
            if time.monotonic() > deadline:
                return written
            for layer, (k, v) in enumerate(self.kv):
                staging[layer, 0].copy_(k[block])
                staging[layer, 1].copy_(v[block])
            if self._write(entry, h, key, staged):
                written.append(entry)
        for slot, entry, h, key in zip(msg.cpu_slots, msg.cpu_entries, msg.cpu_hashes,
                                       msg.cpu_keys):
            if time.monotonic() > deadline:
                return written
            if self._write(entry, h, key, self._slot_view(slot)):
                written.append(entry)
        return written

    def _write(self, entry: int, h: bytes, key: bytes, payload: memoryview) -> bool:
        try:
            self.ssd.write(entry, h, key, payload)
            return True
        except OSError as e:
            log.warning("flush to SSD entry %d failed: %s", entry, e)
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
        for q in self._queues:
            q.close()
        self._queues = []

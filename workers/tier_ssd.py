"""The SSD tier's folder: content-addressed KV entries, shared by every engine on it.

An entry holds one KV-head range of one block, all layers, K and V:
  <root>/<fingerprint[:32]>/<hash hex[:2]>/<hash hex>.h<lo>-<hi>.kv
Its name derives from the KV fingerprint (workers/kv_fingerprint.py: the weights' bytes, the
config fields that change the KV, dtype, block size, hash seed, format), the block hash and the
head range, so any engine on the folder, of any TP size, finds it with one `open` and no
shared index. A rank needing heads [a, b) reads the entry of exactly that range, else one
holding more heads (a smaller TP size wrote it), else the entries of a partition of it (a
larger TP size wrote them).

A file is a header (msgpack, with its own xxh3-64) and the payload
[layers, 2, block_size, heads, head_dim] with its xxh3-128. It is written to a temporary name,
fsynced and renamed, so a reader sees a whole entry or none; a read checks the header against
what it expects and the payload against its checksum, and a failed check is a miss, never
served. Deleting an entry while another engine reads it is safe: the reader holds the file.

Capacity is the folder's, whoever writes: a writer that has written about an eighth of it
since it last looked, or thinks the folder full, lists the folder and deletes the coldest
entries (oldest modification time; a read touches its entry) down to 90% of it.
"""
from __future__ import annotations

import logging
import os
import struct
import threading
import time

import msgspec
import xxhash

__all__ = ["SsdFolder", "SsdHeader", "kv_head_range", "FORMAT_VERSION"]

log = logging.getLogger("tierserve.tier_ssd")

# Part of the KV fingerprint: entries of another format never match.
FORMAT_VERSION = 2
_MAGIC = b"TSKV\x02\x00\x00\x00"
_PREFIX = struct.Struct("<8sI")  # magic, header length
_HEADER_SUM = struct.Struct("<Q")  # xxh3-64 of the header bytes
_MAX_HEADER = 1 << 20
# A temporary file older than this is a write cut short (a crash): removed when trimming.
_STALE_TMP_S = 600.0
_TRIM_TO = 0.9


def kv_head_range(num_kv_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    """The KV heads [lo, hi) rank `rank` holds (workers/layers.py QKVParallelLinear): an even
    split, or one head shared by tp_size // num_kv_heads neighbouring ranks."""
    if num_kv_heads % tp_size == 0:
        per = num_kv_heads // tp_size
        return rank * per, (rank + 1) * per
    replicas = tp_size // num_kv_heads
    return rank // replicas, rank // replicas + 1


class SsdHeader(msgspec.Struct, array_like=True):
    fingerprint: str
    block_hash: bytes
    hash_key: bytes
    heads: tuple[int, int]
    layout: list[int]  # [layers, 2, block_size, heads, head_dim]
    dtype: str
    payload_len: int
    payload_xxh3: bytes  # xxh3-128 digest


class SsdFolder:
    """One engine's view of a shared SSD folder."""

    _encoder = msgspec.msgpack.Encoder()
    _decoder = msgspec.msgpack.Decoder(SsdHeader)

    def __init__(self, root: str, fingerprint: str, num_kv_heads: int,
                 capacity_bytes: int) -> None:
        if not root:
            raise ValueError("the SSD tier needs a folder path")
        if not fingerprint:
            raise ValueError("the SSD tier needs the model's KV fingerprint")
        self.root = root
        self.dir = os.path.join(root, fingerprint[:32])
        self.fingerprint = fingerprint
        self.num_kv_heads = num_kv_heads
        self.capacity = capacity_bytes
        self._chunks = [c for c in range(1, num_kv_heads + 1) if num_kv_heads % c == 0]
        self._lock = threading.Lock()
        self._usage = -1  # bytes in the folder when last listed, plus what this writer added
        self._since_trim = 0

    # ---------------------------------------------------------------- names

    def path(self, block_hash: bytes, heads: tuple[int, int]) -> str:
        name = block_hash.hex()
        return os.path.join(self.dir, name[:2], f"{name}.h{heads[0]}-{heads[1]}.kv")

    def sources(self, block_hash: bytes, heads: tuple[int, int]
                ) -> list[tuple[str, tuple[int, int]]] | None:
        """The entries holding heads [a, b) of the block, as (path, their range): the exact
        range, else one range holding it, else a partition of it in equal ranges; None when
        the folder has none of these."""
        a, b = heads
        exact = self.path(block_hash, heads)
        if os.path.exists(exact):
            return [(exact, heads)]
        for c in self._chunks:
            if c > b - a:
                lo = a // c * c
                if b <= lo + c:
                    path = self.path(block_hash, (lo, lo + c))
                    if os.path.exists(path):
                        return [(path, (lo, lo + c))]
        for c in reversed(self._chunks):
            if c < b - a and (b - a) % c == 0 and a % c == 0:
                parts = [(self.path(block_hash, (h, h + c)), (h, h + c)) for h in range(a, b, c)]
                if all(os.path.exists(p) for p, _ in parts):
                    return parts
        return None

    def has_block(self, block_hash: bytes, ranges) -> bool:
        """Whether the folder holds every head range in `ranges` of the block."""
        return all(self.sources(block_hash, r) is not None for r in ranges)

    # ---------------------------------------------------------------- entries

    def write(self, block_hash: bytes, heads: tuple[int, int], key: bytes, layout: list[int],
              dtype: str, payload: memoryview) -> None:
        """Writes the entry atomically (a temporary file, fsync, rename); OSError on failure."""
        header = self._encoder.encode(SsdHeader(
            self.fingerprint, block_hash, key, heads, list(layout), dtype, payload.nbytes,
            xxhash.xxh3_128_digest(payload)))
        path = self.path(block_hash, heads)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}.{threading.get_ident()}"
        try:
            with open(tmp, "wb") as f:
                f.write(_PREFIX.pack(_MAGIC, len(header)))
                f.write(header)
                f.write(_HEADER_SUM.pack(xxhash.xxh3_64_intdigest(header)))
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            _remove(tmp)
            raise
        self._account(payload.nbytes + len(header) + _PREFIX.size + _HEADER_SUM.size)

    def read(self, path: str, block_hash: bytes, heads: tuple[int, int], key: bytes | None,
             layout: list[int], dtype: str, out: memoryview) -> str | None:
        """Reads the entry's payload into `out`; None when every check passed, else why not
        (a missing entry included). key None: any key (hits are not verified)."""
        try:
            with open(path, "rb") as f:
                header = self._header(f)
                if isinstance(header, str):
                    return header
                why = self._mismatch(header, block_hash, heads, key, layout, dtype, out.nbytes)
                if why:
                    return why
                if f.readinto(out) != out.nbytes:
                    return "truncated payload"
        except FileNotFoundError:
            return "missing (another engine may have trimmed it)"
        except OSError as e:
            return f"unreadable: {e}"
        if xxhash.xxh3_128_digest(out) != header.payload_xxh3:
            return "payload checksum mismatch"
        try:
            os.utime(path)  # recently used: trimmed last
        except OSError:
            pass
        return None

    def _header(self, f) -> SsdHeader | str:
        """The entry's header (the file positioned at its payload), or why it is unusable."""
        prefix = f.read(_PREFIX.size)
        if len(prefix) != _PREFIX.size:
            return "truncated header"
        magic, length = _PREFIX.unpack(prefix)
        if magic != _MAGIC or length > _MAX_HEADER:
            return "not a tierserve KV entry of this format"
        raw = f.read(length)
        check = f.read(_HEADER_SUM.size)
        if len(raw) != length or len(check) != _HEADER_SUM.size:
            return "truncated header"
        if xxhash.xxh3_64_intdigest(raw) != _HEADER_SUM.unpack(check)[0]:
            return "header checksum mismatch"
        try:
            return self._decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return f"malformed header: {e}"

    def _mismatch(self, h: SsdHeader, block_hash: bytes, heads: tuple[int, int],
                  key: bytes | None, layout: list[int], dtype: str, nbytes: int) -> str | None:
        if h.fingerprint != self.fingerprint:
            return "another model, dtype, block size or hash seed"
        if tuple(h.heads) != tuple(heads) or h.layout != list(layout) or h.dtype != dtype \
                or h.payload_len != nbytes:
            return "another KV layout"
        if h.block_hash != block_hash or (key and h.hash_key != key):
            return "another block"
        return None

    # ---------------------------------------------------------------- capacity

    def _account(self, nbytes: int) -> None:
        with self._lock:
            self._since_trim += nbytes
            if self._usage >= 0:
                self._usage += nbytes
            due = self._usage < 0 or self._usage > self.capacity or \
                self._since_trim > self.capacity // 8
        if due:
            self.trim()

    def trim(self) -> int:
        """Lists the folder; past capacity, deletes the coldest entries down to 90% of it.
        Returns the bytes the folder holds after."""
        entries, total = [], 0
        now = time.time()
        for path, st in _walk_entries(self.root):
            if path.endswith(".kv"):
                entries.append((st.st_mtime_ns, st.st_size, path))
                total += st.st_size
            elif now - st.st_mtime > _STALE_TMP_S:
                _remove(path)
        if total > self.capacity:
            entries.sort()
            goal = int(self.capacity * _TRIM_TO)
            for _, size, path in entries:
                if total <= goal:
                    break
                if _remove(path):
                    total -= size
        with self._lock:
            self._usage, self._since_trim = total, 0
        return total


def _walk_entries(root: str):
    """(path, stat) of every entry and temporary file under <root>/<fp>/<xx>/."""
    for top in _scandir(root):
        if not top.is_dir(follow_symlinks=False):
            continue
        for sub in _scandir(top.path):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for item in _scandir(sub.path):
                if item.name.endswith(".kv") or ".kv.tmp" in item.name:
                    try:
                        yield item.path, item.stat(follow_symlinks=False)
                    except OSError:  # deleted meanwhile
                        continue


def _scandir(path: str):
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []


def _remove(path: str) -> bool:
    try:
        os.remove(path)
        return True
    except OSError:
        return False

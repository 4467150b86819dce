"""The request log: one compact record per finished request, for `tierserve analyze`.

A log file is a sequence of frames, each a 4-byte little-endian length and a msgpack body: first
a LogHeader (the engine's block size, hash width, capacities and costs), then RequestRecords in
the order requests finished. A record carries no text and no token ids (unless the engine runs
with request_log_tokens): the prompt's and the output's full blocks appear as their block-hash
chain (the cache salt is in it), each hash cut to its first HASH_BYTES bytes, and the salt's
tenant as a one-way id.

Writing happens off the engine's step loop: the scheduler hands each finished Request to
`RequestLog.add` (a deque append), and a writer thread encodes and appends them in batches,
rotating the file when it would grow past max_bytes (PATH -> PATH.1 -> PATH.2 ..., the oldest
beyond `keep` deleted). Reading (`read_log`) checks every frame and names the file and record of
the first bad one.
"""
from __future__ import annotations

import array
import collections
import hashlib
import logging
import os
import struct
import sys
import threading
import time
from typing import Iterator

import msgspec

from tierserve.kvcache.tenants import tenant_of

__all__ = ["LogHeader", "RequestRecord", "RequestLog", "read_log", "write_log", "LogError",
           "LOG_VERSION", "HASH_BYTES", "tenant_id", "chain_ints", "MAGIC", "is_request_log"]

log = logging.getLogger("tierserve.request_log")

MAGIC = "tierserve-request-log"
LOG_VERSION = 1
# Bytes kept of each 16-byte block hash: a collision among 10^8 distinct blocks has odds ~3e-4.
HASH_BYTES = 8
_FRAME = struct.Struct("<I")
# A frame longer than this is a corrupt length, not a record (a 1M-token prompt's chain is 0.5 MB).
_MAX_FRAME = 1 << 28
# The writer thread wakes at least this often, or once this many records are waiting.
_FLUSH_S = 1.0
_BATCH = 512


class LogHeader(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What a replay needs to know about the engine that wrote the log. Capacities are per
    rank (CPU slots and SSD entries in blocks); costs are 0 where not measured."""

    magic: str
    version: int
    block_size: int
    hash_bytes: int = HASH_BYTES
    hash_algo: str = "xxhash"
    hash_seed: int = 0
    model: str = ""
    dtype: str = ""
    tensor_parallel_size: int = 1
    kv_block_bytes: int = 0  # one block on one rank
    num_blocks: int = 0  # the device pool, null block included (num_kv_blocks)
    cpu_slots: int = 0
    ssd_entries: int = 0  # blocks (each of kv_head_ranges entries of kv_block_bytes)
    kv_head_ranges: int = 1  # distinct KV-head ranges over the ranks
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    copy_bytes_per_s: float = 0.0
    created: float = 0.0  # unix time the file was started
    with_tokens: bool = False


class RequestRecord(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One finished request (one sample of it, for n > 1). Times are seconds; `arrival` is unix
    time. `hashes` is the chain of every full block of prompt + output (cut to the header's
    hash_bytes each): the first prompt_len // block_size are the prompt's."""

    arrival: float
    prompt_len: int
    output_len: int
    hashes: bytes
    tenant: int = 0  # 0: no cache salt; else tenant_id(salt)
    cached_device: int = 0  # prompt tokens served from each tier at admission
    cached_cpu: int = 0
    cached_ssd: int = 0
    ttft: float = -1.0  # -1: no token was produced
    e2e: float = 0.0
    queued: float = 0.0  # arrival to first scheduled (the step that admitted it)
    finish: int = 0  # FinishReason
    index: int = 0  # which sample of its request
    tokens: bytes = b""  # prompt + output token ids as little-endian uint32, with tokens on


class LogError(ValueError):
    """A log that cannot be read: names the file and the record."""


def tenant_id(cache_salt: str | None) -> int:
    """A stable 63-bit id, that does not reveal it, of the tenant a cache salt belongs to (the
    salt up to its first "|": kvcache.tenants.tenant_of); 0 for none."""
    tenant = tenant_of(cache_salt)
    if tenant is None:
        return 0
    digest = hashlib.blake2b(tenant.encode("utf-8"), digest_size=8,
                             person=b"ts-tenant").digest()
    return (int.from_bytes(digest, "little") >> 1) or 1


def chain_ints(hashes: bytes, width: int = HASH_BYTES) -> list[int]:
    """A record's chain as ints (what the replay keys blocks by)."""
    if width == 8:
        out = array.array("Q", hashes)
        if sys.byteorder != "little":
            out.byteswap()
        return out.tolist()
    return [int.from_bytes(hashes[i:i + width], "little") for i in range(0, len(hashes), width)]


def _frame(body: bytes) -> bytes:
    return _FRAME.pack(len(body)) + body


class RequestLog:
    """Appends a record per finished request to `path`, from a thread of its own."""

    def __init__(self, path: str, header: LogHeader, *, with_tokens: bool = False,
                 max_bytes: int = 256 << 20, keep: int = 8) -> None:
        if max_bytes <= 0 or keep < 0:
            raise ValueError("request log: max_bytes must be > 0 and keep >= 0")
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise ValueError(f"request_log_path: folder {folder!r} does not exist")
        self.path = path
        self.header = msgspec.structs.replace(header, with_tokens=with_tokens)
        self.with_tokens = with_tokens
        self.max_bytes = max_bytes
        self.keep = keep
        self.num_written = 0
        self.num_dropped = 0
        self._pending: collections.deque = collections.deque()
        self._encoder = msgspec.msgpack.Encoder()
        self._file = None
        self._size = 0
        self._wake = threading.Event()
        self._closed = False
        self._failed = False
        try:
            self._open()
        except OSError as e:
            raise ValueError(f"request_log_path: cannot write {path!r}: {e}") from None
        self._thread = threading.Thread(target=self._run, name="request-log", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the step loop's side

    def add(self, request, finished_at: float | None = None) -> None:
        """A request finished (the scheduler's Request, read later on the writer thread: a
        finished request is never changed again). O(1)."""
        self._pending.append((request, time.monotonic() if finished_at is None else finished_at))
        if len(self._pending) >= _BATCH:
            self._wake.set()

    def close(self) -> None:
        """Writes what is pending and closes the file."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        self._thread.join(30.0)
        try:
            self._write_pending()
        except Exception:  # a shutdown goes on without the last records
            log.exception("request log %s: the last records could not be written", self.path)
        if self._file is not None:
            self._file.close()
            self._file = None

    # ------------------------------------------------------------------ the writer thread

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(_FLUSH_S)
            self._wake.clear()
            try:
                self._write_pending()
            except Exception:  # never the engine's problem: the records are dropped, said once
                if not self._failed:
                    log.exception("request log %s: write failed; records are dropped",
                                  self.path)
                self._failed = True

    def _write_pending(self) -> None:
        pending = self._pending
        if not pending:
            return
        offset = time.time() - time.monotonic()
        chunk: list[bytes] = []
        size = self._size
        while pending:
            request, finished_at = pending.popleft()
            frame = _frame(self._encoder.encode(self._record(request, finished_at, offset)))
            if size > self._header_size and size + len(frame) > self.max_bytes:
                self._write(chunk)
                chunk = []
                self._rotate()
                size = self._size
            chunk.append(frame)
            size += len(frame)
        self._write(chunk)

    def _write(self, frames: list[bytes]) -> None:
        if not frames:
            return
        data = b"".join(frames)
        try:
            self._file.write(data)
            self._file.flush()
        except OSError:
            self.num_dropped += len(frames)
            raise
        self._size += len(data)
        self.num_written += len(frames)

    def _record(self, req, finished_at: float, offset: float) -> RequestRecord:
        hashes = b"".join([h[:HASH_BYTES] for h in req.block_hashes])
        first = req.first_token_time
        device, cpu, ssd = req.cached_by_tier
        return RequestRecord(
            arrival=req.arrival_time + offset, prompt_len=req.num_prompt_tokens,
            output_len=req.num_output_tokens, hashes=hashes, tenant=tenant_id(req.cache_salt),
            cached_device=device, cached_cpu=cpu, cached_ssd=ssd,
            ttft=first - req.arrival_time if first is not None else -1.0,
            e2e=finished_at - req.arrival_time, finish=_finish_code(req.status),
            queued=req.admitted_at - req.arrival_time if req.admitted_at is not None else 0.0,
            index=req.index,
            tokens=array.array("I", req.all_token_ids).tobytes() if self.with_tokens else b"")

    def _open(self) -> None:
        """A fresh file headed by this engine's header; a file an earlier engine left is
        rotated first (its records belong to its header)."""
        if os.path.exists(self.path) and os.path.getsize(self.path) > 0:
            self._shift()
        self.header = msgspec.structs.replace(self.header, created=time.time())
        head = _frame(self._encoder.encode(self.header))
        self._file = open(self.path, "wb")
        self._file.write(head)
        self._file.flush()
        self._size = self._header_size = len(head)

    def _rotate(self) -> None:
        self._file.close()
        self._open()

    def _shift(self) -> None:
        """PATH -> PATH.1, PATH.1 -> PATH.2, ...; the oldest beyond `keep` is deleted."""
        if self.keep == 0:
            os.remove(self.path)
        else:
            oldest = f"{self.path}.{self.keep}"
            if os.path.exists(oldest):
                os.remove(oldest)
            for i in range(self.keep - 1, 0, -1):
                if os.path.exists(f"{self.path}.{i}"):
                    os.replace(f"{self.path}.{i}", f"{self.path}.{i + 1}")
            os.replace(self.path, f"{self.path}.1")


def write_log(path: str, header: LogHeader, records) -> int:
    """Writes a whole log (a header and the records, an iterable): for tools and tests that
    make logs of their own. Returns the number of records."""
    encoder = msgspec.msgpack.Encoder()
    n = 0
    with open(path, "wb") as f:
        f.write(_frame(encoder.encode(header)))
        for record in records:
            f.write(_frame(encoder.encode(record)))
            n += 1
    return n


def _finish_code(status) -> int:
    # RequestStatus FINISHED_STOPPED.. FINISHED_REPETITION map in order onto FinishReason 0..4.
    return max(int(status) - 3, 0)


# ---------------------------------------------------------------------- reading

_HEAD_DECODER = msgspec.msgpack.Decoder(LogHeader)
_RECORD_DECODER = msgspec.msgpack.Decoder(RequestRecord)


def is_request_log(path: str) -> bool:
    """Whether the file starts like a request log (the other inputs are JSON text)."""
    with open(path, "rb") as f:
        head = f.read(64)
    return len(head) > 4 and MAGIC.encode() in head


def read_log(path: str) -> tuple[LogHeader, Iterator[RequestRecord]]:
    """The file's header and an iterator over its records; a bad frame raises LogError naming
    the file and the record (1-based)."""
    f = open(path, "rb")
    try:
        header = _read_header(f, path)
    except BaseException:
        f.close()
        raise
    return header, _records(f, path)


def _read_frame(f, path: str, index: int) -> bytes | None:
    raw = f.read(4)
    if not raw:
        return None
    where = f"{path}: record {index}" if index else f"{path}: header"
    if len(raw) < 4:
        raise LogError(f"{where} is truncated (the file ends inside its length)")
    (size,) = _FRAME.unpack(raw)
    if size > _MAX_FRAME:
        raise LogError(f"{where}: frame length {size} is corrupt")
    body = f.read(size)
    if len(body) < size:
        raise LogError(f"{where} is truncated ({len(body)} of {size} bytes)")
    return body


def _read_header(f, path: str) -> LogHeader:
    body = _read_frame(f, path, 0)
    if body is None:
        raise LogError(f"{path}: empty file, not a request log")
    try:
        fields = msgspec.msgpack.decode(body)
    except msgspec.DecodeError as e:
        raise LogError(f"{path}: header: not a request log ({e})") from None
    if not isinstance(fields, list) or len(fields) < 3 or fields[0] != MAGIC:
        raise LogError(f"{path}: header: not a tierserve request log")
    if fields[1] != LOG_VERSION:
        raise LogError(f"{path}: header: request log version {fields[1]!r} is not supported "
                       f"(this tierserve reads version {LOG_VERSION})")
    try:
        return _HEAD_DECODER.decode(body)
    except msgspec.DecodeError as e:
        raise LogError(f"{path}: header: {e}") from None


def _records(f, path: str) -> Iterator[RequestRecord]:
    with f:
        index = 1
        while True:
            body = _read_frame(f, path, index)
            if body is None:
                return
            try:
                yield _RECORD_DECODER.decode(body)
            except msgspec.DecodeError as e:
                raise LogError(f"{path}: record {index}: {e}") from None
            index += 1

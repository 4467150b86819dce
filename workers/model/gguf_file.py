"""A minimal GGUF (v2 and v3) reader: metadata as Python values, tensors as views of one mmap.

gguf.GGUFReader builds a numpy view per metadata element, which costs seconds on a 49k-entry
vocabulary and merge table; here a numeric array is one np.frombuffer and a string array one tight
loop, so a whole file's metadata reads in tens of milliseconds.

Layout, all little-endian: magic b"GGUF", u32 version, u64 tensor count, u64 key/value count; the
key/values (string key, u32 value type, value); the tensor infos (string name, u32 n_dims, u64
dims fastest-varying first, u32 ggml type, u64 offset into the data section); padding up to
`general.alignment`; the tensor data. A string is a u64 byte length and UTF-8 bytes; an array is a
u32 element type, a u64 count and the elements (an element that is itself an array carries its
own type and count).
"""
from __future__ import annotations

import functools
import math
import mmap
import os
import struct
from typing import Any, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

__all__ = ["GGUFFile", "GGUFTensor", "open_gguf", "GGUF_MAGIC", "SUPPORTED_VERSIONS"]

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)  # v1 counted with u32; v2 and v3 share one layout
DEFAULT_ALIGNMENT = 32

# Fixed-width metadata value types of the GGUF spec; 8 (string) and 9 (array) are variable-width.
_SCALARS = {code: struct.Struct(fmt) for code, fmt in {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
    10: "<Q", 11: "<q", 12: "<d"}.items()}
_DTYPES = {code: np.dtype(s.format) for code, s in _SCALARS.items()}
_STRING, _ARRAY = 8, 9
_MAX_ARRAY_NESTING = 32  # a deeper nesting is garbage, and would otherwise exhaust the stack

_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_HEADER = struct.Struct("<4sIQQ")
_ARRAY_HEAD = struct.Struct("<IQ")  # element type, count
_TENSOR_TAIL = struct.Struct("<IQ")  # ggml type, offset into the data section


class GGUFTensor(NamedTuple):
    name: str
    # Row-major element shape: ggml's dims reversed, e.g. (vocab, hidden) for token_embd.
    shape: tuple[int, ...]
    tensor_type: GGMLQuantizationType
    # Read-only uint8 view of the file, shaped (*shape[:-1], bytes per row): the layout
    # gguf.quants.dequantize expects for every type, plain floats included.
    data: np.ndarray
    offset: int  # absolute file offset of the data


class _Parser:
    """Sequential reads from the mapped file. Running past its end raises struct.error (from
    unpack_from) or ValueError (slices, checked explicitly since slicing would just come up short)."""

    def __init__(self, buf: mmap.mmap, path: str) -> None:
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def _advance(self, nbytes: int) -> int:
        """Start of the next `nbytes`; moves past them."""
        start, end = self.pos, self.pos + nbytes
        if end > self.size:
            raise ValueError(f"{self.path}: truncated GGUF file (needs {end} bytes, has {self.size})")
        self.pos = end
        return start

    def unpack(self, st: struct.Struct) -> tuple:
        values = st.unpack_from(self.buf, self.pos)
        self.pos += st.size
        return values

    def string(self) -> str:
        (length,) = self.unpack(_U64)
        start = self._advance(length)
        return self._decode(self.buf[start:self.pos], start)

    def _decode(self, raw: bytes, offset: int) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{self.path}: string at offset {offset} is not UTF-8") from exc

    def value(self, vtype: int, depth: int = 0) -> Any:
        scalar = _SCALARS.get(vtype)
        if scalar is not None:
            return self.unpack(scalar)[0]
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            if depth >= _MAX_ARRAY_NESTING:
                raise ValueError(f"{self.path}: metadata arrays nested over {_MAX_ARRAY_NESTING} deep")
            subtype, count = self.unpack(_ARRAY_HEAD)
            return self.array(subtype, count, depth + 1)
        raise ValueError(f"{self.path}: unknown metadata value type {vtype} before offset {self.pos}")

    def array(self, subtype: int, count: int, depth: int) -> Any:
        """Numbers: a numpy array (a copy, so it outlives the mapping). Strings: a list of str.
        Arrays: a list of the inner arrays."""
        dtype = _DTYPES.get(subtype)
        if dtype is not None:
            start = self._advance(count * dtype.itemsize)
            return np.frombuffer(self.buf, dtype, count, start).copy()
        if subtype == _STRING:
            return self.strings(count)
        if subtype == _ARRAY:
            return [self.value(_ARRAY, depth) for _ in range(count)]
        raise ValueError(f"{self.path}: unknown metadata array type {subtype} before offset {self.pos}")

    def strings(self, count: int) -> list[str]:
        # The hot loop of a vocabulary (~100k strings): locals only, no per-element method calls.
        buf, pos, size, unpack = self.buf, self.pos, self.size, _U64.unpack_from
        out: list[str] = []
        append = out.append
        try:
            for _ in range(count):
                (length,) = unpack(buf, pos)
                pos += 8
                end = pos + length
                if end > size:
                    raise ValueError(f"{self.path}: truncated GGUF file (needs {end} bytes, has {size})")
                append(buf[pos:end].decode("utf-8"))
                pos = end
        except UnicodeDecodeError as exc:
            raise ValueError(f"{self.path}: string at offset {pos} is not UTF-8") from exc
        self.pos = pos
        return out

    def tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self.string()
        (n_dims,) = self.unpack(_U32)
        start = self._advance(8 * n_dims)
        dims = struct.unpack_from(f"<{n_dims}Q", self.buf, start)
        ggml_type, offset = self.unpack(_TENSOR_TAIL)
        return name, dims, ggml_type, offset


class GGUFFile:
    """A parsed GGUF file. `fields` maps every metadata key to its value (int, float, bool, str,
    numpy array, list of str, or list of nested arrays); `tensors` lists the tensors in file order,
    their data left in the page cache until read. The mapping stays open while this object or any
    tensor's `data` is alive."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self._mmap = _map(self.path)
        parser = _Parser(self._mmap, self.path)
        try:
            self.version, tensor_count, kv_count = self._read_header(parser)
            self.fields: dict[str, Any] = self._read_fields(parser, kv_count)
            infos = [parser.tensor_info() for _ in range(tensor_count)]
        except struct.error as exc:
            raise ValueError(f"{self.path}: truncated GGUF file ({exc})") from exc
        self.alignment = self._alignment()
        self.data_offset = -(-parser.pos // self.alignment) * self.alignment
        self._bytes = np.frombuffer(self._mmap, dtype=np.uint8)
        self.tensors: list[GGUFTensor] = [self._tensor(*info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError(f"{self.path}: duplicate tensor names")

    def __repr__(self) -> str:
        return (f"GGUFFile({self.path!r}, version={self.version}, fields={len(self.fields)}, "
                f"tensors={len(self.tensors)})")

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def _read_header(self, parser: _Parser) -> tuple[int, int, int]:
        if self._mmap[:4] != GGUF_MAGIC:
            raise ValueError(f"{self.path}: not a GGUF file (no {GGUF_MAGIC!r} magic)")
        _, version, tensor_count, kv_count = parser.unpack(_HEADER)
        if version not in SUPPORTED_VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            kind = "big-endian GGUF" if swapped in SUPPORTED_VERSIONS else f"GGUF version {version}"
            raise ValueError(f"{self.path}: {kind} is not supported (little-endian v2 and v3 are)")
        return version, tensor_count, kv_count

    def _read_fields(self, parser: _Parser, kv_count: int) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        for _ in range(kv_count):
            key = parser.string()
            if key in fields:
                raise ValueError(f"{self.path}: duplicate metadata key {key!r}")
            (vtype,) = parser.unpack(_U32)
            fields[key] = parser.value(vtype)
        return fields

    def _alignment(self) -> int:
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0:
            raise ValueError(f"{self.path}: bad general.alignment {alignment!r}")
        return alignment

    def _tensor(self, name: str, dims: tuple[int, ...], ggml_type: int, offset: int) -> GGUFTensor:
        try:
            qtype = GGMLQuantizationType(ggml_type)
            block_size, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ValueError(f"{self.path}: tensor {name!r} has unknown ggml type {ggml_type}") from None
        if not dims or dims[0] % block_size:
            raise ValueError(f"{self.path}: tensor {name!r} dims {list(dims)} do not fit "
                             f"{qtype.name} blocks of {block_size}")
        shape = tuple(reversed(dims))
        row_bytes = shape[-1] // block_size * type_size
        start = self.data_offset + offset
        end = start + math.prod(shape[:-1]) * row_bytes
        if end > len(self._bytes):
            raise ValueError(f"{self.path}: truncated GGUF file (tensor {name!r} ends at byte "
                             f"{end}, file has {len(self._bytes)})")
        data = self._bytes[start:end].reshape(*shape[:-1], row_bytes)
        return GGUFTensor(name, shape, qtype, data, start)


def _map(path: str) -> mmap.mmap:
    with open(path, "rb") as f:
        try:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # mmap refuses empty files
            raise ValueError(f"{path}: empty file, not a GGUF file") from None


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """The parsed file, shared within the process (the tokenizer and the weight loader both read
    it); keyed by size and mtime too, so a rewritten file is parsed afresh."""
    path = os.path.abspath(os.fspath(path))
    st = os.stat(path)
    return _open_cached(path, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _open_cached(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)

"""Chained block hashing: hash(parent hash, the block's token ids, extra keys).

The hashed bytes ("key") are parent hash || token ids as little-endian uint32 || extra keys.
Parent hash and token bytes have fixed widths, so the variable-length extra keys at the tail keep
the encoding unambiguous. The root parent is derived from the seed, so the whole chain is stable
across processes and restarts for a given (algorithm, seed) and changes when either does.
"""
from __future__ import annotations

import array
import functools
import hashlib
import struct
import sys
from typing import Callable, Sequence

import xxhash

from tierserve.kvcache.block import BlockHash

__all__ = ["BlockHasher", "encode_extra_keys", "HASH_ALGORITHMS"]

HASH_ALGORITHMS = ("xxhash", "sha256")
_NEEDS_BYTESWAP = sys.byteorder != "little"


def encode_extra_keys(cache_salt: str | None = None, lora_id: int | None = None,
                      extra: bytes | None = None) -> bytes:
    """Tagged, length-prefixed encoding of the keys that change a block's KV besides its tokens."""
    out = bytearray()
    if cache_salt is not None:
        raw = cache_salt.encode("utf-8")
        out += b"s" + struct.pack("<I", len(raw)) + raw
    if lora_id is not None:
        out += b"l" + struct.pack("<q", lora_id)
    if extra:
        out += b"x" + struct.pack("<I", len(extra)) + extra
    return bytes(out)


class BlockHasher:
    """Hashes runs of full blocks; `hash_fn` overrides the algorithm (tests force collisions)."""

    __slots__ = ("block_size", "algorithm", "seed", "root", "_digest")

    def __init__(self, block_size: int, algorithm: str = "xxhash", seed: int = 0,
                 hash_fn: Callable[[bytes], bytes] | None = None) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if algorithm not in HASH_ALGORITHMS:
            raise ValueError(f"hash algorithm must be one of {HASH_ALGORITHMS}, got {algorithm!r}")
        if not 0 <= seed < 2**64:
            raise ValueError(f"hash seed must be in [0, 2**64), got {seed}")
        self.block_size = block_size
        self.algorithm = algorithm
        self.seed = seed
        self._digest = hash_fn or _make_digest(algorithm, seed)
        self.root = BlockHash(self._digest(b"tierserve-root" + struct.pack("<Q", seed)))

    def hash_blocks(self, token_ids: Sequence[int], start_block: int, parent: BlockHash | None,
                    extra_first: bytes = b"", extra: bytes = b"", end_block: int | None = None
                    ) -> tuple[list[BlockHash], list[bytes]]:
        """Hashes every full block from `start_block` on (up to `end_block`, exclusive, when
        given); returns (hashes, keys).

        `extra_first` goes into block 0 only (the cache salt: the chain carries it on);
        `extra` goes into every block (a LoRA id changes every block's KV).
        """
        bs = self.block_size
        full = len(token_ids) // bs
        end_block = full if end_block is None else min(end_block, full)
        if end_block <= start_block:
            return [], []
        packed = array.array("I", token_ids[start_block * bs:end_block * bs])
        if _NEEDS_BYTESWAP:
            packed.byteswap()
        raw = packed.tobytes()
        digest = self._digest
        h = self.root if parent is None else parent
        hashes: list[BlockHash] = []
        keys: list[bytes] = []
        width = bs * 4
        for i, offset in enumerate(range(0, len(raw), width)):
            tail = extra_first + extra if start_block + i == 0 else extra
            key = h + raw[offset:offset + width] + tail
            h = digest(key)
            hashes.append(h)
            keys.append(key)
        return hashes, keys


def _make_digest(algorithm: str, seed: int) -> Callable[[bytes], bytes]:
    if algorithm == "xxhash":
        # A partial, not a lambda: one C call per block, no Python frame.
        return functools.partial(xxhash.xxh3_128_digest, seed=seed)
    prefix = struct.pack("<Q", seed)
    return lambda data: hashlib.sha256(prefix + data).digest()

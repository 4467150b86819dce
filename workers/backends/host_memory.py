"""CPU tensors over anonymous mappings advised for transparent huge pages (2 MiB).

A decode step streams every weight and each sequence's K/V once: on 4 KiB pages that is a TLB
miss every 4 KiB, and the core's stream prefetchers stop at every page boundary. Weights and KV
pools are therefore placed in mappings advised with MADV_HUGEPAGE, which the kernel backs with
2 MiB pages where its THP setting is `always` or `madvise` (with `never`, or off Linux, the
advice is ignored or refused and the pages stay 4 KiB: nothing else changes).

A mapping is released when the last tensor viewing it is: torch.frombuffer keeps it alive.
"""
from __future__ import annotations

import math
import mmap

import torch

__all__ = ["HugePageArena", "mapped_zeros"]

_HUGE = 2 << 20
_ALIGN = 64  # a cache line: the kernels' vector loads want no more


def _advise_huge(m: mmap.mmap, start: int, length: int) -> None:
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or length <= 0:
        return
    try:
        m.madvise(advice, start, length)
    except OSError:  # a kernel built without THP
        pass


def _private(nbytes: int) -> mmap.mmap:
    # Private: an anonymous MAP_SHARED mapping is shmem, whose huge pages a separate setting
    # (shmem_enabled, usually `never`) governs.
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def mapped_zeros(shape: tuple[int, ...], dtype: torch.dtype, huge: bool = True) -> torch.Tensor:
    """A zeroed tensor over its own private anonymous mapping, starting on a 2 MiB boundary and
    advised for huge pages unless `huge` is False; zero until touched (no page is backed before
    its first write or a populate)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return _chunk(max(nbytes, 1), huge)[:nbytes].view(dtype).view(shape)


class HugePageArena:
    """Packs long-lived tensors (a model's weights) into 2 MiB-aligned mappings advised for huge
    pages, one after the other, so that nearly all of their bytes sit on huge pages: a tensor
    given its own mapping would keep its last partial 2 MiB on small pages. A bump allocator:
    space is never reused, a chunk is unmapped once no tensor in it is alive."""

    def __init__(self, chunk_bytes: int = 64 << 20, huge: bool = True) -> None:
        assert chunk_bytes % _HUGE == 0
        self.chunk_bytes = chunk_bytes
        self.huge = huge  # False: the same packing on small pages (bench/huge_pages.py)
        self._chunk: torch.Tensor | None = None  # uint8 view of the current chunk
        self._used = 0

    def adopt(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of CPU tensor `t` in the arena (`t` itself where it is not a CPU
        tensor or is empty)."""
        if t.device.type != "cpu" or t.numel() == 0:
            return t
        out = self.empty(tuple(t.shape), t.dtype)
        out.copy_(t)
        return out

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        count = math.prod(shape)
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        start = -(-self._used // _ALIGN) * _ALIGN
        if self._chunk is None or start + nbytes > self._chunk.numel():
            if nbytes > self.chunk_bytes // 4:
                # A large tensor gets a chunk of its own, so that the current one's tail is
                # not abandoned for it.
                return _chunk(nbytes, self.huge)[:nbytes].view(dtype).view(shape)
            self._chunk, start = _chunk(self.chunk_bytes, self.huge), 0
        self._used = start + nbytes
        return self._chunk[start:start + nbytes].view(dtype).view(shape)


def _chunk(nbytes: int, huge: bool) -> torch.Tensor:
    """A uint8 tensor of at least `nbytes` bytes starting on a 2 MiB boundary, its mapping
    advised for huge pages. The mapping is over-allocated by 2 MiB to place that boundary;
    the untouched slack is never backed."""
    m = _private(nbytes + _HUGE)
    base = torch.frombuffer(m, dtype=torch.uint8)
    offset = -base.data_ptr() % _HUGE
    if huge:
        _advise_huge(m, offset, nbytes)
    return base[offset:offset + nbytes]

"""The KV pool of a rank: per layer, K and V each [num_blocks, block_size, kv_heads_per_rank,
head_dim] (workers/attention.py reads it), allocated once and faulted in before it serves; block
copies (copy-on-write of a forked sample's partial block); its size per block."""
from __future__ import annotations

import ctypes
import errno
import os
import threading

import torch

from tierserve.workers.backends.host_memory import mapped_zeros, on_huge_pages
from tierserve.workers.model.config import ModelConfig
from tierserve.workers.model.layers import partition_heads

__all__ = ["kv_cache_bytes_per_block", "allocate_kv_cache", "prefault_in_background",
           "BackgroundPrefault", "copy_blocks"]


def kv_cache_bytes_per_block(config: ModelConfig, tp_size: int, block_size: int,
                             dtype: torch.dtype) -> int:
    """Bytes one block id occupies on one rank, over all layers, K and V together."""
    _, kv_heads = partition_heads(config.num_attention_heads, config.num_key_value_heads, tp_size)
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * kv_heads * config.head_dim * elem


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, kv_heads_per_rank: int,
                      head_dim: int, dtype: torch.dtype, device, prefault: bool = True
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed pools: stale slots are read (then masked) by padded gathers, so they must not be
    NaN/Inf, which an additive mask cannot cancel. On CPU they are anonymous mappings advised
    for huge pages (a decode step streams each sequence's K/V; host_memory.py), zero until
    touched, then faulted in by the kernel (_Prefaulter) unless `prefault` is False (the
    caller then starts `prefault_in_background`): zeroing a 1 GiB pool from user space took
    seconds of a cold start."""
    shape = (num_blocks, block_size, kv_heads_per_rank, head_dim)
    if torch.device(device).type == "cpu":
        pools = [(mapped_zeros(shape, dtype), mapped_zeros(shape, dtype))
                 for _ in range(num_layers)]
        if prefault:
            _Prefaulter.run([t for pair in pools for t in pair], torch.get_num_threads())
        return pools
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]


def prefault_in_background(kv_caches: list) -> "BackgroundPrefault | None":
    """Faults CPU pools in on one background thread, the lowest block ids of every pool first
    (the free queue hands those out first), so that an engine serves before its whole pool is
    mapped; a page a step touches first is faulted in by that step. None for device pools, and
    for pools on huge pages: a step then faults a fresh 2 MiB (hundreds of blocks of a pool)
    at a time, rarely enough to leave to the steps, where a prefault thread would zero the
    whole pool beside the serving engine, taking memory bandwidth from its steps for as long as
    it runs (seconds to minutes on a busy machine)."""
    tensors = [t for pair in kv_caches for t in pair]
    if not tensors or tensors[0].device.type != "cpu" or _Prefaulter.supported is False:
        return None
    if on_huge_pages(tensors[0]):
        return None
    return BackgroundPrefault(tensors)


class BackgroundPrefault:
    """A running prefault_in_background; `stop` ends it early and waits for it."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=_Prefaulter.run_interleaved,
                                        args=(tensors, self._stop), daemon=True,
                                        name="tierserve-kv-prefault")
        self._thread.start()

    def wait(self) -> None:
        self._thread.join()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def copy_blocks(kv_caches: list, src: list[int], dst: list[int]) -> None:
    """KV of blocks src[i] copied into blocks dst[i], every layer, K and V (copy-on-write of a
    forked sample's partial block)."""
    device = kv_caches[0][0].device
    src_idx = torch.tensor(src, dtype=torch.long, device=device)
    dst_idx = torch.tensor(dst, dtype=torch.long, device=device)
    for k_cache, v_cache in kv_caches:
        for cache in (k_cache, v_cache):  # [num_blocks, block_size, kv_heads, head_dim]
            cache.index_copy_(0, dst_idx, cache.index_select(0, src_idx))


class _Prefaulter:
    """Faults CPU pools in before they serve, on `threads` threads, 4 MiB per call.

    Left to first touch, every fresh 4 KiB of a pool costs the serving thread a page fault: a
    decode step writes each sequence's new K/V slot, opening a fresh page every few tokens of
    every pool. MADV_POPULATE_WRITE (Linux 5.14+) maps zeroed pages in the kernel, where zeroing
    from user space went through a fault per page. Where it is missing, pools stay lazy.
    `run` faults pools in before returning; `run_interleaved` (prefault_in_background) on a
    thread beside a serving engine, where each 4 MiB call holds the address-space lock (which
    the engine's own mmap/munmap calls wait for) for well under a millisecond."""

    CHUNK = 4 << 20
    MADV_POPULATE_WRITE = 23  # linux/mman.h; Python's mmap module has no name for it
    supported: bool | None = None  # None until a call has told

    @classmethod
    def run(cls, tensors: list[torch.Tensor], threads: int) -> None:
        if cls.supported is False:
            return
        ranges = [(t.data_ptr() + offset, min(cls.CHUNK, size - offset))
                  for t in tensors for size in [t.numel() * t.element_size()]
                  for offset in range(0, size, cls.CHUNK)]
        workers = [threading.Thread(target=cls._populate, args=(ranges[i::threads],))
                   for i in range(max(threads, 1))]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    @classmethod
    def run_interleaved(cls, tensors: list[torch.Tensor], stop: threading.Event) -> None:
        """Every pool's first chunk, then every pool's second, ... until done or `stop` is
        set; the tensors stay alive (mapped) while this runs. The thread runs only on a core
        nothing else wants (SCHED_IDLE): on a busy core it would stall the forward's OpenMP
        threads at every barrier."""
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # this thread (Linux)
        except (AttributeError, OSError):
            pass
        sizes = [t.numel() * t.element_size() for t in tensors]
        for offset in range(0, max(sizes), cls.CHUNK):
            if stop.is_set() or cls.supported is False:
                return
            cls._populate([(t.data_ptr() + offset, min(cls.CHUNK, size - offset))
                           for t, size in zip(tensors, sizes) if offset < size])

    @classmethod
    def _populate(cls, ranges: list[tuple[int, int]]) -> None:
        madvise = ctypes.CDLL(None, use_errno=True).madvise  # releases the GIL while it runs
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        for start, length in ranges:
            if madvise(start, length, cls.MADV_POPULATE_WRITE) != 0:
                if ctypes.get_errno() == errno.EINVAL:  # a kernel without it
                    cls.supported = False
                return
            cls.supported = True

"""The KV pool of a rank: per layer, K and V each [num_blocks, block_size, kv_heads_per_rank,
head_dim] (workers/attention.py reads it), allocated once and faulted in before it serves; block
copies (copy-on-write of a forked sample's partial block); its size per block."""
from __future__ import annotations

import ctypes
import errno
import threading

import torch

from tierserve.workers.backends.host_memory import mapped_zeros
from tierserve.workers.model.config import ModelConfig
from tierserve.workers.model.layers import partition_heads

__all__ = ["kv_cache_bytes_per_block", "allocate_kv_cache", "copy_blocks"]


def kv_cache_bytes_per_block(config: ModelConfig, tp_size: int, block_size: int,
                             dtype: torch.dtype) -> int:
    """Bytes one block id occupies on one rank, over all layers, K and V together."""
    _, kv_heads = partition_heads(config.num_attention_heads, config.num_key_value_heads, tp_size)
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * kv_heads * config.head_dim * elem


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, kv_heads_per_rank: int,
                      head_dim: int, dtype: torch.dtype, device
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed pools: stale slots are read (then masked) by padded gathers, so they must not be
    NaN/Inf, which an additive mask cannot cancel. On CPU they are anonymous mappings advised
    for huge pages (a decode step streams each sequence's K/V; host_memory.py), faulted in by
    the kernel before they serve (_Prefaulter). Left to the steps, the first write to each
    fresh 2 MiB costs its step the kernel's zeroing of it while the step's other threads wait at
    their next barrier, and since block ids are the same in every layer, a step that opens a
    fresh 2 MiB of one pool opens it in all of them."""
    shape = (num_blocks, block_size, kv_heads_per_rank, head_dim)
    if torch.device(device).type == "cpu":
        pools = [(mapped_zeros(shape, dtype), mapped_zeros(shape, dtype))
                 for _ in range(num_layers)]
        _Prefaulter.run([t for pair in pools for t in pair], torch.get_num_threads())
        return pools
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]


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
    MADV_POPULATE_WRITE (Linux 5.14+) maps zeroed pages in the kernel, where zeroing from user
    space went through a fault per page. Where it is missing, pools fill in on first touch."""

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
    def _populate(cls, ranges: list[tuple[int, int]]) -> None:
        madvise = ctypes.CDLL(None, use_errno=True).madvise  # releases the GIL while it runs
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        for start, length in ranges:
            if madvise(start, length, cls.MADV_POPULATE_WRITE) != 0:
                if ctypes.get_errno() == errno.EINVAL:  # a kernel without it
                    cls.supported = False
                return
            cls.supported = True

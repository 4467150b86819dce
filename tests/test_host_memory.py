"""Huge-page placement of what a decode step streams (workers/backends/host_memory.py): the
weights a kernel backend chooses and the CPU KV pools live in mappings advised for
transparent huge pages, with their values unchanged."""
from __future__ import annotations

import gc
import mmap

import pytest
import torch

from tierserve.workers.backends.coded import CodedPanelWeight
from tierserve.workers.backends.host_memory import HugePageArena, mapped_zeros
from tierserve.workers.backends.int8_linear import Int8PanelWeight
from tierserve.workers.backends.linear import PanelWeight
from tierserve.workers.backends.quant import QuantPanelWeight
from tierserve.workers.kv_pool import allocate_kv_cache


def _advice_supported() -> bool:
    m = mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
        return True
    except (AttributeError, OSError):
        return False
    finally:
        m.close()


def on_huge_pages(t: torch.Tensor) -> bool:
    """Whether the kernel backs CPU tensor `t` (starting on a 2 MiB boundary) with huge pages:
    its first element is written with its own value, which faults its page in, then
    /proc/self/smaps is asked about the mapping holding it. False where that cannot be told."""
    if t.device.type != "cpu" or t.numel() == 0 or t.data_ptr() % (2 << 20):
        return False
    first = t.view(-1)[:1]
    first.copy_(first.clone())
    address = t.data_ptr()
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= address < hi
                elif inside and head == "AnonHugePages:":
                    return int(line.split()[1]) > 0
    except (OSError, ValueError):
        pass
    return False


def _vm_flags(address: int) -> set[str]:
    """The flags of the mapping holding `address` (/proc/self/smaps; `hg`: MADV_HUGEPAGE)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


huge_pages = pytest.mark.skipif(not _advice_supported(),
                                reason="this kernel takes no MADV_HUGEPAGE advice")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.uint8])
def test_the_arena_keeps_values_and_outlives_itself(dtype):
    """Adopted tensors are equal contiguous copies, cache-line aligned, packed one after
    another; they stay valid once the arena and the sources are gone."""
    arena = HugePageArena(chunk_bytes=4 << 20)
    sources = [(torch.randn(n, 7) * 50).to(dtype) for n in (1, 33, 1000, 30_000)]
    copies = [arena.adopt(s) for s in sources]
    for s, c in zip(sources, copies):
        assert torch.equal(s, c) and c.is_contiguous() and c.data_ptr() % 64 == 0
        assert c.data_ptr() != s.data_ptr()
    expected = [s.clone() for s in sources]
    del arena, sources
    gc.collect()
    _ = [torch.randn(256, 1024) for _ in range(8)]  # reuse of any freed memory would show
    assert all(torch.equal(e, c) for e, c in zip(expected, copies))


def test_a_large_tensor_gets_its_own_chunk_and_the_current_one_goes_on():
    arena = HugePageArena(chunk_bytes=4 << 20)
    small = arena.adopt(torch.ones(1000))
    big = arena.adopt(torch.ones(2 << 20))  # 8 MiB, past a quarter of the chunk
    after = arena.adopt(torch.ones(1000))
    assert big.data_ptr() % (2 << 20) == 0
    assert after.data_ptr() - small.data_ptr() == 4032  # 4000 bytes, to a cache line


def test_mapped_zeros_are_zero_and_writable():
    z = mapped_zeros((3, 5, 7), torch.bfloat16)
    assert z.shape == (3, 5, 7) and not z.any()
    z.fill_(2)
    assert (z == 2).all()


@huge_pages
def test_kernel_weights_and_kv_pools_are_advised_for_huge_pages(kernels):
    w = torch.randn(300, 256)
    method = kernels.linear_method(w)
    # fp32 panels, or where the backend codes them, the coded panels' body (coded.py).
    streamed = method.body if isinstance(method, CodedPanelWeight) else method.panels
    assert isinstance(method, (PanelWeight, CodedPanelWeight))
    assert "hg" in _vm_flags(streamed.data_ptr())
    assert torch.equal(method.weight(), w)
    quant = kernels.linear_method(w, "q4_1")
    assert isinstance(quant, QuantPanelWeight)
    assert {"hg"} <= _vm_flags(quant.codes.data_ptr()) & _vm_flags(quant.scales.data_ptr())
    int8 = kernels.linear_method(w, "q8_0")
    assert isinstance(int8, Int8PanelWeight) and "hg" in _vm_flags(int8.pairs.data_ptr())
    (k, v), = allocate_kv_cache(1, 8, 16, 2, 64, torch.float32, "cpu")
    assert k.data_ptr() % (2 << 20) == 0 and v.data_ptr() % (2 << 20) == 0
    assert "hg" in _vm_flags(k.data_ptr()) and "hg" in _vm_flags(v.data_ptr())
    assert not k.any() and not v.any()


def _thp_mode() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return None


@huge_pages
def test_huge_pages_are_told_apart_from_small_ones():
    """on_huge_pages reads what the kernel did: a mapping without the advice is on small pages
    where THP is `madvise`; with it, on huge pages where THP is `madvise` or `always`. The
    tensor's values are kept."""
    mode = _thp_mode()
    small = mapped_zeros((4 << 20,), torch.uint8, huge=False)
    small[0] = 7
    assert small.data_ptr() % (2 << 20) == 0
    if mode == "madvise":
        assert not on_huge_pages(small)
    assert small[0] == 7
    if mode in ("madvise", "always"):
        assert on_huge_pages(mapped_zeros((4 << 20,), torch.uint8))
    assert not on_huge_pages(torch.zeros(3))  # not on a 2 MiB boundary: cannot be told

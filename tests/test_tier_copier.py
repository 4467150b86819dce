"""The tier copier and the SSD folder on real tensors and real files, no model: the late copier
poisons every destination until the wait the protocol requires (so a test that skips it fails),
spills and loads wait for the copies that touched their slots, a rank reads its head range from
entries another TP size wrote, and eviction racing readers never serves a torn entry."""
from __future__ import annotations

import os
import shutil
import threading
import time

import pytest
import torch

from tierserve.scheduler.messages import CopyKind, TierCopyBatch
from tierserve.workers.tier_copier import TierCopier
from tierserve.workers.tier_ssd import SsdFolder, kv_head_range
from tierserve.workers.tier_streams import LateCopies

LAYERS, BS, HEADS, HD = 2, 4, 3, 8
FP = "f" * 64


def _pool(num_blocks=6, heads=HEADS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(num_blocks, BS, heads, HD, generator=g),
             torch.randn(num_blocks, BS, heads, HD, generator=g)) for _ in range(LAYERS)]


def _block(kv, b) -> torch.Tensor:
    """[layers, 2, BS, heads, HD]: the block as a CPU slot holds it."""
    return torch.stack([torch.stack([k[b], v[b]]) for k, v in kv])


def _h(i: int) -> bytes:
    return bytes([i]) * 16


def test_late_copies_read_nan_until_the_wait_the_protocol_requires():
    kv = _pool()
    want = _block(kv, 1).clone()
    copier = TierCopier(kv, 4, torch.device("cpu"), late=True)
    stream = copier.stream
    assert isinstance(stream, LateCopies)
    out = stream.to_cpu([1], [2])
    assert copier.cpu[2].isnan().all()  # the host did not wait
    stream.device_waits(out)  # the device read block 1 ...
    kv[0][0][1] = 7.0  # ... so the forward may overwrite it now
    assert copier.cpu[2].isnan().all()  # but the host still has not waited
    stream.host_waits(out)
    assert torch.equal(copier.cpu[2], want)
    back = stream.to_device([2], [4])
    assert kv[0][0][4].isnan().all() and kv[1][1][4].isnan().all()
    stream.device_waits(back)
    assert torch.equal(_block(kv, 4), want)


def test_a_copy_batch_reading_a_slot_sees_the_batch_that_filled_it_first():
    kv = _pool()
    want = _block(kv, 3).clone()
    copier = TierCopier(kv, 4, torch.device("cpu"), late=True)
    copier.run([TierCopyBatch(CopyKind.DEVICE_TO_CPU, [3], [0])])
    kv[0][0][3] = 0.0  # the block is reused after the step
    copier.run([TierCopyBatch(CopyKind.CPU_TO_DEVICE, [0], [5])])  # stream order
    assert torch.equal(_block(kv, 5), want)


def test_spills_and_loads_wait_for_the_copies_that_touched_their_slots(tmp_path):
    kv = _pool()
    want = _block(kv, 2).clone()
    folder = SsdFolder(str(tmp_path), FP, HEADS, 1 << 30)
    copier = TierCopier(kv, 4, torch.device("cpu"), ssd=folder, heads=(0, HEADS), late=True)
    try:
        copier.run([TierCopyBatch(CopyKind.DEVICE_TO_CPU, [2], [1])])
        copier.run([TierCopyBatch(CopyKind.CPU_TO_SSD, [1], first_seq=0, hashes=[_h(2)],
                                  keys=[b"k"])])
        assert copier.agree() == ([], [])  # queued copies start a step late
        copier.run([])
        assert copier.wait_idle(30)
        assert copier.agree() == ([0, 1], [])
        # Slot 3 held a demoted block whose host side never landed: the load waits for it,
        # else that block would land over the loaded one later.
        copier.run([TierCopyBatch(CopyKind.DEVICE_TO_CPU, [4], [3])])
        copier.run([TierCopyBatch(CopyKind.SSD_TO_CPU, [], [3], 0, [_h(2)], [b"k"])])
        assert copier.cpu[3].isnan().all()  # poisoned until loaded
        copier.run([])
        assert copier.wait_idle(30) and copier.agree() == ([1, 1], [])
        copier.stream.synchronize()
        assert torch.equal(copier.cpu[3], want)
        copier.run([TierCopyBatch(CopyKind.SSD_TO_CPU, [], [0], 1, [_h(9)], [b""])])
        copier.run([])
        assert copier.wait_idle(30) and copier.agree() == ([2, 1], [int(CopyKind.SSD_TO_CPU), 1])
    finally:
        copier.close()


def test_head_ranges_match_the_model_sharding():
    assert [kv_head_range(3, 3, r) for r in range(3)] == [(0, 1), (1, 2), (2, 3)]
    assert [kv_head_range(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert kv_head_range(4, 2, 1) == (2, 4) and kv_head_range(3, 1, 0) == (0, 3)


def _write(folder, kv, block, block_hash, heads):
    payload = _block(kv, block)[:, :, :, heads[0]:heads[1]].contiguous()
    folder.write(block_hash, heads, b"k", list(payload.shape), "float32",
                 memoryview(payload.view(torch.uint8).numpy()).cast("B"))


def _load(tmp_path, heads, block_hash):
    """A rank holding `heads` of each block loads `block_hash` into slot 0."""
    kv = _pool(heads=heads[1] - heads[0], seed=1)
    folder = SsdFolder(str(tmp_path), FP, HEADS, 1 << 30)
    copier = TierCopier(kv, 1, torch.device("cpu"), ssd=folder, heads=heads)
    try:
        copier.run([TierCopyBatch(CopyKind.SSD_TO_CPU, [], [0], 0, [block_hash], [b"k"])])
        assert copier.wait_idle(30)
        done, failed = copier.agree()
        return copier.cpu[0].clone(), failed
    finally:
        copier.close()


def test_a_rank_reads_its_heads_from_entries_of_another_tp_size(tmp_path):
    kv = _pool()
    folder = SsdFolder(str(tmp_path), FP, HEADS, 1 << 30)
    for r in range(3):  # TP=3 wrote block 0, one head per rank
        _write(folder, kv, 0, _h(0), kv_head_range(HEADS, 3, r))
    _write(folder, kv, 1, _h(1), (0, HEADS))  # TP=1 wrote block 1
    assert [s[1] for s in folder.sources(_h(0), (0, 3))] == [(0, 1), (1, 2), (2, 3)]
    assert folder.sources(_h(1), (1, 2)) == [(folder.path(_h(1), (0, 3)), (0, 3))]
    assert folder.has_block(_h(0), [(0, 3)]) and not folder.has_block(_h(5), [(0, 1)])
    got, failed = _load(tmp_path, (0, 3), _h(0))  # TP=1 reads TP=3's entries
    assert not failed and torch.equal(got, _block(kv, 0))
    got, failed = _load(tmp_path, (1, 2), _h(1))  # TP=3's rank 1 reads TP=1's entry
    assert not failed and torch.equal(got, _block(kv, 1)[:, :, :, 1:2])
    os.remove(folder.path(_h(0), (1, 2)))  # a part gone: a miss, never a partial block
    assert folder.sources(_h(0), (0, 3)) is None
    _, failed = _load(tmp_path, (0, 3), _h(0))
    assert failed == [int(CopyKind.SSD_TO_CPU), 0]


def test_eviction_racing_readers_never_serves_a_torn_entry(tmp_path):
    """Two writers keep rewriting and trimming a folder far over its capacity while a reader
    reads the same entries: every read is whole and checked (it holds the block written under
    that name) or a miss."""
    kv = _pool(num_blocks=8)
    blocks = {i: _block(kv, i).contiguous() for i in range(8)}
    size = blocks[0].numel() * 4
    writers = [SsdFolder(str(tmp_path), FP, HEADS, 3 * size) for _ in range(2)]
    reader = SsdFolder(str(tmp_path), FP, HEADS, 3 * size)
    stop = threading.Event()
    outcomes = {"whole": 0, "miss": 0}

    def write(folder, seed):
        i = seed
        while not stop.is_set():
            _write(folder, kv, i % 8, _h(i % 8), (0, HEADS))
            i += 1

    threads = [threading.Thread(target=write, args=(w, n)) for n, w in enumerate(writers)]
    for t in threads:
        t.start()
    out = torch.empty_like(blocks[0])
    view = memoryview(out.view(torch.uint8).numpy()).cast("B")
    deadline = time.monotonic() + 60
    try:
        n = 0
        while outcomes["whole"] < 100 or outcomes["miss"] < 100:
            assert time.monotonic() < deadline, outcomes
            i, n = n % 8, n + 1
            why = reader.read(reader.path(_h(i), (0, HEADS)), _h(i), (0, HEADS), b"k",
                              list(out.shape), "float32", view)
            if why is None:
                assert torch.equal(out, blocks[i]), f"entry {i} served torn or foreign"
                outcomes["whole"] += 1
            else:
                assert why.startswith("missing"), why
                outcomes["miss"] += 1
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert writers[0].trim() <= 3 * (size + 4096)


def test_the_weights_digest_follows_their_bytes_and_is_cached(tmp_path, monkeypatch):
    from tierserve.workers import kv_fingerprint as fp
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(bytes(range(256)) * 4096)
    (model / "config.json").write_text("{}")  # not a weight file
    cache = str(tmp_path / "cache")
    first = fp.weights_digest(str(model), cache)
    moved = tmp_path / "moved"
    shutil.copytree(model, moved)
    assert fp.weights_digest(str(moved), cache) == first  # another path, the same bytes
    monkeypatch.setattr(fp, "_hash_file", lambda path: pytest.fail(f"{path} read again"))
    assert fp.weights_digest(str(model), cache) == first  # cached by path, size and dates
    monkeypatch.undo()
    path = model / "model.safetensors"
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(5000)
        f.write(b"\xff")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size and mtime
    assert fp.weights_digest(str(model), cache) != first


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_a_cpu_tier_beside_a_cpu_pool_takes_memory_only_as_it_fills():
    """The CPU tier of a CPU pool is a lazy mapping: a tier of 128 MiB costs no resident
    memory until blocks are copied into it, reads zero, and keeps what it is given."""
    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))

    kv = _pool()
    slot_bytes = LAYERS * 2 * BS * HEADS * HD * 4
    slots = (128 << 20) // slot_bytes
    before = rss()
    copier = TierCopier(kv, slots, torch.device("cpu"))
    assert rss() - before < (16 << 20)
    assert copier.cpu.shape == (slots, LAYERS, 2, BS, HEADS, HD)
    assert not copier.cpu[slots - 1].any()
    copier.stream.host_waits(copier.stream.to_cpu([1], [slots - 1]))
    assert torch.equal(copier.cpu[slots - 1], _block(kv, 1))

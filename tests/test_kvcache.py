"""kvcache/ driven directly: free queue, hashing, block pool and manager contracts."""
import subprocess
import sys

import pytest

from tierserve.kvcache import (
    BlockHasher, FreeKVCacheBlockQueue, KVCacheBlock, KVCacheManager, encode_extra_keys,
)
from tierserve.scheduler import SamplingParams
from tierserve.scheduler.request import Request


def _blocks(n):
    return [KVCacheBlock(i) for i in range(n)]


def test_free_queue_popleft_remove_append_keep_order():
    blocks = _blocks(6)
    q = FreeKVCacheBlockQueue(blocks)
    assert q.peek_ids() == [0, 1, 2, 3, 4, 5] and len(q) == 6
    assert q.popleft().block_id == 0
    q.remove(blocks[3])
    assert q.peek_ids() == [1, 2, 4, 5]
    assert [b.block_id for b in q.popleft_n(2)] == [1, 2]
    q.append(blocks[0])
    q.append_n([blocks[3], blocks[1]])
    assert q.peek_ids() == [4, 5, 0, 3, 1] and len(q) == 5
    assert q.popleft_n(0) == []
    assert [b.block_id for b in q.popleft_n(5)] == [4, 5, 0, 3, 1]
    assert len(q) == 0 and q.peek_ids() == []
    with pytest.raises(ValueError):
        q.popleft()
    with pytest.raises(ValueError):
        q.popleft_n(1)


def test_free_queue_rejects_double_insert_and_foreign_remove():
    blocks = _blocks(2)
    q = FreeKVCacheBlockQueue(blocks[:1])
    with pytest.raises(RuntimeError):
        q.append(blocks[0])
    with pytest.raises(RuntimeError):
        q.remove(blocks[1])


def test_hash_chain_is_stable_across_processes_and_depends_on_seed():
    tokens = list(range(37))
    here = [h.hex() for h in BlockHasher(16, seed=1234).hash_blocks(tokens, 0, None)[0]]
    code = ("from tierserve.kvcache import BlockHasher; "
            "print(','.join(h.hex() for h in BlockHasher(16, seed=1234)"
            ".hash_blocks(list(range(37)), 0, None)[0]))")
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={"PYTHONHASHSEED": "99"}).stdout.strip().split(",")
    assert len(here) == 2 and here == there
    other_seed = BlockHasher(16, seed=1235).hash_blocks(tokens, 0, None)[0]
    assert [h.hex() for h in other_seed] != here


def test_hash_chain_incremental_equals_whole_and_parent_matters():
    hasher = BlockHasher(4)
    tokens = list(range(100, 120))
    whole, keys = hasher.hash_blocks(tokens, 0, None)
    first, _ = hasher.hash_blocks(tokens[:9], 0, None)
    rest, _ = hasher.hash_blocks(tokens, len(first), first[-1])
    assert first + rest == whole and len(whole) == 5 and len(keys) == 5
    # Same block tokens after a different prefix hash differently.
    shifted, _ = hasher.hash_blocks([7, 7, 7, 7] + tokens[4:8], 0, None)
    assert shifted[1] != whole[1]


def test_sha256_is_selectable_and_differs():
    tokens = list(range(32))
    x = BlockHasher(16, "xxhash").hash_blocks(tokens, 0, None)[0]
    s = BlockHasher(16, "sha256").hash_blocks(tokens, 0, None)[0]
    assert len(x[0]) == 16 and len(s[0]) == 32 and x != s
    with pytest.raises(ValueError):
        BlockHasher(16, "md5")


def test_extra_keys_salt_first_block_only_lora_every_block():
    hasher = BlockHasher(4)
    tokens = list(range(8))
    plain, _ = hasher.hash_blocks(tokens, 0, None)
    salted, keys = hasher.hash_blocks(tokens, 0, None, encode_extra_keys(cache_salt="t1"))
    assert salted[0] != plain[0] and salted[1] != plain[1]  # the chain carries the salt on
    assert encode_extra_keys(cache_salt="t1") not in keys[1]
    lora, lkeys = hasher.hash_blocks(tokens, 0, None, b"", encode_extra_keys(lora_id=3))
    assert all(k.endswith(encode_extra_keys(lora_id=3)) for k in lkeys)
    assert encode_extra_keys(cache_salt="ab") != encode_extra_keys(extra=b"ab")


def _req(rid, tokens, hasher, salt=None, keep_keys=True):
    return Request(rid, tokens, SamplingParams(), cache_salt=salt, hasher=hasher,
                   keep_keys=keep_keys)


def _admit(kv, req):
    hits, n = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - n, hits, n) is not None
    req.num_computed_tokens = req.num_tokens
    return n


def test_cache_salt_isolates_tenants():
    hasher = BlockHasher(4)
    kv = KVCacheManager(21, 4)
    prompt = list(range(17))
    assert _admit(kv, _req("a", prompt, hasher, salt="tenant-1")) == 0
    assert _admit(kv, _req("b", prompt, hasher, salt="tenant-1")) == 16
    assert _admit(kv, _req("c", prompt, hasher, salt="tenant-2")) == 0
    assert _admit(kv, _req("d", prompt, hasher)) == 0
    kv.check_integrity()


def test_forced_collision_is_caught_by_verification_and_never_served():
    # Every block hashes to the same value: only verification tells them apart.
    hasher = BlockHasher(4, hash_fn=lambda data: b"\x00" * 16)
    kv = KVCacheManager(21, 4, verify_hits=True)
    assert _admit(kv, _req("a", list(range(9)), hasher)) == 0
    assert _admit(kv, _req("b", list(range(50, 59)), hasher)) == 0
    assert kv.pool.num_collisions >= 1
    # A true repeat still hits, even though its bucket holds colliding blocks.
    assert _admit(kv, _req("c", list(range(9)), hasher)) == 8
    kv.check_integrity()


def test_without_verification_a_forced_collision_would_be_served():
    """Shows what verification prevents (the unsafe mode is opt-in)."""
    hasher = BlockHasher(4, hash_fn=lambda data: b"\x00" * 16)
    kv = KVCacheManager(21, 4, verify_hits=False)
    _admit(kv, _req("a", list(range(9)), hasher, keep_keys=False))
    assert _admit(kv, _req("b", list(range(50, 59)), hasher, keep_keys=False)) == 8


def test_allocate_failure_leaves_ref_counts_untouched():
    hasher = BlockHasher(4)
    kv = KVCacheManager(6, 4, watermark=0.0)  # 5 usable blocks
    a = _req("a", list(range(13)), hasher)
    _admit(kv, a)  # 4 blocks
    kv.free(a)
    b = _req("b", list(range(13)) + list(range(100, 110)), hasher)
    hits, n = kv.get_computed_blocks(b)
    assert n == 12
    before = [(blk.ref_cnt, blk.block_hash) for blk in kv.pool.blocks]
    queue_before = kv.pool.free_queue.peek_ids()
    assert kv.allocate_slots(b, b.num_tokens - n, hits, n) is None
    assert [(blk.ref_cnt, blk.block_hash) for blk in kv.pool.blocks] == before
    assert kv.pool.free_queue.peek_ids() == queue_before
    kv.check_integrity()


def test_watermark_applies_to_admissions_only():
    hasher = BlockHasher(4)
    kv = KVCacheManager(11, 4, watermark=0.2)  # 10 usable, 2 reserved from admissions
    a = _req("a", list(range(32)), hasher)
    assert kv.allocate_slots(a, 32, apply_watermark=True) is not None  # 8 blocks, 2 left
    b = _req("b", list(range(100, 104)), hasher)
    assert kv.allocate_slots(b, 4, apply_watermark=True) is None
    a.num_computed_tokens = 32
    a.append_output_token(5)
    assert len(kv.allocate_slots(a, 1)) == 1  # a running request may dip into the reserve


def test_reset_prefix_cache_refused_while_blocks_are_held():
    hasher = BlockHasher(4)
    kv = KVCacheManager(11, 4)
    a = _req("a", list(range(9)), hasher)
    _admit(kv, a)
    assert kv.reset_prefix_cache() is False
    kv.free(a)
    assert kv.pool.num_cached_blocks() == 2
    assert kv.reset_prefix_cache() is True
    assert kv.pool.num_cached_blocks() == 0
    assert _admit(kv, _req("b", list(range(9)), hasher)) == 0
    kv.check_integrity()


def test_eviction_callback_reports_block_hash_and_key():
    from tierserve.kvcache import BlockPool
    hasher = BlockHasher(4)
    seen = []
    kv = KVCacheManager(4, 4, watermark=0.0)
    kv.pool = BlockPool(4, on_evict=lambda bid, h, key, tenant: seen.append((bid, h, key)))
    a = _req("a", list(range(9)), hasher)
    _admit(kv, a)
    hashes, keys = list(a.block_hashes), list(a.block_keys)
    kv.free(a)
    b = _req("b", list(range(50, 61)), hasher)
    _admit(kv, b)
    assert sorted(seen) == sorted(zip([0, 1], hashes, keys))

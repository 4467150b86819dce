"""The tier index and policy and the scheduler's use of them, torch-free: exact demote / promote /
spill / load orders on tiny pools (in the manner of the seed-002 tests), and streams of requests
run against a mirror that holds the KV itself (tests/sched_driver.py: TieredMirror), so that a
block served from the wrong place fails at once. check_integrity() after every step."""
from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.sched_driver import TieredMirror, tiered_step
from tierserve.kvcache import (
    BlockHash, BlockHasher, CopyKind, KVCacheManager, SlotState, TierIndex, TierPolicy,
)
from tierserve.scheduler import SamplingParams, Scheduler

BS = 4


def _h(i: int) -> BlockHash:
    return BlockHash(bytes([i]) * 16)


# ---------------------------------------------------------------- the index alone


class _Req:
    """The little of a request the policy reads."""

    def __init__(self, rid, hashes, keys=None):
        self.request_id, self.block_hashes, self.block_keys = rid, list(hashes), keys
        self.num_tokens = BS * len(hashes) + 1


def _policy(cpu_slots, ssd_blocks=0, probe=None, **kw) -> TierPolicy:
    index = TierIndex(cpu_slots, ssd_blocks, ssd_probe=probe)
    return TierPolicy(index, block_size=BS, **kw)


def _end(t: TierPolicy, step_id=0):
    """The step's batches by kind, as (src, dst) lists (async: (first_seq, slots, hashes))."""
    return {b.kind: b for b in t.end_step(step_id)}


def test_demotions_fill_slots_in_order_then_evict_the_coldest():
    t = _policy(3)
    for block in (7, 8, 9):
        t.on_evict(block, _h(block), b"k%d" % block)
    assert [t.cpu.slots[i].state for i in range(3)] == [SlotState.FILLING] * 3
    assert t.cpu.lookup(_h(7), b"k7") is None  # not until the copy completed
    d2c = _end(t, 0)[CopyKind.DEVICE_TO_CPU]
    assert d2c.src == [7, 8, 9] and d2c.dst == [0, 1, 2]
    t.complete(0)
    assert t.cpu.eviction_order() == [0, 1, 2]
    assert t.cpu.lookup(_h(8), b"k8").slot == 1
    t.cpu.touch(t.cpu.slots[0])  # a hit makes slot 0 the hottest
    assert t.cpu.eviction_order() == [1, 2, 0]
    t.on_evict(99, _h(8), b"k8")  # already in the tier: no second copy
    t.on_evict(4, _h(4), b"k4")  # full: slot 1, the coldest, is dropped
    d2c = _end(t, 1)[CopyKind.DEVICE_TO_CPU]
    assert d2c.src == [4] and d2c.dst == [1] and t.counters.cpu_dropped == 1
    assert t.cpu.lookup(_h(8), b"k8") is None
    t.complete(1)
    assert t.cpu.eviction_order() == [2, 0, 1]
    t.check_integrity()


def test_pinned_slots_are_not_reused_and_releases_wait_for_copies():
    t = _policy(2)
    for block in (1, 2):
        t.on_evict(block, _h(block), None)
    t.end_step(0)
    t.complete(0)
    admission = t.admit(_Req("r", [_h(1), _h(2), _h(3)]), 0)
    assert [s.slot for s in admission.cpu_hits] == [0, 1] and not admission.wait
    t.on_evict(3, _h(3), None)  # every slot is pinned: the block is dropped
    assert t.counters.demotions_dropped == 1
    t.admitted("r", admission, [10, 11, 12])
    c2d = _end(t, 1)[CopyKind.CPU_TO_DEVICE]
    assert (c2d.src, c2d.dst) == ([0, 1], [10, 11])
    t.cpu.release(admission.cpu_hits[0])  # e.g. reset: waits for the copy reading it
    assert t.cpu.slots[0].state == SlotState.READY and t.cpu.slots[0].release_pending
    t.complete(1)
    assert t.cpu.slots[0].state == SlotState.FREE and t.cpu.slots[1].readers == 0
    t.check_integrity()


def test_write_back_spills_the_coldest_dirty_slots_and_eviction_prefers_clean_ones():
    t = _policy(4, 8, writeback_headroom=0.5)
    for block in range(4):
        t.on_evict(block, _h(block), None)
    t.end_step(0)
    t.complete(0)
    spills = _end(t, 1)[CopyKind.CPU_TO_SSD]  # headroom 2: the two coldest are spilled
    assert (spills.first_seq, spills.src, spills.hashes) == (0, [0, 1], [_h(0), _h(1)])
    assert t.cpu.slots[0].readers == 1  # pinned while the spill reads it
    assert t.complete(2, [-1, 2]) == []
    assert t.cpu.slots[0].clean and t.cpu.slots[1].clean and t.counters.spills == 2
    t.cpu.touch(t.cpu.slots[0])
    t.on_evict(9, _h(9), None)  # evicts slot 1: clean, so nothing is lost
    assert _end(t, 3)[CopyKind.DEVICE_TO_CPU].dst == [1] and t.counters.cpu_dropped == 0
    t.complete(3)
    hits = t.find(_Req("q", [_h(1), _h(77)]), 0)
    assert [(h.tier, h.slot.block_hash) for h in hits] == [("ssd", _h(1))]
    t.check_integrity()


def test_loads_wake_their_requests_and_bad_entries_are_dropped_and_counted():
    folder = {_h(0), _h(1), _h(2)}  # entries another engine wrote
    t = _policy(4, 4, probe=folder.__contains__)
    r, q = _Req("r", [_h(0), _h(1), _h(2)] + [_h(9)]), _Req("q", [_h(0), _h(9)])
    assert [h.tier for h in t.find(r, 0)] == ["ssd"] * 3
    assert t.ssd.num_found == 3  # learnt on the miss
    assert t.admit(r, 0).wait
    assert t.admit(q, 0).wait  # the same load, two waiters
    loads = _end(t, 0)[CopyKind.SSD_TO_CPU]
    assert (loads.first_seq, loads.dst, loads.hashes) == (0, [0, 1, 2], [_h(0), _h(1), _h(2)])
    assert t.complete(0, [1, -1]) == [q]
    assert t.complete(1, [3, -1], [CopyKind.SSD_TO_CPU, 2]) == [r]
    assert t.counters.checksum_failures == 1 and t.counters.loads == 2
    assert not t.ssd.contains(_h(2)) and not t.cpu.contains(_h(2))  # never served
    folder.discard(_h(2))
    assert [h.tier for h in t.find(r, 0)] == ["cpu", "cpu"]
    t.check_integrity()


def test_swap_out_is_all_or_nothing_and_owned_slots_are_never_hit():
    t = _policy(3, preemption_mode="swap")
    t.on_evict(5, _h(5), None)
    t.end_step(0)
    t.complete(0)
    assert not t.try_swap_out("victim", [1, 2, 3, 4], 4 * BS)  # 4 blocks, 3 slots
    assert t.cpu.lookup(_h(5), None).slot == 0 and not t.end_step(1)
    assert t.try_swap_out("victim", [1, 2], 2 * BS)
    d2c = _end(t, 2)[CopyKind.DEVICE_TO_CPU]
    assert d2c.dst == [1, 2] and d2c.src == [1, 2]
    t.complete(2)
    assert all(t.cpu.slots[s].owner == "victim" for s in (1, 2))
    assert t.cpu.eviction_order() == [0]  # owned slots are not evictable
    assert t.swapped_tokens("victim") == 2 * BS
    t.swap_in("victim", [7, 8])
    c2d = _end(t, 3)[CopyKind.CPU_TO_DEVICE]
    assert c2d.src == [1, 2] and c2d.dst == [7, 8]
    t.complete(3)
    assert t.cpu.num_free == 2 and t.counters.swap_outs == t.counters.swap_ins == 1
    t.check_integrity()


def test_salts_never_share_a_slot():
    hasher = BlockHasher(BS)
    tokens = list(range(1, 10))
    a, _ = hasher.hash_blocks(tokens, 0, None, extra_first=b"s\x01\x00\x00\x00a")
    b, _ = hasher.hash_blocks(tokens, 0, None, extra_first=b"s\x01\x00\x00\x00b")
    t = _policy(4)
    for i, h in enumerate(a):
        t.on_evict(i, h, None)
    t.end_step(0)
    t.complete(0)
    assert len(t.find(_Req("a", a), 0)) == 2 and t.find(_Req("b", b), 0) == []


def test_write_back_keeps_up_with_demotions_and_stops_on_a_failing_folder():
    t = _policy(300, 1000)
    for block in range(100):
        t.on_evict(block, _h(block), None)
    t.end_step(0)
    t.complete(0)
    for block in range(100, 200):  # more demotions in a step than the minimum budget
        t.on_evict(block, _h(block), None)
    spills = _end(t, 1)[CopyKind.CPU_TO_SSD]
    assert len(spills.src) == 100 and spills.src[:3] == [0, 1, 2]  # the coldest first
    assert t.has_work()
    t.complete(1, [-1, 100], [x for seq in range(100) for x in (CopyKind.CPU_TO_SSD, seq)])
    assert t.counters.spill_failures == 100 and not t.has_work()  # write-back is off
    assert CopyKind.CPU_TO_SSD not in _end(t, 2)
    t.check_integrity()


def test_no_tiers_is_a_layer_of_capacity_zero():
    t = TierPolicy(block_size=BS)
    t.on_evict(1, _h(1), None)
    assert not t.enabled and t.end_step(0) == [] and t.stats() == {}
    assert not t.admit(_Req("r", [_h(1)]), 0).cpu_hits
    assert not t.try_swap_out("r", [1], BS) and t.complete(0) == []
    t.check_integrity()


def test_worker_loss_drops_cpu_slots_and_copies_but_keeps_the_ssd_record():
    folder = {_h(0)}
    t = _policy(4, 8, probe=folder.__contains__, preemption_mode="swap")
    t.on_evict(1, _h(1), None)
    assert t.admit(_Req("w", [_h(0), _h(9)]), 0).wait  # a load in flight
    assert t.try_swap_out("s", [3], BS)
    t.end_step(0)
    waiting = t.drop_worker_memory()
    assert [r.request_id for r in waiting] == ["w"] and not t.is_loading("w")
    assert t.cpu.num_free == 4 and not t.index.has_in_flight()
    assert t.swapped_tokens("s") == 0 and t.ssd.contains(_h(0))
    t.check_integrity()
    assert t.admit(_Req("w", [_h(0), _h(9)]), 0).wait  # the SSD hit loads again
    assert _end(t, 1)[CopyKind.SSD_TO_CPU].first_seq == 0


# ---------------------------------------------------------------- through the scheduler


def _scheduler(num_blocks=12, cpu=16, ssd=0, mode="recompute", max_num_seqs=4, budget=32,
               max_model_len=40, mirror=None):
    index = TierIndex(cpu, ssd, ssd_probe=mirror.probe if mirror is not None else None)
    tiers = TierPolicy(index, block_size=BS, preemption_mode=mode, block_bytes=100)
    kv = KVCacheManager(num_blocks, BS, watermark=0.0, tiers=tiers)
    return Scheduler(kv, BlockHasher(BS), max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=budget, max_model_len=max_model_len,
                     vocab_size=1000)


def _run(sched, mirror, requests, max_tokens=3, steps=400):
    """Adds the requests, steps until all finished; the tokens each produced."""
    for rid, prompt in requests:
        sched.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
    produced = {rid: [] for rid, _ in requests}
    cached = {}
    for _ in range(steps):
        if not sched.has_unfinished_requests() and not sched.has_pending_worker_updates():
            break
        out, outputs = tiered_step(sched, mirror)
        sched.check_integrity()
        for o in outputs:
            produced[o.req_id] += o.new_token_ids
            cached[o.req_id] = o.num_cached_tokens
    assert not sched.has_unfinished_requests(), "requests never finished"
    return produced, cached


def _prompts(n=6, length=18, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(1, 900) for _ in range(length)] for _ in range(n)]


def test_ping_pong_beyond_the_pool_hits_the_cpu_tier_with_the_right_kv():
    """A working set several times the pool, asked for again and again: the second rounds hit
    the CPU tier, and the mirror checks that every promoted block holds its tokens' KV."""
    prompts = _prompts()
    results = {}
    for cpu in (0, 64):
        sched, mirror = _scheduler(cpu=cpu), TieredMirror(BS)
        rounds = [_run(sched, mirror, [(f"r{k}-{i}", p) for i, p in enumerate(prompts)])
                  for k in range(3)]
        results[cpu] = [list(r[0].values()) for r in rounds]
        if cpu:
            assert sum(rounds[2][1].values()) > 0
            assert sched.tiers.counters.promotions > 0
        else:
            assert sum(rounds[2][1].values()) == 0
    assert results[0] == results[64]


def test_ssd_hits_wait_for_loads_without_holding_up_others_and_bad_entries_recompute():
    mirror = TieredMirror(BS)
    sched = _scheduler(cpu=12, ssd=64, mirror=mirror)
    prompts = _prompts(n=6)
    first, _ = _run(sched, mirror, [(f"a{i}", p) for i, p in enumerate(prompts)])
    tiers = sched.tiers
    for _ in range(20):  # let write-back put everything cold on SSD
        tiered_step(sched, mirror)
    assert tiers.counters.spills > 0
    mirror.delay = 3
    mirror.corrupt = set(list(mirror.ssd)[:2])
    again, cached = _run(sched, mirror, [(f"b{i}", p) for i, p in enumerate(prompts)])
    assert list(again.values()) == list(first.values())
    assert tiers.counters.loads > 0 and 1 <= tiers.counters.checksum_failures <= 2
    assert sum(cached.values()) > 0
    sched.check_integrity()


def test_swap_preemption_gives_the_recompute_tokens():
    prompts = _prompts(n=4, length=14, seed=3)
    outs = {}
    for mode in ("recompute", "swap"):
        sched = _scheduler(num_blocks=10, cpu=32, mode=mode, max_model_len=32)
        mirror = TieredMirror(BS)
        outs[mode], _ = _run(sched, mirror, [(f"p{i}", p) for i, p in enumerate(prompts)],
                             max_tokens=12)
        assert sched.num_preemptions > 0
        if mode == "swap":
            assert sched.tiers.counters.swap_outs > 0
            assert sched.tiers.counters.swap_ins > 0
        assert sched.tiers.cpu.num_free + len(sched.tiers.cpu.eviction_order()) == 32
    assert outs["recompute"] == outs["swap"]


def test_abort_while_a_load_is_in_flight_leaks_nothing():
    mirror = TieredMirror(BS)
    sched = _scheduler(cpu=12, ssd=64, mirror=mirror)
    prompts = _prompts(n=6)
    _run(sched, mirror, [(f"a{i}", p) for i, p in enumerate(prompts)])
    for _ in range(20):
        tiered_step(sched, mirror)
    mirror.delay = 5
    for i, p in enumerate(prompts):
        sched.add_request(f"b{i}", p, SamplingParams(temperature=0, max_tokens=3))
    tiered_step(sched, mirror)
    loading = list(sched.tiers.loading_ids())
    assert loading
    sched.abort_requests(loading)
    sched.check_integrity()
    for _ in range(30):  # the loads complete for the cache; nobody waits for them
        tiered_step(sched, mirror)
        sched.check_integrity()
    sched.abort_requests(list(sched.requests))
    tiered_step(sched, mirror)
    tiers = sched.tiers
    assert not tiers.index.has_in_flight() and not tiers.num_loading
    assert all(not s.busy for s in tiers.cpu.slots)
    assert all(not e.busy for e in tiers.ssd._entries.values())
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_usable_blocks


def test_after_a_worker_loss_requests_get_their_prefix_from_ssd_alone():
    """drop_worker_memory (what a worker rebuild calls once every request released its blocks):
    the pool's and the CPU tier's KV are gone with the workers, the SSD folder is not; the same
    prompts then hit SSD only, and the mirror, whose pool and CPU tier are new and empty, checks
    that every loaded block holds its tokens' KV."""
    mirror = TieredMirror(BS)
    sched = _scheduler(cpu=12, ssd=64, mirror=mirror)
    prompts = _prompts(n=4)
    first, _ = _run(sched, mirror, [(f"a{i}", p) for i, p in enumerate(prompts)])
    for _ in range(20):  # write-back puts every cold block on SSD
        tiered_step(sched, mirror)
    assert sched.kv.drop_worker_memory() == []
    assert sched.kv.pool.num_cached_blocks() == 0 and sched.tiers.cpu.num_free == 12
    fresh = TieredMirror(BS)  # the new workers: nothing but the folder
    fresh.ssd = mirror.ssd
    again, cached = _run(sched, fresh, [(f"b{i}", p) for i, p in enumerate(prompts)])
    assert list(again.values()) == list(first.values())
    assert sum(cached.values()) > 0 and sched.tiers.counters.loads > 0


@st.composite
def _events(draw):
    kind = draw(st.sampled_from(["add", "add", "step", "step", "step", "abort", "reset"]))
    if kind == "add":
        base = draw(st.sampled_from([list(range(1, 25)), list(range(100, 117)), []]))
        cut = draw(st.integers(0, len(base)))
        tail = draw(st.lists(st.integers(1, 900), min_size=0 if cut else 1, max_size=8))
        return ("add", base[:cut] + tail, draw(st.integers(1, 8)),
                draw(st.sampled_from([None, "tenant"])))
    if kind == "abort":
        return ("abort", draw(st.integers(0, 60)))
    return (kind,)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=st.lists(_events(), min_size=1, max_size=60),
       mode=st.sampled_from(["recompute", "swap", "auto"]), delay=st.integers(0, 3),
       ssd=st.sampled_from([0, 24]))
def test_random_streams_with_tiers_keep_every_invariant(events, mode, delay, ssd):
    """Random arrivals (two salts), aborts, steps and cache resets on a pool too small for
    them, with tiers and swap preemption: invariants every step, every token's context in the
    pool (the mirror), nothing leaked at the end."""
    mirror = TieredMirror(BS, delay=delay)
    sched = _scheduler(num_blocks=14, cpu=10, ssd=ssd, mode=mode, max_num_seqs=3, budget=16,
                       mirror=mirror)
    added = []
    for ev in events:
        if ev[0] == "add":
            rid = f"r{len(added)}"
            sched.add_request(rid, ev[1], SamplingParams(temperature=0, max_tokens=ev[2]),
                              cache_salt=ev[3])
            added.append(rid)
        elif ev[0] == "abort" and added:
            sched.abort_requests([added[ev[1] % len(added)]])
        elif ev[0] == "reset":
            sched.reset_prefix_cache()
        else:
            tiered_step(sched, mirror)
        sched.check_integrity()
    for _ in range(300):
        if not sched.has_unfinished_requests() and not sched.has_pending_worker_updates():
            break
        tiered_step(sched, mirror)
        sched.check_integrity()
    assert not sched.has_unfinished_requests()
    tiers = sched.tiers
    assert not tiers.index.has_in_flight() and all(not s.busy for s in tiers.cpu.slots)
    assert all(s.owner is None for s in tiers.cpu.slots)
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_usable_blocks

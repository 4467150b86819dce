"""The tier index and the scheduler's use of it, torch-free: exact demote / promote / spill / load
orders on tiny pools (in the manner of the seed-002 tests), and streams of requests run against a
mirror that holds the KV itself (tests/sched_driver.py: TieredMirror), so that a block served
from the wrong place fails at once. check_integrity() after every step."""
from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.sched_driver import TieredMirror, tiered_step
from tierserve.kvcache import BlockHash, BlockHasher, KVCacheManager, SlotState, TierManager
from tierserve.kvcache.tiers import CopyKind
from tierserve.scheduler import SamplingParams, Scheduler

BS = 4


def _h(i: int) -> BlockHash:
    return BlockHash(bytes([i]) * 16)


# ---------------------------------------------------------------- the index alone


def test_demotions_fill_slots_in_order_then_evict_the_coldest():
    t = TierManager(cpu_slots=3)
    for block in (7, 8, 9):
        assert t.demote(block, _h(block), b"k%d" % block)
    assert t.copies.out_blocks == [7, 8, 9] and t.copies.out_slots == [0, 1, 2]
    assert [t.cpu.slots[i].state for i in range(3)] == [SlotState.FILLING] * 3
    assert t.cpu.lookup(_h(7), b"k7") is None  # not until the copy completed
    t.complete_step(t.take_copies())
    assert t.cpu.coldest_ids() == [0, 1, 2]
    assert t.cpu.lookup(_h(8), b"k8").slot == 1
    t.cpu.touch(t.cpu.slots[0])  # a hit makes slot 0 the hottest
    assert t.cpu.coldest_ids() == [1, 2, 0]
    assert not t.demote(99, _h(8), b"k8")  # already in the tier: no second copy
    assert t.demote(4, _h(4), b"k4")  # full: slot 1, the coldest, is dropped
    assert t.copies.out_slots == [1] and t.stats.cpu_dropped == 1
    assert t.cpu.lookup(_h(8), b"k8") is None
    t.complete_step(t.take_copies())
    assert t.cpu.coldest_ids() == [2, 0, 1]
    t.check_integrity()


def test_pinned_slots_are_not_reused_and_releases_wait_for_copies():
    t = TierManager(cpu_slots=2)
    for block in (1, 2):
        t.demote(block, _h(block), None)
    t.complete_step(t.take_copies())
    hits = t.find([_h(1), _h(2)], None, 0, 2)
    assert [(h.tier, h.slot.slot) for h in hits] == [("cpu", 0), ("cpu", 1)]
    t.pin_hits(hits)
    assert not t.demote(3, _h(3), None)  # every slot is pinned: the block is dropped
    assert t.stats.demotions_dropped == 1
    t.promote(hits, [10, 11])
    copies = t.take_copies()
    assert (copies.in_slots, copies.in_blocks) == ([0, 1], [10, 11])
    t.cpu.release(hits[0].slot)  # e.g. reset: waits for the copy reading it
    assert t.cpu.slots[0].state == SlotState.READY and t.cpu.slots[0].release_pending
    t.complete_step(copies)
    assert t.cpu.slots[0].state == SlotState.FREE and t.cpu.slots[1].readers == 0
    t.check_integrity()


def test_write_back_spills_the_coldest_dirty_slots_and_eviction_prefers_clean_ones():
    t = TierManager(cpu_slots=4, ssd_slots=8, writeback_headroom=0.5)
    for block in range(4):
        t.demote(block, _h(block), None)
    t.complete_step(t.take_copies())
    t.write_back()  # headroom 2: the two coldest are spilled
    copies = t.take_copies()
    assert [(c.kind, c.cpu_slot, c.ssd_entry) for c in copies.started] == [(2, 0, 0), (2, 1, 1)]
    assert t.cpu.slots[0].readers == 1  # pinned while the spill reads it
    assert t.complete_async({CopyKind.SPILL: 2}) == []
    assert t.cpu.slots[0].clean and t.cpu.slots[1].clean and t.stats.spills == 2
    t.cpu.touch(t.cpu.slots[0])
    t.demote(9, _h(9), None)  # evicts slot 1: clean, so nothing is lost
    assert t.copies.out_slots == [1] and t.stats.cpu_dropped == 0
    t.complete_step(t.take_copies())
    assert [(h.tier, h.slot.slot) for h in t.find([_h(1)], None, 0, 1)] == [("ssd", 1)]
    t.check_integrity()


def test_loads_wake_their_requests_and_bad_entries_are_dropped_and_counted():
    t = TierManager(cpu_slots=4, ssd_slots=4)
    for entry in range(3):
        t.ssd.restore(entry, _h(entry), None)
    hits = t.find([_h(0), _h(1), _h(2)], None, 0, 3)
    assert [h.tier for h in hits] == ["ssd"] * 3
    assert t.start_loads("r", hits)
    assert t.start_loads("q", hits[:1])  # the same load, two waiters
    copies = t.take_copies()
    assert [(c.seq, c.kind, c.cpu_slot, c.ssd_entry) for c in copies.started] == [
        (0, 1, 0, 0), (1, 1, 1, 1), (2, 1, 2, 2)]
    assert t.complete_async({CopyKind.LOAD: 1}) == ["q"]
    assert t.complete_async({CopyKind.LOAD: 3}, failed=[(CopyKind.LOAD, 2)]) == ["r"]
    assert t.stats.checksum_failures == 1 and t.stats.loads == 2
    assert not t.ssd.contains(_h(2)) and not t.cpu.contains(_h(2))  # never served
    assert [h.tier for h in t.find([_h(0), _h(1), _h(2)], None, 0, 3)] == ["cpu", "cpu"]
    t.check_integrity()


def test_swap_out_is_all_or_nothing_and_owned_slots_are_never_hit():
    t = TierManager(cpu_slots=3)
    t.demote(5, _h(5), None)
    t.complete_step(t.take_copies())
    assert t.swap_out("victim", [1, 2, 3, 4]) is None  # 4 blocks, 3 slots: nothing changes
    assert t.cpu.lookup(_h(5), None).slot == 0 and not t.copies
    slots = t.swap_out("victim", [1, 2])
    assert slots == [1, 2] and t.copies.out_blocks == [1, 2]
    t.complete_step(t.take_copies())
    assert all(t.cpu.slots[s].owner == "victim" for s in slots)
    assert t.cpu.coldest_ids() == [0]  # owned slots are not in the LRU
    t.swap_in(slots, [7, 8])
    copies = t.take_copies()
    assert copies.in_slots == [1, 2] and copies.in_blocks == [7, 8]
    t.complete_step(copies)
    assert t.cpu.num_free == 2 and t.stats.swap_outs == t.stats.swap_ins == 1
    t.check_integrity()


def test_salts_never_share_a_slot():
    hasher = BlockHasher(BS)
    tokens = list(range(1, 9))
    a, _ = hasher.hash_blocks(tokens, 0, None, extra_first=b"s\x01\x00\x00\x00a")
    b, _ = hasher.hash_blocks(tokens, 0, None, extra_first=b"s\x01\x00\x00\x00b")
    t = TierManager(cpu_slots=4)
    for i, h in enumerate(a):
        t.demote(i, h, None)
    t.complete_step(t.take_copies())
    assert len(t.find(a, None, 0, 2)) == 2 and t.find(b, None, 0, 2) == []


# ---------------------------------------------------------------- through the scheduler


def _scheduler(num_blocks=12, cpu=16, ssd=0, mode="recompute", max_num_seqs=4, budget=32,
               max_model_len=40):
    tiers = TierManager(cpu, ssd, block_bytes=100) if cpu else None
    kv = KVCacheManager(num_blocks, BS, watermark=0.0, tiers=tiers)
    return Scheduler(kv, BlockHasher(BS), max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=budget, max_model_len=max_model_len,
                     vocab_size=1000, preemption_mode=mode)


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
            assert sched.tiering.tiers.stats.promotions > 0
        else:
            assert sum(rounds[2][1].values()) == 0
    assert results[0] == results[64]


def test_ssd_hits_wait_for_loads_without_holding_up_others_and_bad_entries_recompute():
    sched, mirror = _scheduler(cpu=12, ssd=64), TieredMirror(BS)
    prompts = _prompts(n=6)
    first, _ = _run(sched, mirror, [(f"a{i}", p) for i, p in enumerate(prompts)])
    tiers = sched.tiering.tiers
    for _ in range(20):  # let write-back put everything cold on SSD
        tiered_step(sched, mirror)
    assert tiers.stats.spills > 0
    mirror.delay = 3
    mirror.corrupt = {tiers.ssd._index[h].slot for h in list(tiers.ssd._index)[:2]}
    again, cached = _run(sched, mirror, [(f"b{i}", p) for i, p in enumerate(prompts)])
    assert list(again.values()) == list(first.values())
    assert tiers.stats.loads > 0 and 1 <= tiers.stats.checksum_failures <= 2
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
            assert sched.tiering.tiers.stats.swap_outs > 0
            assert sched.tiering.tiers.stats.swap_ins > 0
        assert sched.tiering.tiers.cpu.num_free + len(sched.tiering.tiers.cpu.coldest_ids()) \
            == 32
    assert outs["recompute"] == outs["swap"]


def test_abort_while_a_load_is_in_flight_leaks_nothing():
    sched, mirror = _scheduler(cpu=12, ssd=64), TieredMirror(BS)
    prompts = _prompts(n=6)
    _run(sched, mirror, [(f"a{i}", p) for i, p in enumerate(prompts)])
    for _ in range(20):
        tiered_step(sched, mirror)
    mirror.delay = 5
    for i, p in enumerate(prompts):
        sched.add_request(f"b{i}", p, SamplingParams(temperature=0, max_tokens=3))
    tiered_step(sched, mirror)
    loading = list(sched.tiering.loading)
    assert loading
    sched.abort_requests(loading)
    sched.check_integrity()
    for _ in range(30):  # the loads complete for the cache; nobody waits for them
        tiered_step(sched, mirror)
        sched.check_integrity()
    sched.abort_requests(list(sched.requests))
    tiered_step(sched, mirror)
    tiers = sched.tiering.tiers
    assert not tiers.in_flight and not sched.tiering.loading
    assert all(not s.busy for s in tiers.cpu.slots)
    assert all(not s.busy for s in tiers.ssd.slots)
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_usable_blocks


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
    sched = _scheduler(num_blocks=14, cpu=10, ssd=ssd, mode=mode, max_num_seqs=3, budget=16)
    mirror = TieredMirror(BS, delay=delay)
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
    tiers = sched.tiering.tiers
    assert not tiers.in_flight and all(not s.busy for s in tiers.cpu.slots)
    assert all(s.owner is None for s in tiers.cpu.slots)
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_usable_blocks

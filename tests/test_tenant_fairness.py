"""Fair eviction between cache salts (kvcache/tenants.py): a tenant that floods the cache evicts
its own blocks before another tenant's, the heaviest tenant pays even when the LRU head is
someone else's, blocks in use are never protected at the cost of an allocation, and one tenant
(unsalted, or any single salt) gets exactly the plain LRU order. Driven on small pools directly,
then end to end through LLM with a tiny checkpoint."""
from __future__ import annotations

import random

import pytest

from tests.checkpoints import make_tiny_llama
from tierserve import LLM, SamplingParams
from tierserve.kvcache import BlockHasher, KVCacheManager
from tierserve.scheduler import SamplingParams as Params
from tierserve.scheduler.request import Request

BS = 4


def _req(rid: str, tokens: list[int], salt: str | None, hasher: BlockHasher) -> Request:
    return Request(rid, tokens, Params(), cache_salt=salt, hasher=hasher)


def _admit(kv: KVCacheManager, req: Request) -> int:
    """Allocates the whole prompt (after its prefix hits); returns the hit tokens."""
    hits, n = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - n, hits, n) is not None
    req.num_computed_tokens = req.num_tokens
    kv.check_integrity()
    return n


def _run(kv: KVCacheManager, req: Request) -> int:
    n = _admit(kv, req)
    kv.free(req)
    kv.check_integrity()
    return n


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000) for _ in range(n)]


def _flood(salt_a: str | None, salt_b: str | None) -> tuple[int, KVCacheManager]:
    """B caches a 4-block prefix, A runs 10 distinct 4-block prompts through a 20-block pool,
    then B asks again: its hit tokens."""
    rng, hasher = random.Random(0), BlockHasher(BS)
    kv = KVCacheManager(21, BS, watermark=0.0)
    b_prompt = _prompt(rng, 17)
    assert _run(kv, _req("b0", b_prompt, salt_b, hasher)) == 0
    for i in range(10):
        _run(kv, _req(f"a{i}", _prompt(rng, 13), salt_a, hasher))
    return _run(kv, _req("b1", b_prompt, salt_b, hasher)), kv


def test_a_flood_by_another_salt_evicts_its_own_blocks_not_the_victims():
    hit, kv = _flood("tenant-a", "tenant-b")
    assert hit == 16
    assert kv.pool.num_fair_evictions > 0
    assert len(kv.pool.tenants.evictable["tenant-b"]) == 4  # B's cached prefix, nothing lost


@pytest.mark.parametrize("salts", [(None, None), ("one", "one")], ids=["unsalted", "one salt"])
def test_one_tenant_keeps_plain_lru(salts):
    hit, kv = _flood(*salts)
    assert hit == 0  # the flood pushed B's prefix out, as LRU does
    assert kv.pool.num_fair_evictions == 0


def _allocation_trace(salt: str | None, seed: int) -> list[list[int]]:
    """Block ids handed out by a random workload of overlapping prompts, every request with
    the same salt (or none), some held across later admissions."""
    rng, hasher = random.Random(seed), BlockHasher(BS)
    kv = KVCacheManager(17, BS, watermark=0.0)
    prefixes = [_prompt(rng, 8) for _ in range(3)]
    held, trace = [], []
    for i in range(60):
        req = _req(f"r{i}", rng.choice(prefixes) + _prompt(rng, rng.randrange(1, 12)), salt,
                   hasher)
        hits, n = kv.get_computed_blocks(req)
        blocks = kv.allocate_slots(req, req.num_tokens - n, hits, n)
        if blocks is None:
            trace.append(None)
        else:
            req.num_computed_tokens = req.num_tokens
            trace.append([b.block_id for b in blocks])
            held.append(req)
        while held and (len(held) > 2 or blocks is None):
            kv.free(held.pop(rng.randrange(len(held))))
        kv.check_integrity()
    assert kv.pool.num_fair_evictions == 0
    return trace


@pytest.mark.parametrize("seed", range(3))
def test_a_single_salt_allocates_exactly_as_unsalted(seed):
    assert _allocation_trace("tenant", seed) == _allocation_trace(None, seed)


def test_the_heaviest_tenant_pays_even_when_the_lru_head_is_anothers():
    rng, hasher = random.Random(1), BlockHasher(BS)
    kv = KVCacheManager(21, BS, watermark=0.0)
    _run(kv, _req("light", _prompt(rng, 8), "light", hasher))  # 2 blocks, cached first
    heavy = _prompt(rng, 48)
    _run(kv, _req("heavy", heavy, "heavy", hasher))  # 12 blocks, cached after
    light_blocks = {b.block_id for b in kv.pool.tenants.evictable["light"].values()}
    # 6 plain free blocks at the head go first, then the head is light's: heavy's go instead,
    # also once the new tenant occupies more than heavy (heavy still occupies more than light).
    _admit(kv, _req("new", _prompt(rng, 40), "new", hasher))
    assert light_blocks == {b.block_id for b in kv.pool.tenants.evictable["light"].values()}
    assert kv.pool.num_fair_evictions == 4
    # heavy lost its least recently freed blocks: the tail of its prompt (freed first)
    assert kv.get_computed_blocks(_req("heavy2", heavy, "heavy", hasher))[1] == 32


def test_blocks_in_use_do_not_protect_the_cache_of_others_from_a_needed_allocation():
    """A tenant whose blocks are all held by a running request has none to give: the other
    tenant's cached blocks are the only evictable ones, and the LRU head is taken."""
    rng, hasher = random.Random(2), BlockHasher(BS)
    kv = KVCacheManager(21, BS, watermark=0.0)
    _run(kv, _req("b", _prompt(rng, 16), "b", hasher))  # 4 cached blocks
    a = _req("a", _prompt(rng, 64), "a", hasher)
    _admit(kv, a)  # 16 blocks held: all 20 are used, 4 of them B's cached ones
    assert kv.pool.num_free_blocks == 4
    a.append_output_token(7)
    assert len(kv.allocate_slots(a, 1)) == 1
    assert kv.pool.num_fair_evictions == 0
    assert len(kv.pool.tenants.evictable["b"]) == 3
    assert kv.pool.tenants.occupancy.counts == {"a": 17, "b": 3}


def test_the_ledger_sleeps_until_a_second_tenant_allocates():
    """One tenant pays nothing for the rule; the second tenant's first allocation builds the
    ledger from the blocks, and a reset of the prefix cache puts it back to sleep."""
    rng, hasher = random.Random(4), BlockHasher(BS)
    kv = KVCacheManager(21, BS, watermark=0.0)
    held = _req("x0", _prompt(rng, 10), "x", hasher)
    _admit(kv, held)
    _run(kv, _req("x1", _prompt(rng, 12), "x", hasher))
    assert not kv.pool.tenants.active
    _run(kv, _req("y0", _prompt(rng, 9), "y", hasher))
    assert kv.pool.tenants.active
    assert kv.pool.tenants.occupancy.counts == {"x": 3 + 3, "y": 2}  # x0 holds 3, x1 cached 3
    kv.free(held)
    assert kv.reset_prefix_cache() and not kv.pool.tenants.active
    kv.check_integrity()


def test_many_tenants_random_workload_keeps_the_ledger_exact():
    rng, hasher = random.Random(3), BlockHasher(BS)
    kv = KVCacheManager(33, BS, watermark=0.0)
    salts = [None, "x", "y", "z"]
    prefixes = {s: _prompt(rng, 12) for s in salts}
    held = []
    for i in range(300):
        salt = rng.choice(salts)
        req = _req(f"r{i}", prefixes[salt] + _prompt(rng, rng.randrange(1, 20)), salt, hasher)
        hits, n = kv.get_computed_blocks(req)
        if kv.allocate_slots(req, req.num_tokens - n, hits, n) is not None:
            req.num_computed_tokens = req.num_tokens
            held.append(req)
        while held and (len(held) > 3 or rng.random() < 0.3):
            kv.free(held.pop(rng.randrange(len(held))))
        kv.check_integrity()
    assert kv.pool.num_fair_evictions > 0
    for req in held:
        kv.free(req)
    assert kv.reset_prefix_cache()
    assert kv.pool.tenants.evictable == {}
    kv.check_integrity()


# ---------------------------------------------------------------- end to end, in process


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_llama(tmp_path_factory.mktemp("tenants") / "llama"))


GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


def _engine_flood(tiny: str, salt_a: str | None, salt_b: str | None) -> tuple[int, int, dict]:
    """Tenant B's 40-token prompt, a flood of 12 distinct 40-token prompts from tenant A two
    at a time (three times the 40-block pool), then B's prompt again. Returns B's cached
    tokens the first and the second time, and the engine's stats."""
    rng = random.Random(5)
    b_prompt = [rng.randrange(3, 380) for _ in range(40)]
    flood = [[rng.randrange(3, 380) for _ in range(40)] for _ in range(12)]
    with LLM(tiny, block_size=BS, num_kv_blocks=41, max_model_len=64) as llm:
        first = llm.generate([b_prompt], GREEDY, use_tqdm=False, cache_salt=salt_b)[0]
        for i in range(0, len(flood), 2):
            for out in llm.generate(flood[i:i + 2], GREEDY, use_tqdm=False,
                                    cache_salt=salt_a):
                assert out.error is None, out.error
        again = llm.generate([b_prompt], GREEDY, use_tqdm=False, cache_salt=salt_b)[0]
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        llm.engine.scheduler.check_integrity()
        return first.num_cached_tokens, again.num_cached_tokens, llm.stats()


def test_engine_tenant_b_prefix_survives_a_flood_by_another_salt(tiny):
    first, again, stats = _engine_flood(tiny, "tenant-a", "tenant-b")
    assert (first, again) == (0, 36)  # all but the last block: the last token is computed
    assert stats["prefix_cache_evictions"] > 0  # the flood did evict: its own blocks


@pytest.mark.parametrize("salts", [(None, None), ("one", "one")], ids=["unsalted", "one salt"])
def test_engine_one_tenant_keeps_plain_lru_under_the_same_flood(tiny, salts):
    first, again, _ = _engine_flood(tiny, *salts)
    assert (first, again) == (0, 0)


def test_a_salts_tenant_is_its_part_before_the_first_bar():
    from tierserve.kvcache.tenants import tenant_of
    assert tenant_of(None) is None
    assert tenant_of("acme") == "acme"
    assert tenant_of("t-1f|client|x") == "t-1f"


@pytest.mark.parametrize("salt_a, kept, most", [("a", 4, 8), ("a@0.25", 12, 5)],
                         ids=["fair", "share"])
def test_a_tenant_with_a_share_keeps_to_it_and_spares_the_others(salt_a, kept, most):
    """B caches 12 of 20 blocks; A runs 12 distinct 3-block prompts. By the fair rule alone A,
    lighter than B, takes B's blocks until they balance; with a quarter of the pool as its
    share, A never occupies more than 5 blocks, recycles its own, and B keeps all 12."""
    rng, hasher = random.Random(1), BlockHasher(BS)
    kv = KVCacheManager(21, BS, watermark=0.0)
    for i in range(3):
        _run(kv, _req(f"b{i}", _prompt(rng, 16), "b", hasher))
    ledger, peak = kv.pool.tenants, 0
    for i in range(12):
        _run(kv, _req(f"a{i}", _prompt(rng, 9), salt_a, hasher))
        peak = max(peak, ledger.occupancy.counts[salt_a])
    assert len(ledger.evictable["b"]) == kept and peak <= most

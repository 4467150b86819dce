"""KVCacheManager: the scheduler-facing facade over the block pool.

It owns which blocks each request holds (append-only block tables), finds prefix hits for
waiting requests, allocates slots for the tokens a step schedules, caches blocks as they become
full, and frees a request's blocks tail-first.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from tierserve.kvcache.block import BlockHash, KVCacheBlock
from tierserve.kvcache.block_pool import BlockPool
from tierserve.kvcache.events import KVEventRecorder
from tierserve.kvcache.tenants import tenant_of
from tierserve.kvcache.tier_policy import TierPolicy

__all__ = ["KVCacheManager", "PrefixCacheStats", "CacheableRequest"]


class CacheableRequest(Protocol):
    """What the manager reads from a request (scheduler.Request satisfies it)."""

    request_id: str
    num_computed_tokens: int
    # Its tenant, the part before the first '|' (kvcache/tenants.py); None: unsalted.
    cache_salt: str | None
    # Hashes (and, when verifying, the hashed keys) of every full block of the request's tokens.
    block_hashes: list[BlockHash]
    block_keys: list[bytes] | None

    @property
    def num_tokens(self) -> int: ...


@dataclass(slots=True)
class PrefixCacheStats:
    requests: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 verify_hits: bool = True, watermark: float = 0.01,
                 tiers: TierPolicy | None = None,
                 events: KVEventRecorder | None = None) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        # The KV tiers below the pool (none: a policy over an index of capacity 0). A cached
        # block the pool evicts is offered to them (demoted) before its slot is reused.
        self.tiers = tiers if tiers is not None else TierPolicy(block_size=block_size)
        if self.tiers.enabled and not enable_caching:
            raise ValueError("KV tiers hold cached blocks: they need prefix caching")
        self.pool = BlockPool(num_blocks, enable_caching, verify_hits,
                              self.tiers.on_evict if self.tiers.enabled else None,
                              events if enable_caching else None)
        if events is not None and self.tiers.enabled:
            self.tiers.index.record_events(events)
        # Reserved from new admissions only, so running requests can always take a next block.
        self.watermark_blocks = int(watermark * self.pool.num_usable_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def get_computed_blocks(self, request: CacheableRequest) -> tuple[list[KVCacheBlock], int]:
        """Longest run of verified full-block hits; never the whole prompt, so the last token is
        always computed and yields logits."""
        if not self.enable_caching:
            return [], 0
        max_blocks = min((request.num_tokens - 1) // self.block_size, len(request.block_hashes))
        # The chain broke at the first miss: no later block can hit.
        hits = self.pool.lookup_chain(request.block_hashes, request.block_keys, max_blocks)
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: CacheableRequest, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVCacheBlock] = (),
                       num_new_computed_tokens: int = 0,
                       apply_watermark: bool = False) -> list[KVCacheBlock] | None:
        """Blocks for `num_new_tokens` past the computed (and newly hit) tokens.

        Returns the newly allocated blocks, or None when they don't fit; on None nothing changed.
        num_new_computed_tokens may count blocks beyond new_computed_blocks (a tier hit being
        copied in, a swapped-out request's blocks): the first new blocks hold those.
        """
        if num_new_tokens <= 0:
            raise RuntimeError(f"allocate_slots needs num_new_tokens > 0, got {num_new_tokens}")
        held = self.req_to_blocks.get(request.request_id)
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_required = -(-total // self.block_size)
        if held is not None and num_required <= len(held) and not new_computed_blocks:
            # Decode fast path: the tokens fit the blocks the request already holds.
            if self.enable_caching and total // self.block_size > self._num_cached[request.request_id]:
                self._cache_full_blocks(request, held, total)
            return []
        num_held = len(held) if held is not None else 0
        num_new = max(num_required - num_held - len(new_computed_blocks), 0)
        # Hits sitting in the free queue leave it when touched.
        num_free_hits = [b.ref_cnt for b in new_computed_blocks].count(0)
        reserve = self.watermark_blocks if apply_watermark else 0
        if num_new + num_free_hits + reserve > self.pool.num_free_blocks:
            return None
        if held is None:
            held = self.req_to_blocks[request.request_id] = []
            self._num_cached[request.request_id] = len(new_computed_blocks)
            self._record_admission(request, num_new_computed_tokens)
        self.pool.touch(new_computed_blocks)
        held.extend(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(num_new, tenant_of(request.cache_salt))
        held.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, held, total)
        return new_blocks

    def fork(self, parent: CacheableRequest, child: CacheableRequest,
             num_tokens: int) -> tuple[int, int] | None | bool:
        """Gives `child` the parent's KV of its first num_tokens tokens: the full blocks shared
        by ref count, the partial last block as a fresh copy (copy-on-write: the parent writes
        its next tokens there). Returns the (source, destination) block ids of that copy, True
        when there is nothing to copy, or None when no block is free for it (nothing changed)."""
        if child.request_id in self.req_to_blocks:
            raise RuntimeError(f"{child.request_id!r} already holds blocks")
        held = self.req_to_blocks[parent.request_id]
        num_full, partial = divmod(num_tokens, self.block_size)
        assert len(held) * self.block_size >= num_tokens, "the parent has not computed them"
        if partial and self.pool.num_free_blocks == 0:
            return None
        shared = held[:num_full]
        self.pool.touch(shared)
        blocks = self.req_to_blocks[child.request_id] = list(shared)
        self._num_cached[child.request_id] = min(num_full, self._num_cached[parent.request_id])
        self._record_admission(child, num_tokens)
        if not partial:
            return True
        copy = self.pool.get_new_blocks(1, tenant_of(child.cache_salt))[0]
        blocks.append(copy)
        return held[num_full].block_id, copy.block_id

    def free(self, request: CacheableRequest) -> None:
        """Releases the request's blocks, last block first: a tail block extends fewer prefixes,
        so it should be evicted before the prefix blocks."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self._num_cached.pop(request.request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        if not self.pool.reset_prefix_cache():
            return False
        self.tiers.clear()
        return True

    def drop_worker_memory(self) -> list:
        """For a worker rebuild: the pool's KV and the CPU tier lived in the dead workers'
        memory. Every cached device block is forgotten (never demoted: its KV is gone), and so
        is the tiers' state in worker memory (TierPolicy.drop_worker_memory); the SSD record is
        kept. No request may hold blocks (preempt them first). Returns the requests that waited
        for SSD loads: they are waiting requests again."""
        if self.req_to_blocks:
            raise RuntimeError(f"{len(self.req_to_blocks)} requests still hold blocks")
        reset = self.pool.reset_prefix_cache()
        assert reset, "no request holds a block, yet the pool refused the reset"
        return self.tiers.drop_worker_memory()

    def _cache_full_blocks(self, request: CacheableRequest, held: list[KVCacheBlock],
                           num_tokens: int) -> None:
        rid = request.request_id
        start = self._num_cached[rid]
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        if end > start:
            self.pool.cache_full_blocks(held, request.block_hashes, request.block_keys, start, end)
            self._num_cached[rid] = end

    def _record_admission(self, request: CacheableRequest, num_hit_tokens: int) -> None:
        if self.enable_caching:
            self.stats.requests += 1
            self.stats.queried_tokens += request.num_tokens
            self.stats.hit_tokens += num_hit_tokens

    def check_integrity(self) -> None:
        """Invariant 4 and ref-count bookkeeping; O(num_blocks), for tests after every step."""
        pool = self.pool
        holders: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for block in blocks:
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
        queued = set(pool.free_queue.peek_ids())
        assert len(queued) == pool.num_free_blocks, "free queue length is off"
        num_cached_free = num_referenced = 0
        for block in pool.blocks[:-1]:
            assert block.ref_cnt == holders.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != "
                f"{holders.get(block.block_id, 0)} holders")
            assert (block.block_id in queued) == (block.ref_cnt == 0), (
                f"block {block.block_id}: in queue iff ref_cnt 0 violated")
            if block.ref_cnt > 0:
                num_referenced += 1
            elif block.block_hash is not None:
                num_cached_free += 1
        num_plain_free = pool.num_free_blocks - num_cached_free
        assert num_plain_free + num_cached_free + num_referenced == pool.num_usable_blocks
        hashed = sum(1 for b in pool.blocks if b.block_hash is not None)
        assert hashed == pool.num_cached_blocks(), "hash map and block hashes disagree"
        for block in pool.iter_cached_blocks():
            assert not block.is_null
        for rid, blocks in self.req_to_blocks.items():
            assert all(b.block_hash is not None for b in blocks[:self._num_cached[rid]])
        pool.check_hash_map()
        pool.check_tenants()
        self.tiers.check_integrity()

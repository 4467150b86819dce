"""The block pool: every KVCacheBlock, the free queue, and the prefix-cache hash map.

Partitions (invariant 4): each usable block is exactly one of
  free        ref_cnt 0, no hash, in the free queue
  cached      ref_cnt 0, hashed, in the free queue (evictable, LRU by queue position)
  referenced  ref_cnt > 0, not in the queue (hashed or not)
The null block is the last block id; it pads block tables and is in no partition.

Eviction is LRU by queue position within one tenant (cache salt); between tenants, one that
occupies more blocks gives first (kvcache/tenants.py states the rule).
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

from tierserve.kvcache.block import BlockHash, BlockId, FreeKVCacheBlockQueue, KVCacheBlock
from tierserve.kvcache.events import KVEventRecorder, KVTier
from tierserve.kvcache.tenants import TenantLedger, share_of

__all__ = ["BlockPool", "EvictCallback"]

_NOBODY = object()

# Called with (block_id, block_hash, hashed key) when a cached block loses its hash because its
# slot is about to be reused (the tiers copy it out first).
EvictCallback = Callable[[int, BlockHash, "bytes | None"], None]


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, verify_hits: bool = True,
                 on_evict: EvictCallback | None = None,
                 events: KVEventRecorder | None = None) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.verify_hits = verify_hits
        self.on_evict = on_evict
        # Told when a hash enters or leaves the set of cached hashes (a router's KV events).
        self.events = events
        self.blocks = [KVCacheBlock(BlockId(i)) for i in range(num_blocks)]
        self.null_block = self.blocks[-1]
        self.null_block.is_null = True
        self.free_queue = FreeKVCacheBlockQueue(self.blocks[:-1])
        # Several blocks may share a hash: block tables are append-only, so a request that
        # computed a block another request also cached keeps its own copy (seed 002).
        # Value: one block, or {block_id: block} when duplicated.
        self._cached: dict[BlockHash, KVCacheBlock | dict[int, KVCacheBlock]] = {}
        self._num_shared_hashes = 0  # values of _cached that are dicts
        self.tenants = TenantLedger()
        self._caps: dict[str | None, int | None] = {}  # tenant -> its share in blocks
        # The one tenant allocated to so far, while the ledger sleeps (_NOBODY: none yet).
        self._sole_tenant: object = _NOBODY
        self.num_evictions = 0
        # Evictions that took another tenant's block than the LRU head's (the fair rule).
        self.num_fair_evictions = 0
        self.num_collisions = 0

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash, key: bytes | None) -> KVCacheBlock | None:
        """A cached block for this hash whose stored key equals `key` (when verifying)."""
        entry = self._cached.get(block_hash)
        if entry is None:
            return None
        candidates = (entry,) if isinstance(entry, KVCacheBlock) else entry.values()
        if not self.verify_hits:
            return next(iter(candidates))
        for block in candidates:
            if block.hash_key == key:
                return block
        self.num_collisions += 1
        return None

    def lookup_chain(self, hashes: Sequence[BlockHash], keys: Sequence[bytes] | None,
                     stop: int) -> list[KVCacheBlock]:
        """The cached blocks of hashes[:stop] in order, up to the first miss (one loop: a long
        prompt's lookup is the admission's hottest path)."""
        if keys is None or not self.verify_hits:
            hits = list(map(self._cached.get, hashes[:stop]))
            if None in hits:
                del hits[hits.index(None):]
            if self._num_shared_hashes:  # a hash with several blocks: take one
                hits = [b if b.__class__ is KVCacheBlock else next(iter(b.values()))
                        for b in hits]
            return hits
        hits = []
        for i in range(stop):
            block = self.get_cached_block(hashes[i], keys[i])
            if block is None:
                break
            hits.append(block)
        return hits

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], hashes: Sequence[BlockHash],
                          keys: Sequence[bytes] | None, start: int, end: int) -> None:
        """Gives blocks[start:end] their hashes and enters them in the map."""
        cached, events = self._cached, self.events
        for i in range(start, end):
            block = blocks[i]
            assert block.block_hash is None, f"block {block.block_id} is already cached"
            block_hash = block.block_hash = hashes[i]
            if keys is not None:
                block.hash_key = keys[i]
            if block_hash in cached:
                self._insert(block)
            else:
                cached[block_hash] = block
                if events is not None:
                    events.stored(KVTier.DEVICE, block_hash)

    def get_new_blocks(self, n: int, tenant: str | None = None) -> list[KVCacheBlock]:
        """n blocks for `tenant`'s request, evicting cached ones lazily: from the queue head
        while one tenant holds the pool, else by the fair rule, one block at a time."""
        tenants = self.tenants
        if not tenants.active:
            if self._sole_tenant is _NOBODY:
                self._sole_tenant = tenant
            elif tenant != self._sole_tenant:
                tenants.activate(self.blocks[:-1], self._queue())
        cap = self._cap(tenant)
        if not tenants.active or (cap is None and tenants.lru_only(tenant)):
            blocks = self.free_queue.popleft_n(n)
            if tenants.active:
                for block in blocks:
                    self._claim(block, tenant)
                return blocks
            cached, events = self._cached, self.events
            for block in blocks:  # _claim, inlined: one call less per block
                block_hash = block.block_hash
                if block_hash is not None:
                    if self.on_evict is None and cached.get(block_hash) is block:
                        del cached[block_hash]  # _evict's common case
                        if events is not None:
                            events.removed(KVTier.DEVICE, block_hash)
                        block.block_hash = block.hash_key = None
                        self.num_evictions += 1
                    else:
                        self._evict(block)
                block.ref_cnt = 1
                block.tenant = tenant
            return blocks
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} left")
        blocks = []
        for _ in range(n):
            own = tenants.capped_choice(tenant, cap, self.free_queue.head()) \
                if cap is not None else None
            block = own if own is not None else self._next_to_take()
            self.free_queue.remove(block)
            self._claim(block, tenant)
            blocks.append(block)
        return blocks

    def _cap(self, tenant: str | None) -> int | None:
        """Blocks a tenant with a share may occupy before it evicts its own (None: no share)."""
        if tenant is None or "@" not in tenant:
            return None
        caps = self._caps
        if tenant not in caps:
            share = share_of(tenant)
            caps[tenant] = None if share is None else max(1, int(share * (self.num_blocks - 1)))
        return caps[tenant]

    def _queue(self) -> list[KVCacheBlock]:
        return [self.blocks[i] for i in self.free_queue.peek_ids()]

    def check_hash_map(self) -> None:
        """The count of hashes several blocks share is the map's; O(cached hashes)."""
        assert self._num_shared_hashes == sum(
            1 for e in self._cached.values() if not isinstance(e, KVCacheBlock))

    def check_tenants(self) -> None:
        """Asserts the tenant ledger (or, while it sleeps, that one tenant holds every block
        that is not plain free); O(num_blocks)."""
        usable = self.blocks[:-1]
        self.tenants.check(usable, self._queue())
        if not self.tenants.active:
            owners = {b.tenant for b in usable if b.ref_cnt or b.block_hash is not None}
            assert owners <= {self._sole_tenant}, owners

    def _next_to_take(self) -> KVCacheBlock:
        head = self.free_queue.head()
        if head.block_hash is None:
            return head
        victim = self.tenants.victim(head)
        if victim is None:
            return head
        self.num_fair_evictions += 1
        return victim

    def _claim(self, block: KVCacheBlock, tenant: str | None) -> None:
        assert block.ref_cnt == 0
        if self.tenants.active:
            self.tenants.taken(block, tenant)
        if block.block_hash is not None:
            self._evict(block)
        block.ref_cnt = 1
        block.tenant = tenant

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Takes a reference on prefix hits, pulling free cached ones out of the queue."""
        idle = [b for b in blocks if b.ref_cnt == 0]
        if idle:
            self.free_queue.remove_n(idle)
            if self.tenants.active:
                for block in idle:
                    self.tenants.hit(block)
        for block in blocks:
            block.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[KVCacheBlock]) -> None:
        """Drops one reference each; blocks reaching 0 join the queue tail in the given order."""
        released = []
        for block in ordered:
            block.ref_cnt -= 1
            if not block.ref_cnt:
                released.append(block)
            else:
                assert block.ref_cnt > 0, f"block {block.block_id} freed twice"
        if self.tenants.active:
            for block in released:
                self.tenants.freed(block)
        self.free_queue.append_n(released)

    def reset_prefix_cache(self) -> bool:
        """Forgets every hash; refused (False) while any block is referenced."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self.blocks:
            block.reset_hash()
        if self.events is not None:
            for block_hash in self._cached:
                self.events.removed(KVTier.DEVICE, block_hash)
        self._cached.clear()
        self._num_shared_hashes = 0
        self.tenants.deactivate()  # every block is plain free: nobody holds the pool
        self._sole_tenant = _NOBODY
        return True

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash some cached block holds, once each (a KV-event snapshot's device tier)."""
        return list(self._cached)

    def num_cached_blocks(self) -> int:
        return sum(1 if isinstance(e, KVCacheBlock) else len(e) for e in self._cached.values())

    def iter_cached_blocks(self) -> Iterable[KVCacheBlock]:
        for entry in self._cached.values():
            if isinstance(entry, KVCacheBlock):
                yield entry
            else:
                yield from entry.values()

    def _insert(self, block: KVCacheBlock) -> None:
        entry = self._cached.get(block.block_hash)
        if entry is None:
            self._cached[block.block_hash] = block
            if self.events is not None:
                self.events.stored(KVTier.DEVICE, block.block_hash)
        elif isinstance(entry, KVCacheBlock):
            self._cached[block.block_hash] = {entry.block_id: entry, block.block_id: block}
            self._num_shared_hashes += 1
        else:
            entry[block.block_id] = block

    def _evict(self, block: KVCacheBlock) -> None:
        block_hash, key = block.block_hash, block.hash_key
        entry = self._cached[block_hash]
        if entry is block:
            del self._cached[block_hash]
            if self.events is not None:
                self.events.removed(KVTier.DEVICE, block_hash)
        else:
            del entry[block.block_id]
            if len(entry) == 1:
                self._cached[block_hash] = next(iter(entry.values()))
                self._num_shared_hashes -= 1
        block.reset_hash()
        self.num_evictions += 1
        if self.on_evict is not None:
            self.on_evict(block.block_id, block_hash, key)

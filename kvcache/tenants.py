"""Fair eviction between tenants of one block pool.

A tenant is a cache salt up to its first "|" (`tenant_of`; None: unsalted requests, one
tenant): the HTTP server salts a tenant's requests `<tenant salt>|<client salt>`, so the salts a
client picks share its tenant's side of the rule. Salts never share a block (the salt is in the
first block's hash and the chain carries it on), so each cached block belongs to one tenant: the
one whose request cached it.

A tenant occupies the blocks its requests hold and its cached free blocks. The rule
(BlockPool.get_new_blocks): a new block is the free queue's LRU head, unless the head is a
cached block of tenant t and a tenant occupying more blocks than t has a cached free block; then
that tenant's least recently freed cached block is evicted instead. The payer is the tenant
occupying the most blocks if it has a cached free block, else the tenant with the most cached
free blocks if it occupies more than t (two O(1) looks, not a search over every tenant). With
no payer, a plain free block (no hash) goes instead if t occupies fewer blocks than the
heaviest tenant.

A tenant with a share (`share_of`: its name ends in "@SHARE") that occupies its share of the
pool or more takes its own least recently freed cached block first, before a plain free block
or anyone else's: it cannot hold more than its share of the pool with cached blocks. Below its
share it still takes a plain free block, or else its own cached one, before it evicts another
tenant's cached block (`capped_choice`).

So a tenant that fills the cache evicts its own blocks first: another tenant's cached blocks go
only while it occupies at least as much of the pool as they do (ties go by LRU), or when no
block is left but theirs (every other free block is gone, and blocks held by running requests
are never evicted). With one tenant the head is always taken: plain LRU, block for block.

Every operation is O(1): each tenant's cached free blocks and the plain free blocks sit in
insertion-ordered maps (in free-queue order), the counts per tenant in buckets by count
(`MaxCounter`). Until a second tenant allocates, nothing is tracked (TenantLedger.active).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

from tierserve.kvcache.block import KVCacheBlock

__all__ = ["TenantLedger", "MaxCounter", "tenant_of", "share_of"]

Tenant = str | None


def tenant_of(cache_salt: str | None) -> Tenant:
    """The tenant a cache salt belongs to: the salt up to its first "|"."""
    if cache_salt is None:
        return None
    return cache_salt.partition("|")[0]


def share_of(tenant: Tenant) -> float | None:
    """The share of the pool a tenant named `NAME@SHARE` (SHARE in (0, 1]) may hold cached;
    None: no share of its own (the fair rule alone)."""
    if tenant is None or "@" not in tenant:
        return None
    try:
        share = float(tenant.rpartition("@")[2])
    except ValueError:
        return None
    return share if 0.0 < share <= 1.0 else None


class MaxCounter:
    """Counts per key, changed by one at a time, with the key of the largest count in O(1):
    keys sit in buckets by count, and the largest count moves by at most one per change.
    Buckets are kept once made (at most one per count reached): a key moving between two
    counts, the common case, then allocates nothing."""

    __slots__ = ("counts", "_buckets", "_max")

    def __init__(self) -> None:
        self.counts: dict[Tenant, int] = {}
        self._buckets: dict[int, dict[Tenant, None]] = {}  # count -> keys (an ordered set)
        self._max = 0

    def inc(self, key: Tenant) -> None:
        count = self.counts.get(key, 0) + 1
        self.counts[key] = count
        buckets = self._buckets
        if count > 1:
            del buckets[count - 1][key]
        bucket = buckets.get(count)
        if bucket is None:
            buckets[count] = {key: None}
        else:
            bucket[key] = None
        if count > self._max:
            self._max = count

    def dec(self, key: Tenant) -> None:
        count = self.counts[key]
        buckets = self._buckets
        del buckets[count][key]
        if count == 1:
            del self.counts[key]
        else:
            self.counts[key] = count - 1
            buckets[count - 1][key] = None  # made when the key rose through count - 1
        if count == self._max and not buckets[count]:
            self._max = count - 1

    def top(self) -> Tenant:
        """A key with the largest count (the first to reach it); only when counts is not
        empty."""
        return next(iter(self._buckets[self._max]))

    @property
    def largest(self) -> int:
        return self._max

    def clear(self) -> None:
        self.counts.clear()
        self._buckets.clear()
        self._max = 0

    def check(self) -> None:
        assert self._max == max(self.counts.values(), default=0)
        assert {k: c for c, ks in self._buckets.items() for k in ks} == self.counts


class TenantLedger:
    """occupancy: blocks each tenant holds (referenced by its requests, or cached and free);
    evictable[t]: tenant t's cached free blocks by block id, least recently freed first;
    plain: the free blocks without a hash, in free-queue order.

    It sleeps (tracks nothing, `active` False) while one tenant has had the pool to itself,
    where the rule cannot apply and plain LRU costs nothing extra; the pool wakes it when a
    second tenant allocates, and `activate` builds it from the blocks then (O(num_blocks),
    once)."""

    __slots__ = ("occupancy", "evictable", "plain", "_num_evictable", "active")

    def __init__(self) -> None:
        self.occupancy = MaxCounter()
        self.evictable: dict[Tenant, OrderedDict[int, KVCacheBlock]] = {}
        self._num_evictable = MaxCounter()  # len(evictable[t])
        self.plain: OrderedDict[int, KVCacheBlock] = OrderedDict()
        self.active = False

    def activate(self, blocks: Iterable[KVCacheBlock], queue: Iterable[KVCacheBlock]) -> None:
        """Starts tracking: every usable block and the free queue, head first."""
        self.deactivate()
        for block in blocks:
            if block.ref_cnt or block.block_hash is not None:  # plain free: nobody's
                self.occupancy.inc(block.tenant)
        for block in queue:
            if block.block_hash is None:
                self.plain[block.block_id] = block
            else:
                self._add_evictable(block)
        self.active = True

    def deactivate(self) -> None:
        self.occupancy.clear()
        self.evictable.clear()
        self._num_evictable.clear()
        self.plain.clear()
        self.active = False

    def lru_only(self, tenant: Tenant) -> bool:
        """True when allocating to `tenant` takes the queue's head, whatever else it takes
        until blocks are freed: no block is cached and free, or no other tenant occupies one."""
        counts = self.occupancy.counts
        return not self.evictable or not counts or (len(counts) == 1 and tenant in counts)

    def freed(self, block: KVCacheBlock) -> None:
        """The block's last reference went; it joins the free queue's tail."""
        if block.block_hash is None:
            self.occupancy.dec(block.tenant)
            self.plain[block.block_id] = block
        else:
            self._add_evictable(block)

    def _add_evictable(self, block: KVCacheBlock) -> None:
        blocks = self.evictable.get(block.tenant)
        if blocks is None:
            blocks = self.evictable[block.tenant] = OrderedDict()
        blocks[block.block_id] = block
        self._num_evictable.inc(block.tenant)

    def taken(self, block: KVCacheBlock, tenant: Tenant) -> None:
        """A free block (still with its hash, if cached) is allocated to `tenant`."""
        if block.block_hash is None:
            del self.plain[block.block_id]
        else:
            self.hit(block)
            self.occupancy.dec(block.tenant)
        self.occupancy.inc(tenant)

    def hit(self, block: KVCacheBlock) -> None:
        """A cached free block left the free queue (a prefix hit, or its eviction)."""
        blocks = self.evictable[block.tenant]
        del blocks[block.block_id]
        if not blocks:
            del self.evictable[block.tenant]
        self._num_evictable.dec(block.tenant)

    def capped_choice(self, tenant: Tenant, cap: int, head: KVCacheBlock
                      ) -> KVCacheBlock | None:
        """The block a tenant with a share (`cap` blocks) takes instead of `head`: its own
        least recently freed cached block once it occupies its share; else, while the head is
        another tenant's cached block, a plain free block, or failing that its own cached
        block. None: the usual rule (the head, or the fair rule's victim)."""
        own = self.evictable.get(tenant)
        if own and self.occupancy.counts.get(tenant, 0) >= cap:
            return next(iter(own.values()))
        if head.block_hash is None or head.tenant == tenant:
            return None
        if self.plain:
            return next(iter(self.plain.values()))
        return next(iter(own.values())) if own else None

    def victim(self, head: KVCacheBlock) -> KVCacheBlock | None:
        """The block to take instead of `head`, a cached free block at the queue's head; None
        to take the head. A payer must occupy more blocks than the head's tenant: first the
        tenant occupying the most, else the one with the most cached free blocks; without
        one, a plain free block goes before the cached block of a tenant that is not the
        heaviest."""
        occupancy = self.occupancy.counts
        floor = occupancy[head.tenant]
        for payer in (self.occupancy.top(), self._num_evictable.top()):
            if occupancy[payer] > floor and payer in self.evictable:
                return next(iter(self.evictable[payer].values()))
        if self.plain and floor < self.occupancy.largest:
            return next(iter(self.plain.values()))
        return None

    def check(self, blocks: Iterable[KVCacheBlock], queue: Iterable[KVCacheBlock]) -> None:
        """Asserts the ledger, if active, against every usable block and the free queue (head
        first); O(num_blocks)."""
        if not self.active:
            assert not self.occupancy.counts and not self.evictable and not self.plain
            return
        expected = TenantLedger()
        expected.activate(blocks, queue)
        assert expected.occupancy.counts == self.occupancy.counts, (
            expected.occupancy.counts, self.occupancy.counts)
        assert {t: list(b) for t, b in expected.evictable.items()} == {
            t: list(b) for t, b in self.evictable.items()}, \
            "the tenants' cached free blocks are not the free queue's, in its order"
        assert list(expected.plain) == list(self.plain), "plain free blocks are off"
        assert expected._num_evictable.counts == self._num_evictable.counts
        self.occupancy.check()
        self._num_evictable.check()

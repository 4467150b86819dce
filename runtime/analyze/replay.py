"""Replay: the traces through the engine's own KVCacheManager at one capacity, in arrival order.

Each request is admitted as the scheduler admits one: the longest run of device-pool hits
(get_computed_blocks), then blocks for every token it will compute (prompt and output, as the
engine's last decode step holds them), so that the full blocks are cached and evicted exactly as
the engine caches and evicts them; it holds them for its duration (the log's, or one estimated
from the costs) and frees them, last block first. Requests overlap as their times say; one that
does not fit the blocks left waits, first come first served, for requests to finish. Memory: the
pool and the requests in flight, whatever the log's length.
"""
from __future__ import annotations

import collections
import heapq
import itertools
from dataclasses import dataclass, field

from tierserve.kvcache import KVCacheManager
from tierserve.runtime.analyze.costs import Costs
from tierserve.runtime.analyze.traces import Trace

__all__ = ["Capacity", "Replay", "ReplayResult", "TIERS"]

TIERS = ("device", "cpu", "ssd")
# Blocks nobody shares (outputs an input does not spell out) get ints past every 64-bit hash.
_UNSHARED_BASE = 1 << 64


@dataclass(frozen=True, order=True)
class Capacity:
    """One configuration to replay: the device pool in blocks (the null block included, as
    num_kv_blocks counts it) and the tiers below it in bytes per rank."""

    device_blocks: int
    cpu_bytes: int = 0
    ssd_bytes: int = 0


@dataclass
class ReplayResult:
    capacity: Capacity
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: list[int] = field(default_factory=lambda: [0, 0, 0])  # device, CPU, SSD
    # Requests that waited for blocks, and those longer than the pool could ever hold.
    queued: int = 0
    skipped: int = 0
    # What the engine served, summed over the traces that say (our own logs).
    served_tokens: list[int] = field(default_factory=lambda: [0, 0, 0])
    served_requests: int = 0
    evictions: int = 0
    # tenant -> [requests, prompt tokens, hit tokens]
    tenants: dict[int, list[int]] = field(default_factory=dict)

    @property
    def total_hit_tokens(self) -> int:
        return sum(self.hit_tokens)

    def hit_rate(self, tier: str | None = None) -> float:
        hits = self.total_hit_tokens if tier is None else self.hit_tokens[TIERS.index(tier)]
        return hits / self.prompt_tokens if self.prompt_tokens else 0.0


class _Request:
    """What KVCacheManager reads of a request (its CacheableRequest protocol)."""

    __slots__ = ("request_id", "num_computed_tokens", "cache_salt", "block_hashes",
                 "block_keys", "num_tokens", "trace")

    def __init__(self, request_id: int, trace: Trace, chain: list[int]) -> None:
        self.request_id = request_id
        self.num_computed_tokens = 0
        # The pool groups blocks by tenant for fair eviction; the salt itself is in the chain.
        self.cache_salt = str(trace.tenant) if trace.tenant else None
        self.block_hashes = chain
        self.block_keys = None
        self.num_tokens = trace.prompt_len
        self.trace = trace


class Replay:
    def __init__(self, capacity: Capacity, block_size: int, costs: Costs, *,
                 watermark: float = 0.01) -> None:
        self.capacity = capacity
        self.block_size = block_size
        self.costs = costs
        self.kv = KVCacheManager(capacity.device_blocks, block_size, enable_caching=True,
                                 verify_hits=False, watermark=watermark)
        self._room = self.kv.pool.num_usable_blocks - self.kv.watermark_blocks
        self.result = ReplayResult(capacity)
        self.now = 0.0
        self._running: list = []  # (end time, seq, request): a heap
        self._waiting: collections.deque[_Request] = collections.deque()
        self._ids = itertools.count()
        self._unshared = itertools.count(_UNSHARED_BASE)

    # ------------------------------------------------------------------ feeding

    def add(self, trace: Trace) -> None:
        """The next request in arrival order."""
        arrival = trace.arrival
        if arrival is None:  # back to back: after every request before it
            self._advance(float("inf"))
            arrival = self.now
        else:
            self._advance(arrival)
            if arrival > self.now:
                self.now = arrival
        bs = self.block_size
        total = max(trace.prompt_len + trace.output_len - 1, trace.prompt_len)
        if -(-total // bs) > self._room:
            self.result.skipped += 1
            return
        chain = trace.chain
        need = total // bs
        if len(chain) < need:
            chain = chain + [next(self._unshared) for _ in range(need - len(chain))]
        req = _Request(next(self._ids), trace, chain)
        if self._waiting or not self._admit(req, total):
            self._waiting.append(req)
            self.result.queued += 1

    def finish(self) -> ReplayResult:
        """Every request in flight runs to its end; the figures."""
        self._advance(float("inf"))
        assert not self._waiting, "a waiting request fits an empty pool"
        self.result.evictions = self.kv.pool.num_evictions
        return self.result

    # ------------------------------------------------------------------ the timeline

    def _advance(self, until: float) -> None:
        """Requests ending by `until` free their blocks; waiting ones are admitted as they
        fit, at the time blocks were freed."""
        running = self._running
        while running and running[0][0] <= until:
            end, _, req = heapq.heappop(running)
            if end > self.now:
                self.now = end
            self.kv.free(req)
            waiting = self._waiting
            while waiting and self._admit(waiting[0], None):
                waiting.popleft()

    def _admit(self, req: _Request, total: int | None) -> bool:
        """Admits the request now if its blocks fit, as the scheduler's admission does."""
        trace = req.trace
        if total is None:
            total = max(trace.prompt_len + trace.output_len - 1, trace.prompt_len)
        kv = self.kv
        req.num_tokens = trace.prompt_len
        hits, num_hit = kv.get_computed_blocks(req)
        req.num_tokens = total
        if kv.allocate_slots(req, total - num_hit, hits, num_hit, apply_watermark=True) is None:
            return False
        self._count(trace, (num_hit, 0, 0))
        duration = trace.duration
        if duration is None:
            duration = self.costs.duration(trace.prompt_len - num_hit, trace.output_len)
        heapq.heappush(self._running, (self.now + duration, req.request_id, req))
        return True

    def _count(self, trace: Trace, hits: tuple[int, int, int]) -> None:
        r = self.result
        r.requests += 1
        r.prompt_tokens += trace.prompt_len
        total = 0
        for i, n in enumerate(hits):
            r.hit_tokens[i] += n
            total += n
        if trace.served is not None:
            r.served_requests += 1
            for i, n in enumerate(trace.served):
                r.served_tokens[i] += n
        tenant = r.tenants.get(trace.tenant)
        if tenant is None:
            tenant = r.tenants[trace.tenant] = [0, 0, 0]
        tenant[0] += 1
        tenant[1] += trace.prompt_len
        tenant[2] += total

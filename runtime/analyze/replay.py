"""Replay: the traces through the engine's own KVCacheManager, tier index and tier policy at one
capacity, in arrival order.

Each request is admitted as the scheduler admits one: the longest run of device-pool hits, then
the tier policy's (CPU hits promoted; SSD hits loaded first, the request waiting), then blocks
for its prompt. Its output's blocks follow at the times its decode steps would take them (from
its TTFT and latency in the log, else the costs), so that full blocks are cached, evicted,
demoted, written back and dropped as the engine's are, interleaved with the other requests in
flight; the policy's copies complete when their steps end (tier_clock.py). A request frees its
blocks, last block first, when its time is up. Requests overlap as their times say; one that
does not fit the blocks left waits, first come first served, for others to finish. Memory: the
pool, the tiers' index and the requests in flight, whatever the log's length.

Fast path (`progressive=False`, the default without tiers): a request's blocks, prompt and
output, are taken at admission. A serial log replays the same either way; under overlap a
request holds its output's blocks a little early.
"""
from __future__ import annotations

import collections
import heapq
import itertools
from dataclasses import dataclass, field

from tierserve.kvcache import KVCacheManager, TierIndex, TierPolicy
from tierserve.runtime.analyze.costs import Costs
from tierserve.runtime.analyze.tier_clock import TierClock
from tierserve.runtime.analyze.traces import Trace

__all__ = ["Capacity", "Replay", "ReplayResult", "TIERS"]

TIERS = ("device", "cpu", "ssd")
# Blocks nobody shares (outputs an input does not spell out) get ints past every 64-bit hash.
_UNSHARED_BASE = 1 << 64
# Timeline events, by time, then kind (a step's end comes before the next step at its time,
# a request's last step before its end), then order of scheduling.
_COMPLETE, _BLOCK, _END = 0, 1, 2


@dataclass(frozen=True, order=True)
class Capacity:
    """One configuration to replay: the device pool in blocks (the null block included, as
    num_kv_blocks counts it), the CPU tier in slots and the SSD tier in blocks, with the bytes
    they were asked as (0 where given in blocks)."""

    device_blocks: int
    cpu_blocks: int = 0
    ssd_blocks: int = 0
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
    tier_counters: dict = field(default_factory=dict)
    # tenant -> [requests, prompt tokens, hit tokens]
    tenants: dict[int, list[int]] = field(default_factory=dict)

    @property
    def total_hit_tokens(self) -> int:
        return sum(self.hit_tokens)

    def hit_rate(self, tier: str | None = None) -> float:
        hits = self.total_hit_tokens if tier is None else self.hit_tokens[TIERS.index(tier)]
        return hits / self.prompt_tokens if self.prompt_tokens else 0.0


class _Request:
    """What KVCacheManager and TierPolicy read of a request (CacheableRequest, TieredRequest),
    and where the replay is with it."""

    __slots__ = ("request_id", "num_computed_tokens", "cache_salt", "block_hashes",
                 "block_keys", "num_tokens", "trace", "total", "loaded", "start", "interval",
                 "done")

    def __init__(self, request_id: int, trace: Trace, chain: list[int], total: int) -> None:
        self.request_id = request_id
        self.num_computed_tokens = 0
        # The pool groups blocks by tenant for fair eviction; the salt itself is in the chain.
        self.cache_salt = str(trace.tenant) if trace.tenant else None
        self.block_hashes = chain
        self.block_keys = None
        self.num_tokens = trace.prompt_len
        self.trace = trace
        self.total = total  # tokens whose KV it computes: prompt and output but the last
        self.loaded = 0  # blocks loaded from SSD for it while it waited
        self.start = 0.0  # when its first token came
        self.interval = 0.0  # seconds between its decode steps
        # Ended, or a decode step found no block (the engine would preempt it): no more blocks.
        self.done = False


class Replay:
    def __init__(self, capacity: Capacity, block_size: int, costs: Costs, *,
                 watermark: float = 0.01, block_bytes: int = 0,
                 progressive: bool | None = None) -> None:
        self.capacity = capacity
        self.block_size = block_size
        self.costs = costs
        self.tiers = self.clock = None
        if capacity.cpu_blocks:
            self.tiers = TierPolicy(TierIndex(capacity.cpu_blocks, capacity.ssd_blocks,
                                              verify_hits=False),
                                    block_size=block_size, block_bytes=block_bytes)
            self.clock = TierClock(self.tiers, costs.ssd_block_s,
                                   costs.ssd_write_block_s or costs.ssd_block_s,
                                   self._schedule_completion)
        self.progressive = self.tiers is not None if progressive is None else progressive
        self.kv = KVCacheManager(capacity.device_blocks, block_size, enable_caching=True,
                                 verify_hits=False, watermark=watermark, tiers=self.tiers)
        self._room = self.kv.pool.num_usable_blocks - self.kv.watermark_blocks
        self.result = ReplayResult(capacity)
        self.now = 0.0
        self._events: list = []  # (time, seq, kind, request or step id): a heap
        self._seq = itertools.count()
        self._waiting: collections.deque[_Request] = collections.deque()
        self._ids = itertools.count()
        self._unshared = itertools.count(_UNSHARED_BASE)

    # ------------------------------------------------------------------ feeding

    def add(self, trace: Trace) -> None:
        """The next request in arrival order."""
        arrival = trace.arrival
        if arrival is None:  # back to back: after every request before it
            self._run(float("inf"))
        else:
            self._run(arrival)
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
        req = _Request(next(self._ids), trace, chain, total)
        if trace.duration is not None and trace.ttft is not None:
            req.interval = max(trace.duration - trace.ttft, 0.0) / max(trace.output_len - 1, 1)
        else:
            req.interval = 1.0 / self.costs.decode_tokens_per_s
        if self._waiting or not self._admit(req):
            self._waiting.append(req)
            self.result.queued += 1

    def finish(self) -> ReplayResult:
        """Every request in flight runs to its end; the figures."""
        self._run(float("inf"))
        while self.clock is not None and (self.clock.finish() or self._events):
            self._run(float("inf"))
        assert not self._waiting, "a waiting request fits an empty pool"
        r = self.result
        r.evictions = self.kv.pool.num_evictions
        if self.tiers is not None:
            c = self.tiers.counters
            r.tier_counters = {"demotions": c.demotions, "promotions": c.promotions,
                               "loads": c.loads, "spills": c.spills,
                               "demotions_dropped": c.demotions_dropped,
                               "cpu_dropped": c.cpu_dropped, "ssd_dropped": c.ssd_dropped}
        return r

    # ------------------------------------------------------------------ the timeline

    def _at(self, time: float, kind: int, what) -> None:
        heapq.heappush(self._events, (time, kind, next(self._seq), what))

    def _schedule_completion(self, time: float) -> None:
        self._at(time, _COMPLETE, None)

    def _run(self, until: float) -> None:
        """Every event due by `until`, in time order: decode steps taking blocks, copies
        completing, requests ending (waiting ones are admitted as blocks free up)."""
        events = self._events
        while events and events[0][0] <= until:
            time, kind, _, what = heapq.heappop(events)
            if time > self.now:
                self.now = time
            if kind == _COMPLETE:
                self.clock.complete(self.now)
            elif kind == _END:
                self._end(what)
            else:
                self._next_block(what)
            if self.clock is not None and self.clock.ready:
                for req in reversed(self.clock.ready):
                    self._waiting.appendleft(req)  # its loads are in: it goes first
                self.clock.ready.clear()
                self._admit_waiting()
            elif kind == _COMPLETE:
                self._admit_waiting()  # the step's copies are done: their blocks may be free

    def _admit_waiting(self) -> None:
        waiting = self._waiting
        while waiting and self._admit(waiting[0]):
            waiting.popleft()

    def _end(self, req: _Request) -> None:
        if self.clock is not None:
            self.clock.end_open_step(self.now)  # a request finishes as its last step ends
        if self.progressive and not req.done and req.num_computed_tokens < req.total:
            self._take(req, req.total)  # its last full block is cached
        req.done = True
        self.kv.free(req)
        self._admit_waiting()

    # ------------------------------------------------------------------ admission

    def _admit(self, req: _Request) -> bool:
        """Admits the request now if its blocks fit, as the scheduler's admission does; True
        when it left the queue (running, or waiting for its SSD loads)."""
        hits = self._admit_device(req) if not self.progressive else self._admit_stepwise(req)
        if hits is None:
            return False
        if hits is True:
            return True  # loading from SSD: retried when its loads complete
        trace = req.trace
        self._count(trace, hits)
        uncached = trace.prompt_len - sum(hits)
        duration = trace.duration
        if duration is None:
            duration = self.costs.duration(uncached, trace.output_len)
        self._at(self.now + duration, _END, req)
        if self.progressive:
            ttft = trace.ttft if trace.ttft is not None else min(
                self.costs.duration(uncached, 1), duration)
            req.start = self.now + ttft
            self._schedule_block(req)
        return True

    def _admit_device(self, req: _Request) -> tuple[int, int, int] | None:
        """The fast path: every block, prompt and output, at admission."""
        kv = self.kv
        req.num_tokens = req.trace.prompt_len
        hits, num_hit = kv.get_computed_blocks(req)
        req.num_tokens = req.total
        if kv.allocate_slots(req, req.total - num_hit, hits, num_hit,
                             apply_watermark=True) is None:
            return None
        return num_hit, 0, 0

    def _admit_stepwise(self, req: _Request) -> tuple[int, int, int] | bool | None:
        """Device hits, then the tier policy's, then the prompt's blocks (the output's come
        with its decode steps). True: it waits for SSD loads."""
        kv, tiers, bs = self.kv, self.tiers, self.block_size
        prompt_len = req.num_tokens = req.trace.prompt_len
        if self.clock is not None:
            ttft = req.trace.ttft
            self.clock.begin(self.now, req.request_id, req.interval,
                             self.now + ttft if ttft is not None else None)
        hits, num_hit = kv.get_computed_blocks(req)
        below = 0
        admission = None
        if tiers is not None:
            before = tiers.counters.ssd_hit_blocks
            admission = tiers.admit(req, len(hits))
            req.loaded += tiers.counters.ssd_hit_blocks - before
            if admission.wait:
                return True  # its loads start with this step
            if admission.defer:
                return None
            below = len(admission.cpu_hits) * bs
            num_hit += below
        blocks = kv.allocate_slots(req, prompt_len - num_hit, hits, num_hit,
                                   apply_watermark=True)
        if blocks is None:
            if admission is not None:
                tiers.refused(admission)
            return None
        if admission is not None:
            tiers.admitted(req.request_id, admission, [b.block_id for b in blocks])
        req.num_computed_tokens = prompt_len
        ssd = min(req.loaded * bs, below)
        return num_hit - below, below - ssd, ssd

    def _schedule_block(self, req: _Request) -> None:
        """The decode step computing the next position that starts a block, if any: the step
        computing position p starts (p - prompt length) intervals after the first token and
        ends with the next token."""
        bs = self.block_size
        position = -(-req.num_computed_tokens // bs) * bs
        if position < req.total:
            self._at(req.start + (position - req.trace.prompt_len) * req.interval, _BLOCK, req)

    def _next_block(self, req: _Request) -> None:
        if req.done:
            return
        if self.clock is not None:
            self.clock.begin(self.now, req.request_id, req.interval)
        position = -(-req.num_computed_tokens // self.block_size) * self.block_size
        if not self._take(req, position + 1):
            req.done = True
            return
        self._schedule_block(req)

    def _take(self, req: _Request, upto: int) -> bool:
        """Blocks for the request's positions up to `upto` (its full blocks cached)."""
        n = upto - req.num_computed_tokens
        req.num_tokens = upto
        if self.kv.allocate_slots(req, n) is None:
            return False
        req.num_computed_tokens = upto
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

"""Routing policies: which replica serves a request.

`kv` (the default) scores each replica by an estimate of the request's time to first token
there, from the exact KV index (deploy/kv_index.py) and the replica's load:

    work  = queued prefill tokens + tokens routed there and not yet reported + this request's
            tokens not cached there
    ttft ~ (work + running requests x steps + tokens of the blocks work lacks) / prefill rate
           + blocks found in the CPU tier x a CPU block's load time
           + blocks found on SSD x an SSD block's load time

where steps = 1 + work / max_num_batched_tokens (each step also carries every running
request's decode), the prefill rate is the replicas' measured mean, and the blocks work lacks
are those it needs beyond the replica's free ones (they wait for running requests to finish).
A replica's score is its estimate plus RECOMPUTE_WEIGHT x the prompt tokens another eligible
replica holds and it lacks, at the prefill rate: recomputing them is work the cluster does
twice, and it delays the requests that come after this one there.
A replica may take a request only while its outstanding requests stay within `load_bound` x
the mean or `LOAD_SLACK` above it, whichever is looser (bounded loads), so a hot prefix spreads
once its replica is that far ahead. Scores within NEAR_TIE of the least tie when they hold
as much of the prompt, and a tie goes to the replica whose pool holds the fewest blocks (the
turns to come follow the history).
`least_loaded` and `round_robin` ignore the cache; `prefix_tree` is the approximate policy of
SGLang's and Ray Serve's routers: a tree of the prompts each replica was sent (never told of
evictions, tiers or salts), for comparison.

Policies are plain objects driven by the router actor (deploy/router.py), Ray-free and
testable alone.
"""
from __future__ import annotations

import itertools
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Iterator, Protocol

import msgspec

from tierserve.deploy.kv_index import KVIndex, Match
from tierserve.kvcache.hashing import BlockHasher, encode_extra_keys
from tierserve.scheduler.kv_events import ReplicaLoad

__all__ = ["RouteQuery", "Candidate", "LoadTracker", "Choice", "Policy", "RoundRobin",
           "LeastLoaded", "KVAware", "PrefixTree", "make_policy", "bounded", "LOAD_BOUND",
           "LOAD_SLACK", "NEAR_TIE", "RECOMPUTE_WEIGHT"]

_WIRE = dict(array_like=True, omit_defaults=True, gc=False)

# A prefill rate (tokens/s) assumed until a replica has measured its own; only ratios between
# replicas matter while none has.
_DEFAULT_PREFILL_TOKENS_PER_S = 1000.0
# Unmeasured tier costs, as a share of prefilling the block's tokens: a CPU block is a memcpy
# into the pool; an SSD block is a read, and the request waits a step for it.
_CPU_BLOCK_SHARE = 0.05
_SSD_BLOCK_SHARE = 0.25
# Bounded loads: a replica takes a request only while its outstanding requests, this one
# included, stay within LOAD_BOUND x the mean or LOAD_SLACK above it. The slack matters at a
# few requests a replica, where the ratio alone would send a conversation away from its cached
# history (seconds of prefill) over a difference of a few decodes (a few % of a step).
LOAD_BOUND = 1.5
LOAD_SLACK = 3
# Estimates within this factor of the least count as a tie, which goes to the replica whose
# pool holds the fewest blocks. Later turns follow a conversation's history, so the blocks a
# replica holds stand for the turns still to come to it: a new conversation (its prompt
# cached nowhere, so its estimates differ by the load of the moment alone) then balances the
# work to come, not only the work queued now.
NEAR_TIE = 1.25
# The estimate is this request's own wait; a prefix held elsewhere and recomputed here also
# costs the requests queued behind it. Counting those tokens once more keeps a conversation
# with its history until the holder's queue exceeds about twice the recompute: under load, a
# greedy move at a smaller gap lowers the cluster's hit rate and raises every queue.
RECOMPUTE_WEIGHT = 1.0


class RouteQuery(msgspec.Struct, **_WIRE):
    """What the router needs of a request: its prompt's token ids, cache salt and LoRA
    adapter's digest (0: the base model)."""

    prompt_token_ids: list[int]
    cache_salt: str | None = None
    # Replicas this request must not go to (it just failed there).
    exclude: list[int] = []
    lora_digest: int = 0


@dataclass(slots=True)
class LoadTracker:
    """A replica's load as the router sees it: the last reported, plus the requests it routed
    there that the replica had not yet been given when it reported."""

    reported: ReplicaLoad = field(default_factory=ReplicaLoad)
    epoch: int | None = None
    routed: int = 0  # requests routed to this engine instance
    _recent: deque = field(default_factory=deque)  # uncached tokens of the latest routes
    _recent_tokens: int = 0

    def route(self, tokens: int) -> None:
        self.routed += 1
        self._recent.append(tokens)
        self._recent_tokens += tokens

    def report(self, load: ReplicaLoad, epoch: int | None) -> None:
        if epoch != self.epoch:  # a new engine instance: nothing of the old one is on its way
            self.epoch, self.routed = epoch, load.requests_added
        self.reported = load
        while len(self._recent) > self.in_transit:
            self._recent_tokens -= self._recent.popleft()

    @property
    def in_transit(self) -> int:
        return max(0, self.routed - self.reported.requests_added)

    @property
    def in_transit_tokens(self) -> int:
        return self._recent_tokens

    @property
    def outstanding(self) -> int:
        r = self.reported
        return r.num_running + r.num_waiting + self.in_transit


@dataclass(slots=True)
class Candidate:
    replica: int
    load: LoadTracker


@dataclass(slots=True)
class Choice:
    replica: int
    # The prompt tokens the policy expects the replica to compute (for its in-transit load).
    uncached_tokens: int
    cached_blocks: int = 0


class Policy(Protocol):
    name: str

    def pick(self, query: RouteQuery, candidates: list[Candidate]) -> Choice: ...

    def forget(self, replica: int) -> None:
        """The replica left (died, restarted or was scaled away)."""


def bounded(candidates: list[Candidate], bound: float = LOAD_BOUND,
            slack: int = LOAD_SLACK) -> list[Candidate]:
    """The candidates whose outstanding requests, with one more, stay within bound x the
    mean or slack above it (never empty: the least loaded always qualifies)."""
    total = sum(c.load.outstanding for c in candidates) + 1
    mean = total / len(candidates)
    cap = max(math.ceil(bound * mean), math.floor(mean + slack))
    ok = [c for c in candidates if c.load.outstanding + 1 <= cap]
    return ok or [min(candidates, key=lambda c: c.load.outstanding)]


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def pick(self, query: RouteQuery, candidates: list[Candidate]) -> Choice:
        c = candidates[next(self._turn) % len(candidates)]
        return Choice(c.replica, len(query.prompt_token_ids))

    def forget(self, replica: int) -> None:
        pass


class LeastLoaded:
    name = "least_loaded"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def pick(self, query: RouteQuery, candidates: list[Candidate]) -> Choice:
        turn = next(self._turn)
        n = len(candidates)
        best = min(range(n), key=lambda i: (
            candidates[i].load.outstanding,
            candidates[i].load.reported.queued_prefill_tokens
            + candidates[i].load.in_transit_tokens, (i - turn) % n))
        return Choice(candidates[best].replica, len(query.prompt_token_ids))

    def forget(self, replica: int) -> None:
        pass


class KVAware:
    """The least estimated time to first token, from the exact index (module docstring)."""

    name = "kv"

    def __init__(self, index: KVIndex, hasher: BlockHasher, max_num_batched_tokens: int,
                 load_bound: float = LOAD_BOUND) -> None:
        self.index = index
        self.hasher = hasher
        self.block_size = hasher.block_size
        self.budget = max_num_batched_tokens
        self.load_bound = load_bound
        self._turn = itertools.count()

    def chain(self, tokens: list[int], cache_salt: str | None,
              lora_digest: int = 0) -> Iterator[bytes]:
        """The prompt's block hashes as the engines compute them, lazily in growing chunks
        (a lookup stops at the first block no replica holds), up to the last block an engine
        would serve from cache (never the whole prompt)."""
        extra = encode_extra_keys(cache_salt=cache_salt)
        every = encode_extra_keys(lora_id=lora_digest or None)
        cap = (len(tokens) - 1) // self.block_size
        start, parent, chunk = 0, None, 8
        while start < cap:
            end = min(start + chunk, cap)
            hashes, _ = self.hasher.hash_blocks(tokens, start, parent, extra, every, end)
            yield from hashes
            parent, start, chunk = hashes[-1], end, chunk * 2

    def pick(self, query: RouteQuery, candidates: list[Candidate]) -> Choice:
        eligible = bounded(candidates, self.load_bound)
        tokens = query.prompt_token_ids
        matches = self.index.match(self.chain(tokens, query.cache_salt, query.lora_digest),
                                   [c.replica for c in eligible])
        # Replicas run one model and config: one prefill rate, the mean of those measured (a
        # replica's own swings with its batches, and would make an idle one look slower).
        rates = [c.load.reported.prefill_tokens_per_s for c in candidates
                 if c.load.reported.prefill_tokens_per_s > 0]
        rate = sum(rates) / len(rates) if rates else _DEFAULT_PREFILL_TOKENS_PER_S
        turn, n = next(self._turn), len(eligible)
        most_held = max(matches[c.replica].blocks for c in eligible)
        recompute_s = RECOMPUTE_WEIGHT * self.block_size / rate
        scored = [(self.estimate(c.load, matches[c.replica], len(tokens), rate)
                   + (most_held - matches[c.replica].blocks) * recompute_s,
                   c.load.outstanding, (i - turn) % n, i) for i, c in enumerate(eligible)]
        fastest = min(scored)[0]
        near = [s for s in scored if s[0] <= fastest * NEAR_TIE]
        # Of those, the ones holding the most of this prompt: a turn whose history one
        # replica holds comes near another's estimate only by the holder's queue, and moving
        # it would recompute the history and leave the holder's copy idle.
        most = max(matches[eligible[s[-1]].replica].blocks for s in near)
        near = [s for s in near if matches[eligible[s[-1]].replica].blocks == most]
        held = {c.replica: self.index.device_blocks(c.replica) for c in eligible}
        best = eligible[min(near, key=lambda s: (held[eligible[s[-1]].replica], s[1], s[2]))[-1]]
        m = matches[best.replica]
        return Choice(best.replica, len(tokens) - m.blocks * self.block_size, m.blocks)

    def estimate(self, load: LoadTracker, m: Match, num_tokens: int, rate: float) -> float:
        """Seconds to the request's first token on a replica (module docstring)."""
        r = load.reported
        block_s = self.block_size / rate
        cpu_s = r.cpu_block_s or _CPU_BLOCK_SHARE * block_s
        ssd_s = r.ssd_block_s or _SSD_BLOCK_SHARE * block_s
        work = r.queued_prefill_tokens + load.in_transit_tokens + num_tokens \
            - m.blocks * self.block_size
        steps = 1 + work / self.budget
        # Blocks the queue and this request need beyond the free ones wait for running
        # requests to finish (or preempt one): as long again as prefilling their tokens.
        deficit = -(-work // self.block_size) - r.free_blocks if r.total_blocks else 0
        return (work + steps * r.num_running + max(deficit, 0) * self.block_size) / rate \
            + m.cpu * cpu_s + m.ssd * ssd_s

    def forget(self, replica: int) -> None:
        pass


class PrefixTree:
    """The approximate policy SGLang's cache-aware router and Ray Serve's prefix-aware router
    describe: a tree per replica of the prompts routed there, matched at block granularity.
    Balanced (the busiest replica at most `balance_abs` requests above the idlest, or at most
    `balance_rel` times it): the replica whose tree shares the longest prefix with the
    prompt (of equal ones the least loaded), when that covers more than `cache_threshold` of
    it, else the replica with the smallest tree; imbalanced: the least loaded. The tree
    learns only from its own choices (no evictions, tiers or salts), with LRU trimming past
    `max_nodes` per replica."""

    name = "prefix_tree"

    def __init__(self, block_size: int, cache_threshold: float = 0.3, balance_abs: int = 64,
                 balance_rel: float = 1.5, max_nodes: int = 1 << 20) -> None:
        self.hasher = BlockHasher(block_size)
        self.cache_threshold = cache_threshold
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self.max_nodes = max_nodes
        self._trees: dict[int, OrderedDict[bytes, None]] = {}
        self._least = LeastLoaded()

    def pick(self, query: RouteQuery, candidates: list[Candidate]) -> Choice:
        tokens = query.prompt_token_ids
        loads = [c.load.outstanding for c in candidates]
        if max(loads) - min(loads) > self.balance_abs and max(loads) > self.balance_rel * min(
                loads):
            choice = self._least.pick(query, candidates)
            self._insert(choice.replica, self.hasher.hash_blocks(tokens, 0, None)[0])
            return choice
        hashes = self.hasher.hash_blocks(tokens, 0, None)[0]
        best, best_len = None, -1
        for c in candidates:  # the longest match; of equal ones, the least loaded
            tree = self._trees.setdefault(c.replica, OrderedDict())
            n = 0
            for h in hashes:
                if h not in tree:
                    break
                n += 1
            if n > best_len or n == best_len and c.load.outstanding < best.load.outstanding:
                best, best_len = c, n
        rate = best_len * self.hasher.block_size / len(tokens)
        if rate <= self.cache_threshold:
            best = min(candidates, key=lambda c: len(self._trees[c.replica]))
            best_len = 0
        self._insert(best.replica, hashes)
        return Choice(best.replica, len(tokens) - best_len * self.hasher.block_size, best_len)

    def _insert(self, replica: int, hashes: list[bytes]) -> None:
        tree = self._trees.setdefault(replica, OrderedDict())
        for h in reversed(hashes):  # a parent more recent than its children: leaves go first
            tree[h] = None
            tree.move_to_end(h)
        while len(tree) > self.max_nodes:
            tree.popitem(last=False)

    def forget(self, replica: int) -> None:
        self._trees.pop(replica, None)


def make_policy(name: str, index: KVIndex, hasher: BlockHasher,
                max_num_batched_tokens: int) -> Policy:
    if name == "kv":
        return KVAware(index, hasher, max_num_batched_tokens)
    if name == "least_loaded":
        return LeastLoaded()
    if name == "round_robin":
        return RoundRobin()
    if name == "prefix_tree":
        return PrefixTree(hasher.block_size)
    raise ValueError(f"unknown routing policy {name!r}")

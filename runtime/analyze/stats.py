"""How much of a workload's prompts is shared: the seed's PrefixAnalyzer figures (per tenant too),
the block-reuse distance distribution, and the hit rate an unbounded cache would reach.

Over the prompts' full blocks: total, unique (distinct), shared (appearing in two prompts or
more), reusable block instances (total - unique: every appearance after a block's first),
potential prefill savings (reusable / total) and the average shared prefix (reusable blocks x
block size / requests). A block's hash chains its prefix and cache salt, so two tenants never
share a block and each block belongs to the tenant of its requests.

The unbounded cache keeps every block any request computed (prompt and output), so a request
hits the longest run of its prompt's blocks computed before it (never the last token): the
ceiling the replayed capacities are measured against. Reuse distance: for each prompt block
computed before, how many requests ago it was last used (power-of-two buckets).

Each distinct block keeps one state, its last use and flags (`last request index << 2 |
flags`): the last request whose prompt held it, else the first that computed it. The states
live in a sorted uint64 key array beside a uint32 state array (12 bytes a block), updated a
chunk of requests at a time with numpy; keys that do not fit in 64 bits move everything to a
dict (the same states, one Python entry a block). Both give the same figures.
"""
from __future__ import annotations

import array
from dataclasses import dataclass

import numpy as np

from tierserve.runtime.analyze.traces import Trace

__all__ = ["PrefixStats", "TenantStats"]

# Flags kept beside each block's last use: seen in a prompt, seen in two prompts or more.
_IN_PROMPT, _SHARED = 1, 2
# Block appearances buffered before a chunk is folded into the table.
_CHUNK = 1 << 20
# Request indices past this need 64-bit states (index << 2 | flags).
_STAMP32 = 1 << 30


@dataclass
class TenantStats:
    requests: int = 0
    prompt_tokens: int = 0
    total_blocks: int = 0
    unique_blocks: int = 0
    shared_blocks: int = 0
    unbounded_hit_tokens: int = 0

    @property
    def reusable_block_instances(self) -> int:
        return self.total_blocks - self.unique_blocks

    def figures(self, block_size: int) -> dict:
        reusable = self.reusable_block_instances
        return {
            "total_requests": self.requests,
            "total_blocks": self.total_blocks,
            "unique_blocks": self.unique_blocks,
            "shared_blocks": self.shared_blocks,
            "reusable_block_instances": reusable,
            "potential_prefill_savings": reusable / max(self.total_blocks, 1),
            "avg_shared_prefix_length": reusable * block_size / max(self.requests, 1),
            "prompt_tokens": self.prompt_tokens,
            "unbounded_hit_rate": self.unbounded_hit_tokens / max(self.prompt_tokens, 1),
        }


class PrefixStats:
    """Fed every trace in arrival order (add), then read (figures, total, tenants)."""

    def __init__(self, block_size: int, *, chunk: int = _CHUNK) -> None:
        self.block_size = block_size
        self._total = TenantStats()
        self._tenants: dict[int, TenantStats] = {}
        # reuse_distance[k]: prompt blocks last used between 2^(k-1) and 2^k - 1 requests before.
        self.reuse_distance = [0] * 64
        self._chunk = chunk
        self._table = _BlockTable()
        self._dict: dict | None = None  # block -> state, once a key does not fit in 64 bits
        self._requests = 0  # requests added, buffered ones included (the next one's index)
        self._flushed = 0  # requests folded into the table (the first buffered one's index)
        self._slots: dict[int, int] = {}  # tenant id -> its index in the buffers
        self._stats_of_slot: list[TenantStats] = []
        self._buffer = _Buffer()

    @property
    def total(self) -> TenantStats:
        self._flush()
        return self._total

    @property
    def tenants(self) -> dict[int, TenantStats]:
        self._flush()
        return self._tenants

    def add(self, trace: Trace) -> None:
        bs = self.block_size
        chain = trace.chain
        n = len(chain)
        num_prompt = min(trace.prompt_len // bs, n)
        computed = min(max(trace.prompt_len + trace.output_len - 1, 0) // bs, n)
        tenant = self._tenants.get(trace.tenant)
        if tenant is None:
            tenant = self._tenants[trace.tenant] = TenantStats()
            self._slots[trace.tenant] = len(self._stats_of_slot)
            self._stats_of_slot.append(tenant)
        for t in (tenant, self._total):
            t.requests += 1
            t.prompt_tokens += trace.prompt_len
            t.total_blocks += num_prompt
        idx = self._requests
        self._requests += 1
        if self._dict is not None:
            return self._add_to_dict(trace, idx, num_prompt, computed, tenant)
        upto = max(num_prompt, computed)
        if not self._buffer.add(chain if upto == n else chain[:upto], num_prompt,
                                min((trace.prompt_len - 1) // bs, num_prompt),
                                self._slots[trace.tenant]):
            self._to_dict()  # a key past 64 bits: this trace and the rest go to the dict
            return self._add_to_dict(trace, idx, num_prompt, computed, tenant)
        if len(self._buffer.keys) >= self._chunk:
            self._flush()

    def _add_to_dict(self, trace: Trace, idx: int, num_prompt: int, computed: int,
                     tenant: TenantStats) -> None:
        unique, shared, hit = add_to_dict(
            self._dict, self.reuse_distance, trace.chain, idx, num_prompt,
            min((trace.prompt_len - 1) // self.block_size, num_prompt), computed)
        for t in (tenant, self._total):
            t.unique_blocks += unique
            t.shared_blocks += shared
            t.unbounded_hit_tokens += hit * self.block_size

    def _to_dict(self) -> None:
        self._flush()
        keys, states = self._table.keys, self._table.states
        self._dict = dict(zip(keys.tolist(), states.tolist()))
        self._table = _BlockTable()

    def _flush(self) -> None:
        buf = self._buffer
        if not buf.num_prompt:
            return
        self._buffer = _Buffer()
        first = self._flushed
        self._flushed += len(buf.num_prompt)
        unique, shared, hits, hist = self._table.fold(buf.arrays(), first)
        for slot, t in enumerate(self._stats_of_slot):
            if slot < len(unique):
                t.unique_blocks += int(unique[slot])
                t.shared_blocks += int(shared[slot])
                t.unbounded_hit_tokens += int(hits[slot]) * self.block_size
        self._total.unique_blocks += int(unique.sum())
        self._total.shared_blocks += int(shared.sum())
        self._total.unbounded_hit_tokens += int(hits.sum()) * self.block_size
        for k in np.flatnonzero(hist):
            self.reuse_distance[k] += int(hist[k])

    @property
    def distinct_blocks(self) -> int:
        self._flush()
        return len(self._dict) if self._dict is not None else len(self._table.keys)

    def figures(self) -> dict:
        """The seed's dict for the whole log, with `tenants` (by tenant id) and
        `reuse_distance` (bucket upper bounds in requests -> prompt blocks) added."""
        self._flush()
        out = self._total.figures(self.block_size)
        out["tenants"] = {tid: t.figures(self.block_size) for tid, t in self._tenants.items()}
        last = max((k for k, n in enumerate(self.reuse_distance) if n), default=0)
        out["reuse_distance"] = {(1 << k) - 1: self.reuse_distance[k]
                                 for k in range(1, last + 1)}
        return out


def add_to_dict(blocks: dict, hist: list[int], chain, idx: int, num_prompt: int, max_hit: int,
                computed: int) -> tuple[int, int, int]:
    """One request, block by block, into a dict of states: (unique, shared, hit blocks). The
    definition the chunked table reproduces."""
    hit = unique = shared = 0
    stamp = idx << 2
    for i in range(num_prompt):
        h = chain[i]
        seen = blocks.get(h)
        if seen is None:
            blocks[h] = stamp | _IN_PROMPT
            unique += 1
            continue
        if hit == i and i < max_hit:
            hit += 1
        hist[(idx - (seen >> 2)).bit_length()] += 1
        flags = seen & 3
        if not flags & _IN_PROMPT:  # computed as an output before, first in a prompt
            unique += 1
            flags = _IN_PROMPT
        elif not flags & _SHARED:
            shared += 1
            flags |= _SHARED
        blocks[h] = stamp | flags
    for i in range(num_prompt, computed):
        if chain[i] not in blocks:
            blocks[chain[i]] = stamp
    return unique, shared, hit


class _Buffer:
    """A chunk of requests: their blocks' keys (prompt, then computed output) back to back."""

    def __init__(self) -> None:
        self.keys = array.array("Q")
        self.lengths = array.array("q")
        self.num_prompt = array.array("q")
        self.max_hit = array.array("q")
        self.slot = array.array("q")

    def add(self, keys, num_prompt: int, max_hit: int, slot: int) -> bool:
        """False (and nothing kept) where a key is not a 64-bit unsigned int."""
        before = len(self.keys)
        try:
            self.keys.extend(keys)
        except (OverflowError, TypeError):
            del self.keys[before:]
            return False
        self.lengths.append(len(self.keys) - before)
        self.num_prompt.append(num_prompt)
        self.max_hit.append(max(max_hit, 0))
        self.slot.append(slot)
        return True

    def arrays(self) -> tuple[np.ndarray, ...]:
        return tuple(np.frombuffer(a, dtype=np.uint64 if a.typecode == "Q" else np.int64)
                     for a in (self.keys, self.lengths, self.num_prompt, self.max_hit,
                               self.slot))


class _BlockTable:
    """Every distinct block's state: keys sorted (uint64), states beside them."""

    def __init__(self) -> None:
        self.keys = np.empty(0, np.uint64)
        self.states = np.empty(0, np.uint32)

    def fold(self, chunk: tuple[np.ndarray, ...], first: int):
        """A chunk's requests (indices first, first + 1, ...) in order: per tenant slot their
        unique blocks, shared blocks and unbounded-cache hit blocks, and the reuse-distance
        histogram of their prompt blocks; the states updated as add_to_dict would."""
        keys, lengths, num_prompt, max_hit, slot = chunk
        slots = int(slot.max()) + 1
        if not len(keys):
            none = np.zeros(slots, np.int64)
            return none, none, none, np.zeros(64, np.int64)
        if first + len(lengths) >= _STAMP32 and self.states.dtype != np.uint64:
            self.states = self.states.astype(np.uint64)
        # Appearances index the chunk (int32: a chunk is far below 2^31 of them).
        starts = (np.cumsum(lengths) - lengths).astype(np.int32)
        req = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)
        pos = np.arange(len(keys), dtype=np.int32)
        pos -= starts[req]
        in_prompt = pos < num_prompt[req]
        seen, unique, shared, hist = self._scan(keys, req, in_prompt, first)
        del in_prompt
        occ_slot = slot.astype(np.int32)[req]
        # The unbounded cache hits a request's leading run of blocks seen before (< max_hit).
        seen &= pos < max_hit[req]
        del req
        pos[seen] = np.iinfo(np.int32).max
        hit = np.zeros(len(lengths), np.int64)
        has = lengths > 0
        if has.any():
            hit[has] = np.minimum(np.minimum.reduceat(pos, starts[has]), max_hit[has])
        return (np.bincount(occ_slot[unique], minlength=slots),
                np.bincount(occ_slot[shared], minlength=slots),
                np.bincount(slot, weights=hit, minlength=slots).astype(np.int64), hist)

    def _scan(self, keys: np.ndarray, req: np.ndarray, in_prompt: np.ndarray, first: int):
        """Per appearance (in the chunk's order): seen before, counted unique, counted shared;
        and the reuse-distance histogram. Appearances are grouped by block (a stable sort
        keeps each block's in request order); a group's first looks up the table. `req`:
        each appearance's request, from 0 (the table's stamps count from -first)."""
        order = np.argsort(keys, kind="stable")
        m = len(order)
        start = np.empty(m, bool)
        start[0] = True
        k = keys[order]
        np.not_equal(k[1:], k[:-1], out=start[1:])
        heads = np.flatnonzero(start).astype(np.int32)
        head_keys = k[heads]
        del k
        group = np.cumsum(start, dtype=np.int32)
        group -= 1
        p = in_prompt[order]
        r = req[order]
        found, gstate, loc = self._lookup(head_keys)
        gflags = (gstate & 3).astype(np.int32)
        gprompts = (gflags & _IN_PROMPT) + (gflags >> 1 & 1)
        # Prompt appearances of the block before this one: the table's (0, 1, 2+), the chunk's.
        cum = np.cumsum(p, dtype=np.int32)
        before = cum - p
        base = gprompts - before[heads]
        prompts_before = before
        prompts_before += base[group]
        unique_s = p & (prompts_before == 0)
        shared_s = p & (prompts_before == 1)
        del prompts_before, before
        # The last prompt appearance before this one in the chunk, else the table's stamp,
        # else the group's first appearance (an output that computed it). Stamps count
        # requests from the chunk's first.
        last_p = np.where(p, np.arange(m, dtype=np.int32), np.int32(-1))
        np.maximum.accumulate(last_p, out=last_p)
        fallback = np.where(found, (gstate >> 2).astype(np.int64) - first, r[heads])
        reuse = p & ~start
        reuse[start] = p[start] & found
        at = np.flatnonzero(reuse)
        del reuse
        prev = np.where(at > 0, last_p[at - 1], -1)
        prev_ok = prev >= heads[group[at]]
        stamp = np.where(prev_ok, r[np.maximum(prev, 0)], fallback[group[at]])
        _, exp = np.frexp((r[at] - stamp).astype(np.float64))
        hist = np.bincount(exp, minlength=64)
        del at, prev, prev_ok, stamp, exp
        # The blocks' states after the chunk.
        ends = np.append(heads[1:], m) - 1
        prompts = np.minimum(gprompts + cum[ends] - (cum[heads] - p[heads]), 2)
        last = last_p[ends]
        new_stamp = np.where(last >= heads, r[np.maximum(last, 0)], fallback) + first
        flags = np.where(prompts >= 1, _IN_PROMPT, 0) | np.where(prompts >= 2, _SHARED, 0)
        self._store(head_keys, found, loc, (new_stamp.astype(np.uint64) << 2)
                    | flags.astype(np.uint64))
        del last_p, cum, group, p, r
        seen = np.empty(m, bool)
        seen[order] = ~start
        seen[order[heads]] = found
        unique = np.empty(m, bool)
        unique[order] = unique_s
        shared = np.empty(m, bool)
        shared[order] = shared_s
        return seen, unique, shared, hist

    def _lookup(self, heads: np.ndarray):
        n = len(self.keys)
        loc = np.searchsorted(self.keys, heads)
        if not n:
            return np.zeros(len(heads), bool), np.zeros(len(heads), np.uint64), loc
        at = np.minimum(loc, n - 1)
        found = self.keys[at] == heads
        return found, np.where(found, self.states[at], 0).astype(np.uint64), loc

    def _store(self, heads: np.ndarray, found: np.ndarray, loc: np.ndarray,
               states: np.ndarray) -> None:
        """Known blocks' states in place; new blocks merged in at their sorted places."""
        self.states[loc[found]] = states[found]
        new = ~found
        count = int(new.sum())
        if not count:
            return
        dest = loc[new] + np.arange(count)
        size = len(self.keys) + count
        old = np.ones(size, bool)
        old[dest] = False
        keys = np.empty(size, np.uint64)
        keys[old] = self.keys
        keys[dest] = heads[new]
        self.keys = keys
        values = np.empty(size, self.states.dtype)
        values[old] = self.states
        values[dest] = states[new]
        self.states = values

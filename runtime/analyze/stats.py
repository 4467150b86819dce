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

Memory: one dict entry per distinct block (the figures are defined over all of them).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tierserve.runtime.analyze.traces import Trace

__all__ = ["PrefixStats", "TenantStats"]

# Flags kept beside each block's last use: seen in a prompt, seen in two prompts or more.
_IN_PROMPT, _SHARED = 1, 2


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


@dataclass
class PrefixStats:
    block_size: int
    total: TenantStats = field(default_factory=TenantStats)
    tenants: dict[int, TenantStats] = field(default_factory=dict)
    # reuse_distance[k]: prompt blocks last used between 2^(k-1) and 2^k - 1 requests before.
    reuse_distance: list[int] = field(default_factory=lambda: [0] * 64)
    _blocks: dict = field(default_factory=dict)  # block -> last request index << 2 | flags

    def add(self, trace: Trace) -> None:
        bs = self.block_size
        idx = self.total.requests
        tenant = self.tenants.get(trace.tenant)
        if tenant is None:
            tenant = self.tenants[trace.tenant] = TenantStats()
        chain = trace.chain
        num_prompt = min(trace.prompt_len // bs, len(chain))
        max_hit = min((trace.prompt_len - 1) // bs, num_prompt)
        blocks = self._blocks
        hist = self.reuse_distance
        hit = 0
        unique = shared = 0
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
        computed = min(max(trace.prompt_len + trace.output_len - 1, 0) // bs, len(chain))
        for i in range(num_prompt, computed):
            if chain[i] not in blocks:
                blocks[chain[i]] = stamp
        for t in (tenant, self.total):
            t.requests += 1
            t.prompt_tokens += trace.prompt_len
            t.total_blocks += num_prompt
            t.unique_blocks += unique
            t.shared_blocks += shared
            t.unbounded_hit_tokens += hit * bs

    @property
    def distinct_blocks(self) -> int:
        return len(self._blocks)

    def figures(self) -> dict:
        """The seed's dict for the whole log, with `tenants` (by tenant id) and
        `reuse_distance` (bucket upper bounds in requests -> prompt blocks) added."""
        out = self.total.figures(self.block_size)
        out["tenants"] = {tid: t.figures(self.block_size) for tid, t in self.tenants.items()}
        last = max((k for k, n in enumerate(self.reuse_distance) if n), default=0)
        out["reuse_distance"] = {(1 << k) - 1: self.reuse_distance[k]
                                 for k in range(1, last + 1)}
        return out

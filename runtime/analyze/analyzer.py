"""`analyze`: one streaming pass over the inputs feeding the statistics and one replay per
capacity; the figures as one JSON-able dict (what `tierserve analyze --json` prints)."""
from __future__ import annotations

import itertools
import time
from dataclasses import replace
from typing import Iterable, Sequence

from tierserve.kvcache import BlockHasher
from tierserve.runtime.analyze.costs import ASSUMED, Costs, TtftFit
from tierserve.runtime.analyze.replay import TIERS, Capacity, Replay, ReplayResult
from tierserve.runtime.analyze.stats import PrefixStats
from tierserve.runtime.analyze.traces import Trace, TraceSource
from tierserve.runtime.analyze.text_inputs import hash_chain

__all__ = ["analyze_source", "token_traces", "recommend", "WITHIN"]

# The recommendation: the smallest tiers whose hit rate is within this share of the unbounded
# cache's (relative: 0.98 x its hit rate or more).
WITHIN = 0.02


def token_traces(prompts: Iterable[Sequence[int]], block_size: int) -> Iterable[Trace]:
    """The seed's input, a list of token-id lists (prompts, back to back, no output)."""
    hasher = BlockHasher(block_size)
    for tokens in prompts:
        tokens = list(tokens)
        yield Trace(None, 0, len(tokens), 1, hash_chain(hasher, tokens, None))


def analyze_source(source: TraceSource, capacities: list[Capacity], *, costs: Costs | None,
                   block_bytes: int = 0, statistics: bool = True) -> dict:
    """Feeds every trace to the statistics and to a Replay per capacity, once."""
    bs = source.block_size
    header = source.header
    run_costs = costs or _header_costs(source) or ASSUMED
    # Decode steps take their blocks in time wherever a tier is replayed, at every capacity
    # alike (the curves compare like with like).
    progressive = any(c.cpu_blocks for c in capacities)
    replays = [Replay(c, bs, run_costs, block_bytes=block_bytes, progressive=progressive)
               for c in capacities]
    stats = PrefixStats(bs) if statistics else None
    fit = TtftFit()
    t0 = time.perf_counter()
    num = 0
    for trace in source.traces:
        num += 1
        if stats is not None:
            stats.add(trace)
        if trace.ttft is not None and trace.served is not None:
            fit.add(trace.prompt_len - sum(trace.served), trace.ttft, trace.duration,
                    trace.output_len)
        for replay in replays:
            replay.add(trace)
    results = [r.finish() for r in replays]
    elapsed = time.perf_counter() - t0
    final_costs = costs or _fitted(fit, source) or run_costs
    out = {
        "input": {"requests": num, "block_size": bs, "late_records": source.counters["late"],
                  "seconds": elapsed, "kv_block_bytes": block_bytes},
        "costs": _costs_dict(final_costs),
        "statistics": stats.figures() if stats is not None else None,
        "replays": [_result_dict(r, final_costs, bs) for r in results],
    }
    if header is not None:
        out["engine"] = {"num_blocks": header.num_blocks, "cpu_slots": header.cpu_slots,
                         "ssd_entries": header.ssd_entries, "model": header.model,
                         "tensor_parallel_size": header.tensor_parallel_size}
    if stats is not None:
        out["recommendation"] = recommend(out["replays"], stats.total.figures(bs)[
            "unbounded_hit_rate"])
    return out


def _header_costs(source: TraceSource) -> Costs | None:
    """The engine's copy bandwidth from its log's header (rates come from the fit)."""
    h = source.header
    if h is None or not h.copy_bytes_per_s:
        return None
    return ASSUMED.with_copies(h.kv_block_bytes, h.copy_bytes_per_s, 0.0)


def _fitted(fit: TtftFit, source: TraceSource) -> Costs | None:
    """Prefill and decode rates fitted to the log; copy costs measured by the engine (its
    header), else assumed."""
    fitted = fit.costs()
    if fitted is None:
        return None
    h = source.header
    copies = _header_costs(source)
    measured = copies is not None
    copies = copies or ASSUMED
    return replace(fitted, cpu_block_s=copies.cpu_block_s, ssd_block_s=copies.ssd_block_s,
                   ssd_write_block_s=copies.ssd_write_block_s,
                   source=fitted.source + ("; copies measured by the engine" if measured and h
                                           else "; copies assumed"))


def _costs_dict(c: Costs) -> dict:
    return {"source": c.source, "prefill_tokens_per_s": c.prefill_tokens_per_s,
            "decode_tokens_per_s": c.decode_tokens_per_s, "ttft_base_s": c.ttft_base_s,
            "cpu_block_s": c.cpu_block_s, "ssd_block_s": c.ssd_block_s,
            "ssd_write_block_s": c.ssd_write_block_s}


def _result_dict(r: ReplayResult, costs: Costs, bs: int) -> dict:
    cap = r.capacity
    out = {
        "device_blocks": cap.device_blocks, "cpu_bytes": cap.cpu_bytes,
        "ssd_bytes": cap.ssd_bytes, "cpu_blocks": cap.cpu_blocks, "ssd_blocks": cap.ssd_blocks,
        "requests": r.requests, "prompt_tokens": r.prompt_tokens,
        "hit_rate": r.hit_rate(),
        "hit_tokens": dict(zip(TIERS, r.hit_tokens)),
        "hit_rate_by_tier": {t: r.hit_rate(t) for t in TIERS},
        "prefill_tokens_saved": r.total_hit_tokens,
        "ttft_saved_s": costs.ttft_saved(r.hit_tokens, bs),
        "ttft_saved_ms_per_request": 1e3 * costs.ttft_saved(r.hit_tokens, bs) / max(
            r.requests, 1),
        "queued": r.queued, "skipped": r.skipped, "evictions": r.evictions,
        "tier_counters": r.tier_counters,
        "tenants": {tid: {"requests": n, "prompt_tokens": p, "hit_tokens": h}
                    for tid, (n, p, h) in r.tenants.items()},
    }
    if r.served_requests:
        out["served_tokens"] = dict(zip(TIERS, r.served_tokens))
    return out


def recommend(replays: list[dict], unbounded_rate: float) -> dict:
    """Per device size: the smallest CPU tier, then the smallest SSD tier, whose hit rate is
    within WITHIN of the unbounded cache's."""
    out = {"unbounded_hit_rate": unbounded_rate, "within": WITHIN, "by_device_blocks": {}}
    floor = (1.0 - WITHIN) * unbounded_rate
    key = lambda r: r["device_blocks"]  # noqa: E731
    for device, group in itertools.groupby(sorted(replays, key=key), key=key):
        group = list(group)
        good = [r for r in group if r["hit_rate"] >= floor - 1e-12]
        if good:
            best = min(good, key=lambda r: (r["cpu_bytes"], r["ssd_bytes"]))
            out["by_device_blocks"][device] = {
                "cpu_bytes": best["cpu_bytes"], "ssd_bytes": best["ssd_bytes"],
                "hit_rate": best["hit_rate"], "found": True}
        else:
            top = max(group, key=lambda r: r["hit_rate"])
            out["by_device_blocks"][device] = {
                "cpu_bytes": top["cpu_bytes"], "ssd_bytes": top["ssd_bytes"],
                "hit_rate": top["hit_rate"], "found": False}
    return out

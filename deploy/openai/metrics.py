"""Prometheus metrics: the engine's gauges and counters (read from its stats at each scrape)
and the server's own counters and latency histograms."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

__all__ = ["Metrics", "Tracker", "EngineCollector"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class EngineCollector:
    """Gauges and counters read from the engine's stats, fetched once per scrape."""

    def __init__(self) -> None:
        self.stats: dict = {}

    def collect(self):
        s = self.stats
        yield _gauge("num_requests_running", "requests in the running batch",
                     s.get("num_running", 0))
        yield _gauge("num_requests_waiting", "requests waiting for admission (or an SSD load)",
                     s.get("num_waiting", 0) + s.get("num_loading", 0))
        usage = GaugeMetricFamily("tierserve:kv_cache_usage_perc",
                                  "share of each KV tier in use (1 = full)", labels=["tier"])
        usage.add_metric(["device"], s.get("kv_usage", 0.0))
        for tier in ("cpu", "ssd"):
            if f"{tier}_tier_usage" in s:
                usage.add_metric([tier], s[f"{tier}_tier_usage"])
        yield usage
        yield _gauge("kv_cache_free_blocks", "device KV blocks no request holds (cached ones "
                     "included)", s.get("num_free_blocks", 0))
        yield _gauge("kv_cache_total_blocks", "device KV blocks in the pool",
                     s.get("num_total_blocks", 0))
        yield _counter("prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                       s.get("prefix_cache_queried_tokens", 0))
        yield _counter("prefix_cache_hits", "prompt tokens served from the prefix cache",
                       s.get("prefix_cache_hit_tokens", 0))
        yield _counter("num_preemptions", "requests preempted", s.get("num_preemptions", 0))
        for name in ("promotions", "demotions", "loads", "spills"):
            if f"tier_{name}" in s:
                yield _counter(f"kv_tier_{name}", f"KV tier block {name}", s[f"tier_{name}"])
        yield from _spec_metrics(s)
        yield _gauge("engine_dead", "1 once the engine cannot serve", int(bool(s.get("dead"))))


def _spec_metrics(s: dict):
    """Speculative decoding (vLLM's names), where the engine speculates: drafts, draft and
    accepted tokens, accepted tokens by draft position, and a histogram of each finished
    request's acceptance rate."""
    if "spec_num_drafts" not in s:
        return
    yield _counter("spec_decode_num_drafts", "steps of a request with drafts",
                   s["spec_num_drafts"])
    yield _counter("spec_decode_num_draft_tokens", "draft tokens verified",
                   s["spec_num_draft_tokens"])
    yield _counter("spec_decode_num_accepted_tokens", "draft tokens accepted",
                   s["spec_num_accepted_tokens"])
    per_pos = CounterMetricFamily("tierserve:spec_decode_num_accepted_tokens_per_pos",
                                  "draft tokens accepted, by position", labels=["position"])
    for pos, count in enumerate(s["spec_accepted_per_position"]):
        per_pos.add_metric([str(pos)], count)
    yield per_pos
    counts, bounds = s["spec_request_acceptance_buckets"], s["spec_request_acceptance_bounds"]
    buckets = [(str(b), c) for b, c in zip(bounds[:-1], counts[:-1])]
    buckets.append(("+Inf", counts[-1]))
    yield HistogramMetricFamily("tierserve:spec_decode_request_acceptance_rate",
                                "accepted drafts per draft of each finished request",
                                buckets=buckets, sum_value=s["spec_request_acceptance_sum"])


def _gauge(name: str, doc: str, value) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"tierserve:{name}", doc, value=value)


def _counter(name: str, doc: str, value) -> CounterMetricFamily:
    return CounterMetricFamily(f"tierserve:{name}", doc, value=value)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.engine = EngineCollector()
        r.register(self.engine)
        self.ttft = Histogram("tierserve:time_to_first_token_seconds", "time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tierserve:inter_token_latency_seconds",
                             "time between a request's tokens", buckets=_LATENCY_BUCKETS,
                             registry=r)
        self.e2e = Histogram("tierserve:e2e_request_latency_seconds", "request latency",
                             buckets=_LATENCY_BUCKETS, registry=r)
        # The tenant label is the API key's tenant ("" without keys).
        self.prompt_tokens = Counter("tierserve:prompt_tokens", "prompt tokens", ["tenant"],
                                     registry=r)
        self.cached_tokens = Counter("tierserve:prompt_cached_tokens", "prompt tokens served "
                                     "from the prefix cache, any tier", ["tenant"], registry=r)
        self.generation_tokens = Counter("tierserve:generation_tokens", "generated tokens",
                                         ["tenant"], registry=r)
        self.finished = Counter("tierserve:request_success", "finished requests",
                                ["finished_reason", "tenant"], registry=r)
        self.refused = Counter("tierserve:requests_refused", "requests answered with an error "
                               "status", ["status", "tenant"], registry=r)


class Tracker:
    """One engine request's metrics: its token counts (charged to its tenant's token rate
    too), finish reasons and latencies."""

    def __init__(self, metrics: Metrics, tenant: str, charge=None) -> None:
        self.metrics, self.tenant, self.charge = metrics, tenant, charge
        self.generated = metrics.generation_tokens.labels(tenant)
        self.start = time.perf_counter()
        self.last: float | None = None

    def prompt(self, delta) -> None:
        m = self.metrics
        m.prompt_tokens.labels(self.tenant).inc(len(delta.prompt_token_ids))
        if delta.num_cached_tokens > 0:
            m.cached_tokens.labels(self.tenant).inc(delta.num_cached_tokens)
        if self.charge is not None:
            self.charge(len(delta.prompt_token_ids))

    def outputs(self, delta) -> None:
        n = 0
        for c in delta.outputs:
            n += len(c.token_ids)
            if c.finish_reason is not None:
                self.metrics.finished.labels(c.finish_reason, self.tenant).inc()
        if n <= 0:
            return
        now = time.perf_counter()
        if self.last is None:
            self.metrics.ttft.observe(now - self.start)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now
        self.generated.inc(n)
        if self.charge is not None:
            self.charge(n)

    def done(self) -> None:
        self.metrics.e2e.observe(time.perf_counter() - self.start)

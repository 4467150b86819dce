"""Prometheus metrics: the engine's gauges and counters (read from its stats at each scrape)
and the server's own counters and latency histograms."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["Metrics", "Tracker", "EngineCollector"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class EngineCollector:
    """Gauges and counters read from the engine's stats, fetched once per scrape. A replicated
    deployment's come per replica, with a `replica` label (sum them for the deployment), with
    each replica's state and the router's own figures."""

    def __init__(self) -> None:
        self.stats: dict = {}

    def collect(self):
        s = self.stats
        replicas = s.get("replicas")
        if replicas is None:
            yield from _engine_families([((), s)], ())
            return
        sources = [((str(r),), rs) for r, rs in sorted(replicas.items()) if "num_running" in rs]
        yield from _engine_families(sources, ("replica",))
        up = GaugeMetricFamily("tierserve:replica_up", "1 while a replica serves (0: starting, "
                               "restarting or draining)", labels=["replica"])
        restarts = CounterMetricFamily("tierserve:replica_restarts", "times a replica was "
                                       "restarted after its death", labels=["replica"])
        for r, rs in sorted(replicas.items()):
            up.add_metric([str(r)], int(rs.get("state") == "live"))
            restarts.add_metric([str(r)], rs.get("replica_restarts", 0))
        yield up
        yield restarts
        router = s.get("router", {})
        yield _counter("router_requests", "requests the router routed", router.get("routed", 0))
        yield _gauge("router_route_us_mean", "the router's time per request, microseconds "
                     "(mean of the latest)", router.get("route_us_mean", 0.0))
        yield _gauge("router_indexed_blocks", "block hashes in the router's KV index",
                     router.get("indexed_blocks", 0))
        yield _gauge("engine_dead", "1 once the deployment cannot serve", int(bool(s.get("dead"))))


def _engine_families(sources: list[tuple[tuple, dict]], labels: tuple):
    """Each engine metric, one sample per (label values, stats) source."""
    def family(kind, name, doc, key, extra=()):
        cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
        fam = cls(f"tierserve:{name}", doc, labels=list(labels))
        for values, st in sources:
            fam.add_metric(list(values), key(st) if callable(key) else st.get(key, 0))
        return fam

    yield family("gauge", "num_requests_running", "requests in the running batch", "num_running")
    yield family("gauge", "num_requests_waiting", "requests waiting for admission (or an SSD "
                 "load)", lambda st: st.get("num_waiting", 0) + st.get("num_loading", 0))
    usage = GaugeMetricFamily("tierserve:kv_cache_usage_perc",
                              "share of each KV tier in use (1 = full)",
                              labels=[*labels, "tier"])
    for values, st in sources:
        usage.add_metric([*values, "device"], st.get("kv_usage", 0.0))
        for tier in ("cpu", "ssd"):
            if f"{tier}_tier_usage" in st:
                usage.add_metric([*values, tier], st[f"{tier}_tier_usage"])
    yield usage
    yield family("gauge", "kv_cache_free_blocks", "device KV blocks no request holds (cached "
                 "ones included)", "num_free_blocks")
    yield family("gauge", "kv_cache_total_blocks", "device KV blocks in the pool",
                 "num_total_blocks")
    yield family("counter", "prefix_cache_queries", "prompt tokens looked up in the prefix "
                 "cache", "prefix_cache_queried_tokens")
    yield family("counter", "prefix_cache_hits", "prompt tokens served from the prefix cache",
                 "prefix_cache_hit_tokens")
    yield family("counter", "num_preemptions", "requests preempted", "num_preemptions")
    for name in ("promotions", "demotions", "loads", "spills"):
        if any(f"tier_{name}" in st for _, st in sources):
            yield family("counter", f"kv_tier_{name}", f"KV tier block {name}", f"tier_{name}")
    yield family("counter", "worker_restarts", "times the engine rebuilt lost workers (a rank "
                 "died or a step hung) and re-admitted their requests", "restarts")
    if not labels:
        yield family("gauge", "engine_dead", "1 once the engine cannot serve",
                     lambda st: int(bool(st.get("dead"))))


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
                                     "from the prefix cache, by the tier that held them (cpu: "
                                     "the CPU tier, loaded there from SSD or demoted there)",
                                     ["tenant", "tier"], registry=r)
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
        lower = min(delta.num_tier_cached_tokens, delta.num_cached_tokens)
        if delta.num_cached_tokens > lower:
            m.cached_tokens.labels(self.tenant, "device").inc(delta.num_cached_tokens - lower)
        if lower > 0:
            m.cached_tokens.labels(self.tenant, "cpu").inc(lower)
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

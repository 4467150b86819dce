"""Prometheus metrics, every series present (zero) from the first scrape, whether or not its
feature is on, each saying what it counts and whose:

- the engine's (read from its stats at each scrape): gauges of its state and counters of
  everything it served, every client of a deployment included (other servers, `tierserve
  generate --name`, Python clients); a replicated deployment's per replica;
- this server's: its requests' tokens and outcomes by tenant, its refusals, and the latencies
  its clients saw.

So behind `--name` a counter counts the same thing as in front of an engine of its own: a
prefix hit rate of this server's requests is prompt_cached_tokens / prompt_tokens, the engine's
prefix_cache_hits / prefix_cache_queries.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from tierserve.runtime.metrics import engine_families

__all__ = ["Metrics", "Tracker", "EngineCollector", "FINISH_REASONS", "REFUSED_STATUSES"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
# The statuses a request can be refused with (each series starts at zero).
REFUSED_STATUSES = ("400", "401", "404", "405", "413", "422", "429", "500", "503")
CACHED_TIERS = ("device", "cpu")
_SERVER = " (this server's: its requests, its reading of the engine)"


class EngineCollector:
    """Gauges and counters read from the engine's stats, fetched once per scrape; a feature
    that is off reads zero; while the engine does not answer, the last values, with their age.
    A replicated deployment's come per replica, with a `replica` label (sum them for the
    deployment), with each replica's state and the router's own figures."""

    def __init__(self) -> None:
        self.stats: dict = {}
        self.read_at: float | None = None  # time.monotonic() of the stats' reading

    def update(self, stats: dict | None) -> None:
        """Fresh stats, or None: the engine did not answer, the last ones stay."""
        if stats is not None:
            self.stats, self.read_at = stats, time.monotonic()

    def collect(self):
        yield from engine_families(self.stats)
        age = -1.0 if self.read_at is None else time.monotonic() - self.read_at
        yield _gauge("engine_stats_age_seconds", "seconds since the engine's values above were "
                     "read: they are the last ones while the engine does not answer (-1: "
                     "never read)" + _SERVER, round(age, 3))


def _gauge(name: str, doc: str, value) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"tierserve:{name}", doc, value=value)


class Metrics:
    """`tenants`: the tenant label's values (the API keys' tenants; "" without keys), whose
    series start at zero."""

    def __init__(self, tenants: tuple[str, ...] = ("",)) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.engine = EngineCollector()
        r.register(self.engine)
        self.ttft = Histogram("tierserve:time_to_first_token_seconds", "seconds from a "
                              "request's arrival to its first token" + _SERVER,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tierserve:inter_token_latency_seconds",
                             "seconds between two of a request's outputs" + _SERVER,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tierserve:e2e_request_latency_seconds", "seconds from a "
                             "request's arrival to its last token" + _SERVER,
                             buckets=_LATENCY_BUCKETS, registry=r)
        # The tenant label is the API key's tenant ("" without keys).
        self.prompt_tokens = Counter("tierserve:prompt_tokens", "prompt tokens" + _SERVER,
                                     ["tenant"], registry=r)
        self.cached_tokens = Counter("tierserve:prompt_cached_tokens", "prompt tokens served "
                                     "from the prefix cache, by the tier that held them (cpu: "
                                     "the CPU tier, loaded there from SSD or demoted there)"
                                     + _SERVER, ["tenant", "tier"], registry=r)
        self.generation_tokens = Counter("tierserve:generation_tokens", "generated tokens"
                                         + _SERVER, ["tenant"], registry=r)
        self.finished = Counter("tierserve:request_success", "finished sequences (a request "
                                "with n samples finishes n) by finish reason" + _SERVER,
                                ["finished_reason", "tenant"], registry=r)
        self.refused = Counter("tierserve:requests_refused", "requests answered with an error "
                               "status" + _SERVER, ["status", "tenant"], registry=r)
        for tenant in tenants:
            self.prompt_tokens.labels(tenant)
            self.generation_tokens.labels(tenant)
            for tier in CACHED_TIERS:
                self.cached_tokens.labels(tenant, tier)
            for reason in FINISH_REASONS:
                self.finished.labels(reason, tenant)
            for status in REFUSED_STATUSES:
                self.refused.labels(status, tenant)

    def served_whole(self, tenant, prompt: int, generated: int, reasons: list[str]) -> None:
        """A body answered whole from its requests' final outputs (embeddings, beam search):
        its tokens and finished sequences counted, and its tokens charged to its tenant's
        token rate, as a streamed body's are (Tracker)."""
        name = tenant.name if tenant is not None else ""
        self.prompt_tokens.labels(name).inc(prompt)
        self.generation_tokens.labels(name).inc(generated)
        for reason in reasons:
            self.finished.labels(reason, name).inc()
        if tenant is not None:
            tenant.charge(prompt + generated)


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

    def aborted(self, samples: int) -> None:
        """Samples that ended because the client went away (no finishing output reached it)."""
        if samples > 0:
            self.metrics.finished.labels("abort", self.tenant).inc(samples)

    def done(self) -> None:
        self.metrics.e2e.observe(time.perf_counter() - self.start)

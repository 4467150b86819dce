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
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

__all__ = ["Metrics", "Tracker", "EngineCollector", "FINISH_REASONS", "REFUSED_STATUSES"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
# The statuses a request can be refused with (each series starts at zero).
REFUSED_STATUSES = ("400", "401", "404", "405", "413", "422", "429", "500", "503")
CACHED_TIERS = ("device", "cpu")
_ENGINE = " (the engine: every client of a deployment)"
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
        yield from self._engine()
        age = -1.0 if self.read_at is None else time.monotonic() - self.read_at
        yield _gauge("engine_stats_age_seconds", "seconds since the engine's values above were "
                     "read: they are the last ones while the engine does not answer (-1: "
                     "never read)" + _SERVER, round(age, 3))

    def _engine(self):
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

    yield family("gauge", "num_requests_running", "requests in the running batch" + _ENGINE,
                 "num_running")
    yield family("gauge", "num_requests_waiting", "requests waiting for admission or an SSD "
                 "load" + _ENGINE, lambda st: st.get("num_waiting", 0) + st.get("num_loading", 0))
    usage = GaugeMetricFamily("tierserve:kv_cache_usage_perc",
                              "share of each KV tier in use, 1 = full; 0 for a tier that is off"
                              + _ENGINE, labels=[*labels, "tier"])
    for values, st in sources:
        usage.add_metric([*values, "device"], st.get("kv_usage", 0.0))
        for tier in ("cpu", "ssd"):
            usage.add_metric([*values, tier], st.get(f"{tier}_tier_usage", 0.0))
    yield usage
    yield family("gauge", "kv_cache_free_blocks", "device KV blocks no request holds, cached "
                 "ones included" + _ENGINE, "num_free_blocks")
    yield family("gauge", "kv_cache_total_blocks", "device KV blocks in the pool" + _ENGINE,
                 "num_total_blocks")
    yield family("counter", "prefix_cache_queries", "prompt tokens looked up in the prefix "
                 "cache" + _ENGINE, "prefix_cache_queried_tokens")
    yield family("counter", "prefix_cache_hits", "prompt tokens served from the prefix cache"
                 + _ENGINE, "prefix_cache_hit_tokens")
    yield family("counter", "num_preemptions", "times a running request was preempted"
                 + _ENGINE, "num_preemptions")
    for name, what in (("promotions", "blocks copied from the CPU tier into the pool"),
                       ("demotions", "blocks copied from the pool into the CPU tier"),
                       ("loads", "blocks read from the SSD tier into the CPU tier"),
                       ("spills", "blocks written from the CPU tier to the SSD tier")):
        yield family("counter", f"kv_tier_{name}", what + "; 0 without tiers" + _ENGINE,
                     f"tier_{name}")
    yield family("counter", "worker_restarts", "times the engine rebuilt lost workers (a rank "
                 "died or a step hung) and re-admitted their requests" + _ENGINE, "restarts")
    yield from _spec_families(sources, labels)
    yield from _lora_families(sources, labels)
    if not labels:
        yield family("gauge", "engine_dead", "1 once the engine cannot serve",
                     lambda st: int(bool(st.get("dead"))))


def _lora_families(sources: list[tuple[tuple, dict]], labels: tuple):
    """vLLM's lora_requests_info, where LoRA is enabled: the running and the waiting requests'
    adapters (comma-separated names) and max_loras, as labels of a sample of value 1."""
    lora = [(v, st) for v, st in sources if "lora_running_adapters" in st]
    if not lora:
        return
    fam = GaugeMetricFamily("tierserve:lora_requests_info", "LoRA adapters of the running and "
                            "the waiting requests" + _ENGINE, labels=[
                                *labels, "running_lora_adapters", "waiting_lora_adapters",
                                "max_lora"])
    for values, st in lora:
        fam.add_metric([*values, ",".join(st["lora_running_adapters"]),
                        ",".join(st["lora_waiting_adapters"]), str(st["max_loras"])], 1)
    yield fam


def _spec_families(sources: list[tuple[tuple, dict]], labels: tuple):
    """Speculative decoding (vLLM's names): drafts, draft and accepted tokens (zero where the
    engine does not speculate); where it does, accepted tokens by draft position and a
    histogram of each finished request's acceptance rate."""
    for name, key, doc in (("num_drafts", "spec_num_drafts", "steps of a request with drafts"),
                           ("num_draft_tokens", "spec_num_draft_tokens", "draft tokens verified"),
                           ("num_accepted_tokens", "spec_num_accepted_tokens",
                            "draft tokens accepted")):
        fam = CounterMetricFamily(f"tierserve:spec_decode_{name}", doc + _ENGINE,
                                  labels=list(labels))
        for values, st in sources:
            fam.add_metric(list(values), st.get(key, 0))
        yield fam
    speculating = [(v, st) for v, st in sources if "spec_num_drafts" in st]
    if not speculating:
        return
    per_pos = CounterMetricFamily("tierserve:spec_decode_num_accepted_tokens_per_pos",
                                  "draft tokens accepted, by position" + _ENGINE,
                                  labels=[*labels, "position"])
    rates = HistogramMetricFamily("tierserve:spec_decode_request_acceptance_rate",
                                  "accepted drafts per draft of each finished request"
                                  + _ENGINE, labels=list(labels))
    for values, st in speculating:
        for pos, count in enumerate(st["spec_accepted_per_position"]):
            per_pos.add_metric([*values, str(pos)], count)
        counts, bounds = st["spec_request_acceptance_buckets"], st["spec_request_acceptance_bounds"]
        buckets = [(str(b), c) for b, c in zip(bounds[:-1], counts[:-1])]
        buckets.append(("+Inf", counts[-1]))
        rates.add_metric(list(values), buckets, st["spec_request_acceptance_sum"])
    yield per_pos
    yield rates


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

    def done(self) -> None:
        self.metrics.e2e.observe(time.perf_counter() - self.start)

"""The engine's metrics, from its stats() dict: Prometheus metric families (the HTTP server's
/metrics serves them) and, for `LLM.get_metrics()`, a snapshot of them as plain records shaped
like vLLM's (`vllm.v1.metrics.reader`): Counter, Gauge, Histogram and Vector, each with its
family's name and its sample's labels.
"""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

__all__ = ["engine_families", "snapshot", "Metric", "Counter", "Gauge", "Histogram", "Vector"]

# Every engine family's help text ends so: its counts are the engine's, whoever sent the work.
_ENGINE = " (the engine: every client of a deployment)"


def engine_families(s: dict):
    """The engine's metric families from its stats() dict; a replicated deployment's per
    replica, with a `replica` label (sum them for the deployment), each replica's state and
    the router's own figures."""
    replicas = s.get("replicas")
    if replicas is None:
        yield from _families([((), s)], ())
        return
    sources = [((str(r),), rs) for r, rs in sorted(replicas.items()) if "num_running" in rs]
    yield from _families(sources, ("replica",))
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


def _families(sources: list[tuple[tuple, dict]], labels: tuple):
    """Each engine metric, one sample per (label values, stats) source."""
    def family(kind, name, doc, key):
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


def _gauge(name: str, doc: str, value) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"tierserve:{name}", doc, value=value)


def _counter(name: str, doc: str, value) -> CounterMetricFamily:
    return CounterMetricFamily(f"tierserve:{name}", doc, value=value)


@dataclass
class Metric:
    """One sample of a family: a family with labels (a replica's, a tier's) gives one each."""
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Vector(Metric):
    """Counters indexed by a `position` label, as one list (accepted drafts by position)."""
    values: list[int]


@dataclass
class Histogram(Metric):
    """`buckets`: each bucket's upper bound (its `le` label, "+Inf" included) -> the
    observations up to it, cumulative as Prometheus counts them."""
    count: int
    sum: float
    buckets: dict[str, int]


_VECTORS = {"tierserve:spec_decode_num_accepted_tokens_per_pos"}


def snapshot(families) -> list[Metric]:
    """The samples of Prometheus metric families as records, in the families' order."""
    out: list[Metric] = []
    for fam in families:
        if fam.type == "gauge":
            out += [Gauge(fam.name, dict(s.labels), s.value) for s in fam.samples]
        elif fam.type == "counter" and fam.name in _VECTORS:
            out += _vectors(fam)
        elif fam.type == "counter":
            out += [Counter(fam.name, dict(s.labels), int(s.value)) for s in fam.samples
                    if s.name == fam.name + "_total"]
        elif fam.type == "histogram":
            out += _histograms(fam)
        else:
            raise AssertionError(f"metric family {fam.name} has type {fam.type}")
    return out


def _key(labels: dict, drop: str) -> tuple:
    return tuple(sorted((k, v) for k, v in labels.items() if k != drop))


def _vectors(fam) -> list[Vector]:
    by_labels: dict[tuple, dict[int, int]] = {}
    for s in fam.samples:
        if s.name == fam.name + "_total":
            by_labels.setdefault(_key(s.labels, "position"), {})[int(s.labels["position"])] = \
                int(s.value)
    return [Vector(fam.name, dict(k), [v.get(i, 0) for i in range(max(v, default=-1) + 1)])
            for k, v in by_labels.items()]


def _histograms(fam) -> list[Histogram]:
    parts: dict[tuple, dict] = {}
    for s in fam.samples:
        part = parts.setdefault(_key(s.labels, "le"), {"buckets": {}})
        if s.name.endswith("_bucket"):
            part["buckets"][s.labels["le"]] = int(s.value)
        elif s.name.endswith("_count"):
            part["count"] = int(s.value)
        elif s.name.endswith("_sum"):
            part["sum"] = float(s.value)
    return [Histogram(fam.name, dict(k), p.get("count", p["buckets"].get("+Inf", 0)),
                      p.get("sum", 0.0), p["buckets"]) for k, p in parts.items()]

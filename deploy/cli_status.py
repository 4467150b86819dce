"""`tierserve status`: a deployment's stats() and info() as lines a person reads.

Every part a user needs to judge a deployment: requests, the KV pool, the prefix cache, the KV
tiers (usage, hits per tier, copies; or how to turn them on), preemption, the CPU backend, the
data plane and how long the start took; with replicas, the router and each replica; on request,
the unfinished requests. A stats key an engine does not report is skipped, so the lines follow
the engine rather than break on it.
"""
from __future__ import annotations

__all__ = ["status_lines", "replica_lines", "request_lines"]


def status_lines(name: str, stats: dict, info: dict) -> list[str]:
    lines = [f"deployment {name!r}: running (namespace {info.get('namespace')!r}, "
             f"TP={info.get('tensor_parallel_size')}, model {info.get('model') or 'default'}, "
             f"engine on {info.get('node_ip')})"]
    rows = [("requests", _requests(stats)), ("KV pool", _pool(stats, info)),
            ("prefix cache", _prefix(stats)), ("KV tiers", _tiers(stats)),
            ("preemptions", _preemptions(stats)), ("worker restarts", _restarts(stats)),
            ("backend", _backend(stats)),
            ("data plane", _dataplane(stats)), ("sampling defaults", _sampling(info)),
            ("start", _startup(info))]
    for label, text in rows:
        for i, line in enumerate(text if isinstance(text, list) else [text]):
            if line:
                lines.append(f"  {label if i == 0 else '':<18} {line}")
    return lines


def _requests(s: dict) -> str:
    text = f"{s.get('num_running', 0)} running, {s.get('num_waiting', 0)} waiting"
    return text + (f", {s['num_loading']} loading from SSD" if s.get("num_loading") else "")


def _pool(s: dict, info: dict) -> str:
    total = s.get("num_total_blocks", 0)
    return (f"{s.get('kv_usage', 0.0):.1%} of {total} blocks in use "
            f"({s.get('num_free_blocks', 0)} free, {s.get('block_size', '?')} tokens each); "
            f"max_model_len {info.get('max_model_len')}")


def _prefix(s: dict) -> str:
    return (f"hit rate {s.get('prefix_cache_hit_rate', 0.0):.1%} "
            f"({s.get('prefix_cache_hit_tokens', 0)} of "
            f"{s.get('prefix_cache_queried_tokens', 0)} prompt tokens), "
            f"{s.get('prefix_cache_evictions', 0)} evictions, "
            f"{s.get('prefix_cache_collisions', 0)} hash collisions")


def _tiers(s: dict) -> list[str]:
    if "cpu_tier_usage" not in s:
        return ["off (--kv-offload-cpu-bytes adds a CPU tier, --kv-offload-ssd-path an SSD "
                "tier below it)"]
    lines = [f"CPU: {s['cpu_tier_usage']:.1%} of {s.get('cpu_tier_slots', '?')} slots, "
             f"{s.get('tier_cpu_hit_blocks', 0)} blocks hit"]
    if "ssd_tier_usage" in s:
        lines.append(f"SSD: {s['ssd_tier_usage']:.1%} of {s.get('ssd_tier_blocks', '?')} "
                     f"blocks, {s.get('tier_ssd_hit_blocks', 0)} blocks hit, "
                     f"{s.get('tier_ssd_found_blocks', 0)} found from earlier runs, "
                     f"{s.get('tier_checksum_failures', 0)} checksum failures")
    moves = [f"{s[f'tier_{k}']} {k}" for k in ("promotions", "demotions", "loads", "spills")
             if f"tier_{k}" in s]
    copied = s.get("tier_bytes_copied")
    lines.append(", ".join(moves) + (f"; {copied / 2**20:.1f} MiB copied" if copied else ""))
    return lines


def _preemptions(s: dict) -> str:
    text = str(s.get("num_preemptions", 0))
    if "tier_swap_outs" in s:
        text += f" ({s['tier_swap_outs']} swapped out, {s.get('tier_swap_ins', 0)} back in)"
    return text


def _restarts(s: dict) -> str:
    if not s.get("restarts"):
        return "0" if "restarts" in s else ""
    return (f"{s['restarts']} (last: {s.get('restart_reason')}; rebuilt in "
            f"{s.get('restart_s', 0.0):.1f} s)")


def _backend(s: dict) -> str:
    backend = s.get("backend")
    if not backend:
        return ""
    paths = ", ".join(backend.get("paths", ())) or "plain torch ops"
    return f"{backend['name']} ({paths}) on {backend.get('cpu', '?')}"


def _dataplane(s: dict) -> str:
    return "" if "dropped_frames" not in s else \
        f"{s['dropped_frames']} frames dropped (unauthenticated or malformed)"


def _sampling(info: dict) -> str:
    defaults = info.get("generation_defaults")
    if defaults is None:
        return ""
    if not defaults:
        return "vLLM's (temperature 1.0, 16 tokens)"
    return ", ".join(f"{k} {v}" for k, v in sorted(defaults.items()))


def _startup(info: dict) -> str:
    parts = info.get("startup_s")
    if not parts:
        return ""
    total = parts.get("total")
    detail = ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in parts.items()
                       if k != "total")
    return f"{total:.1f} s ({detail})" if total is not None else detail


def replica_lines(stats: dict) -> list[str]:
    """The router's counters and a line per replica, for a replicated deployment's stats."""
    router = stats["router"]
    lines = [f"  routing            {router['policy']}: {router['routed']} requests, "
             f"{router['route_us_mean']:.0f} us mean ({router['route_us_p99']:.0f} us p99), "
             f"{router['indexed_blocks']} blocks indexed",
             f"  replicas ({len(stats['replicas'])}):"]
    for rid, r in sorted(stats["replicas"].items()):
        line = f"    {rid}  {r['state']:<8} node {(r['node'] or '?')[:12]}  restarts " \
               f"{r['replica_restarts']}"
        if "num_running" in r:
            line += (f"  running {r['num_running']:>3}  waiting {r['num_waiting']:>3}  KV "
                     f"{r['kv_usage']:.0%}  prefix hits {r['prefix_cache_hit_rate']:.0%}")
        if r.get("error") and r["state"] != "live":
            line += f"  ({r['error']})"
        lines.append(line)
    return lines


def request_lines(requests: list[dict]) -> list[str]:
    """A heading and a line per unfinished request (list_requests()), with its replica's id
    where the deployment has replicas."""
    lines = [f"  requests ({len(requests)}):"]
    for r in requests:
        where = f"  replica {r['replica']}" if "replica" in r else ""
        lines.append(f"    {r['request_id']}  {r['status']:<9} prompt {r['prompt_tokens']:>6}  "
                     f"output {r['output_tokens']:>6}  age {r['age_s']:.1f} s{where}")
    return lines

"""The analysis as text (tables), and its hit-rate curves as a PNG (matplotlib, optional)."""
from __future__ import annotations

import re

__all__ = ["format_report", "plot_curves", "check_plotting", "parse_size", "human_bytes"]

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6,
          "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40,
          "tb": 10**12, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """'0', '512MiB', '4G' (binary), '10GB' (decimal) -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 0, 512MiB, 4GiB, 10GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def human_bytes(n: int) -> str:
    if n == 0:
        return "0"
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            value = n / size
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return f"{n}B"


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def format_report(out: dict, max_tenants: int = 10) -> str:
    lines = []
    inp, costs = out["input"], out["costs"]
    lines.append(f"{inp['requests']} requests, block size {inp['block_size']}, "
                 f"KV block {human_bytes(inp['kv_block_bytes'])} per rank"
                 + (f", {inp['late_records']} records out of order" if inp["late_records"]
                    else ""))
    stats = out.get("statistics")
    if stats:
        lines += ["", "Prefix sharing (prompt blocks)"] + _stats_lines(stats, max_tenants)
    lines += ["", f"Replay (costs {costs['source']}: prefill "
              f"{costs['prefill_tokens_per_s']:.0f} tok/s, CPU->device "
              f"{1e6 * costs['cpu_block_s']:.0f} us/block, SSD->CPU "
              f"{1e6 * costs['ssd_block_s']:.0f} us/block, CPU->SSD "
              f"{1e6 * (costs['ssd_write_block_s'] or costs['ssd_block_s']):.0f} us/block)"]
    rows = [["device blocks", "CPU tier", "SSD tier", "hit rate", "device", "CPU", "SSD",
             "tokens saved", "TTFT saved/req", "queued"]]
    for r in out["replays"]:
        by = r["hit_rate_by_tier"]
        rows.append([str(r["device_blocks"]), human_bytes(r["cpu_bytes"]),
                     human_bytes(r["ssd_bytes"]), _pct(r["hit_rate"]), _pct(by["device"]),
                     _pct(by["cpu"]), _pct(by["ssd"]), str(r["prefill_tokens_saved"]),
                     f"{r['ttft_saved_ms_per_request']:.1f} ms", str(r["queued"])])
    lines += _table(rows)
    lines += _served_lines(out)
    rec = out.get("recommendation")
    if rec:
        lines += ["", f"Unbounded cache: {_pct(rec['unbounded_hit_rate'])} hit rate."]
        for device, best in rec["by_device_blocks"].items():
            size = (f"CPU tier {human_bytes(best['cpu_bytes'])}, SSD tier "
                    f"{human_bytes(best['ssd_bytes'])}")
            if best["found"]:
                lines.append(f"Recommended with {device} device blocks: {size} "
                             f"({_pct(best['hit_rate'])}, within {_pct(rec['within'])} of it).")
            else:
                lines.append(f"With {device} device blocks no size tried is within "
                             f"{_pct(rec['within'])} of it; the best, {size}, reaches "
                             f"{_pct(best['hit_rate'])}: try larger tiers.")
    return "\n".join(lines)


def _stats_lines(stats: dict, max_tenants: int) -> list[str]:
    keys = ["total_requests", "total_blocks", "unique_blocks", "shared_blocks",
            "reusable_block_instances", "potential_prefill_savings", "avg_shared_prefix_length",
            "unbounded_hit_rate"]
    lines = []
    for k in keys:
        v = stats[k]
        text = _pct(v) if k in ("potential_prefill_savings", "unbounded_hit_rate") else (
            f"{v:.1f}" if isinstance(v, float) else str(v))
        lines.append(f"  {k:<26} {text}")
    tenants = sorted(stats["tenants"].items(), key=lambda kv: -kv[1]["total_requests"])
    if len(tenants) > 1:
        rows = [["tenant", "requests", "blocks", "unique", "shared", "savings", "avg prefix"]]
        for tid, t in tenants[:max_tenants]:
            rows.append([f"{int(tid):016x}" if int(tid) else "(no salt)",
                         str(t["total_requests"]), str(t["total_blocks"]),
                         str(t["unique_blocks"]), str(t["shared_blocks"]),
                         _pct(t["potential_prefill_savings"]),
                         f"{t['avg_shared_prefix_length']:.1f}"])
        lines += ["", "  per tenant" + (f" (the {max_tenants} busiest)"
                                        if len(tenants) > max_tenants else "")]
        lines += ["  " + line for line in _table(rows)]
    dist = stats["reuse_distance"]
    if dist:
        total = sum(dist.values()) or 1
        lines += ["", "  reuse distance (requests since a prompt block's last use)"]
        low = 1
        for high, n in dist.items():
            high = int(high)
            label = f"{low}" if low == high else f"{low}-{high}"
            lines.append(f"  {label:>16}  {n:>10}  {_pct(n / total):>6}")
            low = high + 1
    return lines


def _served_lines(out: dict) -> list[str]:
    """Predicted against served, at the engine's own capacity (its log's header)."""
    engine = out.get("engine")
    if not engine:
        return []
    lines = []
    for r in out["replays"]:
        served = r.get("served_tokens")
        own = (r["device_blocks"], r["cpu_blocks"], r["ssd_blocks"]) == (
            engine["num_blocks"], engine["cpu_slots"], engine["ssd_entries"])
        if served is None or not own:
            continue
        pred = r["hit_tokens"]
        lines.append(f"At the engine's own capacity, the replay predicts device {pred['device']}, "
                     f"CPU {pred['cpu']}, SSD {pred['ssd']} hit tokens; the engine served "
                     f"{served['device']}, {served['cpu']}, {served['ssd']}.")
    return [""] + lines if lines else []


def check_plotting() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'tierserve[analyze]'") from None


def plot_curves(out: dict, path: str) -> None:
    """Hit rate against CPU tier size (a line per device size and SSD size), or against the
    device pool where no tier varies; the unbounded cache's as a dashed line."""
    check_plotting()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    replays = out["replays"]
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    cpu_sizes = sorted({r["cpu_bytes"] for r in replays})
    if len(cpu_sizes) > 1:
        groups: dict = {}
        for r in replays:
            groups.setdefault((r["device_blocks"], r["ssd_bytes"]), []).append(r)
        for (device, ssd), rs in sorted(groups.items()):
            rs.sort(key=lambda r: r["cpu_bytes"])
            ax.plot([r["cpu_bytes"] / (1 << 30) for r in rs], [100 * r["hit_rate"] for r in rs],
                    marker="o", label=f"{device} device blocks, SSD {human_bytes(ssd)}")
        ax.set_xlabel("CPU tier per rank (GiB)")
    else:
        rs = sorted(replays, key=lambda r: r["device_blocks"])
        ax.plot([r["device_blocks"] for r in rs], [100 * r["hit_rate"] for r in rs],
                marker="o", label="device pool")
        ax.set_xlabel("device pool (blocks)")
    rec = out.get("recommendation")
    if rec:
        ax.axhline(100 * rec["unbounded_hit_rate"], linestyle="--", color="gray",
                   label="unbounded cache")
    ax.set_ylabel("prefix hit rate (% of prompt tokens)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

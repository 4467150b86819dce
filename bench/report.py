"""Output shared by the benchmarks: a two-column table (or a table of rows), or JSON with --json."""
from __future__ import annotations

import json


def emit(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
        return
    width = max(len(k) for k in result) + 2
    print(f"{'metric':<{width}} {'value':>12}")
    for key, value in result.items():
        text = f"{value:>12.2f}" if isinstance(value, float) else f"{value:>12}"
        print(f"{key:<{width}} {text}")


def print_table(rows: list[dict]) -> None:
    """Rows of equal keys as aligned columns."""
    if not rows:
        return
    keys = list(rows[0])
    cells = [[str(r.get(k, "")) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    print("  ".join(k.rjust(w) for k, w in zip(keys, widths)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)))

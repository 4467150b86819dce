"""Output shared by the benchmarks: a two-column table, or one JSON object with --json."""
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

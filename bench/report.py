"""Output shared by the benchmarks: a two-column table (or a table of rows), or JSON with --json."""
from __future__ import annotations

import json
import sys
import time


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


class Rows:
    """A benchmark's results as each is measured, so that none is lost to a later failure:
    with a table, each row prints when added; with --json, each goes to stderr as it comes and
    the JSON object prints at the end (`close`), with an "error" key where the run failed."""

    def __init__(self, as_json: bool, width: int = 34) -> None:
        self.as_json, self.width, self.result = as_json, width, {}
        if not as_json:
            print(f"{'metric':<{width}} {'value':>12}", flush=True)

    def add(self, key: str, value) -> None:
        self.result[key] = value
        text = f"{value:>12.2f}" if isinstance(value, float) else f"{value:>12}"
        print(f"{key:<{self.width}} {text}", file=sys.stderr if self.as_json else sys.stdout,
              flush=True)

    def close(self, error: BaseException | None = None) -> None:
        if error is not None:
            self.result["error"] = f"{type(error).__name__}: {error}"
        if self.as_json:
            print(json.dumps(self.result), flush=True)
        elif error is not None:
            print(f"stopped early: {self.result['error']}", flush=True)

    def __enter__(self) -> "Rows":
        return self

    def __exit__(self, kind, error, tb) -> None:
        self.close(error)


def best_of(fn, repeats: int) -> float:
    """The fastest of `repeats` timed calls of fn, after one untimed (warm-up) call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best

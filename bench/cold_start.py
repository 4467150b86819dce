"""Cold start of the default model, tierserve alone: fresh processes, each timed from its spawn
to its first token, split by phase. The same span `offline_throughput.py --against` calls cold
start, without waiting minutes for vLLM.

Phases (seconds): `import` (`import tierserve` and the engine's modules), `construct`
(`LLM()`, of which the engine reports its parts: `tokenizer`, loaded on a thread beside the
weights; `kernels`, loading the compiled CPU kernels; `weights`; `kv_pool`), `first_token` and
`cold_start` (spawn to first token); `cpu` is the process's CPU seconds to its first token,
a figure that moves less than wall time on a machine shared with other work.

Kernels load before the first token (TIERSERVE_CPU_KERNELS=sync), as in that bench; the
tokenizer and kernel caches are warm after the first run, so the first run is reported apart.
Each run's phases print as it finishes.

Rows: `<phase>_s_median`, `<phase>_s_min` over the runs after the first;
`first_run_cold_start_s`.

Usage: python bench/cold_start.py [--json] [--runs 5] [--kv-cache-gib 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from report import Rows

# Runs in the child: the times it reports are seconds since its parent spawned it.
_CHILD = """
import json, sys, time
spawned_at = float(sys.argv[1])
import tierserve
import tierserve.runtime.engine_core
t_imported = time.time()
llm = tierserve.LLM(kv_cache_memory_bytes=int(sys.argv[2]))
t_built = time.time()
llm.generate([list(range(100, 108))], tierserve.SamplingParams(temperature=0, max_tokens=1),
             use_tqdm=False)
t_ready = time.time()
cpu = time.process_time()
parts = llm.engine.info()["startup_s"]
llm.shutdown()
print(json.dumps({"import": t_imported - spawned_at, "construct": t_built - t_imported,
                  **{k: v for k, v in parts.items() if k != "total"},
                  "first_token": t_ready - t_built, "cold_start": t_ready - spawned_at,
                  "cpu": cpu}))
"""
PHASES = ("import", "construct", "tokenizer", "kernels", "weights", "kv_pool", "first_token",
          "cold_start", "cpu")


def one_run(kv_cache_bytes: int) -> dict[str, float]:
    env = {**os.environ, "TIERSERVE_CPU_KERNELS": os.environ.get("TIERSERVE_CPU_KERNELS", "sync")}
    done = subprocess.run([sys.executable, "-c", _CHILD, repr(time.time()), str(kv_cache_bytes)],
                          env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the engine failed to start:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--runs", type=int, default=5, help="runs after the first (at least 1)")
    ap.add_argument("--kv-cache-gib", type=int, default=2, help="as offline_throughput.py's")
    args = ap.parse_args()
    if args.runs < 1 or args.kv_cache_gib < 1:
        ap.error("--runs and --kv-cache-gib must be at least 1")
    with Rows(args.json) as rows:
        first = one_run(args.kv_cache_gib << 30)
        rows.add("first_run_cold_start_s", first["cold_start"])
        runs = []
        for i in range(args.runs):
            runs.append(one_run(args.kv_cache_gib << 30))
            rows.add(f"run_{i + 1}", " ".join(f"{k} {runs[-1].get(k, 0.0):.2f}"
                                              for k in PHASES))
        for phase in PHASES:
            values = [r.get(phase, 0.0) for r in runs]
            rows.add(f"{phase}_s_median", statistics.median(values))
            rows.add(f"{phase}_s_min", min(values))


if __name__ == "__main__":
    main()

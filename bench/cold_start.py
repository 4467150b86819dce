"""Cold start of the default model, tierserve alone: fresh processes, each timed from its spawn
to its first token, split into import (`import tierserve` and the engine's modules), engine
construction (`LLM()`: weights, kernels, KV pool, tokenizer) and the first token. The same
span `offline_throughput.py --against` calls cold start, without waiting minutes for vLLM.

Kernels load before the first token (TIERSERVE_CPU_KERNELS=sync), as in that bench; the
tokenizer and kernel caches are warm after the first run, so the first run is reported apart.

Rows: `<part>_s_median`, `<part>_s_min` over the runs after the first; `first_run_cold_start_s`.

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

from report import emit

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
llm.shutdown()
print(json.dumps({"import": t_imported - spawned_at, "construct": t_built - t_imported,
                  "first_token": t_ready - t_built, "cold_start": t_ready - spawned_at}))
"""
PARTS = ("import", "construct", "first_token", "cold_start")


def one_run(kv_cache_bytes: int) -> dict[str, float]:
    env = {**os.environ, "TIERSERVE_CPU_KERNELS": os.environ.get("TIERSERVE_CPU_KERNELS", "sync")}
    done = subprocess.run([sys.executable, "-c", _CHILD, repr(time.time()), str(kv_cache_bytes)],
                          env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the engine failed to start:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--runs", type=int, default=5, help="runs after the first (at least 1)")
    ap.add_argument("--kv-cache-gib", type=int, default=2, help="as offline_throughput.py's")
    args = ap.parse_args()
    if args.runs < 1 or args.kv_cache_gib < 1:
        ap.error("--runs and --kv-cache-gib must be at least 1")
    first = one_run(args.kv_cache_gib << 30)
    runs = [one_run(args.kv_cache_gib << 30) for _ in range(args.runs)]
    result: dict[str, float] = {}
    for part in PARTS:
        values = [r[part] for r in runs]
        result[f"{part}_s_median"] = statistics.median(values)
        result[f"{part}_s_min"] = min(values)
    result["first_run_cold_start_s"] = first["cold_start"]
    emit(result, args.json)


if __name__ == "__main__":
    main()

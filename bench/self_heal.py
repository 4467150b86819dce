"""Self-healing: a worker SIGKILLed under load, and the time until the streams go on.

An engine on Ray (the default model at --tp, --kv-cache-mib of KV pool per rank, on a private
local Ray instance) serves --streams
concurrent greedy streams of --max-tokens tokens. The first batch runs undisturbed (warm-up and
reference tokens). Then, --kills times, the same batch runs and, once every stream has
--kill-after tokens, rank --rank's process is sent SIGKILL. The engine rebuilds its workers and
re-admits the streams (README, Self-healing). Before each kill the bench waits for the
engine's spare ranks to have started (--no-spares: none are kept, a restart starts processes).

Reported (medians over the kills):
  recovery_s        SIGKILL to the next token of any in-flight stream
  recovery_all_s    SIGKILL to the moment every stream has had a token again
  restart_s         the engine's rebuild of its workers inside that (stats()["restart_s"]),
                    and restart_<phase>_s: teardown (killing the old ranks), spawn (new
                    actors up and imported; a spare's is done before), init (data plane,
                    gloo), load (weights), cache (KV pool and tiers), subscribe
  requests_lost     streams that ended in an error or short of their tokens (must be 0)
  tokens_match      every stream's tokens equal the undisturbed run's
  worker_start_s    the engine's first worker start, for comparison; bound_met says whether
                    recovery_s <= 2 x worker_start_s (the issue's acceptance line)

    python bench/self_heal.py [--json] [--model PATH] [--tp N] [--streams N] [--kills N]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import emit  # noqa: E402

PHASES = ("teardown", "spawn", "init", "load", "cache", "subscribe")


def _prompts(n: int) -> list[list[int]]:
    return [[(7 * i + 11 * j) % 5000 + 100 for j in range(24 + 4 * i)] for i in range(n)]


async def _stream(llm, prompt, params, marks: list[float]) -> list[int] | str:
    """The stream's tokens (or its error); marks gets the arrival time of each delta."""
    toks = []
    async for delta in llm.generate(prompt, params):
        if delta.error is not None:
            return delta.error
        if delta.outputs[0].token_ids:
            marks.append(time.monotonic())
            toks.extend(delta.outputs[0].token_ids)
    return toks


async def _batch(llm, args, pid: int | None = None) -> tuple[list, float | None, list]:
    """Every stream at once; with pid, SIGKILLs it once each stream has --kill-after
    tokens. Returns (results, kill time, each stream's delta times)."""
    from tierserve import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    marks = [[] for _ in range(args.streams)]
    tasks = [asyncio.create_task(_stream(llm, p, params, m))
             for p, m in zip(_prompts(args.streams), marks)]
    killed_at = None
    if pid is not None:
        while not all(len(m) >= args.kill_after for m in marks):
            if any(t.done() for t in tasks):
                raise RuntimeError("a stream finished before the kill: raise --max-tokens")
            await asyncio.sleep(0.005)
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
    return await asyncio.gather(*tasks), killed_at, marks


def _await_spares(llm, tp: int, timeout_s: float = 300.0) -> None:
    """Until the engine's spare ranks (if it keeps them) have started: the steady state a
    failure usually meets."""
    deadline = time.monotonic() + timeout_s
    while llm.stats().get("spare_ranks_ready", tp) < tp and time.monotonic() < deadline:
        time.sleep(0.5)


def _start_ray() -> None:
    import ray
    tmp = tempfile.mkdtemp(prefix="ts-bench-heal-", dir="/tmp")
    os.environ.update(RAY_TMPDIR=tmp, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    os.environ.pop("RAY_ADDRESS", None)
    ray.init(num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False,
             object_store_memory=256 << 20, _temp_dir=tmp, log_to_driver=False)


def run(args) -> dict:
    import tierserve
    from tierserve.workers.backends.cpu_features import detect_cpu_features

    _start_ray()
    options = dict(tensor_parallel_size=args.tp, distributed=True, max_restarts=args.kills,
                   spare_workers=not args.no_spares,
                   kv_cache_memory_bytes=args.kv_cache_mib << 20)
    if args.model:
        options["model"] = args.model
    llm = tierserve.AsyncLLM(**options)
    try:
        stats = llm.stats()
        start_s, start_phases = stats["worker_start_s"], stats["worker_phases"]
        reference, _, _ = asyncio.run(_batch(llm, args))
        rows = []
        for _ in range(args.kills):
            _await_spares(llm, args.tp)
            pid = llm.info()["worker_pids"][args.rank]
            results, killed_at, marks = asyncio.run(_batch(llm, args, pid))
            after = [next((t for t in m if t > killed_at), None) for m in marks]
            resumed = [t - killed_at for t in after if t is not None]
            stats = llm.stats()
            rows.append({
                "recovery_s": min(resumed) if resumed else float("inf"),
                "recovery_all_s": max(resumed) if len(resumed) == len(after) else float("inf"),
                "restart_s": stats["restart_s"],
                **{f"restart_{p}_s": stats["worker_phases"].get(p, 0.0) for p in PHASES},
                "lost": sum(1 for r in results
                            if isinstance(r, str) or len(r) != args.max_tokens),
                "match": results == reference,
            })
    finally:
        llm.shutdown()
    result = {"cpu": detect_cpu_features().model_name, "model": args.model or "default",
              "tp": args.tp, "streams": args.streams, "kills": args.kills,
              "kv_cache_mib": args.kv_cache_mib, "spares": not args.no_spares}
    for key in ("recovery_s", "recovery_all_s", "restart_s",
                *(f"restart_{p}_s" for p in PHASES)):
        result[key] = round(statistics.median(r[key] for r in rows), 3)
    result["requests_lost"] = sum(r["lost"] for r in rows)
    result["tokens_match"] = all(r["match"] for r in rows)
    result["worker_start_s"] = round(start_s, 3)
    for p in PHASES:
        result[f"start_{p}_s"] = start_phases.get(p, 0.0)
    result["bound_met"] = result["requests_lost"] == 0 and \
        result["recovery_s"] <= 2 * result["worker_start_s"]
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: the SmolLM2 GGUF")
    p.add_argument("--tp", type=int, default=3)
    p.add_argument("--rank", type=int, default=1, help="the rank killed")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--kill-after", type=int, default=8, help="tokens every stream has first")
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--kv-cache-mib", type=int, default=256, help="KV pool per rank")
    p.add_argument("--no-spares", action="store_true",
                   help="spare_workers=False: every restart starts new processes")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if not 0 <= args.rank < args.tp:
        p.error("--rank must be a rank of --tp")
    emit(run(args), args.json)


if __name__ == "__main__":
    main()

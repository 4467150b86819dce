"""`offline_throughput.py --against PYTHON`: tierserve and vLLM's `LLM` (in the interpreter
PYTHON) on the same workload, one after the other, in one table.

Each engine runs in a fresh process per dtype (tierserve_driver.py, vllm_driver.py) through
the same sections of engine_driver.py, with the same token ids: the chat prompts of the
offline workload (output tok/s, fp32 and bf16 where the CPU runs bf16 natively), and random
prompts of --prompt-len tokens (single-stream decode; TTFT cold, then with the prefix cached).
Cold start is the time from the parent starting that process to its first token (imports,
engine construction, compilation or kernel builds, one 1-token request); each engine says
whether its compile / kernel cache held anything new afterwards (not warm) or not (warm).

vLLM gets the model as a Hugging Face folder (export_hf.py), its OpenMP threads bound to this
process's CPUs, the same KV cache size and max_model_len as tierserve, prefix caching on, and
usage stats off.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

from engine_driver import SECTIONS

HERE = os.path.dirname(os.path.abspath(__file__))
ENGINES = ("tierserve", "vllm")
PARTS = SECTIONS + ("cold_start",)  # what --only picks from
DRIVER_TIMEOUT_S = 3600  # a first vLLM run compiles for minutes; an hour means it hangs
SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def cpu_list(cpus: set[int]) -> str:
    """{0, 1, 2, 5} -> "0-2,5" (the form VLLM_CPU_OMP_THREADS_BIND takes)."""
    ranges, ordered = [], sorted(cpus)
    start = prev = ordered[0]
    for cpu in ordered[1:] + [None]:
        if cpu is not None and cpu == prev + 1:
            prev = cpu
            continue
        ranges.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = cpu
    return ",".join(ranges)


def vllm_env(kv_cache_gib: int, cache_root: str | None) -> dict:
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=cpu_list(os.sched_getaffinity(0)),
               VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib), VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1")
    if cache_root:
        env["VLLM_CACHE_ROOT"] = cache_root
    return env


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


def run_driver(argv: list[str], spec: dict, env: dict, log_path: str) -> dict:
    """One driver process, its stderr to log_path; its result is its last line of stdout."""
    spec = dict(spec, spawned_at=time.time())
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                env=env, cwd=HERE, start_new_session=True)
        try:
            out, _ = proc.communicate(json.dumps(spec).encode(), timeout=DRIVER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            out = None
        finally:
            _kill_group(proc)
    if out is None or proc.returncode != 0:
        with open(log_path, errors="replace") as f:
            tail = f.read()[-4000:]
        why = "timed out" if out is None else f"exited {proc.returncode}"
        raise SystemExit(f"{' '.join(argv)} {why}; log {log_path}:\n{tail}")
    return json.loads(out.decode().strip().splitlines()[-1])


def _kill_group(proc: subprocess.Popen) -> None:
    """The driver's session (its engine's helper processes) ends with it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def plan(parts: set[str], dtypes: list[str]) -> list[tuple[str, list[str]]]:
    """(dtype, sections) of each process one engine runs: the first dtype also runs decode
    and TTFT; the others run throughput alone, and only when it was asked for."""
    runs = [(dtypes[0], [s for s in SECTIONS if s in parts])]
    if "throughput" in parts:
        runs += [(dtype, ["throughput"]) for dtype in dtypes[1:]]
    return runs


def run_engines(args, spec: dict, hf_folder: str, runs, log_dir: str) -> dict:
    """{engine: {dtype: driver result}}, all of one engine's runs before the other's."""
    order = ENGINES[::-1] if args.vllm_first else ENGINES
    fresh_cache = tempfile.mkdtemp(prefix="vllm-cache-") if args.vllm_fresh_cache else None
    results: dict[str, dict] = {}
    for engine in order:
        results[engine] = {}
        for dtype, sections in runs:
            run_spec = dict(spec, dtype=dtype, sections=sections)
            if engine == "vllm":
                argv = [args.against, os.path.join(HERE, "vllm_driver.py")]
                env = vllm_env(args.kv_cache_gib, fresh_cache)
                run_spec["model"] = hf_folder
            else:
                argv = [sys.executable, os.path.join(HERE, "tierserve_driver.py")]
                env = dict(os.environ)
            log = os.path.join(log_dir, f"{engine}-{SHORT[dtype]}.log")
            print(f"running {engine} {dtype}: {', '.join(sections) or 'cold start only'} "
                  f"(log {log})", file=sys.stderr, flush=True)
            results[engine][dtype] = run_driver(argv, run_spec, env, log)
            if engine == "vllm":
                results[engine][dtype]["compile_cache_load_failure"] = _cache_load_failure(log)
    return results


def _cache_load_failure(log_path: str) -> str | None:
    """Why vLLM compiled again though its compile cache held this model (its log's words), or
    None: a cache that fails to load is cold on every start."""
    with open(log_path, errors="replace") as f:
        for line in f:
            if "Compiling model again due to a load failure" in line:
                return line.rsplit("reason: ", 1)[-1].strip()
    return None


def base_spec(args, prompts: list[list[int]]) -> dict:
    """What every driver gets; the random prompts are distinct, so none is cached at first."""
    long = random_prompts(2 + args.ttft_repeats, args.prompt_len, seed=1)
    return {"model": None, "cpu_isa": args.cpu_isa, "max_model_len": args.max_model_len,
            "kv_cache_bytes": args.kv_cache_gib << 30, "ready_prompt": list(range(100, 108)),
            "prompts": prompts, "output_len": args.output_len, "decode_prompts": long[:2],
            "ttft_prompts": long[2:], "engine_options": getattr(args, "engine", {})}


# metric key, label, unit, target (text, test of (tierserve, vllm)) from the acceptance
_METRICS = (
    ("output_tok_s", "output tok/s {dtype}", "tok/s", (">= 1.0x vLLM", lambda t, v: t >= v)),
    ("decode_tok_s", "decode tok/s, 1 request", "tok/s", (">= 1.2x vLLM", lambda t, v: t >= 1.2 * v)),
    ("ttft_ms", "TTFT {prompt_len}-token prompt", "ms", ("<= vLLM", lambda t, v: t <= v)),
    ("ttft_cached_ms", "TTFT, prefix cached", "ms", None),
    ("ttft_cut", "TTFT cut by the cached prefix", "x", (">= 10x", lambda t, v: t >= 10)),
    ("ttft_cached_tokens", "prompt tokens found cached", "tokens", None),
    ("cold_start_s", "cold start {dtype} (to first token)", "s", ("<= 10 s", lambda t, v: t <= 10)),
)


def table_rows(results: dict, dtypes: list[str], prompt_len: int) -> list[dict]:
    rows = []
    for dtype in dtypes:
        ts, vl = results["tierserve"].get(dtype), results["vllm"].get(dtype)
        if ts is None or vl is None:
            continue
        for key, label, unit, target in _METRICS:
            if key not in ts or key not in vl:
                continue
            t, v = ts[key], vl[key]
            rows.append({"metric": label.format(dtype=SHORT[dtype], prompt_len=prompt_len),
                         "unit": unit, "tierserve": t, "vllm": v,
                         "tierserve/vllm": t / v if v else None,
                         "target": target[0] if target else "",
                         "met": None if target is None else target[1](t, v)})
    return rows


def add_derived(result: dict) -> None:
    if "ttft_ms" in result:
        result["ttft_cut"] = result["ttft_ms"] / result["ttft_cached_ms"]


def agreement(results: dict) -> dict:
    """Per dtype: of the throughput prompts, how many got the same greedy tokens from both
    engines, and the mean length of the common start (fp rounding differs, so long outputs
    may part ways; an early split on most prompts means the engines do not run one model)."""
    out = {}
    for dtype, ts in results["tierserve"].items():
        vl = results["vllm"].get(dtype, {})
        a, b = ts.pop("throughput_token_ids", None), vl.pop("throughput_token_ids", None)
        if a is None or b is None:
            continue
        common = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), len(p))
                  for p, q in zip(a, b)]
        out[SHORT[dtype]] = {"identical": sum(p == q for p, q in zip(a, b)), "prompts": len(a),
                             "mean_common_prefix": sum(common) / len(common),
                             "tokens": len(a[0])}
    return out


def _fmt(value) -> str:
    if isinstance(value, bool) or value is None:
        return {True: "yes", False: "NO", None: ""}[value]
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def notes(config: dict, results: dict, agree: dict) -> list[str]:
    lines = [f"{config['first']} ran first, then {config['second']}; one process per engine "
             f"and dtype, never two at once",
             f"CPU: {config['cpu']} ({', '.join(config['isas']) or 'no kernel ISA'}); "
             f"native bf16: {'yes' if config['native_bf16'] else 'no'}"]
    if config["tierserve_engine_options"]:
        lines.append("tierserve engine options: " + ", ".join(
            f"{k}={v}" for k, v in config["tierserve_engine_options"].items()))
    if config["skipped_dtypes"]:
        lines.append(f"not run: {', '.join(config['skipped_dtypes'])} (this CPU has no native "
                     f"bf16; pass --dtypes to run it anyway)")
    for engine, by_dtype in results.items():
        for dtype, r in by_dtype.items():
            lines.append(f"{engine} {r['version']} {dtype}: compile/kernel cache "
                         f"{'warm' if r['compile_cache_warm'] else 'cold'} "
                         f"({r['compile_cache_new_files']} new files in {r['compile_cache']}); "
                         f"import {r['import_s']:.1f} s, construct {r['construct_s']:.1f} s"
                         + (f"; backend {r['cpu_backend']}" if "cpu_backend" in r else ""))
            if r.get("compile_cache_load_failure"):
                lines.append(f"{engine} {dtype} compiled again: its cached compile failed to "
                             f"load ({r['compile_cache_load_failure']})")
    for dtype, a in agree.items():
        lines.append(f"greedy tokens {dtype}: {a['identical']}/{a['prompts']} outputs identical, "
                     f"mean common start {a['mean_common_prefix']:.1f} of {a['tokens']}")
    lines.append("wall-clock figures on a shared machine are noisy; logs: " + config["log_dir"])
    return lines


def compare(args, prompts: list[list[int]], dtypes: list[str], features) -> None:
    """Runs both engines and prints the table (or one JSON object with --json)."""
    from export_hf import export_hf
    from report import print_table
    parts = set(args.only.split(",")) if args.only else set(PARTS)
    if args.prompt_len + args.output_len + 1 > args.max_model_len:
        raise SystemExit("--prompt-len + --output-len exceed --max-model-len")
    hf_folder = args.hf_model or export_hf()
    log_dir = tempfile.mkdtemp(prefix="tierserve-against-")
    results = run_engines(args, base_spec(args, prompts), hf_folder, plan(parts, dtypes), log_dir)
    for by_dtype in results.values():
        for result in by_dtype.values():
            add_derived(result)
    agree = agreement(results)
    order = ENGINES[::-1] if args.vllm_first else ENGINES
    all_dtypes = args.dtypes.split(",") if args.dtypes else ["float32", "bfloat16"]
    config = {"first": order[0], "second": order[1], "cpu": features.model_name,
              "isas": list(features.isas), "native_bf16": features.onednn_bf16,
              "dtypes": dtypes, "skipped_dtypes": [d for d in all_dtypes if d not in dtypes],
              "num_prompts": len(prompts), "output_len": args.output_len,
              "prompt_len": args.prompt_len, "kv_cache_gib": args.kv_cache_gib,
              "max_model_len": args.max_model_len, "hf_model": hf_folder,
              "vllm_python": args.against, "vllm_threads_bind": cpu_list(os.sched_getaffinity(0)),
              "log_dir": log_dir, "tierserve_engine_options": getattr(args, "engine", {})}
    rows = table_rows(results, dtypes, args.prompt_len)
    if args.json:
        print(json.dumps({"config": config, "rows": rows, "greedy_agreement": agree,
                          **results}))
        return
    print_table([{k: _fmt(v) for k, v in row.items()} for row in rows])
    print()
    for line in notes(config, results, agree):
        print("- " + line)

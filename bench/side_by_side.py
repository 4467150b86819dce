"""`offline_throughput.py --against PYTHON` (and `--variant`): tierserve, variants of it (other
engine options) and vLLM's `LLM` (in the interpreter PYTHON) on the same workload, one after
the other, in one table; with --rounds N, N times over, the order reversed every other round
(run_rounds).

Each engine runs in a fresh process per dtype (tierserve_driver.py, vllm_driver.py) through
the same sections of engine_driver.py, with the same token ids: the chat prompts of the
offline workload (output tok/s, fp32 and bf16 where the CPU runs bf16 natively), the
single-stream decode prompts (--decode-workload: random ids of --prompt-len tokens, a chat
prompt, or an edit of a given text), and random prompts of --prompt-len tokens (TTFT cold,
then with the prefix cached). Cold start is the time from the parent starting that process to
its first token (imports, engine construction, compilation or kernel builds, one 1-token
request); each engine says whether its compile / kernel cache held anything new afterwards
(not warm) or not (warm).

Each figure is also given as a fraction of its bound on this machine (roofline.py, measured
first with the engines' threads): output tok/s as the run's FLOPs per second over the matmul
peak of its dtype, decode tok/s as the bytes a step streams per second over the bandwidth.

vLLM gets the model as a Hugging Face folder (export_hf.py, or --model's folder), its OpenMP
threads bound to this process's CPUs, the same KV cache size and max_model_len as tierserve,
prefix caching on, and usage stats off.
"""
from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from engine_driver import SECTIONS

HERE = os.path.dirname(os.path.abspath(__file__))
# What --only picks from; paired_decode goes with decode where there are several dtypes.
PARTS = tuple(s for s in SECTIONS if s != "paired_decode") + ("cold_start",)
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
    """(dtype, sections) of each process one engine runs: the first dtype runs every part
    asked for; the others throughput and decode (TTFT does not depend on the comparison of
    dtypes), when asked for. With decode and several dtypes, the first dtype's process also
    runs paired_decode: the dtypes' single-stream decodes in alternating rounds in one
    process, the figure the dtype ratio is read from."""
    first = [s for s in SECTIONS if s in parts]
    if "decode" in parts and len(dtypes) > 1:
        first.append("paired_decode")  # tierserve's engines only (run_engines)
    runs = [(dtypes[0], first)]
    runs += [(dtype, [s for s in ("throughput", "decode") if s in parts])
             for dtype in dtypes[1:]]
    return [(dtype, sections) for dtype, sections in runs if sections or dtype == dtypes[0]]


def engines_of(args) -> list[dict]:
    """The engines to run, in order: label, kind (tierserve / vllm) and tierserve's engine
    options (--engine, then each --variant's own on top)."""
    base = dict(getattr(args, "engine", {}))
    engines = [{"label": "tierserve", "kind": "tierserve", "options": base}]
    engines += [{"label": f"tierserve[{name}]", "kind": "tierserve",
                 "options": {**base, **options}} for name, options in args.variant]
    if args.against:
        vllm = {"label": "vllm", "kind": "vllm", "options": {}}
        engines = [vllm] + engines if args.vllm_first else engines + [vllm]
    return engines


def run_engines(args, spec: dict, hf_folder: str | None, runs, log_dir: str,
                engines: list[dict], tag: str = "") -> dict:
    """{engine label: {dtype: driver result}}, all of one engine's runs before the next's;
    tag names this round's logs."""
    fresh_cache = tempfile.mkdtemp(prefix="vllm-cache-") if args.vllm_fresh_cache else None
    base = next((e["options"] for e in engines if e["label"] == "tierserve"), None)
    results: dict[str, dict] = {}
    for entry in engines:
        engine = entry["label"]
        results[engine] = {}
        for dtype, sections in runs:
            run_spec = dict(spec, dtype=dtype, engine_options=entry["options"])
            if entry["kind"] != "tierserve":
                sections = [s for s in sections if s != "paired_decode"]
            elif engine != "tierserve" and dtype == runs[0][0] and "decode" in sections:
                # A variant's decode is also paired with tierserve's in this process.
                sections = sections + ["paired_decode"] * ("paired_decode" not in sections)
                run_spec["paired_base"] = base
            run_spec["sections"] = sections
            if entry["kind"] == "vllm":
                argv = [args.against, os.path.join(HERE, "vllm_driver.py")]
                env = vllm_env(args.kv_cache_gib, fresh_cache)
                run_spec["model"] = hf_folder
            else:
                argv = [sys.executable, os.path.join(HERE, "tierserve_driver.py")]
                env = dict(os.environ)
            log = os.path.join(log_dir, f"{engine.replace('[', '-').strip(']')}-"
                                        f"{SHORT[dtype]}{tag}.log")
            print(f"running {engine} {dtype}: {', '.join(sections) or 'cold start only'} "
                  f"(log {log})", file=sys.stderr, flush=True)
            results[engine][dtype] = run_driver(argv, run_spec, env, log)
            if entry["kind"] == "vllm":
                results[engine][dtype]["compile_cache_load_failure"] = _cache_load_failure(log)
    return results


# The figures --rounds repeats: per engine and dtype, the median over the rounds.
ROUND_KEYS = ("output_tok_s", "decode_tok_s", "ttft_ms", "ttft_cached_ms", "cold_start_s")


def run_rounds(args, spec: dict, hf_folder: str | None, runs, log_dir: str,
               engines: list[dict]) -> dict:
    """run_engines --rounds times, the engines' order reversed every other round, so that this
    machine's drift (its memory bandwidth moves by tens of percent within minutes) falls on
    every engine alike. Per engine and dtype: the first round's result (its greedy tokens and
    paired decode among them), each figure of ROUND_KEYS the median over the rounds, and
    under "rounds" each round's figures, which table_rows pairs round by round."""
    rounds = [run_engines(args, spec, hf_folder, runs, log_dir,
                          engines if r % 2 == 0 else engines[::-1],
                          f"-r{r + 1}" if args.rounds > 1 else "")
              for r in range(args.rounds)]
    merged = rounds[0]
    if len(rounds) == 1:
        return merged
    for engine, by_dtype in merged.items():
        for dtype, result in by_dtype.items():
            if "paired_decode" in result:  # every round's, pooled by variant_rows
                result["paired_decode_rounds"] = [r[engine][dtype]["paired_decode"]
                                                  for r in rounds]
            for later in rounds[1:]:
                later[engine][dtype].pop("throughput_token_ids", None)
            figures = {k: [r[engine][dtype][k] for r in rounds]
                       for k in ROUND_KEYS if k in result}
            result["rounds"] = figures
            result.update({k: statistics.median(v) for k, v in figures.items()})
    return merged


def _cache_load_failure(log_path: str) -> str | None:
    """Why vLLM compiled again though its compile cache held this model (its log's words), or
    None: a cache that fails to load is cold on every start."""
    with open(log_path, errors="replace") as f:
        for line in f:
            if "Compiling model again due to a load failure" in line:
                return line.rsplit("reason: ", 1)[-1].strip()
    return None


def base_spec(args, prompts: list[list[int]], decode_prompts: list[list[int]] | None = None,
              model: str | None = None, dtypes: list[str] | None = None) -> dict:
    """What every driver gets; the random prompts are distinct, so none of them is cached at
    first.
    decode_prompts: the single-stream prompts of a workload (--decode-workload), a pair per
    decode (default: random ids of --prompt-len, --decode-repeats pairs). The paired decode
    takes a warm-up pair per dtype, then a pair per round and dtype: distinct random ids of the
    decode prompts' length, or a workload's own pairs again and again, since what a speculating
    variant drafts depends on them (after the warm-up their prefixes are cached for every
    engine alike)."""
    pairs = 2 * getattr(args, "decode_repeats", 1)
    long = random_prompts(pairs + args.ttft_repeats, args.prompt_len, seed=1)
    dtypes = dtypes or ["float32"]
    rounds = getattr(args, "paired_rounds", 0)
    # A pair per warm-up and round for each dtype's engine and a variant's base engine.
    count = 2 * (rounds + 1) * (len(dtypes) + 1)
    if decode_prompts:
        paired = [decode_prompts[i % len(decode_prompts)] for i in range(count)]
    else:
        paired = random_prompts(count, args.prompt_len, seed=2)
    return {"paired_dtypes": dtypes[1:], "paired_rounds": rounds,
            "paired_decode_prompts": paired, "model": model, "cpu_isa": args.cpu_isa,
            "max_model_len": args.max_model_len,
            "kv_cache_bytes": args.kv_cache_gib << 30, "ready_prompt": list(range(100, 108)),
            "prompts": prompts, "output_len": args.output_len,
            "decode_prompts": decode_prompts or long[:pairs], "ttft_prompts": long[pairs:],
            "engine_options": getattr(args, "engine", {})}


# metric key, label, unit, target (text, test of (tierserve, vllm)) from issue 27's acceptance
# (fp32, dense checkpoint) and the earlier ones
_METRICS = (
    ("output_tok_s", "output tok/s {dtype}", "tok/s", (">= 1.5x vLLM", lambda t, v: t >= 1.5 * v)),
    ("offline_frac", "  of the {dtype} matmul bound", "", (">= 0.5", lambda t, v: t >= 0.5)),
    ("decode_tok_s", "decode tok/s {dtype}, 1 request", "tok/s",
     (">= 2x vLLM", lambda t, v: t >= 2 * v)),
    ("decode_frac", "  of the bandwidth bound", "", (">= 0.5", lambda t, v: t >= 0.5)),
    ("spec_acceptance", "  drafts accepted", "", None),
    ("ttft_ms", "TTFT {prompt_len}-token prompt", "ms", ("<= vLLM", lambda t, v: t <= v)),
    ("ttft_cached_ms", "TTFT, prefix cached", "ms", None),
    ("ttft_cut", "TTFT cut by the cached prefix", "x", (">= 10x", lambda t, v: t >= 10)),
    ("ttft_cached_tokens", "prompt tokens found cached", "tokens", None),
    ("cold_start_s", "cold start {dtype} (to first token)", "s", ("<= 10 s", lambda t, v: t <= 10)),
)


def table_rows(results: dict, dtypes: list[str], prompt_len: int) -> list[dict]:
    """A row per metric and dtype: each engine's figure, tierserve/vllm (with vLLM) and each
    variant over tierserve, and the target against vLLM where there is one."""
    labels = list(results)
    variants = [e for e in labels if e.startswith("tierserve[")]
    by_round = "vllm" in results and any("rounds" in r for r in results["tierserve"].values())
    rows = []
    for dtype in dtypes:
        for key, label, unit, target in _METRICS:
            values = {e: results[e].get(dtype, {}).get(key) for e in labels}
            if values.get("tierserve") is None:
                continue
            row = {"metric": label.format(dtype=SHORT[dtype], prompt_len=prompt_len),
                   "unit": unit, **values}
            t, v = values["tierserve"], values.get("vllm")
            paired = None
            if "vllm" in results:
                row["tierserve/vllm"] = t / v if v else None
                paired = _round_ratios(results, dtype, key, "tierserve", "vllm") \
                    if by_round else None
                if paired:  # the rounds' own ratios: each pair ran minutes apart at most
                    row["tierserve/vllm"] = statistics.median(paired)
                if by_round:
                    row["tierserve/vllm by round"] = paired
            for e in variants:
                row[f"{e}/tierserve"] = values[e] / t if values[e] is not None and t else None
                rounds = _round_ratios(results, dtype, key, e, "tierserve")
                if rounds:  # each round's variant and tierserve ran minutes apart at most
                    row[f"{e}/tierserve by round"] = rounds
            vs_vllm = target is not None and "vLLM" in target[0]
            row["target"] = target[0] if target and (v is not None or not vs_vllm) else ""
            if row["target"] and paired and vs_vllm:
                # Met on the median round: the ratio's own median against the target's factor.
                row["met"] = target[1](row["tierserve/vllm"], 1.0)
            else:
                row["met"] = None if not row["target"] else target[1](t, v)
            rows.append(row)
    return rows


def _round_ratios(results: dict, dtype: str, key: str, num: str, den: str
                  ) -> list[float] | None:
    """Engine num's figure over engine den's, round by round (--rounds), or None."""
    ours = results[num].get(dtype, {}).get("rounds", {}).get(key)
    theirs = results[den].get(dtype, {}).get("rounds", {}).get(key)
    if not ours or not theirs or not all(theirs):
        return None
    return [t / v for t, v in zip(ours, theirs)]


def dtype_rows(results: dict, dtypes: list[str]) -> list[dict]:
    """tierserve's decode tok/s of each further dtype over its first: issue 27 asks bf16 for
    1.7x fp32 (half the bytes a step streams). `ratio` is the paired decode's (both dtypes in
    one process, alternating rounds: the median round's ratio) where it ran; `separate` the
    ratio of the decode sections, each dtype in its own process minutes apart; `interleaved`
    the step-interleaved one (engine_driver.interleaved_steps: the median round's ratio of
    times per token), which the target reads where it ran: of the three, drift in this
    machine's bandwidth moves it least."""
    first, rows = dtypes[0], []
    for engine, by_dtype in results.items():
        base = by_dtype.get(first, {}).get("decode_tok_s")
        paired = by_dtype.get(first, {}).get("paired_decode")
        for dtype in dtypes[1:]:
            got = by_dtype.get(dtype, {}).get("decode_tok_s")
            separate = got / base if base and got else None
            ratio = paired["ratio"][dtype] if paired else separate
            if ratio is None:
                continue
            target = ">= 1.7x" if (first, dtype) == ("float32", "bfloat16") else ""
            row = {"engine": engine, "decode": f"{SHORT[dtype]} / {SHORT[first]}",
                   "ratio": ratio, "separate": separate}
            if paired:
                row.update({f"paired {SHORT[d]} tok/s": paired["median_tok_s"][d]
                            for d in (first, dtype)},
                           rounds=paired["rounds"])
            steps = (paired or {}).get("interleaved")
            if steps:
                row.update({f"interleaved {SHORT[d]} ms/token": statistics.median(
                    steps["token_ms"][d]) for d in (first, dtype)},
                           interleaved=steps["ratio"][dtype])
                ratio = steps["ratio"][dtype]
            rows.append({**row, "target": target, "met": None if not target else ratio >= 1.7})
    return rows


def variant_rows(results: dict, dtypes: list[str], engines: list[dict]) -> list[dict]:
    """Each variant's single-stream decode over tierserve's, both engines in the variant's
    first-dtype process (paired_decode's "base"), so that the machine's drift falls on both:
    `ratio`, the median of the paired rounds' ratios (pooled over --rounds, listed under `by
    round`), and `interleaved`, the step-interleaved one's, which the target reads where it ran.
    Issue 27 asks quantization="q8_0" for 1.8x fp32."""
    first, rows = dtypes[0], []
    for entry in engines:
        result = results.get(entry["label"], {}).get(first, {})
        pairs = [p for p in result.get("paired_decode_rounds", [result.get("paired_decode")])
                 if p and "base" in p["ratios"]]
        if not pairs:
            continue
        ratios = [1 / r for p in pairs for r in p["ratios"]["base"]]
        steps = [1 / r for p in pairs if p.get("interleaved")
                 for r in p["interleaved"]["ratios"]["base"]]
        row = {"engine": entry["label"], "decode": f"{SHORT[first]}, 1 request",
               "ratio": statistics.median(ratios), "by round": ratios}
        if steps:
            row["interleaved"] = statistics.median(steps)
        q8 = entry["options"].get("quantization") == "q8_0" and first == "float32"
        read = row.get("interleaved", row["ratio"])
        rows.append({**row, "target": ">= 1.8x" if q8 else "", "met": read >= 1.8 if q8 else None})
    return rows


def add_fractions(result: dict, dtype: str, limits: dict | None, cost, prompts: list[list[int]],
                  output_len: int, decode_context: int, quantization: str | None,
                  streamed_weight_bytes: int | None = None) -> None:
    """offline_frac and decode_frac of one run (roofline.py); nothing without limits.
    streamed_weight_bytes: the weight bytes the engine says its decode step reads (tierserve's
    stats()["decode_weight_bytes"]); None: the config's weights in the run's dtype."""
    if limits is None or cost is None:
        return
    from roofline import decode_frac, offline_frac
    if "output_tok_s" in result:
        result["offline_frac"] = offline_frac(limits, cost, result["output_tok_s"], dtype,
                                              [len(p) for p in prompts], output_len)
    if "decode_tok_s" in result:
        result["decode_frac"] = decode_frac(limits, cost, result["decode_tok_s"], dtype,
                                            quantization, decode_context, streamed_weight_bytes)


def add_derived(result: dict) -> None:
    if "ttft_ms" in result:
        result["ttft_cut"] = result["ttft_ms"] / result["ttft_cached_ms"]


def agreement(results: dict) -> dict:
    """Per engine other than tierserve and dtype: of the throughput prompts, how many got the
    same greedy tokens as tierserve's, and the mean length of the common start (fp rounding
    differs, so long outputs may part ways; an early split on most prompts means the engines
    do not run one model)."""
    ids = {engine: {dtype: r.pop("throughput_token_ids", None) for dtype, r in by.items()}
           for engine, by in results.items()}
    out = {}
    for engine in results:
        if engine == "tierserve":
            continue
        for dtype, b in ids[engine].items():
            a = ids["tierserve"].get(dtype)
            if a is None or b is None:
                continue
            common = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), len(p))
                      for p, q in zip(a, b)]
            out[f"{engine} {SHORT[dtype]}"] = {
                "identical": sum(p == q for p, q in zip(a, b)), "prompts": len(a),
                "mean_common_prefix": sum(common) / len(common), "tokens": len(a[0])}
    return out


def _fmt(value) -> str:
    if isinstance(value, list):
        return " ".join(_fmt(v) for v in value)
    if isinstance(value, bool) or value is None:
        return {True: "yes", False: "NO", None: ""}[value]
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def notes(config: dict, results: dict, agree: dict) -> list[str]:
    paired = any(r.get("paired_decode") for by_dtype in results.values()
                 for r in by_dtype.values())
    rounds = config.get("rounds", 1)
    lines = [f"ran in this order: {', '.join(config['order'])}; one process per engine and "
             f"dtype, never two at once"
             + (f"; {rounds} rounds, the order reversed every other one: each engine's "
                f"figures are its medians, each ratio the median of the rounds' ratios"
                if rounds > 1 else "")
             + ("; the paired decode ran each tierserve engine's dtypes (and, for a variant, "
                "tierserve's engine) in its first dtype's process, one request at a time"
                if paired else ""),
             f"CPU: {config['cpu']} ({', '.join(config['isas']) or 'no kernel ISA'}); "
             f"native bf16: {'yes' if config['native_bf16'] else 'no'}",
             f"model: {config['model']}; decode workload: {config['decode_workload']}"]
    limits = config.get("limits")
    if limits:
        lines.append(f"bounds ({limits['threads']} threads): {limits['bandwidth_gb_s']:.1f} "
                     f"GB/s read; matmul {limits['matmul_gflop_s']:.1f} GFLOP/s fp32 "
                     f"({limits['matmul_route']}), {limits['matmul_gflop_s_bf16']:.1f} bf16 "
                     f"({limits['matmul_route_bf16']})")
    for engine in config["engines"]:
        if engine["kind"] == "tierserve" and engine["options"]:
            lines.append(f"{engine['label']} engine options: " + ", ".join(
                f"{k}={v}" for k, v in engine["options"].items()))
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
    for what, a in agree.items():
        lines.append(f"greedy tokens, {what} vs tierserve: {a['identical']}/{a['prompts']} "
                     f"outputs identical, mean common start {a['mean_common_prefix']:.1f} of "
                     f"{a['tokens']}")
    lines.append("wall-clock figures on a shared machine are noisy; logs: " + config["log_dir"])
    return lines


def compare(args, prompts: list[list[int]], dtypes: list[str], features, *,
            model: str | None = None, hf_folder: str | None = None,
            decode_prompts: list[list[int]] | None = None, limits: dict | None = None,
            cost=None) -> None:
    """Runs every engine and prints the table (or one JSON object with --json). model:
    tierserve's (None: the default GGUF); hf_folder: vLLM's (default: the default model
    exported by export_hf.py)."""
    from report import print_table
    parts = set(args.only.split(",")) if args.only else set(PARTS)
    if args.prompt_len + args.output_len + 1 > args.max_model_len:
        raise SystemExit("--prompt-len + --output-len exceed --max-model-len")
    engines = engines_of(args)
    if args.against and hf_folder is None:
        from export_hf import export_hf
        hf_folder = export_hf(model)  # the GGUF tierserve runs (None: the default one)
    log_dir = tempfile.mkdtemp(prefix="tierserve-against-")
    spec = base_spec(args, prompts, decode_prompts, model, dtypes)
    results = run_rounds(args, spec, hf_folder, plan(parts, dtypes), log_dir, engines)
    decode_context = len(spec["decode_prompts"][1]) + args.output_len // 2
    for entry in engines:
        options = entry["options"]
        for dtype, result in results[entry["label"]].items():
            add_derived(result)
            # tierserve says what its decode step reads (GGUF codes, coded panels, the greedy
            # head's codes); a peer's bound is the config's weights in its dtype.
            add_fractions(result, dtype, limits, cost, prompts, args.output_len, decode_context,
                          options.get("quantization"), result.get("decode_weight_bytes"))
    agree = agreement(results)
    all_dtypes = args.dtypes.split(",") if args.dtypes else ["float32", "bfloat16"]
    config = {"order": [e["label"] for e in engines], "rounds": args.rounds, "engines": engines,
              "cpu": features.model_name, "isas": list(features.isas),
              "native_bf16": features.onednn_bf16, "model": model or "the default GGUF",
              "decode_workload": args.decode_workload, "limits": limits,
              "dtypes": dtypes, "skipped_dtypes": [d for d in all_dtypes if d not in dtypes],
              "num_prompts": len(prompts), "output_len": args.output_len,
              "prompt_len": args.prompt_len, "kv_cache_gib": args.kv_cache_gib,
              "max_model_len": args.max_model_len, "hf_model": hf_folder,
              "vllm_python": args.against, "vllm_threads_bind": cpu_list(os.sched_getaffinity(0)),
              "log_dir": log_dir}
    rows = table_rows(results, dtypes, args.prompt_len)
    ratios = dtype_rows(results, dtypes)
    variants = variant_rows(results, dtypes, engines)
    if args.json:
        out = {"config": config, "rows": rows, "dtype_ratios": ratios,
               "variant_ratios": variants, "greedy_agreement": agree, **results}
        if limits:
            out.update(bandwidth_gb_s=limits["bandwidth_gb_s"],
                       matmul_gflop_s=limits["matmul_gflop_s"],
                       matmul_gflop_s_bf16=limits["matmul_gflop_s_bf16"])
        print(json.dumps(out))
        return
    print_table([{k: _fmt(v) for k, v in row.items()} for row in rows])
    for table in (ratios, variants):
        if table:
            print()
            print_table([{k: _fmt(v) for k, v in row.items()} for row in table])
    print()
    for line in notes(config, results, agree):
        print("- " + line)

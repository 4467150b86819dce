"""Where the time of the offline workload goes: bench/offline_throughput.py's 64 prompts x 128
tokens through tierserve (in process), split into prefill and decode steps; then, in a second
engine over the same prompts (cold cache), a per-op profile (torch.profiler, self CPU time) of
the first prefill step and of decode steps 2-4.

Rows: run_s, run_tok_s, run_prefill_s / run_decode_s (time in steps with / without prefill
tokens) and their step counts; then `<phase>_<op>_ms`, milliseconds per step of the --top ops
of each profiled phase, and `<phase>_step_ms`, the profiled steps' mean total self CPU time.

Usage: python bench/step_profile.py [--json] [--dtype float32] [--top 8]
                                    [--model default|dense-noise|PATH]
"""
from __future__ import annotations

import argparse
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from decode_step import model_path
from offline_throughput import NEW_TOKENS, NUM_PROMPTS, make_chat_prompts
from report import emit
from tierserve import LLM, SamplingParams
from tierserve.workers import model_runner

DECODE_STEPS_PROFILED = (2, 3, 4)  # decode steps after the first (allocator warm-up) one


class StepClock:
    """Wraps ModelRunner.execute: time per step kind, and profiles of the chosen steps."""

    def __init__(self) -> None:
        self.seconds = {"prefill": 0.0, "decode": 0.0}
        self.steps = {"prefill": 0, "decode": 0}
        self.profiles: dict[str, list] = {"prefill": [], "decode": []}
        self.active = False
        self.profiling = False
        self.decodes_seen = 0
        self._original = model_runner.ModelRunner.execute

    def install(self) -> None:
        clock = self

        def execute(runner, out):
            if not clock.active:
                return clock._original(runner, out)
            kind = "decode" if out.num_scheduled_tokens and \
                max(out.num_scheduled_tokens) == 1 else "prefill"
            if not clock.profiling:
                t0 = time.perf_counter()
                result = clock._original(runner, out)
                clock.seconds[kind] += time.perf_counter() - t0
                clock.steps[kind] += 1
                return result
            done = len(clock.profiles[kind])
            if (kind == "prefill" and done == 0) or \
                    (kind == "decode" and done < len(DECODE_STEPS_PROFILED)
                     and clock.decodes_seen in DECODE_STEPS_PROFILED):
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    result = clock._original(runner, out)
                clock.profiles[kind].append(prof)
            else:
                result = clock._original(runner, out)
            clock.decodes_seen += kind == "decode"
            return result

        model_runner.ModelRunner.execute = execute

    def uninstall(self) -> None:
        model_runner.ModelRunner.execute = self._original


def op_rows(kind: str, averages: list, top: int) -> dict[str, float]:
    """Mean self-CPU milliseconds per step of the `top` costliest ops over the profiled steps."""
    totals: dict[str, float] = {}
    for step in averages:
        for event in step.key_averages():
            totals[event.key] = totals.get(event.key, 0.0) + event.self_cpu_time_total / 1e3
    n = max(len(averages), 1)
    rows = {f"{kind}_step_ms": sum(totals.values()) / n}
    for key, ms in sorted(totals.items(), key=lambda kv: -kv[1])[:top]:
        rows[f"{kind}_{key.split('::')[-1]}_ms"] = ms / n
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--model", default="default", help="default (the GGUF), dense-noise "
                    "(its weights plus 1%% noise, as an HF folder) or a path")
    args = ap.parse_args()
    path = model_path(args.model)
    torch.set_num_threads(os.cpu_count() or 1)
    clock = StepClock()
    clock.install()
    try:
        with LLM(path, dtype=args.dtype) as llm:
            prompts = make_chat_prompts(llm.tokenizer)
            llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
            clock.active = True
            params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - t0
        clock.profiling = True
        with LLM(path, dtype=args.dtype) as llm:
            # Long enough that every sequence is still decoding in the profiled decode steps
            # (the first ones start decoding during the other prompts' prefill steps).
            few = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
            llm.generate(prompts, few, use_tqdm=False)
    finally:
        clock.uninstall()
    result: dict[str, float | int] = {
        "run_s": elapsed, "run_tok_s": NUM_PROMPTS * NEW_TOKENS / elapsed,
        "run_prefill_s": clock.seconds["prefill"], "prefill_steps": clock.steps["prefill"],
        "run_decode_s": clock.seconds["decode"], "decode_steps": clock.steps["decode"],
    }
    for kind in ("prefill", "decode"):
        result.update(op_rows(kind, clock.profiles[kind], args.top))
    emit(result, args.json)


if __name__ == "__main__":
    main()

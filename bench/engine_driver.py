"""The workload of `offline_throughput.py --against`, run for one engine in a process of its own.

A driver (vllm_driver.py in vLLM's interpreter, tierserve_driver.py in tierserve's) reads a
JSON spec on stdin, builds its engine through an adapter and hands both to `serve`, which runs
the spec's sections in order and writes one JSON object on stdout. Both engines run this same
code with the same token ids, so they do the same work and are timed the same way.

This module imports neither engine: vLLM's interpreter has no tierserve, and tierserve's none
of vLLM.

Spec: spawned_at (the parent's time.time() just before it started this process), dtype,
max_model_len, sections (of SECTIONS), ready_prompt, prompts, output_len, decode_prompts (pairs
of prompts of one length, all distinct), ttft_prompts (distinct prompts of one length), plus
what the adapter reads (model, ...). The paired_decode section also reads paired_dtypes (the
other dtypes, each built as a further engine in this process), paired_base (engine options of
one more engine, labelled "base": the engine a variant is compared with; absent or null: none),
paired_rounds and paired_decode_prompts (a warm-up pair per engine, then a pair per round and
engine, all distinct).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Callable, Protocol

SECTIONS = ("throughput", "decode", "ttft", "paired_decode")
WARMUP_PROMPTS, WARMUP_TOKENS = 4, 4

# (output token ids, prompt tokens served from the prefix cache) per prompt, in input order
Outputs = list[tuple[list[int], int]]


class Engine(Protocol):
    def generate(self, prompts: list[list[int]], max_tokens: int) -> Outputs:
        """Greedy, EOS ignored: exactly max_tokens tokens per prompt."""

    # An engine may also offer stream_steps(prompt, max_tokens): one greedy request's engine
    # steps as an iterator, one per next() (its prefill, then a token each). paired_decode's
    # step-interleaved measure runs where every engine does (tierserve's driver; not vLLM's).

    def info(self) -> dict:
        """Versions, and whether compile / kernel caches were warm at start."""

    def close(self) -> None: ...


def serve(make_engine: Callable[[dict], Engine]) -> None:
    """Reads the spec, runs it and writes the result as the last line of stdout; what is
    printed from here on (engine logs, child processes) goes to stderr."""
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    spec = json.load(sys.stdin)
    out.write(json.dumps(run(make_engine, spec)) + "\n")
    out.flush()


def run(make_engine: Callable[[dict], Engine], spec: dict) -> dict:
    unknown = set(spec["sections"]) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown sections {sorted(unknown)}; known: {', '.join(SECTIONS)}")
    t_imported = time.time()
    engine = make_engine(spec)
    t_built = time.time()
    engine.generate([spec["ready_prompt"]], 1)
    t_ready = time.time()
    result = {"import_s": t_imported - spec["spawned_at"], "construct_s": t_built - t_imported,
              "cold_start_s": t_ready - spec["spawned_at"], **engine.info()}
    try:
        for section in spec["sections"]:
            if section == "paired_decode":
                result.update(paired_decode(engine, spec, make_engine))
            else:
                result.update(_SECTION_RUNNERS[section](engine, spec))
        if hasattr(engine, "final_info"):  # what an engine can only tell after the work
            result.update(engine.final_info())
    finally:
        engine.close()
    return result


def _timed(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, Outputs]:
    t0 = time.perf_counter()
    outs = engine.generate(prompts, max_tokens)
    elapsed = time.perf_counter() - t0
    if [len(tokens) for tokens, _ in outs] != [max_tokens] * len(prompts):
        raise RuntimeError(f"asked for {max_tokens} tokens per prompt, got "
                           f"{[len(tokens) for tokens, _ in outs]}")
    return elapsed, outs


def throughput(engine: Engine, spec: dict) -> dict:
    """All prompts in one generate call, after a short warm-up on the first few."""
    prompts, output_len = spec["prompts"], spec["output_len"]
    _timed(engine, prompts[:WARMUP_PROMPTS], WARMUP_TOKENS)
    elapsed, outs = _timed(engine, prompts, output_len)
    return {"output_tok_s": len(prompts) * output_len / elapsed, "throughput_s": elapsed,
            "throughput_token_ids": [tokens for tokens, _ in outs]}


def _decode_pair(engine: Engine, first: list[int], second: list[int],
                 n: int) -> tuple[float, float, float]:
    """(decode tok/s, prefill s, total s): the time of 1 + n tokens on `second` minus that of
    1 token on `first`, two uncached prompts of one length, is the decode of n tokens."""
    prefill_s, _ = _timed(engine, [first], 1)
    total_s, _ = _timed(engine, [second], 1 + n)
    return n / (total_s - prefill_s), prefill_s, total_s


def decode(engine: Engine, spec: dict) -> dict:
    """One request alone (_decode_pair), once per pair of decode_prompts (each prompt used
    once, so never cached); the median pair."""
    prompts, n = spec["decode_prompts"], spec["output_len"]
    runs = [_decode_pair(engine, first, second, n)
            for first, second in zip(prompts[::2], prompts[1::2])]
    tok_s, prefill_s, total_s = sorted(runs)[(len(runs) - 1) // 2]
    return {"decode_tok_s": tok_s, "decode_prefill_ms": prefill_s * 1e3,
            "decode_total_s": total_s, "decode_runs_tok_s": [r[0] for r in runs]}


def paired_decode(engine: Engine, spec: dict, make_engine: Callable[[dict], Engine]) -> dict:
    """Single-stream decode of this engine (labelled by its dtype) against paired_dtypes and
    paired_base, all engines in this process, in rounds of one decode pair each, so that drift
    in the machine's memory bandwidth falls on every engine alike. The rounds run the engines
    forwards and backwards in turn (A B, B A, ...); each round's ratio to this engine, then
    the median over rounds. Then, where the engines can be stepped (stream_steps), as many
    rounds of interleaved_steps."""
    others = {d: {"dtype": d} for d in spec["paired_dtypes"]}
    if spec.get("paired_base") is not None:
        others["base"] = {"engine_options": spec["paired_base"]}
    labels = [spec["dtype"], *others]
    engines = {spec["dtype"]: engine}
    try:
        for label, overrides in others.items():
            engines[label] = make_engine(dict(spec, **overrides))
            engines[label].generate([spec["ready_prompt"]], 1)
        prompts, n = iter(spec["paired_decode_prompts"]), spec["output_len"]
        # A decode pair per engine first, untimed: an engine's first long prefill (oneDNN's
        # primitives, fresh KV pages) costs more than later ones, which the pair's difference
        # would credit to the decode.
        for label in labels:
            _decode_pair(engines[label], next(prompts), next(prompts), n)
        tok_s: dict[str, list[float]] = {d: [] for d in labels}
        for r in range(spec["paired_rounds"]):
            for label in labels if r % 2 == 0 else labels[::-1]:
                tok_s[label].append(_decode_pair(engines[label], next(prompts), next(prompts),
                                                 n)[0])
        interleaved = interleaved_steps(engines, spec["paired_decode_prompts"][0], n,
                                        spec["paired_rounds"]) \
            if all(hasattr(e, "stream_steps") for e in engines.values()) else None
    finally:
        for label in labels[1:]:
            if label in engines:
                engines[label].close()
    ratios = {d: [x / y for x, y in zip(tok_s[d], tok_s[labels[0]])] for d in labels[1:]}
    result = {"engines": labels, "rounds": spec["paired_rounds"], "tok_s": tok_s,
              "median_tok_s": {d: statistics.median(v) for d, v in tok_s.items()},
              "ratios": ratios, "ratio": {d: statistics.median(v) for d, v in ratios.items()}}
    if interleaved:
        result["interleaved"] = interleaved
    return {"paired_decode": result}


def interleaved_steps(engines: dict[str, Engine], prompt: list[int], n: int,
                      rounds: int) -> dict:
    """Single-stream decode steps of the engines taken in turn, a step each, the order reversed
    every step and round: bandwidth that drifts within seconds falls on every engine alike,
    where a round of whole decodes (seconds each) leaves it to chance. Per round each engine's
    milliseconds per token after its prefill: its steps' time over the tokens they emitted
    (one a step, or several where it speculates, so that its stream ends in fewer steps);
    each later engine's speed-up over the first (the first's time per token over its own),
    then the median round's."""
    names = list(engines)
    token_ms: dict[str, list[float]] = {d: [] for d in names}
    for r in range(rounds):
        streams = {d: engines[d].stream_steps(prompt, n + 1) for d in names}
        seconds, tokens = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0)
        try:
            for stream in streams.values():
                next(stream)  # the prefill
            order, live, k = names if r % 2 == 0 else names[::-1], set(names), 0
            while live:
                for d in [d for d in (order if k % 2 == 0 else order[::-1]) if d in live]:
                    t0 = time.perf_counter()
                    outputs = next(streams[d], None)
                    if outputs is None:
                        live.discard(d)
                        continue
                    seconds[d] += time.perf_counter() - t0
                    tokens[d] += sum(len(o.new_token_ids) for o in outputs)
                k += 1
        finally:
            for stream in streams.values():
                stream.close()
        for d in names:
            token_ms[d].append(seconds[d] / tokens[d] * 1e3)
    ratios = {d: [a / b for a, b in zip(token_ms[names[0]], token_ms[d])] for d in names[1:]}
    return {"token_ms": token_ms, "ratios": ratios,
            "ratio": {d: statistics.median(v) for d, v in ratios.items()}}


def ttft(engine: Engine, spec: dict) -> dict:
    """Each prompt twice for one token: cold, then with its prefix in the cache; medians."""
    cold_ms, cached_ms, cached_tokens, same = [], [], [], True
    for prompt in spec["ttft_prompts"]:
        cold_s, cold = _timed(engine, [prompt], 1)
        warm_s, warm = _timed(engine, [prompt], 1)
        cold_ms.append(cold_s * 1e3)
        cached_ms.append(warm_s * 1e3)
        cached_tokens.append(warm[0][1])
        same &= cold[0][0] == warm[0][0]
        if cold[0][1]:
            raise RuntimeError(f"a fresh prompt found {cold[0][1]} tokens cached")
    return {"ttft_ms": statistics.median(cold_ms), "ttft_cached_ms": statistics.median(cached_ms),
            "ttft_ms_all": cold_ms, "ttft_cached_ms_all": cached_ms,
            "ttft_cached_tokens": min(cached_tokens), "ttft_cached_same_token": same}


_SECTION_RUNNERS = {"throughput": throughput, "decode": decode, "ttft": ttft}


def count_files(root: str) -> int:
    """Files under root (0 when it does not exist): a cache that gains none was warm."""
    return sum(len(files) for _, _, files in os.walk(root))

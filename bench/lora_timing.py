"""The timing bench/lora.py runs on each engine (ours in-process, vLLM's in its own venv through
bench/lora_vllm.py): no engine imports, only a `generate(prompts, max_tokens, lora)` callable
that runs greedy generation to the end (lora: one adapter for all, a list, or None)."""
from __future__ import annotations

import time


def single_stream(generate, prompt: list[int], tokens: int, lora) -> float:
    """Decode tok/s of one request: its tokens after the first over their time."""
    def run(n: int) -> float:
        t0 = time.perf_counter()
        generate([prompt], n, lora)
        return time.perf_counter() - t0
    first = run(1)
    return (tokens - 1) / max(run(tokens) - first, 1e-9)


def batch(generate, prompts: list[list[int]], tokens: int, lora) -> float:
    """Output tok/s of the whole batch, its prefills included."""
    t0 = time.perf_counter()
    generate(prompts, tokens, lora)
    return len(prompts) * tokens / (time.perf_counter() - t0)


def measure(generate, prompts: list[list[int]], tokens: int, adapters: list,
            repeats: int) -> dict[str, dict[str, float]]:
    """Best of `repeats` runs per case, the cases interleaved: the base model, one adapter
    (single-stream and batch), the batch spread over all the adapters."""
    spread = [adapters[i % len(adapters)] for i in range(len(prompts))]
    cases = {"base model": (None, None), "one adapter": (adapters[0], adapters[0]),
             f"{len(adapters)} adapters, batch spread": (False, spread)}
    single_stream(generate, prompts[0], 8, adapters[0])  # warm-up: kernels, adapter loads
    batch(generate, prompts, 4, spread)
    best: dict[str, dict[str, float]] = {name: {} for name in cases}
    for _ in range(repeats):
        for name, (one, many) in cases.items():
            runs = best[name]
            if one is not False:
                runs["decode"] = max(runs.get("decode", 0.0),
                                     single_stream(generate, prompts[0], tokens, one))
            runs["batch"] = max(runs.get("batch", 0.0), batch(generate, prompts, tokens, many))
    return best

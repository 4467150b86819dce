"""Where the CPU prefill attention should switch from the paged decode kernel to the tiled
prefill kernel: time to first token of one prompt (random ids, prefix caching off, default
SmolLM2 GGUF) at several lengths, with every prefill chunk on the decode kernel (token by token
over its causal context), on the tiled causal kernel (csrc/prefill_attention.cpp), and on
torch's SDPA (the route of dtypes the tiled kernel does not take).
attention.KERNEL_PREFILL_MAX_CONTEXT picks between the first and the others in serving.

Rows: `ttft_token_ms_<n>`, `ttft_tiled_ms_<n>`, `ttft_sdpa_ms_<n>`: best of --repeats, in ms.

Usage: python bench/prefill_attention.py [--json] [--lengths 32,64,128,256,384,512,1024]
           [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import random
import time

import torch

from report import emit
from tierserve import LLM, SamplingParams
from tierserve.workers import attention


def ttft_ms(llm: LLM, prompt: list[int], repeats: int) -> float:
    one = SamplingParams(temperature=0, max_tokens=1)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        llm.generate([prompt], one, use_tqdm=False)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--lengths", default="32,64,128,256,384,512,1024")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    default, tiled = attention.KERNEL_PREFILL_MAX_CONTEXT, attention._prefill

    def sdpa(*args, backend=None):  # _prefill without the backend: its SDPA route
        return tiled(*args)

    result: dict[str, float] = {}
    try:
        with LLM(enable_prefix_caching=False) as llm:
            llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
            for n in (int(x) for x in args.lengths.split(",")):
                rng = random.Random(n)
                prompt = [rng.randrange(100, 40000) for _ in range(n)]
                for path, limit, prefill in (("token", 1 << 30, tiled), ("tiled", 0, tiled),
                                             ("sdpa", 0, sdpa)):
                    attention.KERNEL_PREFILL_MAX_CONTEXT, attention._prefill = limit, prefill
                    result[f"ttft_{path}_ms_{n}"] = ttft_ms(llm, prompt, args.repeats)
    finally:
        attention.KERNEL_PREFILL_MAX_CONTEXT, attention._prefill = default, tiled
    emit(result, args.json)


if __name__ == "__main__":
    main()

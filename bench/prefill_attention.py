"""Where the CPU prefill attention should switch from the paged decode kernel to the tiled
prefill kernel: time to first token of one prompt (random ids, prefix caching off, default
SmolLM2 GGUF) at several lengths, with every prefill chunk on the decode kernel (token by token
over its causal context), on the tiled causal kernel (csrc/prefill_attention.cpp), and on
torch's SDPA (the route of dtypes the tiled kernel does not take).
backends/cpu.py's KERNEL_PREFILL_MAX_CONTEXT picks between the first and the others in serving.

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
import torch.nn.functional as F

from report import emit
from tierserve import LLM, SamplingParams
from tierserve.workers.backends import cpu as cpu_backends


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
    cls = cpu_backends.CpuKernelBackend
    default, tiled = cpu_backends.KERNEL_PREFILL_MAX_CONTEXT, cls.prefill_attention

    def sdpa(self, q, k, v, scale, window=None):  # the tiled kernel's work through SDPA
        length, context = q.shape[0], k.shape[0]
        mask = torch.arange(context)[None, :] <= torch.arange(context - length, context)[:, None]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=mask, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)

    result: dict[str, float] = {}
    try:
        with LLM(enable_prefix_caching=False) as llm:
            llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
            for n in (int(x) for x in args.lengths.split(",")):
                rng = random.Random(n)
                prompt = [rng.randrange(100, 40000) for _ in range(n)]
                for path, limit, prefill in (("token", 1 << 30, tiled), ("tiled", 0, tiled),
                                             ("sdpa", 0, sdpa)):
                    cpu_backends.KERNEL_PREFILL_MAX_CONTEXT, cls.prefill_attention = limit, prefill
                    result[f"ttft_{path}_ms_{n}"] = ttft_ms(llm, prompt, args.repeats)
    finally:
        cpu_backends.KERNEL_PREFILL_MAX_CONTEXT, cls.prefill_attention = default, tiled
    emit(result, args.json)


if __name__ == "__main__":
    main()

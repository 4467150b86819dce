"""Per-layer decode attention time: the torch gather + SDPA path against the C++ paged kernel.

SmolLM2-135M shapes: 64 decode sequences of 40-330 tokens (seeded), 9 query heads over 3 KV
heads, head_dim 64, block_size 16, block ids scattered over the pool. Each of 30 layers has its
own pool, as in a real step, so one step's K/V does not sit in cache from the previous layer;
a step is `_decode` over all 30 layers, reported per layer. Median of --steps steps per run,
then the median over --repeats runs.

Usage: python bench/decode_attention.py [--json] [--dtypes float32,bfloat16] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from tierserve.runtime import envs
from tierserve.workers.attention import AttentionMetadata, _decode
from tierserve.workers.kernels import build_dir_for, cpu_kernels

NUM_SEQS, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, LAYERS = 64, 9, 3, 64, 16, 30


def make_step(dtype: torch.dtype, seed: int = 0):
    rng = random.Random(seed)
    lens = [rng.randint(40, 330) for _ in range(NUM_SEQS)]
    need = sum(-(-n // BLOCK_SIZE) for n in lens)
    ids = list(range(2 * need))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in lens:
        k = -(-n // BLOCK_SIZE)
        tables.append(ids[at : at + k])
        at += k
    shape = (2 * need, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    pools = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(LAYERS)]
    q = torch.randn(NUM_SEQS, HEADS, HEAD_DIM).to(dtype)
    slots = [t[(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE for t, n in zip(tables, lens)]
    attn = AttentionMetadata.build(slot_mapping=slots, query_lens=[1] * NUM_SEQS, seq_lens=lens,
                                   block_tables=tables, num_decodes=NUM_SEQS, block_size=BLOCK_SIZE)
    return q, pools, attn


def time_step(q, pools, attn, steps: int) -> float:
    """Median per-layer microseconds of one step (all layers' _decode)."""
    scale = HEAD_DIM ** -0.5
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        for k_cache, v_cache in pools:
            _decode(q, k_cache, v_cache, attn, scale)
        if i >= 2:  # the first steps build the gather mask and warm the allocator
            times.append((time.perf_counter() - t0) / len(pools) * 1e6)
    return statistics.median(times)


def run(dtype: torch.dtype, steps: int) -> dict:
    q, pools, attn = make_step(dtype)
    attn.use_cpu_kernel = False
    torch_us = time_step(q, pools, attn, steps)
    attn.use_cpu_kernel = True
    kernel_us = time_step(q, pools, attn, steps)
    return {"torch_us": torch_us, "kernel_us": kernel_us}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    cpu_kernels.start_build(build_dir_for(envs.cache_dir()), sync=True)
    if not cpu_kernels.available:
        raise SystemExit(f"kernels unavailable: {cpu_kernels.error}")
    torch.manual_seed(0)
    results = {}
    for name in args.dtypes.split(","):
        runs = [run(getattr(torch, name), args.steps) for _ in range(args.repeats)]
        results[name] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        results[name]["speedup"] = results[name]["torch_us"] / results[name]["kernel_us"]
    results["threads"] = torch.get_num_threads()
    if args.json:
        print(json.dumps(results))
        return
    for name, r in results.items():
        if name != "threads":
            print(f"{name:9s} torch {r['torch_us']:8.0f} us/layer   kernel {r['kernel_us']:7.0f} "
                  f"us/layer   x{r['speedup']:.2f}")


if __name__ == "__main__":
    main()

"""What huge pages give the two things a decode step streams: weights and K/V.

The engine places the weights its kernels stream and its CPU KV pools in mappings advised for
transparent huge pages (workers/backends/host_memory.py). This compares the same kernels on the
same values in mappings with and without that advice, alternating the two placements round by
round (--rounds), so that a drift of the machine's bandwidth falls on both:
- `linear`: one input row through SmolLM2-135M's four decoder products x 30 layers (the panel
  kernel, --dtypes), each layer with weights of its own;
- `attention`: one sequence's decode attention over 30 layers' pools (9 query heads over 3 KV
  heads, head_dim 64, block ids scattered over a pool twice the context) for each --contexts.
Rows: `<what>_<dtype>[_ctx<N>]_{small,huge}_us` (median round) and `..._gb_s` (bytes streamed /
time), `..._speedup` (small / huge), `..._anon_huge_mb` (the process's AnonHugePages meanwhile:
about the huge placement's bytes where THP is `madvise` or `always`, 0 where it is `never`).

Usage: python bench/huge_pages.py [--json] [--dtypes float32,bfloat16] [--contexts 580,8192]
                                  [--rounds 9] [--cpu-isa avx2|avx512|amx]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from report import Rows
from tierserve.runtime import envs
from tierserve.workers.backends.cpu import kernel_backend
from tierserve.workers.backends.cpu_features import detect_cpu_features
from tierserve.workers.backends.host_memory import HugePageArena, mapped_zeros
from tierserve.workers.backends.linear import PanelWeight

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16


def huge_kb() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages"))


def linear_case(backend, dtype):
    """Per placement, a function running the 30 layers' products; and the bytes they stream."""
    weights = [[torch.randn(n, k).mul_(0.05).to(dtype) for n, k in SHAPES] for _ in range(LAYERS)]
    xs = {k: torch.randn(1, k).to(dtype) for k in (576, 1536)}
    runs, nbytes = {}, 0
    for name, huge in (("small", False), ("huge", True)):
        arena = HugePageArena(huge=huge)
        panels = [[PanelWeight(w, backend).place(arena) for w in layer] for layer in weights]
        nbytes = sum(p.nbytes for layer in panels for p in layer)

        def run(panels=panels):
            for layer in panels:
                for p, (_, k) in zip(layer, SHAPES):
                    p.linear(xs[k], None)
        runs[name] = run
    return runs, nbytes


def attention_case(backend, dtype, context):
    blocks = -(-context // BLOCK)
    ids = list(range(2 * blocks))
    random.Random(0).shuffle(ids)
    table = torch.tensor([ids[:blocks]], dtype=torch.int32)
    lens = torch.tensor([context], dtype=torch.int32)
    q = torch.randn(1, HEADS, HEAD_DIM).to(dtype)
    shape = (2 * blocks, BLOCK, KV_HEADS, HEAD_DIM)
    values = [torch.randn(shape).to(dtype) for _ in range(2)]
    runs = {}
    for name, huge in (("small", False), ("huge", True)):
        pools = []
        for _ in range(LAYERS):
            k, v = mapped_zeros(shape, dtype, huge), mapped_zeros(shape, dtype, huge)
            k.copy_(values[0])
            v.copy_(values[1])
            pools.append((k, v))

        def run(pools=pools):
            for k, v in pools:
                backend.paged_attention(q, k, v, table, lens, HEAD_DIM ** -0.5)
        runs[name] = run
    return runs, LAYERS * 2 * context * KV_HEADS * HEAD_DIM * q.element_size()


def alternate(runs: dict, rounds: int) -> dict:
    """Median seconds per placement, the order of the two flipped every round."""
    times = {name: [] for name in runs}
    for run in runs.values():
        run()
    for r in range(rounds):
        for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            t0 = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def report(rows: Rows, key: str, seconds: dict, nbytes: int) -> None:
    """The case's rows; called while its two placements are still alive (anon_huge_mb)."""
    for name in ("small", "huge"):
        rows.add(f"{key}_{name}_us", round(seconds[name] * 1e6, 1))
        rows.add(f"{key}_{name}_gb_s", round(nbytes / seconds[name] / 1e9, 1))
    rows.add(f"{key}_speedup", round(seconds["small"] / seconds["huge"], 3))
    rows.add(f"{key}_anon_huge_mb", huge_kb() // 1024)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--contexts", default="580,8192")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--cpu-isa", default=None)
    args = ap.parse_args()
    features = detect_cpu_features()
    backend = kernel_backend(args.cpu_isa or features.best_isa(), envs.cache_dir())
    with Rows(args.json, width=44) as rows:
        rows.add("cpu", features.model_name)
        rows.add("threads", torch.get_num_threads())
        for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
            name = str(dtype).removeprefix("torch.")
            runs, nbytes = linear_case(backend, dtype)
            report(rows, f"linear_{name}", alternate(runs, args.rounds), nbytes)
            del runs
            for context in (int(c) for c in args.contexts.split(",")):
                runs, nbytes = attention_case(backend, dtype, context)
                report(rows, f"attention_{name}_ctx{context}", alternate(runs, args.rounds),
                       nbytes)
                del runs


if __name__ == "__main__":
    main()

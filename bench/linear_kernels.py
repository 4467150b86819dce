"""fp32 linear routes on SmolLM2-135M's shapes, and the greedy LM head against full logits.

One "layer" is the four decoder-layer products of SmolLM2-135M (qkv 960x576, o 576x576,
gate_up 3072x576, down 576x1536). For each row count M, each route computes them for 30
layers, each layer with weights of its own (so they stream from memory, as in a real step);
best of --repeats. Routes:
- `panel`: the C++ panel kernel (csrc/linear.cpp; serves up to PanelWeight.KERNEL_MAX_ROWS);
- `amx`: csrc/linear_amx.cpp, weight split from the panels in the call (serves beyond that
  where the CPU has AMX-BF16);
- `mkl`: MKL sgemm on W^T rebuilt from the panels (the fallback beyond it without AMX).
Rows: `<route>_m<M>_ms` (30 layers) and `<route>_m<M>_gflops`; `<route>_m<M>_err_1e6`, the
largest deviation from float64 on one gate_up product, in units of 1e-6.

Then the LM head (49152 x 576) for 64 rows: `head_full_ms`, linear_f32's logits plus
argmax_rows; `head_greedy_ms`, layers.GreedyHead's exact route (bf16 approximation, bound,
fp32 candidates); `head_greedy_equal`, 1 when both give the same tokens.

Usage: python bench/linear_kernels.py [--json] [--rows 1,16,64,161,512,2048] [--repeats 5]
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from report import emit
from tierserve.runtime import envs
from tierserve.workers.kernels import build_dir_for, cpu_kernels
from tierserve.workers.layers import GreedyHead, PanelWeight

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K) of one decoder layer
LAYERS = 30
VOCAB, HIDDEN = 49152, 576


def mkl(x: torch.Tensor, w: PanelWeight) -> torch.Tensor:
    k = w.panels.shape[1]
    return torch.mm(x, w.panels.transpose(0, 1).reshape(k, -1)[:, : w.out_features])


def routes() -> dict:
    out = {"panel": lambda x, w: cpu_kernels.linear_f32(x, w.panels, None, w.out_features),
           "mkl": mkl}
    if cpu_kernels.has_amx:
        out["amx"] = lambda x, w: cpu_kernels.linear_amx(x, w.panels, None, w.out_features)
    return out


def best_of(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_linears(rows: list[int], repeats: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    weights = [[PanelWeight(torch.randn(n, k, generator=gen) * 0.05) for n, k in SHAPES]
               for _ in range(LAYERS)]
    result: dict[str, float] = {}
    for m in rows:
        xs = {k: torch.randn(m, k, generator=gen) for k in {k for _, k in SHAPES}}
        flops = 2 * m * sum(n * k for n, k in SHAPES) * LAYERS
        gate_up = weights[0][2]
        w64 = gate_up.panels.transpose(1, 2).reshape(-1, 576)[: gate_up.out_features].double()
        want = F.linear(xs[576].double(), w64)
        for name, route in routes().items():
            def step(route=route):
                for layer in weights:
                    for (_, k), w in zip(SHAPES, layer):
                        route(xs[k], w)
            seconds = best_of(step, repeats)
            result[f"{name}_m{m}_ms"] = seconds * 1e3
            result[f"{name}_m{m}_gflops"] = flops / seconds / 1e9
            err = (route(xs[576], gate_up).double() - want).abs().max().item()
            result[f"{name}_m{m}_err_1e6"] = err * 1e6
    return result


def bench_head(repeats: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(VOCAB, HIDDEN, generator=gen) * 0.05
    panel = PanelWeight(w)
    head = GreedyHead(panel, w)
    # Rows shaped like final hidden states: RMS-normalised, then scaled.
    x = F.normalize(torch.randn(64, HIDDEN, generator=gen), dim=1) * HIDDEN ** 0.5 * 3
    full = lambda: cpu_kernels.argmax_rows(panel.linear(x, None))  # noqa: E731
    greedy = lambda: head.tokens(x)  # noqa: E731
    return {"head_full_ms": best_of(full, repeats) * 1e3,
            "head_greedy_ms": best_of(greedy, repeats) * 1e3,
            "head_greedy_equal": int(torch.equal(full(), greedy()))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rows", default="1,16,64,161,512,2048")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    cpu_kernels.start_build(build_dir_for(envs.cache_dir()), sync=True)
    if not cpu_kernels.available:
        raise SystemExit(f"the C++ kernels did not load: {cpu_kernels.error}")
    result = {"amx_available": int(cpu_kernels.has_amx)}
    result.update(bench_linears([int(r) for r in args.rows.split(",")], args.repeats))
    result.update(bench_head(args.repeats))
    emit(result, args.json)


if __name__ == "__main__":
    main()

"""Linear routes on SmolLM2-135M's shapes, per dtype, and the greedy LM head against full logits.

One "layer" is the four decoder-layer products of SmolLM2-135M (qkv 960x576, o 576x576,
gate_up 3072x576, down 576x1536). For each row count M, each route computes them for 30
layers, each layer with weights of its own (so they stream from memory, as in a real step);
best of --repeats. Routes, of the --cpu-isa backend (default: the best this CPU runs):
- `torch`: F.linear on the plain weight, the torch backend's route (oneDNN-packed where the
  torch backend packs that dtype);
- `panel`: the C++ panel kernel (csrc/linear.cpp): fp32 up to the backend's panel_max_rows
  rows; bf16 / fp16 (the engine takes it at every size where the backend's half_linear is
  "kernel", else for single rows), bf16 in pair panels on AVX512_BF16's dot product where
  the backend packs them (csrc/linear_pairs.cpp);
- `panel_widen`: bf16 panels widened to fp32 in registers, where `panel` runs pairs;
- `coded`: the panels with each value's top byte coded (workers/backends/coded.py): fp32 in
  28 bits a value, bf16 pair panels in 12; what the engine loads where `quantized_linears`
  is on (fp32 up to panel_max_rows rows, on the AVX-512 backends; bf16 pairs up to the pair
  panels' rows);
- `amx`: csrc/linear_amx.cpp, fp32, weight split from the panels in the call (beyond
  panel_max_rows where the backend has AMX);
- `mkl`: fp32 MKL sgemm on W rebuilt from the panels (beyond panel_max_rows without AMX);
- `q4_1`: fp32 from the weight's GGUF Q4_1 codes (csrc/quant.cpp), where the backend has the
  quantized kernel; the engine takes it up to the backend's panel_max_rows rows. fp32 weights
  are Q4_1 blocks dequantized here, as the default model's are, so that route applies; the
  others read the same values as fp32.
- `q8_0`: the weight quantized to Q8_0, its products by quant.cpp's fp32 chain (what an LM
  head in Q8_0 runs); `int8`: the same codes with int8 activations (csrc/linear_int8.cpp,
  what the engine runs for a decoder's Q8_0 linears), `int8_vnni` and `int8_narrow` with its
  vpdpbusd tiles (where the CPU has AVX512_VNNI) or its 256-bit tile forced at every row count.
  Their `err` includes the quantization (Q8_0 of the weight; of the rows too for int8).
Rows: `<dtype>_<route>_m<M>_ms` (30 layers) and `..._gflops`; `..._err_1e6`, the largest
deviation from float64 on one gate_up product, in units of 1e-6.

Then the LM head (49152 x 576) for 1, 8, 16 and 64 rows:
`head_full_m<M>_ms`, linear_f32's logits plus argmax_rows; `head_greedy_m<M>_ms`,
greedy.GreedyHead's exact route (Q8_0 approximation, bound, fp32 candidates), with the suffix
`_unused` past the rows the engine takes it for (greedy.FP32_MAX_ROWS, none where the CPU has
the int8 pass); `head_int8_m<M>_ms`, the same route from the int8 pass (where the CPU has
AVX512_VNNI: every row count); `head_greedy_equal_m<M>` and `head_int8_equal_m<M>`, 1 when the
route gives the full product's tokens.

Usage: python bench/linear_kernels.py [--json] [--rows 1,16,64,161,512,2048] [--repeats 5]
           [--dtypes float32,bfloat16] [--cpu-isa avx2|avx512|amx]
"""
from __future__ import annotations

import argparse
import dataclasses
import os

import torch
import torch.nn.functional as F

from report import best_of, emit
from tierserve.runtime import envs
from tierserve.workers.backends.cpu import CpuKernelBackend, kernel_backend
from tierserve.workers.backends.coded import CodedPairPanels, CodedPanelWeight
from tierserve.workers.backends.cpu_features import detect_cpu_features
from tierserve.workers.backends.greedy import GreedyHead
from tierserve.workers.backends.int8_linear import Int8PanelWeight
from tierserve.workers.backends.linear import PackedWeight, PanelWeight
from tierserve.workers.backends.portable import torch_backend
from tierserve.workers.backends.quant import QuantPanelWeight

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K) of one decoder layer
LAYERS = 30
VOCAB, HIDDEN = 49152, 576


class Weight:
    """One weight in every layout a route reads."""

    def __init__(self, w: torch.Tensor, backend: CpuKernelBackend) -> None:
        self.plain = w
        half = w.dtype != torch.float32
        self.panel = PanelWeight(w, backend) \
            if half or PanelWeight.applies_to(w, backend) else None
        self.widen = PanelWeight(w, dataclasses.replace(backend, bf16_pairs=False)) \
            if half and self.panel.pairs else None
        torch_route = torch_backend().half_linear_for(w.dtype)
        self.onednn = PackedWeight(w) if torch_route == "onednn" else None
        self.quant = QuantPanelWeight.encode(w, backend) if self.panel else None
        self.q8 = QuantPanelWeight.quantize(w, "q8_0", backend) \
            if w.dtype == torch.float32 and backend.quant_linear else None
        self.int8 = Int8PanelWeight.from_codes(*self.q8.reference_codes()[:2], backend) \
            if self.q8 is not None else None
        if w.dtype == torch.float32:
            coding = dataclasses.replace(backend, coded_linear=True)  # AVX2 does not choose it
            self.coded = CodedPanelWeight.encode(w, coding) if self.panel else None
        else:
            self.coded = CodedPairPanels.encode(self.panel, backend)

    def torch(self, x: torch.Tensor) -> torch.Tensor:
        return self.onednn.linear(x, None) if self.onednn else F.linear(x, self.plain)


def routes(backend: CpuKernelBackend, dtype: torch.dtype, m: int) -> dict:
    out = {"torch": lambda x, w: w.torch(x)}
    if dtype != torch.float32:
        out["panel"] = lambda x, w: backend.linear_half(x, w.panel.panels, None,
                                                        w.plain.shape[0])
        if dtype == torch.bfloat16 and backend.bf16_pairs:
            out["panel_widen"] = lambda x, w: backend.linear_half(x, w.widen.panels, None,
                                                                  w.plain.shape[0])
            if backend.quant_linear:
                out["coded"] = lambda x, w: w.coded.linear(x, None)
        return out
    out["panel"] = lambda x, w: backend.linear_f32(x, w.panel.panels, None, w.plain.shape[0])
    if backend.amx_linear:
        out["amx"] = lambda x, w: backend.linear_amx(x, w.panel.panels, None, w.plain.shape[0])
    out["mkl"] = lambda x, w: F.linear(x, w.panel.weight())
    if backend.quant_linear:
        out["coded"] = lambda x, w: w.coded.linear(x, None)
        out["q4_1"] = lambda x, w: backend.ops.linear_q4_1(
            x, w.quant.codes, w.quant.scales, w.quant.offsets, None, w.plain.shape[0])
        if m <= backend.panel_max_rows:
            out["q8_0"] = lambda x, w: w.q8.linear(x, None)
        out["int8"] = lambda x, w: w.int8.linear(x, None)
        if backend.ops.int8_linear_path() == "avx512_vnni":
            out["int8_vnni"] = lambda x, w: backend.ops.linear_int8(
                x, w.int8.pairs, None, w.plain.shape[0], 1)
        out["int8_narrow"] = lambda x, w: backend.ops.linear_int8(
            x, w.int8.pairs, None, w.plain.shape[0], 2)
    return out


def q4_1_weight(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """A random fp32 [n, k] weight that is GGUF Q4_1 blocks dequantized."""
    import gguf
    w = (torch.randn(n, k, generator=gen) * 0.05).numpy()
    qtype = gguf.GGMLQuantizationType.Q4_1
    raw = gguf.quants.quantize(w, qtype)
    return torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(n, k).copy())


def bench_linears(backend: CpuKernelBackend, dtype: torch.dtype, rows: list[int],
                  repeats: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    make = (lambda n, k: q4_1_weight(n, k, gen)) if dtype == torch.float32 and \
        backend.quant_linear else (lambda n, k: (torch.randn(n, k, generator=gen) * 0.05).to(dtype))
    weights = [[Weight(make(n, k), backend) for n, k in SHAPES] for _ in range(LAYERS)]
    short = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    result: dict[str, float] = {}
    for m in rows:
        xs = {k: torch.randn(m, k, generator=gen).to(dtype) for k in {k for _, k in SHAPES}}
        flops = 2 * m * sum(n * k for n, k in SHAPES) * LAYERS
        gate_up = weights[0][2]
        want = F.linear(xs[576].double(), gate_up.plain.double())
        for name, route in routes(backend, dtype, m).items():
            def step(route=route):
                for layer in weights:
                    for (_, k), w in zip(SHAPES, layer):
                        route(xs[k], w)
            seconds = best_of(step, repeats)
            key = f"{short}_{name}_m{m}"
            result[f"{key}_ms"] = seconds * 1e3
            result[f"{key}_gflops"] = flops / seconds / 1e9
            err = (route(xs[576], gate_up).double() - want).abs().max().item()
            result[f"{key}_err_1e6"] = err * 1e6
    return result


def bench_head(backend: CpuKernelBackend, repeats: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(VOCAB, HIDDEN, generator=gen) * 0.05
    panel = PanelWeight(w, backend)
    # The Q8_0 pass's head as on a CPU without the int8 pass; the int8 pass's where it runs.
    q8 = GreedyHead(panel, w, dataclasses.replace(backend, int8_head=False))
    int8 = GreedyHead(panel, w, backend) if backend.int8_head else None
    limit = 0 if int8 is not None else q8.max_rows  # rows the engine sends to the Q8_0 pass
    result: dict[str, float] = {}
    for m in (1, 8, 16, 64):
        # Rows shaped like final hidden states: RMS-normalised, then scaled.
        x = F.normalize(torch.randn(m, HIDDEN, generator=gen), dim=1) * HIDDEN ** 0.5 * 3
        full = lambda: backend.argmax_rows(panel.linear(x, None))  # noqa: E731
        result[f"head_full_m{m}_ms"] = best_of(full, repeats) * 1e3
        for name, head in (("greedy", q8), ("int8", int8)):
            if head is None:
                continue
            if head is q8:
                head.max_rows = max(m, q8.max_rows)  # timed past its limit too
            greedy = lambda: head.tokens(x)  # noqa: E731
            taken = m <= limit if head is q8 else True
            unused = "" if taken else "_unused"
            result[f"head_{name}_m{m}_ms{unused}"] = best_of(greedy, repeats) * 1e3
            result[f"head_{name}_equal_m{m}"] = int(torch.equal(full(), greedy()))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rows", default="1,16,64,161,512,2048")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--cpu-isa", choices=("avx2", "avx512", "amx"),
                    default=detect_cpu_features().best_isa())
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    backend = kernel_backend(args.cpu_isa, envs.cache_dir())
    result: dict = {"backend": backend.name, "amx_available": int(backend.amx_linear),
                    "panel_max_rows": backend.panel_max_rows}
    for name in args.dtypes.split(","):
        result.update(bench_linears(backend, getattr(torch, name),
                                    [int(r) for r in args.rows.split(",")], args.repeats))
    if backend.greedy_head_route:
        result.update(bench_head(backend, args.repeats))
    emit(result, args.json)


if __name__ == "__main__":
    main()

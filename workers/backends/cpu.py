"""The CPU backend: which compiled kernels a model runs with, chosen once per engine.

A backend is an immutable object built when the worker loads its model and passed to the
layers, the attention and the sampler; nothing switches under a running engine, so a request's
tokens never depend on when a background build finished. Its name is the ISA variant whose
kernels it runs (`avx2`, `avx512`, `amx`), or `torch`: plain torch ops, correct on every CPU
(and the only backend on CUDA).

What each variant uses (`plan_for`) follows bench/ on CPUs of that level; a path is on only
where it is correct there and measured faster than the torch path.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from tierserve.workers.backends.cpu_features import ISAS, CpuFeatures, detect_cpu_features, isa_rank
from tierserve.workers.backends.kernels import kernel_library

__all__ = ["BACKEND_NAMES", "CpuBackend", "torch_backend", "kernel_backend", "plan_for"]

BACKEND_NAMES = ("torch",) + ISAS

# Largest row count the fp32 panel kernel takes by default; larger (prefill-sized) inputs go to
# AMX where the backend has it, else to MKL. Beyond it AMX or MKL's blocking for large M wins on
# AVX-512 CPUs; on AVX2 the panel kernel keeps up with MKL further (bench/linear_kernels.py).
PANEL_MAX_ROWS = 160
AVX2_PANEL_MAX_ROWS = 1024
# Largest row count the quantized-weight kernel takes: up to it a product is bound by the
# bytes of weight it streams, past it by its FMAs, where the fp32 panels' register blocking wins.
# Both kernels give the same bits, so the limit moves speed only; bench/linear_kernels.py's
# q4_1 and panel routes show where they cross.
QUANT_MAX_ROWS = 8


@dataclass(frozen=True, eq=False)
class CpuBackend:
    name: str  # one of BACKEND_NAMES
    features: CpuFeatures
    ops: Any = None  # torch.ops.tierserve_<isa>; None for the torch backend
    attention: bool = False  # paged attention read in place (decodes, short prefill chunks)
    fused: bool = False  # rms_norm(+residual), silu_and_mul, rotary + KV write, argmax_rows
    fp32_linear: bool = False  # panel kernel up to panel_max_rows rows
    panel_max_rows: int = PANEL_MAX_ROWS
    amx_linear: bool = False  # fp32 linears above panel_max_rows rows on AMX (bf16x3)
    greedy_head: bool = False  # exact greedy tokens from a bf16 copy of the fp32 LM head
    # fp32 weights that are GGUF blocks dequantized run from their codes (backends/quant.py)
    # in products of up to quant_max_rows rows.
    quant_linear: bool = False
    quant_max_rows: int = QUANT_MAX_ROWS
    # How bf16 / fp16 linears run: "onednn" (weights packed once in oneDNN's layout, where
    # oneDNN runs that dtype natively), "kernel" (the panel kernel, fp32 math on half-precision
    # panels) or "torch" (F.linear on the plain weight; a dtype not in the map).
    half_linear: dict = field(default_factory=dict)
    panel_width: int = 0
    head_dims: frozenset = frozenset()

    @property
    def has_kernels(self) -> bool:
        return self.ops is not None

    def half_linear_for(self, dtype: torch.dtype) -> str:
        return self.half_linear.get(dtype, "torch")

    def fuses(self, x: torch.Tensor) -> bool:
        """Whether the fused elementwise ops take x."""
        return self.fused and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)

    def attends(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether attention takes the kernels: paged decode and the tiled causal prefill,
        which are built for the same dtypes and head sizes."""
        return self.attention and dtype in (torch.float32, torch.bfloat16) \
            and head_dim in self.head_dims

    def describe(self) -> dict:
        """What stats(), `tierserve status` and the start-up log show."""
        paths = [p for p in ("attention", "fused", "fp32_linear", "amx_linear", "greedy_head",
                             "quant_linear")
                 if getattr(self, p)]
        half = {str(dt).removeprefix("torch."): how for dt, how in self.half_linear.items()}
        return {"name": self.name, "paths": paths, "half_linear": half,
                "cpu": self.features.model_name, "cpu_isas": list(self.features.isas),
                "torch_capability": self.features.torch_capability}

    # ---------------------------------------------------------------- kernel ops

    def paged_attention(self, q, k_cache, v_cache, block_tables, seq_lens, scale: float,
                        window: int | None = None, rows=None):
        """q [n, heads, D] over pools [num_blocks, block_size, kv_heads, D], block_tables int32
        [num_rows, max_blocks], seq_lens int32 [n] -> [n, heads, D] in q's dtype. Query i reads
        its context through table row rows[i] (int32 [n]), or row i without rows (then
        num_rows == n); it sees the last `window` tokens of its context where window is set."""
        return self.ops.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                               window or 0, rows)

    def prefill_attention(self, q, k, v, scale: float, window: int | None = None):
        """Causal attention of a chunk's queries q [L, heads, D] over its keys and values
        [S, kv_heads, D], S >= L, query i at position S - L + i -> [L, heads, D]; fp32 or
        bf16 (fp32 math)."""
        return self.ops.prefill_attention(q, k, v, scale, window or 0)

    def linear_f32(self, x, panels, bias, out_features: int):
        """x [M, K] float32 times a weight in panels [ceil(N / W), K, W] -> [M, N] (+ bias)."""
        return self.ops.linear_f32(x, panels, bias, out_features)

    def linear_half(self, x, panels, bias, out_features: int):
        """x [M, K] bf16/fp16 times a weight in panels of x's dtype -> [M, N] in that dtype:
        fp32 products and sums, rounded once."""
        return self.ops.linear_half(x, panels, bias, out_features)

    def linear_amx(self, x, panels, bias, out_features: int):
        """linear_f32's product on AMX, to fp32 accuracy (csrc/linear_amx.cpp)."""
        return self.ops.linear_amx(x, panels, bias, out_features)

    def greedy_from_approx(self, approx, x, panels, norms, out_features: int, rel: float,
                           out_rel: float):
        """The first index of each row's maximum of linear_f32(x, panels), from approx [M, N]
        bf16 within rel * |x| * norms + out_rel * |approx| of it -> long[M]; -1 for rows with
        non-finite values (see csrc/linear.cpp)."""
        return self.ops.greedy_from_approx(approx, x, panels, norms, out_features, rel, out_rel)

    def rms_norm(self, x, residual, weight, eps: float):
        """(norm(x + residual) * weight, x + residual); without residual (norm(x) * weight, x)."""
        return self.ops.rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x):
        """[M, 2d] -> silu(x[:, :d]) * x[:, d:]."""
        return self.ops.silu_and_mul(x)

    def argmax_rows(self, x):
        """[M, n] float32/bfloat16 with contiguous rows -> long[M], the first index of each
        row's maximum, NaN counting as the maximum (what x.max(dim=-1).indices gives)."""
        return self.ops.argmax_rows(x)

    def rotary_write_kv(self, qkv, cos, sin, k_cache, v_cache, slot_mapping, heads: int):
        """Rotate q and k of qkv [T, (heads + 2 kv_heads) D] by cos/sin [T, D/2]; write k and v
        to their pool slots; returns q [T, heads, D] and k [T, kv_heads, D]."""
        return self.ops.rotary_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, heads)


def _half_linear(features: CpuFeatures, isa: str = "torch") -> dict:
    """How bf16 / fp16 linears run. oneDNN's packed weights where oneDNN runs the dtype
    natively (elsewhere its reorder refuses the weight); else a kernel backend's panel kernel,
    which widens the weights to fp32 in registers (torch's own half-precision linear on such a
    CPU is several times slower than its fp32 one: bench/linear_kernels.py). A kernel backend
    capped below AVX-512 plans as a CPU of its level would, so that the cap reproduces that
    machine's paths."""
    half = {}
    native_ok = isa == "torch" or isa_rank(isa) >= isa_rank("avx512")
    for dtype, native in ((torch.bfloat16, features.onednn_bf16),
                          (torch.float16, features.onednn_fp16)):
        if native and native_ok:
            half[dtype] = "onednn"
        elif isa != "torch":
            half[dtype] = "kernel"
    return half


@functools.cache
def torch_backend() -> CpuBackend:
    """Plain torch ops on this process's CPU (oneDNN-packed half-precision weights where oneDNN
    takes them); what every device other than a CPU with kernels runs."""
    features = detect_cpu_features()
    return CpuBackend("torch", features, half_linear=_half_linear(features))


def plan_for(isa: str, features: CpuFeatures, ops: Any, *, quant_linear: bool = True) -> CpuBackend:
    """The backend of a loaded ISA variant on this CPU. Every level runs the paged attention,
    the fused ops and the fp32 panel kernel; AMX adds its prefill linear; the greedy head
    needs oneDNN's native bf16 for its approximate logits."""
    if not features.has(isa):
        raise RuntimeError(f"the {isa} backend needs a CPU with {isa}; this one has "
                           f"{', '.join(features.isas) or 'none of ' + ', '.join(ISAS)}")
    return CpuBackend(
        isa, features, ops, attention=True, fused=True, fp32_linear=True,
        panel_max_rows=AVX2_PANEL_MAX_ROWS if isa == "avx2" else PANEL_MAX_ROWS,
        amx_linear=isa == "amx" and bool(ops.has_amx()),
        greedy_head=features.onednn_bf16 and isa_rank(isa) >= isa_rank("avx512"),
        quant_linear=quant_linear,
        half_linear=_half_linear(features, isa), panel_width=int(ops.panel_width()),
        head_dims=frozenset(ops.decode_head_dims()))


def kernel_backend(isa: str, cache_root: str, *, features: CpuFeatures | None = None) -> CpuBackend:
    """The `isa` backend, its kernels built (or loaded from cache_root) first, synchronously.
    For tests and benches that pin a backend; engines go through the worker's start-up."""
    if isa == "torch":
        return torch_backend()
    features = features or detect_cpu_features()
    if not features.has(isa):
        raise ValueError(f"this CPU ({features.model_name}) cannot run the {isa} backend; it "
                         f"runs: {', '.join(('torch',) + features.isas)}")
    library = kernel_library(isa)
    library.start_build(cache_root, sync=True)
    if not library.available:
        raise RuntimeError(f"the {isa} kernels did not load: {library.error}")
    return plan_for(isa, features, library.ops)

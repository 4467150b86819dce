"""The torch backend: plain torch ops, correct on every CPU (and the base of the others).

On CPU, bf16 / fp16 weights are kept in oneDNN's packed layout where oneDNN runs the dtype
natively; everything else is the Hugging Face formulation op for op, so that this backend is
the reference the kernel backends are tested against.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tierserve.workers import attention as paged
from tierserve.workers.backends.base import QUANTIZATIONS, Backend
from tierserve.workers.backends.cpu_features import CpuFeatures, detect_cpu_features, isa_rank
from tierserve.workers.backends.linear import PackedWeight, PlainLinear
from tierserve.workers.backends.quant import DequantLinear

__all__ = ["TorchBackend", "torch_backend", "half_linear_plan", "rotate_half"]


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] by cos / sin [T, 1, D/2]; equals x*cat(cos,cos) +
    rotate_half(x)*cat(sin,sin), HF's formulation."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def half_linear_plan(features: CpuFeatures, isa: str = "torch") -> dict:
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


@dataclass(frozen=True, eq=False)
class TorchBackend(Backend):
    name: str
    features: CpuFeatures
    # How bf16 / fp16 linears run: "onednn" (weights packed once in oneDNN's layout, where
    # oneDNN runs that dtype natively), "kernel" (the panel kernel, fp32 math on half-precision
    # panels) or "torch" (F.linear on the plain weight; a dtype not in the map).
    half_linear: dict = field(default_factory=dict)
    device_type: str = "cpu"

    def half_linear_for(self, dtype: torch.dtype) -> str:
        return self.half_linear.get(dtype, "torch")

    @property
    def paths(self) -> list[str]:
        """The fast paths this backend runs (describe())."""
        return []

    # ------------------------------------------------------------ linears

    def linear_method(self, weight: torch.Tensor, quantization: str | None = None,
                      head: bool = False):
        if quantization is not None:
            if quantization not in QUANTIZATIONS:
                raise ValueError(f"unknown quantization {quantization!r}; "
                                 f"known: {', '.join(QUANTIZATIONS)}")
            return DequantLinear.quantize(weight, quantization)
        if weight.device.type == "cpu" and self.half_linear_for(weight.dtype) == "onednn" \
                and PackedWeight.applies_to(weight):
            return PackedWeight(weight)
        return PlainLinear(weight)

    # ------------------------------------------------------------ attention

    def rotary_write_kv(self, qkv, cos, sin, kv_cache, slot_mapping, heads, kv_heads, head_dim):
        num_tokens = qkv.shape[0]
        qk_heads = heads + kv_heads
        v = qkv[:, qk_heads * head_dim :].view(num_tokens, kv_heads, head_dim)
        # q and k share one rotation call: [T, heads + kv_heads, D]
        qk = rotate_half(qkv[:, : qk_heads * head_dim].view(num_tokens, qk_heads, head_dim),
                         cos.unsqueeze(1), sin.unsqueeze(1))
        q, k = qk[:, :heads], qk[:, heads:]
        paged.write_kv(*kv_cache, k, v, slot_mapping)
        return q, k, v

    def attention(self, q, k, v, kv_cache, attn, scale, window=None):
        return paged.torch_attention(q, k, v, kv_cache, attn, scale, window)

    # ------------------------------------------------------------ elementwise

    def rms_norm(self, x, residual, weight, eps):
        if residual is not None:
            x = x + residual
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype), x

    def silu_and_mul(self, x):
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]

    def argmax_rows(self, logits):
        # max(dim) gives argmax's indices (the first on ties), faster on CPU at decode sizes.
        return logits.max(dim=-1).indices

    def describe(self) -> dict:
        half = {str(dt).removeprefix("torch."): how for dt, how in self.half_linear.items()}
        return {"name": self.name, "device": self.device_type, "paths": self.paths,
                "half_linear": half, "cpu": self.features.model_name,
                "cpu_isas": list(self.features.isas),
                "torch_capability": self.features.torch_capability}


@functools.cache
def torch_backend() -> TorchBackend:
    """Plain torch ops on this process's CPU (oneDNN-packed half-precision weights where oneDNN
    takes them)."""
    features = detect_cpu_features()
    return TorchBackend("torch", features, half_linear=half_linear_plan(features))

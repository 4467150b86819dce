"""A model's decoder layers as one kernel call per step (csrc/layer_stack.cpp).

The model's per-layer path calls about ten ops per layer from Python; at decode sizes each op's
dispatch costs about as much as its work. The kernel backends run the same kernels, in the
same order, from one C++ loop, when every piece of the step takes a kernel: every linear has a
kernel method for the step's row count, attention reads the pool in place (no prefill chunk
longer than KERNEL_PREFILL_MAX_CONTEXT), and the elementwise ops are fused for the dtype. Any
other step returns None and the model takes its per-layer path. Results are bitwise the
per-layer path's (tests/test_kernels.py compares them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from tierserve.workers.backends.coded import CodedPairPanels, CodedPanelWeight
from tierserve.workers.backends.int8_linear import Int8PanelWeight
from tierserve.workers.backends.linear import PackedWeight, PanelWeight
from tierserve.workers.backends.quant import QuantPanelWeight

__all__ = ["StackLayer", "KernelLayerStack"]

# csrc/layer_stack.cpp's LinearKind.
_PANEL_F32, _PANEL_HALF, _Q8_0, _Q4_1, _CODED_F32, _CODED_PAIRS, _INT8 = range(7)


class StackLayer(NamedTuple):
    """One decoder layer in plain values: its norms' weights, its four linears in order
    (qkv, o, gate_up, down) as (method, bias), its sliding window (None: full), and its
    per-head query and key norms' weights (Qwen3; None: none)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    linears: tuple[tuple[Any, torch.Tensor | None], ...]
    window: int | None
    qk_norms: tuple[torch.Tensor, torch.Tensor] | None = None


class _Plan(NamedTuple):
    weights: list[torch.Tensor | None]
    biases: list[torch.Tensor | None]
    kinds: list[int]
    widths: list[int]


def _kernel_of(method, dtype: torch.dtype, rows: int, max_rows: int):
    """(kind, tensors) of the kernel `method.linear` runs for `rows` rows of `dtype`, or None
    where it runs something else (oneDNN, MKL, AMX or a dtype conversion)."""
    if isinstance(method, PackedWeight):
        if not method.panel_takes(rows):
            return None
        method = method.panel
    if isinstance(method, CodedPairPanels):
        return (_CODED_PAIRS, method.kernel_tensors()) if dtype == torch.bfloat16 else None
    if isinstance(method, PanelWeight):
        if dtype != torch.float32:
            return (_PANEL_HALF, (method.panels,)) if method.panels.dtype == dtype else None
        return (_PANEL_F32, (method.panels,)) if rows <= max_rows else None
    if isinstance(method, CodedPanelWeight) and dtype == torch.float32 and rows <= max_rows:
        return _CODED_F32, method.kernel_tensors()
    # Codes' kernels take fp32 rows: half-precision rows go through fp32 and back
    # (linear.run_fp32), in the stack as in the layer-by-layer path.
    if isinstance(method, Int8PanelWeight):
        return _INT8, method.kernel_tensors()
    if isinstance(method, QuantPanelWeight) and rows <= max_rows:
        if method.format == "q4_1":
            return _Q4_1, (method.codes, method.scales, method.offsets)
        return _Q8_0, (method.codes, method.scales)
    return None


@dataclass(eq=False)
class KernelLayerStack:
    """A CPU kernel backend's route for a model's layers (module docstring)."""

    ops: Any
    layers: list[StackLayer]
    heads: int
    scale: float
    eps: float
    dtype: torch.dtype
    max_rows: int
    max_prefill_context: int

    def __post_init__(self) -> None:
        self._norms = [t for layer in self.layers for t in (layer.input_norm, layer.post_norm)]
        self._qk_norms = [t for layer in self.layers for t in (layer.qk_norms or ())]
        assert len(self._qk_norms) in (0, 2 * len(self.layers)), "qk norms in some layers"
        self._windows = [layer.window or 0 for layer in self.layers]
        # Row count -> plan: one row and several rows may run different kernels (oneDNN
        # weights take the panel kernel for a single row only).
        self._plans = {1: self._plan(1), 2: self._plan(2)}

    @property
    def takes_any(self) -> bool:
        """Whether some row count runs through the stack."""
        return any(plan is not None for plan in self._plans.values())

    def _plan(self, rows: int) -> _Plan | None:
        plan = _Plan([], [], [], [])
        for layer in self.layers:
            for method, bias in layer.linears:
                kernel = _kernel_of(method, self.dtype, rows, self.max_rows)
                if kernel is None:
                    return None
                kind, tensors = kernel
                plan.weights.extend(list(tensors) + [None] * (3 - len(tensors)))
                plan.biases.append(bias)
                plan.kinds.append(kind)
                plan.widths.append(method.out_features)
        return plan

    def run(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            kv_caches: list, attn, keep: torch.Tensor | None = None,
            lora: tuple[list, torch.Tensor | None, torch.Tensor | None] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(last layer's MLP output, residual stream) for the step, of the rows in keep
        (int64) where given, or None where a piece of it takes no kernel (the caller then runs
        its layers one by one). lora: the step's LoRA adapters (model/lora.py LoRAStep.stack):
        five tensors per linear in the layers' order, flat, and each row's adapter, of the
        step's tokens and of the kept rows (None with one adapter on every row)."""
        rows = hidden.shape[0]
        plan = self._plans[min(rows, 2)]
        if plan is None or rows > self.max_rows or hidden.dtype != self.dtype \
                or attn.prefills_longer_than(self.max_prefill_context):
            return None
        tables, lens, token_rows = attn.token_tables()
        pools = [t for pair in kv_caches for t in pair]  # [k0, v0, k1, v1, ...]
        return self.ops.layer_stack(
            hidden, cos, sin, attn.slot_mapping, tables, lens, token_rows, keep, self._norms,
            self._qk_norms, plan.weights, plan.biases, plan.kinds, plan.widths,
            *(lora or ([], None, None)), pools, self._windows, self.heads, self.scale, self.eps)

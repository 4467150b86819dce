"""fp32 weights in 28 bits, exactly: the panel layout with each weight's top byte coded.

An fp32 weight's top byte is its sign and the exponent's 7 high bits. A trained weight spans a
few binades, so 16 top bytes hold nearly all its values: the kernels (csrc/linear_coded.cpp)
keep each value's low 24 bits and a 4-bit index into those 16, and the rare values outside
them (escapes, mostly near zero) in a short exact list. Products are bitwise the fp32 panels',
from 7/8 of the bytes, which a single-row decode step streams at the memory's rate: a dense
fp32 checkpoint's decode gains what its weights shrink by. The same principle as GGUF codes and
half-precision panels (an exact narrower form), under the same switch (`quantized_linears`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tierserve.workers.backends.linear import LinearMethod, plain_weight

__all__ = ["CodedPanelWeight", "CodedPairPanels", "MAX_ESCAPE_FRACTION"]

# Escapes per weight value above which a weight keeps plain fp32 panels: each costs 8 bytes and
# breaks a single row's run of in-register decodes (trained weights have far fewer).
MAX_ESCAPE_FRACTION = 1 / 512


class _Coded(LinearMethod):
    """What coded panels hold: body (uint8, the coded values in panel order), table (int32: the
    16 top bytes, then each panel's first escape), escapes (int32 [E, 2]: position in the panel,
    the value's bits)."""

    __slots__ = ("body", "table", "escapes", "out_features", "in_features", "backend")

    def __init__(self, body: torch.Tensor, table: torch.Tensor, escapes: torch.Tensor,
                 out_features: int, in_features: int, backend) -> None:
        self.body, self.table, self.escapes = body, table, escapes
        self.out_features, self.in_features = out_features, in_features
        self.backend = backend

    def kernel_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the layer stack's coded kinds read (csrc/layer_stack.cpp)."""
        return self.body, self.table, self.escapes

    def place(self, arena) -> "_Coded":
        self.body = arena.adopt(self.body)
        return self

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.body, self.table, self.escapes)


class CodedPanelWeight(_Coded):
    """An fp32 [N, K] weight as coded panels, 28 bits a value (csrc/linear_coded.cpp has the
    layout)."""

    __slots__ = ()

    @classmethod
    def encode(cls, weight: torch.Tensor, backend) -> "CodedPanelWeight | None":
        """The coded panels of an fp32 weight, or None where the backend runs no exact narrower
        forms (quantized_linears off), does not take coded panels (coded_linear), or more than
        MAX_ESCAPE_FRACTION of the weight's values escape."""
        if not (backend.quant_linear and backend.coded_linear and weight.dtype == torch.float32
                and weight.device.type == "cpu" and weight.dim() == 2 and weight.numel() > 0):
            return None
        body, table, escapes = backend.ops.coded_encode(weight.detach())
        if escapes.shape[0] > MAX_ESCAPE_FRACTION * weight.numel():
            return None
        return cls(body, table, escapes, weight.shape[0], weight.shape[1], backend)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise RuntimeError(f"coded fp32 panels take float32 inputs, not {x.dtype}")
        if x.shape[0] <= self.backend.panel_max_rows:
            return self.backend.ops.linear_coded(x, self.body, self.table, self.escapes, bias,
                                                 self.out_features)
        # Prefill-sized products: PanelWeight's routes over the weight rebuilt (a copy that is
        # small next to such a product), so the results are its results.
        if self.backend.amx_linear:
            return self.backend.linear_amx(x, self.panels(), bias, self.out_features)
        return F.linear(x, self.weight(), bias)

    def panels(self) -> torch.Tensor:
        """The fp32 panels [ceil(N / W), K, W] (PanelWeight's layout) the codes hold."""
        return self.backend.ops.coded_panels(self.body, self.table, self.escapes,
                                             self.out_features, self.in_features)

    def weight(self) -> torch.Tensor:
        return self.backend.ops.coded_weight(self.body, self.table, self.escapes,
                                             self.out_features, self.in_features)


class CodedPairPanels(_Coded):
    """A bf16 weight's pair panels (PanelWeight's layout where the CPU has AVX512_BF16) with each
    value's top byte coded the same way: 12 bits a value, the rare others kept apart
    (csrc/linear_coded_pairs.cpp). bf16 inputs and outputs; the products are bitwise the pair
    panels'. PackedWeight keeps them for its few-row products, beside oneDNN's copy."""

    __slots__ = ()
    pairs = True  # takes PackedWeight's pair-panel rows

    @classmethod
    def encode(cls, panel, backend) -> "CodedPairPanels | None":
        """The coded form of a PanelWeight's bf16 pair panels, or None where the backend runs no
        exact narrower forms or more than MAX_ESCAPE_FRACTION of the values escape."""
        if not (backend.quant_linear and panel.pairs and panel.panels.dtype == torch.bfloat16):
            return None
        n = panel.out_features
        body, table, escapes = backend.ops.coded_pairs_encode(panel.panels, n)
        if escapes.shape[0] > MAX_ESCAPE_FRACTION * n * panel.panels.shape[1] * 2:
            return None
        return cls(body, table, escapes, n, panel.panels.shape[1] * 2, backend)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.backend.ops.linear_coded_pairs(x, self.body, self.table, self.escapes, bias,
                                                   self.out_features)

    def panels(self) -> torch.Tensor:
        """The bf16 pair panels [ceil(N / W), K / 2, 2 W] the codes hold."""
        return self.backend.ops.coded_pairs_panels(self.body, self.table, self.escapes,
                                                   self.out_features, self.in_features)

    def weight(self) -> torch.Tensor:
        return plain_weight(self.panels(), self.out_features, pairs=True)

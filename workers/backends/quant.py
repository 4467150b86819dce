"""fp32 weights that are GGUF blocks dequantized, run from their blocks (csrc/quant.cpp).

A GGUF checkpoint's linears arrive dequantized to fp32 (Q4_1: w = q * d + m per block of 32
inputs; Q8_0: w = q * d). A decode-sized product streams every weight once per step, so it
runs at the speed of memory: reading the 4-bit or 8-bit codes instead of fp32 weights streams
several times fewer bytes. The encoder accepts a weight only where codes and scales rebuild
each fp32 value exactly, and the kernel rebuilds them in registers before the fp32 panel
kernel's own FMA chain, so the product equals `PanelWeight`'s bit for bit: small batches take
the codes, large ones (compute-bound) the fp32 panels, and a request's tokens never depend on
its batch. Weights from any other source (an HF checkpoint) fail the exact check and keep the
panels alone.
"""
from __future__ import annotations

import torch

from tierserve.workers.backends.cpu import CpuBackend

__all__ = ["QuantPanelWeight", "QUANT_FORMATS"]

# Encodings tried, most compact first.
QUANT_FORMATS = ("q4_1", "q8_0")


class QuantPanelWeight:
    """A `PanelWeight` with the GGUF codes of the same fp32 weight beside it.

    Products of up to `backend.quant_max_rows` rows read the codes; larger ones the panels."""

    __slots__ = ("panel", "format", "codes", "scales", "offsets", "backend")

    def __init__(self, panel, fmt: str, codes: torch.Tensor, scales: torch.Tensor,
                 offsets: torch.Tensor | None, backend: CpuBackend) -> None:
        self.panel = panel
        self.format = fmt
        self.codes = codes  # Q4_1 [panels, blocks, 32, W/2] uint8; Q8_0 [panels, blocks, 32, W] int8
        self.scales = scales  # [panels, blocks, W] fp32
        self.offsets = offsets  # Q4_1 [panels, blocks, W] fp32; None for Q8_0
        self.backend = backend

    @classmethod
    def encode(cls, panel, weight: torch.Tensor, backend: CpuBackend) -> "QuantPanelWeight | None":
        """The weight's exact encoding beside `panel` (its fp32 panels), or None where no
        format rebuilds every value exactly (or the backend has no quantized kernel)."""
        if not (backend.quant_linear and weight.dtype == torch.float32
                and weight.device.type == "cpu" and weight.dim() == 2
                and weight.shape[1] % 32 == 0):
            return None
        w = weight.detach()
        codes, scales, offsets = backend.ops.quant_encode_q4_1(w)
        if codes.numel():
            return cls(panel, "q4_1", codes, scales, offsets, backend)
        codes, scales = backend.ops.quant_encode_q8_0(w)
        if codes.numel():
            return cls(panel, "q8_0", codes, scales, None, backend)
        return None

    @property
    def out_features(self) -> int:
        return self.panel.out_features

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dtype != torch.float32 or x.shape[0] > self.backend.quant_max_rows \
                or x.stride(-1) != 1:
            return self.panel.linear(x, bias)
        ops, n = self.backend.ops, self.panel.out_features
        if self.format == "q4_1":
            return ops.linear_q4_1(x, self.codes, self.scales, self.offsets, bias, n)
        return ops.linear_q8_0(x, self.codes, self.scales, bias, n)

    def weight(self) -> torch.Tensor:
        return self.panel.weight()

    @property
    def panels(self) -> torch.Tensor:
        return self.panel.panels

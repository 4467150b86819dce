"""Linears that run from GGUF block codes (Q8_0, Q4_1): only the codes are kept.

Codes come from two sources, both ending in the same layout and kernels (csrc/quant.cpp):
  * a GGUF checkpoint's weights, which arrive dequantized to fp32: `QuantPanelWeight.encode`
    finds codes and scales that rebuild every fp32 value exactly (or declines the weight);
  * any fp32 / bf16 checkpoint quantized at load (the `quantization` option):
    `QuantPanelWeight.quantize` runs the GGUF reference quantizer's arithmetic (gguf-py's
    quantize_blocks, itself bit-exact with ggml's; `reference_quantize` here in torch,
    csrc/quant_encode.cpp in the kernels), so the codes equal a GGUF file's.
Q4_1: w = q * d + m per block of 32 inputs (q 0..15, d and m fp16); Q8_0: w = q * d (q
-127..127, d fp16). q * d is exact in fp32 (11 + 8 significant bits), so a rebuilt weight is
the fp32 value the loader's dequantization gives, bit for bit.

The kernel rebuilds the weights in registers (or, for batches past a few rows, a slice at a
time into L1) before the fp32 panel kernel's own FMA chain, so a product equals linear_f32's
on the dequantized weight bit for bit whatever the batch size, and a request's tokens never
depend on its batch. Prefill-sized batches (past the panel kernel's rows) dequantize the whole
weight for that call and take AMX or MKL, as fp32 panels do.

`DequantLinear` is the torch backend's form: the same codes, dequantized for each product.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tierserve.workers.backends.linear import LinearMethod, run_fp32

__all__ = ["QuantPanelWeight", "DequantLinear", "QUANT_FORMATS", "reference_quantize",
           "head_format"]

# Encodings tried on a GGUF checkpoint's weights, most compact first.
QUANT_FORMATS = ("q4_1", "q8_0")
BLOCK = 32


def head_format(quantization: str) -> str:
    """The format of the LM head (and a tied embedding) under a quantization: q8_0 throughout
    for q8_0; the mostly-Q4_1 layout of llama.cpp's files (SmolLM2's among them) for q4_1,
    whose head stays Q8_0: its errors reach every logit directly."""
    return "q8_0" if quantization in ("q8_0", "q4_1") else quantization


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """Round half away from zero, as ggml's roundf (gguf-py's np_roundf, step for step)."""
    a = x.abs()
    floored = a.floor()
    return torch.sign(x) * (floored + (2 * (a - floored)).floor())


def reference_quantize(weight: torch.Tensor, fmt: str
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """[N, K] -> (codes [N, K/32, 32] (int8 for q8_0, uint8 0..15 for q4_1), d [N, K/32] and
    m [N, K/32] (q4_1; None for q8_0) as fp32 values of their fp16 storage): gguf-py's
    quantize_blocks in fp32, operation for operation."""
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"{fmt} needs K a multiple of {BLOCK}, got {k}")
    blocks = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    if not bool(torch.isfinite(blocks).all()):
        raise ValueError(f"cannot quantize a weight holding non-finite values to {fmt}")
    if fmt == "q8_0":
        d = blocks.abs().amax(dim=-1, keepdim=True) / 127
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        codes = _roundf(blocks * inv).to(torch.int8)
        return codes, d.squeeze(-1).half().float(), None
    if fmt == "q4_1":
        hi = blocks.amax(dim=-1, keepdim=True)
        lo = blocks.amin(dim=-1, keepdim=True)
        d = (hi - lo) / 15
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        codes = torch.trunc((blocks - lo) * inv + 0.5).clamp_(0, 15).to(torch.uint8)
        return codes, d.squeeze(-1).half().float(), lo.squeeze(-1).half().float()
    raise ValueError(f"unknown block format {fmt!r}")


def dequantize(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """Reference-layout codes [N, B, 32] -> fp32 [N, B * 32]: q * d (+ m), a product then a
    sum as gguf-py rounds it."""
    w = codes.float() * d.unsqueeze(-1)
    if m is not None:
        w = w + m.unsqueeze(-1)
    return w.reshape(codes.shape[0], -1)


_SAMPLE_ROWS = 64


class QuantPanelWeight(LinearMethod):
    """A weight as GGUF codes in the kernels' panel layout; no fp32 copy is kept."""

    __slots__ = ("format", "codes", "scales", "offsets", "out_features", "in_features",
                 "backend")

    def __init__(self, fmt: str, codes: torch.Tensor, scales: torch.Tensor,
                 offsets: torch.Tensor | None, out_features: int, in_features: int,
                 backend) -> None:
        self.format = fmt
        self.codes = codes  # Q4_1 [panels, blocks, 32, W/2] uint8; Q8_0 [panels, blocks, 32, W] int8
        self.scales = scales  # [panels, blocks, W] fp32
        self.offsets = offsets  # Q4_1 [panels, blocks, W] fp32; None for Q8_0
        self.out_features = out_features
        self.in_features = in_features
        self.backend = backend

    @staticmethod
    def applies_to(weight: torch.Tensor) -> bool:
        return weight.device.type == "cpu" and weight.dim() == 2 and weight.shape[1] % BLOCK == 0

    @classmethod
    def encode(cls, weight: torch.Tensor, backend) -> "QuantPanelWeight | None":
        """A GGUF checkpoint's dequantized fp32 weight as its exact codes, or None where no
        format rebuilds every value exactly (or the backend has no quantized kernel)."""
        if not (backend.quant_linear and weight.dtype == torch.float32
                and cls.applies_to(weight)):
            return None
        w = weight.detach()
        # A few rows first: a weight of neither format (any dense checkpoint) fails there,
        # before a whole-weight encode allocates its codes.
        sample = w[:_SAMPLE_ROWS]
        if backend.ops.quant_encode_q4_1(sample)[0].numel():
            codes, scales, offsets = backend.ops.quant_encode_q4_1(w)
            if codes.numel():
                return cls("q4_1", codes, scales, offsets, w.shape[0], w.shape[1], backend)
        if backend.ops.quant_encode_q8_0(sample)[0].numel():
            codes, scales = backend.ops.quant_encode_q8_0(w)
            if codes.numel():
                return cls("q8_0", codes, scales, None, w.shape[0], w.shape[1], backend)
        return None

    @classmethod
    def quantize(cls, weight: torch.Tensor, fmt: str, backend) -> "QuantPanelWeight":
        """Any [N, K] weight (K a multiple of 32) quantized to `fmt` as the GGUF reference
        quantizer does it (the kernels' own quantizer: reference_quantize's arithmetic, in the
        panel layout)."""
        if fmt not in QUANT_FORMATS:
            raise ValueError(f"unknown block format {fmt!r}")
        if weight.shape[-1] % BLOCK:
            raise ValueError(f"{fmt} needs K a multiple of {BLOCK}, got {weight.shape[-1]}")
        w = weight.detach().float().contiguous()
        if fmt == "q4_1":
            codes, scales, offsets = backend.ops.quant_quantize_q4_1(w)
        else:
            (codes, scales), offsets = backend.ops.quant_quantize_q8_0(w), None
        if codes.numel() == 0:
            raise ValueError(f"cannot quantize a weight holding non-finite values to {fmt}")
        return cls(fmt, codes, scales, offsets, weight.shape[0], weight.shape[1], backend)

    def place(self, arena) -> "QuantPanelWeight":
        self.codes = arena.adopt(self.codes)
        self.scales = arena.adopt(self.scales)
        if self.offsets is not None:
            self.offsets = arena.adopt(self.offsets)
        return self

    def reference_codes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The codes back in reference layout: codes [N, B, 32], d [N, B], m [N, B] or None."""
        panels, blocks, _, cols = self.codes.shape
        if self.format == "q4_1":
            c = torch.cat([self.codes & 0xF, self.codes >> 4], dim=-1)
        else:
            c = self.codes
        n = self.out_features
        codes = c.permute(0, 3, 1, 2).reshape(-1, blocks, BLOCK)[:n]
        d = self.scales.transpose(1, 2).reshape(-1, blocks)[:n]
        m = None if self.offsets is None else self.offsets.transpose(1, 2).reshape(-1, blocks)[:n]
        return codes, d, m

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return run_fp32(x, bias, self._linear_fp32)

    def _linear_fp32(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        backend, n = self.backend, self.out_features
        if x.shape[0] <= backend.panel_max_rows:
            if self.format == "q4_1":
                return backend.ops.linear_q4_1(x, self.codes, self.scales, self.offsets, bias, n)
            return backend.ops.linear_q8_0(x, self.codes, self.scales, bias, n)
        # A prefill-sized batch: the weight dequantized for this call, then AMX or MKL.
        panels = backend.ops.quant_dequant_panels(self.codes, self.scales, self.offsets,
                                                  self.in_features)
        if backend.amx_linear:
            return backend.linear_amx(x, panels, bias, n)
        k = self.in_features
        return F.linear(x, panels.transpose(1, 2).reshape(-1, k)[:n], bias)

    def weight(self) -> torch.Tensor:
        return dequantize(*self.reference_codes())

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the dequantized weight (an embedding's lookup): [len(ids), K] fp32."""
        width = self.backend.panel_width
        p, c = ids // width, ids % width
        if self.format == "q4_1":
            half = width // 2
            raw = self.codes[p, :, :, c % half]  # [T, B, 32]
            q = torch.where((c < half)[:, None, None], raw & 0xF, raw >> 4)
        else:
            q = self.codes[p, :, :, c]
        d = self.scales[p, :, c]
        m = None if self.offsets is None else self.offsets[p, :, c]
        return dequantize(q, d, m)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.codes, self.scales, self.offsets) if t is not None)


class DequantLinear(LinearMethod):
    """Codes in reference layout, dequantized for every product (F.linear): the torch
    backend's form of a quantized weight, correct on any device."""

    __slots__ = ("format", "codes", "d", "m", "dtype")

    def __init__(self, fmt: str, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
                 dtype: torch.dtype) -> None:
        self.format, self.codes, self.d, self.m, self.dtype = fmt, codes, d, m, dtype

    @classmethod
    def quantize(cls, weight: torch.Tensor, fmt: str) -> "DequantLinear":
        codes, d, m = reference_quantize(weight, fmt)
        return cls(fmt, codes, d, m, weight.dtype)

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    def reference_codes(self):
        return self.codes, self.d, self.m

    def weight(self) -> torch.Tensor:
        return dequantize(self.codes, self.d, self.m).to(self.dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight(), bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        m = None if self.m is None else self.m[ids]
        return dequantize(self.codes[ids], self.d[ids], m).to(self.dtype)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.codes, self.d, self.m) if t is not None)

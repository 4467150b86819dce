"""Q8_0 linears with int8 activations (csrc/linear_int8.cpp): the decoder's Q8_0 weights on the
kernel backends.

Each input row is quantized to 8 bits per block of 32 inputs (llama.cpp's Q8_0 x Q8_0
arithmetic) and multiplied with the weight's codes in integers, so a product streams the codes
once with 32-64 multiply-adds an instruction, where the fp32 chain (quant.py) rebuilds every
weight first. The results are not the dequantized weight's fp32 products: they carry the
rows' quantization (bench/quality.py measures what that does to perplexity), the same bits on
every CPU and at every batch size. LM heads keep QuantPanelWeight: the greedy head's exact
argmax and the tied embedding's rows run from its layout.
"""
from __future__ import annotations

import torch

from tierserve.workers.backends.linear import LinearMethod, run_fp32
from tierserve.workers.backends.quant import BLOCK, dequantize

__all__ = ["Int8PanelWeight", "reference_int8_linear"]

FEATURES = 16  # output features per panel; the layout holds panels in pairs
GROUP = 4  # inputs a feature's codes are grouped by


class Int8PanelWeight(LinearMethod):
    """Q8_0 codes (w + 128) and fp16 scales in linear_int8's panel pairs; nothing else is
    kept."""

    __slots__ = ("pairs", "out_features", "in_features", "backend")

    def __init__(self, pairs: torch.Tensor, out_features: int, in_features: int,
                 backend) -> None:
        self.pairs = pairs  # [N / 32 rounded up, B, 1088] uint8
        self.out_features = out_features
        self.in_features = in_features
        self.backend = backend

    @staticmethod
    def takes(d: torch.Tensor) -> bool:
        """Whether the scales [N, B] are fp16 values, as GGUF's Q8_0 and the reference
        quantizer's are (an encoded weight's exact scales may be other fp32 values)."""
        return bool(torch.equal(d.half().float(), d.float()))

    @classmethod
    def from_codes(cls, codes: torch.Tensor, d: torch.Tensor, backend) -> "Int8PanelWeight":
        """Reference-layout Q8_0 codes [N, B, 32] int8 and fp16-valued scales [N, B] -> panel
        pairs."""
        if not cls.takes(d):
            raise ValueError("Int8PanelWeight keeps Q8_0 scales as fp16: these are not")
        n, blocks, _ = codes.shape
        pairs = -(-n // (2 * FEATURES))
        pad = 2 * FEATURES * pairs - n
        c = torch.cat([codes, codes.new_zeros(pad, blocks, BLOCK)]) if pad else codes
        s = torch.cat([d.float(), d.new_zeros(pad, blocks, dtype=torch.float32)]) if pad else d
        # [pairs, 2 panels, 16 features, B, 8 groups, 4] -> [pairs, B, 8, 2, 16, 4]
        packed = (c.to(torch.int16) + 128).to(torch.uint8)
        packed = packed.view(pairs, 2, FEATURES, blocks, BLOCK // GROUP, GROUP)
        packed = packed.permute(0, 3, 4, 1, 2, 5).reshape(pairs, blocks, -1)
        scales = s.half().view(pairs, 2, FEATURES, blocks).permute(0, 3, 1, 2).contiguous()
        scales = scales.view(torch.uint8).reshape(pairs, blocks, -1)
        return cls(torch.cat([packed, scales], dim=-1).contiguous(), n, blocks * BLOCK, backend)

    def place(self, arena) -> "Int8PanelWeight":
        self.pairs = arena.adopt(self.pairs)
        return self

    def reference_codes(self) -> tuple[torch.Tensor, torch.Tensor, None]:
        """codes [N, B, 32] int8, d [N, B], None (Q8_0 has no offsets)."""
        pairs, blocks, _ = self.pairs.shape
        code_bytes = 2 * FEATURES * BLOCK
        c = self.pairs[..., :code_bytes].reshape(pairs, blocks, BLOCK // GROUP, 2, FEATURES, GROUP)
        c = c.permute(0, 3, 4, 1, 2, 5).reshape(-1, blocks, BLOCK)[: self.out_features]
        codes = (c.to(torch.int16) - 128).to(torch.int8)
        s = self.pairs[..., code_bytes:].contiguous().view(torch.float16)  # [pairs, B, 32]
        d = s.float().reshape(pairs, blocks, 2 * FEATURES).permute(0, 2, 1).reshape(-1, blocks)
        return codes, d[: self.out_features], None

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return run_fp32(x, bias, lambda x, b: self.backend.ops.linear_int8(
            x, self.pairs, b, self.out_features))

    def weight(self) -> torch.Tensor:
        return dequantize(*self.reference_codes())

    def kernel_tensors(self) -> tuple[torch.Tensor]:
        return (self.pairs,)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.pairs,)


def reference_int8_linear(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear_int8's arithmetic in torch, for tests: x [M, K] fp32, reference codes [N, B, 32]
    and d [N, B] -> [M, N]; each block's dot exact, then the fp32 steps in the kernel's order
    (each fused multiply-add emulated in float64 and rounded once, which equals the fp32 FMA
    unless the float64 sum itself rounds: never at these magnitudes' spreads in practice)."""
    m, k = x.shape
    blocks = k // BLOCK
    xb = x.float().reshape(m, blocks, BLOCK)
    amax = xb.abs().amax(-1)
    dx = amax / 127.0
    inv = torch.where((dx != 0) & torch.isfinite(dx), 1.0 / dx, torch.zeros_like(dx))
    q = torch.round(xb * inv.unsqueeze(-1)).clamp(-127, 127)
    q = torch.where(torch.isfinite(q), q, torch.zeros_like(q))
    dx = torch.where(torch.isfinite(dx), dx, torch.full_like(dx, float("nan")))
    dots = torch.einsum("mbi,nbi->mnb", q.double(), codes.double())  # exact integers
    scale = (d.float().unsqueeze(0) * dx.unsqueeze(1))  # [M, N, B] fp32 products
    acc = torch.zeros(m, codes.shape[0], dtype=torch.float32)
    for b in range(blocks):
        acc = (dots[:, :, b] * scale[:, :, b].double() + acc.double()).float()
    return acc if bias is None else acc + bias

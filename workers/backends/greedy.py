"""Exact greedy tokens of an LM head without its full product.

A decode step's LM head streams the whole vocabulary's weights (SmolLM2-135M: 113 MB in fp32,
a fifth of the step); a greedy request needs only the argmax. The head's GGUF Q8_0 codes
(quantized at load, 30 MB) give approximate logits; the exact error of the codes is known per
vocabulary row (|w_j - what_j|, measured at load), so csrc/greedy_head.cpp's greedy_tokens bounds
every approximate logit, computes only the rows that could still be the maximum with the full
product's own arithmetic (the panel kernel's FMA chain, then its rounding to the head's dtype),
and returns the token argmax over the full logits would give, bit for bit. It runs at every ISA
level, for fp32, bf16 and fp16 heads. Greedy rows without penalties or logprobs need no more
(SamplingBatch.plain_greedy).
"""
from __future__ import annotations

import torch

from tierserve.workers.backends.linear import PanelWeight
from tierserve.workers.backends.quant import QuantPanelWeight

__all__ = ["GreedyHead"]


def _row_norms(w: torch.Tensor) -> torch.Tensor:
    """Euclidean norms of the rows of w in float64, a block of rows at a time (no float64
    copy of the whole head), rounded up so that each stays an upper bound after the cast."""
    norms = torch.cat([torch.linalg.vector_norm(w[i : i + 4096].double(), dim=1)
                       for i in range(0, w.shape[0], 4096)])
    return (norms * (1 + 1e-6)).float().contiguous()


# Rows past which an fp32 head's full product beats the route: the Q8_0 pass reads half the
# bytes, which wins while the product is bound by memory, but it rebuilds every weight block in
# fp32 on the way, which costs more than the panel kernel's plain loads once it is bound by
# FMAs (bench/linear_kernels.py's head rows show the crossover). A half-precision head's full
# product widens its weights too, and the route wins at every size.
FP32_MAX_ROWS = 8


class GreedyHead:
    MAX_K = 1 << 16

    __slots__ = ("panel", "approx", "norms", "devs", "backend", "max_rows")

    def __init__(self, panel: PanelWeight, weight: torch.Tensor, backend) -> None:
        self.panel = panel
        self.backend = backend
        self.max_rows = backend.panel_max_rows if weight.dtype != torch.float32 \
            else min(backend.panel_max_rows, FP32_MAX_ROWS)
        w = weight.detach().float()
        self.approx = QuantPanelWeight.quantize(w, "q8_0", backend)
        rebuilt = self.approx.weight()
        self.norms = _row_norms(w)
        self.devs = _row_norms(w - rebuilt)

    @staticmethod
    def gamma(k: int) -> float:
        """The relative error bound of an fp32 chain of k FMAs, with slack for the bound's own
        arithmetic."""
        return k * 2.0 ** -24 / (1 - k * 2.0 ** -24) * 1.001 + 1e-7

    @staticmethod
    def applies_to(weight: torch.Tensor, backend) -> bool:
        return (backend.greedy_head_route and weight.device.type == "cpu"
                and weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
                and weight.shape[1] % 32 == 0 and weight.shape[1] <= GreedyHead.MAX_K
                and bool(torch.isfinite(weight).all()))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (*self.approx.tensors(), self.norms, self.devs)

    def place(self, arena) -> "GreedyHead":
        """The first pass's codes into `arena` (the head's panels are its linear method's)."""
        self.approx.place(arena)
        return self

    def tokens(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [M, K] in the head's dtype -> long[M], or None where the full product must
        decide: more rows than the panel kernel takes (larger inputs go through AMX or MKL,
        which round differently) or than the route gains on (FP32_MAX_ROWS), or non-finite
        values."""
        if x.shape[0] > self.max_rows:
            return None
        x = x.float().contiguous()
        approx = self.approx.linear(x, None)
        ids = self.backend.greedy_tokens(approx, x, self.panel.panels, self.norms, self.devs,
                                         self.panel.out_features, self.gamma(x.shape[1]))
        return None if bool((ids < 0).any()) else ids

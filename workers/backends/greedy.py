"""Exact greedy tokens of an LM head without its full product.

A decode step's LM head streams the whole vocabulary's weights (SmolLM2-135M: 113 MB in fp32,
a fifth of the step); a greedy request needs only the argmax. The head's GGUF Q8_0 codes
(quantized at load, 30 MB) give approximate logits; the exact error of the codes is known per
vocabulary row (|w_j - what_j|, measured at load), so csrc/greedy_head.cpp's greedy_tokens bounds
every approximate logit, computes only the rows that could still be the maximum with the full
product's own arithmetic (the panel kernel's FMA chain, then its rounding to the head's dtype),
and returns the token argmax over the full logits would give, bit for bit. It runs at every ISA
level, for fp32, bf16 and fp16 heads. Greedy rows without penalties or logprobs need no more
(SamplingBatch.plain_greedy). Where the CPU has AVX512_VNNI, at every row count, the
approximate logits come from the same codes against the rows quantized to 8 bits, once for
every column and again for the candidates' panels (csrc/int8_greedy.cpp), and the bound widens
by how far the quantized rows are from x. An fp32 head that runs from Q8_0 codes (a GGUF
file's, as the default model's, or one quantized at load) takes that route too: its codes are the
approximation, with no error of their own, and its exact columns rebuild them as its product
does.
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
# product widens its weights too, and the route wins at every size. Where the CPU has the int8
# pass, it takes every head's rows, one included: it multiplies the codes as they are.
FP32_MAX_ROWS = 8


# Candidates past which a row's exact columns (read across the panels, a cache line per
# weight) cost more than its share of the full product: such a row (a flat distribution, whose
# approximate logits leave many columns within the bound of the best) takes the full product.
MAX_CANDIDATES = 256


def _int8_layout(approx: QuantPanelWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 panels [P, B, 32 inputs, 32 features] -> int8_head.cpp's codes + 128 as uint8
    [P, B, 8, 2, 16, 4] (per group of 4 inputs, each half of the panel's features with each
    feature's 4 codes side by side) and scales [P, B, 32]."""
    codes, scales = approx.codes, approx.scales
    panels, blocks, inputs, width = codes.shape
    assert inputs == 32 and width == 32, "int8 layout from 32-feature Q8_0 panels"
    c = codes.view(panels, blocks, 8, 4, 2, 16).permute(0, 1, 2, 4, 5, 3)
    return (c.to(torch.int16) + 128).to(torch.uint8).contiguous(), scales.contiguous()


def is_q8_codes(method) -> bool:
    return isinstance(method, QuantPanelWeight) and method.format == "q8_0"


class GreedyHead:
    MAX_K = 1 << 16

    # approx: the Q8_0 pass's codes (None where the int8 pass takes every row count);
    # int8: the int8 pass's copy of them (None where the CPU has no AVX512_VNNI).
    __slots__ = ("panel", "approx", "int8", "norms", "devs", "backend", "max_rows")

    def __init__(self, panel: PanelWeight | QuantPanelWeight, weight: torch.Tensor,
                 backend) -> None:
        self.panel = panel  # the head's linear method: fp32 / half panels, or its Q8_0 codes
        self.backend = backend
        if is_q8_codes(panel):
            # Its codes are the weights its products run (a GGUF head's exactly, or a head
            # quantized at load): the approximation itself, with no error of its own (devs 0).
            self.approx = panel
            w = panel.weight()
        else:
            w = weight.detach().float()
            self.approx = QuantPanelWeight.quantize(w, "q8_0", backend)
        # The int8 pass's copy of the codes, where the CPU runs it.
        self.int8 = _int8_layout(self.approx) if backend.int8_head else None
        assert self.int8 is not None or not is_q8_codes(panel), \
            "a Q8_0 head's only route is the int8 pass: its Q8_0 pass is the full product"
        # Rows up to which the Q8_0 pass runs; past them, the int8 pass up to panel_max_rows.
        if self.int8 is not None:
            self.max_rows = 0
        elif weight.dtype == torch.float32:
            self.max_rows = min(backend.panel_max_rows, FP32_MAX_ROWS)
        else:
            self.max_rows = backend.panel_max_rows
        rebuilt = self.approx.weight()
        self.norms = _row_norms(w)
        self.devs = _row_norms(w - rebuilt)
        if self.int8 is not None and self.approx is not panel:
            self.approx = None  # the int8 pass takes every row count: the Q8_0 pass never runs

    @staticmethod
    def gamma(k: int) -> float:
        """The relative error bound of an fp32 chain of k FMAs, with slack for the bound's own
        arithmetic."""
        return k * 2.0 ** -24 / (1 - k * 2.0 ** -24) * 1.001 + 1e-7

    @staticmethod
    def applies_to(weight: torch.Tensor, backend, method=None) -> bool:
        """Whether a head of this weight has the route; with `method`, its linear method,
        whether that one does: panels of the weight's dtype, or Q8_0 codes of an fp32 head
        where the CPU runs the int8 pass (a half-precision model's products from codes round
        their logits to its dtype, which the exact columns of codes do not)."""
        takes = method is None or isinstance(method, PanelWeight) or (
            is_q8_codes(method) and backend.int8_head and weight.dtype == torch.float32)
        return (takes and backend.greedy_head_route and weight.device.type == "cpu"
                and weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
                and weight.shape[1] % 32 == 0 and weight.shape[1] <= GreedyHead.MAX_K
                and bool(torch.isfinite(weight).all()))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        approx = () if self.approx is None else self.approx.tensors()
        return (*approx, *(self.int8 or ()), self.norms, self.devs)

    def row_tensors(self) -> tuple[torch.Tensor, ...]:
        """What a single row's pass reads: the int8 copy where the CPU runs it (it then takes
        every row count), else the Q8_0 codes; the rows' norms and deviations."""
        first = self.int8 if self.int8 is not None else self.approx.tensors()
        return (*first, self.norms, self.devs)

    def place(self, arena) -> "GreedyHead":
        """The first pass's codes into `arena` (the head's panels, or codes, are its linear
        method's)."""
        if self.approx is not None and self.approx is not self.panel:
            self.approx.place(arena)
        if self.int8 is not None:
            self.int8 = tuple(arena.adopt(t) for t in self.int8)
        return self

    def _weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What the exact columns read: the head's panels, or its Q8_0 codes and scales."""
        if is_q8_codes(self.panel):
            return self.panel.codes, self.panel.scales
        return self.panel.panels, None

    def tokens(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [M, K] in the head's dtype -> long[M], or None where the full product must
        decide: more rows than the panel kernel takes (larger inputs go through AMX or MKL,
        which round differently) or than the route gains on (FP32_MAX_ROWS, without the int8
        pass), or non-finite values."""
        m, n = x.shape[0], self.panel.out_features
        int8 = m > self.max_rows
        if int8 and (self.int8 is None or m > self.backend.panel_max_rows):
            return None
        xf = x.float().contiguous()
        gamma = self.gamma(xf.shape[1])
        weight, q8_scales = self._weight()
        if int8:
            ids = self.backend.int8_greedy_tokens(xf, *self.int8, weight, self.norms, self.devs,
                                                  n, gamma, MAX_CANDIDATES, q8_scales)
        else:
            ids = self.backend.greedy_tokens(self.approx.linear(xf, None), xf, weight,
                                             self.norms, self.devs, n, gamma, None,
                                             MAX_CANDIDATES, q8_scales)
        if bool((ids == -1).any()):
            return None
        crowded = ids == -2
        if bool(crowded.any()):  # rows of a flat distribution: their own full product
            ids[crowded] = self.backend.argmax_rows(self.panel.linear(x[crowded], None))
        return ids

"""Linear methods: a weight in the layout one backend runs, and its product.

A backend's `linear_method(weight)` picks one per weight at load; the layer then calls only
`method.linear(x, bias)`. Each method also rebuilds its plain weight (`weight()`, a copy) and
reports the bytes it holds (`nbytes`), which stats() sums.

  PlainLinear    F.linear on the weight as loaded (any device, any dtype)
  PackedWeight   bf16 / fp16 in oneDNN's blocked layout, where oneDNN runs the dtype natively
  PanelWeight    the C++ panel kernel's layout (csrc/linear.cpp), fp32 or half precision
Quantized methods (GGUF block codes) are in quant.py; the greedy LM head in greedy.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["LinearMethod", "PlainLinear", "PackedWeight", "PanelWeight", "plain_weight",
           "tensor_bytes", "run_fp32"]


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def run_fp32(x: torch.Tensor, bias: torch.Tensor | None, product) -> torch.Tensor:
    """product(x, bias) on fp32 rows of unit column stride, which the quantized kernels take:
    rows of another dtype go through fp32 and come back in their dtype."""
    if x.dtype != torch.float32:
        b = None if bias is None else bias.float()
        return run_fp32(x.float(), b, product).to(x.dtype)
    if x.stride(-1) != 1:
        x = x.contiguous()
    return product(x, bias)


class LinearMethod:
    """y = x W^T + b for x [M, K] -> [M, N]."""

    __slots__ = ()
    out_features: int

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def weight(self) -> torch.Tensor:
        """The plain [N, K] weight (a copy where the method holds another layout)."""
        raise NotImplementedError

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors the method holds (stats() sums their bytes, each tensor once)."""
        raise NotImplementedError

    def row_tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors a single input row's product reads (a lone decode step's bytes)."""
        return self.tensors()

    def place(self, arena) -> "LinearMethod":
        """Moves the tensors a product streams into `arena` (host_memory.HugePageArena);
        returns self. Methods whose tensors are not plain CPU storage keep them."""
        return self

    @property
    def nbytes(self) -> int:
        return tensor_bytes(*self.tensors())


class PlainLinear(LinearMethod):
    __slots__ = ("w",)

    def __init__(self, weight: torch.Tensor) -> None:
        self.w = weight.detach()

    @property
    def out_features(self) -> int:
        return self.w.shape[0]

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.w, bias)

    def weight(self) -> torch.Tensor:
        return self.w

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.w,)


# Rows up to which bf16 pair panels beat oneDNN's native bf16 product on a decoder layer's
# shapes (bench/linear_kernels.py: equal near 64 rows, oneDNN ahead from about 96).
PAIR_PANEL_MAX_ROWS = 64


class PackedWeight(LinearMethod):
    """A CPU bf16/fp16 weight in oneDNN's blocked layout: with plain weights oneDNN re-lays
    them out on every call, which doubles the cost of decode-sized (small-M) matmuls. Results
    are the same kernels' results. Given a kernel backend, a single row (a lone decode) runs
    the panel kernel instead (the weight kept in its layout too, in place of the plain copy):
    oneDNN's one-row product runs at half the memory bandwidth, the panel kernel's near it.
    bf16 pair panels take up to PAIR_PANEL_MAX_ROWS rows (decode batches). `panel`: the
    method those rows run (default: the backend's PanelWeight; coded.CodedPairPanels)."""

    __slots__ = ("packed", "plain", "panel", "out_features")

    def __init__(self, weight: torch.Tensor, backend=None, panel: LinearMethod | None = None
                 ) -> None:
        self.out_features = weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        if panel is None and backend is not None:
            panel = PanelWeight(weight, backend)
        self.panel = panel
        self.plain = weight.detach() if self.panel is None else None

    @staticmethod
    def applies_to(weight: torch.Tensor) -> bool:
        return (weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float16)
                and torch.backends.mkldnn.is_available())

    def panel_takes(self, rows: int) -> bool:
        """Whether `rows` input rows run the panel kernel rather than oneDNN."""
        if self.panel is None:
            return False
        return rows <= (PAIR_PANEL_MAX_ROWS if self.panel.pairs else 1)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.panel_takes(x.shape[0]):
            return self.panel.linear(x, bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    def weight(self) -> torch.Tensor:
        return self.plain if self.panel is None else self.panel.weight()

    def place(self, arena) -> "PackedWeight":
        # oneDNN's packed copy is an opaque tensor; the panels serve the single rows.
        if self.panel is not None:
            self.panel.place(arena)
        return self

    def tensors(self) -> tuple[torch.Tensor, ...]:
        # The packed copy is what a product streams; the plain weight (or the panels) is kept
        # for weight() (an LM head's is the embedding's) and for single rows.
        return (self.packed, *((self.plain,) if self.panel is None else self.panel.tensors()))

    def row_tensors(self) -> tuple[torch.Tensor, ...]:
        return self.panel.row_tensors() if self.panel_takes(1) else (self.packed,)


def plain_weight(panels: torch.Tensor, out_features: int, pairs: bool) -> torch.Tensor:
    """The [N, K] weight held by panels [P, K, W] (pair panels [P, K / 2, 2 W] where `pairs`),
    a copy; N = out_features."""
    p, rows, width = panels.shape
    if pairs:
        width //= 2
        w = panels.view(p, rows, width, 2).transpose(1, 2).reshape(p, width, 2 * rows)
    else:
        w = panels.transpose(1, 2)
    return w.reshape(-1, w.shape[2])[:out_features]


# Rows checked first: most fp32 checkpoints fail there, at no cost.
_SAMPLE_ROWS = 64


def _holds(w: torch.Tensor, narrow: torch.dtype) -> bool:
    """Whether every value of the fp32 tensor w is a value of `narrow` (bf16: the low 16 bits
    of each fp32 pattern are zero)."""
    if narrow == torch.bfloat16:
        return not bool((w.view(torch.int32) & 0xFFFF).any())
    return torch.equal(w.to(narrow).float(), w)


class PanelWeight(LinearMethod):
    """A CPU weight [N, K] in the C++ linear kernel's layout (csrc/linear.cpp): panels of W
    output features, [ceil(N / W), K, W], the last one zero-padded, W the backend's panel width
    (two of its vector registers). It replaces the plain weight. bf16 weights of an even K on
    a backend with bf16_pairs are pair panels instead, [ceil(N / W), K / 2, 2 W]: per k pair,
    each output feature's weights for k = 2j, 2j + 1 side by side (csrc/linear_pairs.cpp).

    fp32: inputs of up to the backend's panel_max_rows rows run the panel kernel; larger ones
    run csrc/linear_amx.cpp where the backend has AMX (bf16x3, to fp32 accuracy), else MKL on
    W rebuilt from the panels, a copy that is small next to a prefill-sized product. An fp32
    weight whose every value is a bf16 (or fp16) value, as a half-precision checkpoint loaded
    in fp32 has, keeps its panels in that dtype (`half_panels`): the kernel widens them in
    registers, products bitwise the fp32 panels', from half the bytes. bf16 / fp16 (backends
    whose half_linear is "kernel"): the panel kernel at every size, in fp32 math.
    bench/linear_kernels.py compares the routes."""

    __slots__ = ("panels", "out_features", "backend", "dtype")

    def __init__(self, weight: torch.Tensor, backend, dtype: torch.dtype | None = None) -> None:
        """dtype: the weight's dtype in the model, where its panels hold it narrower (fp32)."""
        n, k = weight.shape
        width = backend.panel_width
        num_panels = -(-n // width)
        padded = F.pad(weight.detach(), (0, 0, 0, num_panels * width - n))
        self.dtype = dtype or weight.dtype
        if self.pairs_for(weight, backend) and self.dtype == weight.dtype:
            # [P, W, K/2, 2] -> [P, K/2, W, 2]: a k pair's W pairs are one contiguous row.
            self.panels = padded.view(num_panels, width, k // 2, 2).transpose(1, 2) \
                .reshape(num_panels, k // 2, 2 * width).contiguous()
        else:
            self.panels = padded.view(num_panels, width, k).transpose(1, 2).contiguous()
        self.out_features = n
        self.backend = backend

    @classmethod
    def half_panels(cls, weight: torch.Tensor, backend) -> "PanelWeight | None":
        """An fp32 weight's panels in bf16 or fp16 where that holds every value exactly (and the
        backend runs weights from exact narrower forms: its quant_linear), else None."""
        if weight.dtype == torch.float32 and backend.quant_linear:
            w = weight.detach()
            for narrow in (torch.bfloat16, torch.float16):
                if _holds(w[:_SAMPLE_ROWS], narrow) and _holds(w, narrow):
                    return cls(w.to(narrow), backend, dtype=torch.float32)
        return None


    @staticmethod
    def pairs_for(weight: torch.Tensor, backend) -> bool:
        return weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0 \
            and backend.bf16_pairs

    @property
    def pairs(self) -> bool:
        return self.panels.shape[2] == 2 * self.backend.panel_width

    @staticmethod
    def applies_to(weight: torch.Tensor, backend) -> bool:
        if weight.device.type != "cpu":
            return False
        if weight.dtype == torch.float32:
            return backend.fp32_linear
        return backend.half_linear_for(weight.dtype) == "kernel"

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dtype != torch.float32:
            return self.backend.linear_half(x, self.panels, bias, self.out_features)
        if x.shape[0] <= self.backend.panel_max_rows:
            return self.backend.linear_f32(x, self.panels, bias, self.out_features)
        if self.backend.amx_linear:
            return self.backend.linear_amx(x, self.panels.float(), bias, self.out_features)
        return F.linear(x, self.weight(), bias)

    def weight(self) -> torch.Tensor:
        return plain_weight(self.panels, self.out_features, self.pairs).to(self.dtype)

    def place(self, arena) -> "PanelWeight":
        self.panels = arena.adopt(self.panels)
        return self

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight (an embedding's lookup): [len(ids), K]."""
        if self.pairs:
            p, half, width2 = self.panels.shape
            width = width2 // 2
            return self.panels.view(p, half, width, 2)[ids // width, :, ids % width] \
                .reshape(len(ids), 2 * half)
        width = self.panels.shape[2]
        return self.panels[ids // width, :, ids % width].to(self.dtype)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.panels,)

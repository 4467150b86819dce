"""Tensor-parallel building blocks.

All tensor parallelism lives here: each layer allocates only this rank's shard, and its
`weight_loader(param, full_tensor[, shard_id])` cuts that shard out of the full Hugging Face
tensor. Models compose these layers and never look at the rank themselves.

Sharding scheme (Megatron style): column-parallel layers split output features, row-parallel
layers split input features and all-reduce their output, vocab layers split the vocabulary into
equal contiguous ranges (the last one zero-padded).
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tierserve.workers.backends.cpu import CpuBackend
from tierserve.workers.model.config import partition_heads  # noqa: F401
from tierserve.workers.parallel import get_tp_rank, get_tp_size, tp_all_reduce, tp_gather
from tierserve.workers.backends.quant import QuantPanelWeight


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by the TP size ({denominator})")
    return numerator // denominator


def _param(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    """copy_ without broadcasting: a wrongly shaped checkpoint tensor is an error, not a smear."""
    if dst.shape != src.shape:
        raise ValueError(f"weight shard shape {tuple(src.shape)} != parameter shape {tuple(dst.shape)}")
    dst.copy_(src)


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (vocabulary) are split into one contiguous range per rank."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, device):
        super().__init__()
        tp_size, rank = get_tp_size(), get_tp_rank()
        self.num_embeddings = num_embeddings
        self.shard_size = math.ceil(num_embeddings / tp_size)
        self.vocab_start = min(rank * self.shard_size, num_embeddings)
        self.vocab_end = min(self.vocab_start + self.shard_size, num_embeddings)
        self.weight = _param((self.shard_size, embedding_dim), dtype, device)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor) -> None:
        if full.shape[0] != self.num_embeddings:
            raise ValueError(f"vocab tensor has {full.shape[0]} rows, expected {self.num_embeddings}")
        n = self.vocab_end - self.vocab_start
        copy_checked(param.data[:n], full[self.vocab_start : self.vocab_end])
        param.data[n:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if get_tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        in_shard = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        # Foreign ids look up local row 0 and are zeroed, so the all-reduce sums exactly one row.
        local_ids = (input_ids - self.vocab_start) * in_shard
        out = F.embedding(local_ids, self.weight)
        out.masked_fill_(~in_shard.unsqueeze(-1), 0)
        return tp_all_reduce(out)


class PackedWeight:
    """A CPU bf16/fp16 weight also kept in oneDNN's blocked layout: with plain weights oneDNN
    re-lays them out on every call, which doubles the cost of decode-sized (small-M) matmuls.
    Results are the same kernels' results."""

    __slots__ = ("packed",)

    def __init__(self, weight: torch.Tensor) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)

    @staticmethod
    def applies_to(weight: torch.Tensor) -> bool:
        return (weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float16)
                and torch.backends.mkldnn.is_available())

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


class PanelWeight:
    """A CPU weight [N, K] in the C++ linear kernel's layout (csrc/linear.cpp): panels of W
    output features, [ceil(N / W), K, W], the last one zero-padded, W the backend's panel width
    (two of its vector registers). It replaces the plain weight.

    fp32: inputs of up to the backend's panel_max_rows rows run the panel kernel; larger ones
    run csrc/linear_amx.cpp where the backend has AMX (bf16x3, to fp32 accuracy), else MKL on
    W rebuilt from the panels, a copy that is small next to a prefill-sized product. bf16 / fp16
    (backends whose half_linear is "kernel"): the panel kernel at every size, in fp32 math.
    bench/linear_kernels.py compares the routes."""

    __slots__ = ("panels", "out_features", "backend")

    def __init__(self, weight: torch.Tensor, backend: CpuBackend) -> None:
        n, k = weight.shape
        width = backend.panel_width
        num_panels = -(-n // width)
        padded = F.pad(weight.detach(), (0, 0, 0, num_panels * width - n))
        self.panels = padded.view(num_panels, width, k).transpose(1, 2).contiguous()
        self.out_features = n
        self.backend = backend

    @staticmethod
    def applies_to(weight: torch.Tensor, backend: CpuBackend) -> bool:
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
            return self.backend.linear_amx(x, self.panels, bias, self.out_features)
        return F.linear(x, self.weight(), bias)

    def weight(self) -> torch.Tensor:
        """The plain [N, K] weight, rebuilt from the panels (a copy)."""
        k = self.panels.shape[1]
        return self.panels.transpose(1, 2).reshape(-1, k)[: self.out_features]


class GreedyHead:
    """Exact greedy tokens of an fp32 LM head (panels) without its full fp32 product.

    A bf16 copy of the weight gives approximate logits at a fraction of the fp32 product's cost
    (oneDNN's native bf16: AVX512-BF16 or AMX; bench/linear_kernels.py measures it);
    csrc/linear.cpp's greedy_from_approx bounds their error, computes only the
    columns that could still be the maximum with the fp32 kernel's own arithmetic, and returns
    the token argmax over the full fp32 logits would give, bit for bit. Greedy rows without
    penalties or logprobs need no more (SamplingBatch.plain_greedy).
    """

    # |approx_j - exact_j| <= rel(K) |x| |w_j| + OUT_REL |approx_j| (+ subnormal flushes, in
    # the kernel): bf16 rounding of x and of W (2^-8 relative each: 2^-7 + 2^-16 on a product),
    # fp32 accumulation of the approximate and of the exact product (K 2^-24 / (1 - K 2^-24)
    # each), and the output's bf16 rounding (2^-8 / (1 - 2^-8) of it). The slack terms absorb
    # the rounding of the bound's own fp32 arithmetic.
    OUT_REL = 2.0 ** -8 / (1 - 2.0 ** -8) + 1e-6
    MAX_K = 1 << 16

    @staticmethod
    def rel(k: int) -> float:
        gamma = k * 2.0 ** -24 / (1 - k * 2.0 ** -24)
        return 2.0 ** -7 + 2.0 ** -16 + 2 * gamma + 1e-4

    __slots__ = ("panel", "approx", "norms", "backend")

    def __init__(self, panel: PanelWeight, weight: torch.Tensor, backend: CpuBackend) -> None:
        self.panel = panel
        self.backend = backend
        self.approx = PackedWeight(weight.detach().to(torch.bfloat16))
        # Row norms in float64, a block of rows at a time (no float64 copy of the whole head),
        # rounded up so that each stays an upper bound of |w_j| after the cast.
        w = weight.detach()
        norms = torch.cat([torch.linalg.vector_norm(w[i : i + 4096], dim=1, dtype=torch.float64)
                           for i in range(0, w.shape[0], 4096)])
        self.norms = (norms * (1 + 1e-6)).float().contiguous()

    @staticmethod
    def applies_to(weight: torch.Tensor, backend: CpuBackend) -> bool:
        return (backend.greedy_head and weight.dtype == torch.float32
                and PanelWeight.applies_to(weight, backend)
                and torch.backends.mkldnn.is_available()
                and weight.shape[1] <= GreedyHead.MAX_K and bool(torch.isfinite(weight).all()))

    def tokens(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [M, K] float32 -> long[M], or None where the full product must decide: more rows
        than the panel kernel takes (larger inputs go through AMX or MKL, which round
        differently), or non-finite values."""
        if x.shape[0] > self.backend.panel_max_rows:
            return None
        x = x.contiguous()
        approx = self.approx.linear(x.to(torch.bfloat16), None)
        ids = self.backend.greedy_from_approx(approx, x, self.panel.panels, self.norms,
                                             self.panel.out_features, self.rel(x.shape[1]),
                                             self.OUT_REL)
        return None if bool((ids < 0).any()) else ids


def linear(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
           packed: "PackedWeight | PanelWeight | QuantPanelWeight | None") -> torch.Tensor:
    """x [M, K] -> [M, N]; `weight` may be None once `packed` replaced it."""
    if packed is not None:
        return packed.linear(x, bias)
    return F.linear(x, weight, bias)


def pack_weights(module: nn.Module, backend: CpuBackend) -> None:
    """Gives the CPU linears of `module` the weight layout `backend` runs; call after loading.

    bf16/fp16 weights get a oneDNN copy where the backend packs them so. Weights the backend's
    panel kernel runs are re-laid out as panels, replacing the plain weight (except the LM
    head's, which may be the embedding's); an fp32 LM head at TP=1 also gets its greedy route
    where the backend has one.
    """
    for sub in module.modules():
        if not isinstance(sub, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)) \
                or sub.packed is not None or sub.weight.device.type != "cpu":
            continue
        if backend.half_linear_for(sub.weight.dtype) == "onednn" \
                and PackedWeight.applies_to(sub.weight):
            sub.packed = PackedWeight(sub.weight)
        elif PanelWeight.applies_to(sub.weight, backend):
            sub.packed = PanelWeight(sub.weight, backend)
            if isinstance(sub, ParallelLMHead) and get_tp_size() == 1 \
                    and GreedyHead.applies_to(sub.weight, backend):
                sub.greedy_head = GreedyHead(sub.packed, sub.weight, backend)
            sub.packed = QuantPanelWeight.encode(sub.packed, sub.weight, backend) or sub.packed
            if not isinstance(sub, ParallelLMHead):
                sub.weight = None


class ParallelLMHead(VocabParallelEmbedding):
    """Vocab-sharded output projection; the full vocabulary's logits are gathered on rank 0,
    the only rank that samples."""

    packed: "PackedWeight | PanelWeight | QuantPanelWeight | None" = None
    greedy_head: GreedyHead | None = None

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The argmax of forward(hidden) per row (first index of the maximum) where a cheaper
        exact route exists (GreedyHead), else None."""
        return None if self.greedy_head is None else self.greedy_head.tokens(hidden)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[n, hidden] -> logits [n, vocab] on rank 0; None on the other ranks."""
        logits = linear(hidden, self.weight, None, self.packed)  # [n, shard_size]
        if get_tp_size() > 1:
            logits = tp_gather(logits, dim=-1)
            return None if logits is None else logits[:, : self.num_embeddings]
        return logits


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's rows (output features) split across ranks; no communication."""

    packed: "PackedWeight | PanelWeight | QuantPanelWeight | None" = None

    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype, device):
        super().__init__()
        self.input_size = input_size
        self.output_size_per_rank = _divide(output_size, get_tp_size(), "output size")
        self.weight = _param((self.output_size_per_rank, input_size), dtype, device)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = _param((self.output_size_per_rank,), dtype, device)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor) -> None:
        n = param.shape[0]
        copy_checked(param.data, full.narrow(0, get_tp_rank() * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul.

    The local weight is [part0 shard; part1 shard; ...], so one rank's output is the
    concatenation of its slice of every part (e.g. gate/up for SiLU-and-mul).
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool, dtype, device):
        tp_size = get_tp_size()
        self.part_sizes = [_divide(s, tp_size, "merged output part") for s in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias, dtype, device)

    def _part_range(self, shard_id: Any) -> tuple[int, int, int]:
        """(offset in the local param, rows this rank holds, first row in the full tensor)."""
        size = self.part_sizes[shard_id]
        return sum(self.part_sizes[:shard_id]), size, get_tp_rank() * size

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is None:
            raise ValueError("merged linear layers need the shard_id of the part being loaded")
        offset, size, src = self._part_range(shard_id)
        copy_checked(param.data.narrow(0, offset, size), full.narrow(0, src, size))


class QKVParallelLinear(MergedColumnParallelLinear):
    """Fused q/k/v projection. Query heads split across ranks; KV heads split or replicate."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool, dtype: torch.dtype, device):
        tp_size, rank = get_tp_size(), get_tp_rank()
        self.head_dim = head_dim
        self.num_heads, self.num_kv_heads = partition_heads(num_heads, num_kv_heads, tp_size)
        # Ranks sharing a replicated KV head are neighbours: rank r holds global KV head
        # r // (tp_size // num_kv_heads), which is the head its query heads group onto.
        replicas = max(1, tp_size // num_kv_heads)
        self.kv_head_start = (rank // replicas) * self.num_kv_heads
        q_size, kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.q_size, self.kv_size = q_size, kv_size
        super().__init__(hidden_size, [q_size * tp_size, kv_size * tp_size, kv_size * tp_size],
                         bias, dtype, device)

    def _part_range(self, shard_id: Any) -> tuple[int, int, int]:
        if shard_id == "q":
            return 0, self.q_size, get_tp_rank() * self.q_size
        src = self.kv_head_start * self.head_dim
        if shard_id == "k":
            return self.q_size, self.kv_size, src
        if shard_id == "v":
            return self.q_size + self.kv_size, self.kv_size, src
        raise ValueError(f"unknown qkv shard id {shard_id!r}")


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's columns (input features) split; partial sums are all-reduced."""

    packed: "PackedWeight | PanelWeight | QuantPanelWeight | None" = None

    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype, device):
        super().__init__()
        self.input_size_per_rank = _divide(input_size, get_tp_size(), "input size")
        self.weight = _param((output_size, self.input_size_per_rank), dtype, device)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = _param((output_size,), dtype, device)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor) -> None:
        if param.dim() == 1:  # bias is replicated and added once, after the reduction
            copy_checked(param.data, full)
            return
        n = self.input_size_per_rank
        copy_checked(param.data, full.narrow(1, get_tp_rank() * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if get_tp_size() == 1:
            return linear(x, self.weight, self.bias, self.packed)
        out = tp_all_reduce(linear(x, self.weight, None, self.packed))
        return out if self.bias is None else out + self.bias


class RMSNorm(nn.Module):
    """HF Llama RMSNorm (statistics in float32), optionally fused with the residual add."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device,
                 backend: CpuBackend):
        super().__init__()
        self.eps = eps
        self.backend = backend
        self.weight = _param((hidden_size,), dtype, device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Returns norm(x), or (norm(x + residual), x + residual) when residual is given."""
        if x.dim() == 2 and self.backend.fuses(x):
            out, summed = self.backend.rms_norm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, summed)
        if residual is not None:
            x = x + residual
            residual = x
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        out = self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(x.dtype)
        return out if residual is None else (out, residual)


class SiluAndMul(nn.Module):
    """[..., 2d] -> silu(x[..., :d]) * x[..., d:], the SwiGLU of a fused gate/up output."""

    def __init__(self, backend: CpuBackend):
        super().__init__()
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and self.backend.fuses(x):
            return self.backend.silu_and_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


def rope_inv_freq(head_dim: int, base: float, rope_scaling: Mapping[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (float32), following HF's rope initialisers."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    raise NotImplementedError(f"rope_scaling type {rope_type!r} is not supported")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: Mapping[str, Any]) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE as HF Llama/Qwen2 apply it.

    cos/sin are computed per step from positions (cheap: [T, head_dim/2]) rather than cached for
    every position, so long-context models need no big table.
    """

    def __init__(self, head_dim: int, base: float, rope_scaling: Mapping[str, Any] | None, device):
        super().__init__()
        self.head_dim = head_dim
        self.register_buffer(
            "inv_freq", rope_inv_freq(head_dim, base, rope_scaling).to(device), persistent=False
        )

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, head_dim // 2] in `dtype` (HF rounds them to the model dtype)."""
        freqs = positions[:, None].float() * self.inv_freq  # [T, head_dim // 2]
        return freqs.cos().to(dtype).unsqueeze(1), freqs.sin().to(dtype).unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, head_dim]; equals x*cat(cos,cos) + rotate_half(x)*cat(sin,sin)."""
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

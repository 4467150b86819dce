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

from tierserve.workers.backends.base import Backend
from tierserve.workers.backends.linear import LinearMethod
from tierserve.workers.backends.portable import rotate_half
from tierserve.workers.backends.quant import head_format
from tierserve.workers.model.config import partition_heads  # noqa: F401
from tierserve.workers.parallel import get_tp_rank, get_tp_size, tp_all_reduce, tp_gather


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
    """Embedding whose rows (vocabulary) are split into one contiguous range per rank. Tied to
    an LM head whose method can look rows up (`source`), it keeps no weight of its own."""

    source: LinearMethod | None = None

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, device):
        super().__init__()
        tp_size, rank = get_tp_size(), get_tp_rank()
        self.num_embeddings = num_embeddings
        self.shard_size = math.ceil(num_embeddings / tp_size)
        self.vocab_start = min(rank * self.shard_size, num_embeddings)
        self.vocab_end = min(self.vocab_start + self.shard_size, num_embeddings)
        self.dtype = dtype
        self.weight = _param((self.shard_size, embedding_dim), dtype, device)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor) -> None:
        if full.shape[0] != self.num_embeddings:
            raise ValueError(f"vocab tensor has {full.shape[0]} rows, expected {self.num_embeddings}")
        n = self.vocab_end - self.vocab_start
        copy_checked(param.data[:n], full[self.vocab_start : self.vocab_end])
        param.data[n:].zero_()

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            return F.embedding(ids, self.weight)
        return self.source.rows(ids).to(self.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if get_tp_size() == 1:
            return self.lookup(input_ids)
        in_shard = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        # Foreign ids look up local row 0 and are zeroed, so the all-reduce sums exactly one row.
        local_ids = (input_ids - self.vocab_start) * in_shard
        out = self.lookup(local_ids)
        out.masked_fill_(~in_shard.unsqueeze(-1), 0)
        return tp_all_reduce(out)


def linear(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
           method: LinearMethod | None) -> torch.Tensor:
    """x [M, K] -> [M, N]: through the layer's method once the backend gave it one."""
    if method is not None:
        return method.linear(x, bias)
    return F.linear(x, weight, bias)


def pack_weights(module: nn.Module, backend: Backend, quantization: str | None = None) -> None:
    """Hands each linear of `module` to the backend once the weights are loaded: the layer
    runs the method the backend picks for its weight (a layout of its own, or only its block
    codes with `quantization`) and drops its plain weight. An LM head at TP=1 also gets the
    backend's greedy route, where it has one. A tied embedding then looks its rows up in the
    head's method where the method can (rows()), so no second copy of the table is kept."""
    for sub in module.modules():
        if not isinstance(sub, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)) \
                or sub.method is not None:
            continue
        head = isinstance(sub, ParallelLMHead)
        fmt = quantization
        if fmt is not None:
            fmt = head_format(fmt) if head else fmt
            if sub.weight.shape[1] % 32:  # blocks of 32 inputs: such a weight stays dense
                fmt = None
        sub.method = backend.linear_method(sub.weight, fmt, head)
        if head and get_tp_size() == 1:
            sub.greedy_head = backend.greedy_head(sub.method, sub.weight)
        if head and sub.tied_to is not None and hasattr(sub.method, "rows") \
                and sub.method.out_features == sub.tied_to.weight.shape[0]:
            sub.tied_to.source = sub.method
            sub.tied_to.weight = None
        sub.weight = None


class ParallelLMHead(VocabParallelEmbedding):
    """Vocab-sharded output projection; the full vocabulary's logits are gathered on rank 0,
    the only rank that samples."""

    method: LinearMethod | None = None
    greedy_head = None  # the backend's greedy route (Backend.greedy_head), if any
    tied_to: VocabParallelEmbedding | None = None  # the embedding whose weight this is

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        """Makes this head the embedding's weight (tie_word_embeddings)."""
        self.weight = embedding.weight
        # Not a submodule: the embedding belongs to the model.
        object.__setattr__(self, "tied_to", embedding)

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The argmax of forward(hidden) per row (first index of the maximum) where a cheaper
        exact route exists (Backend.greedy_head), else None."""
        return None if self.greedy_head is None else self.greedy_head.tokens(hidden)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[n, hidden] -> logits [n, vocab] on rank 0; None on the other ranks."""
        logits = linear(hidden, self.weight, None, self.method)  # [n, shard_size]
        if get_tp_size() > 1:
            logits = tp_gather(logits, dim=-1)
            return None if logits is None else logits[:, : self.num_embeddings]
        return logits


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's rows (output features) split across ranks; no communication."""

    method: LinearMethod | None = None
    # The model's step of LoRA adapters (lora.LoRAStep) where LoRA is enabled.
    lora = None

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

    @property
    def lora_out_features(self) -> int:
        return self.output_size_per_rank

    def lora_shard(self, a: torch.Tensor, b: torch.Tensor, shard_id: Any = None):
        """This rank's part of a LoRA pair on (part shard_id of) this projection: (A, the rows
        of B that make this rank's outputs, where those rows go in the local output)."""
        n = self.output_size_per_rank
        return a, b.narrow(0, get_tp_rank() * n, n), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias, self.method)
        return y if self.lora is None or not self.lora.active else self.lora.add(self, x, y)


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

    def lora_shard(self, a: torch.Tensor, b: torch.Tensor, shard_id: Any = None):
        offset, size, src = self._part_range(shard_id)
        return a, b.narrow(0, src, size), offset


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

    method: LinearMethod | None = None
    lora = None  # as ColumnParallelLinear's

    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype, device):
        super().__init__()
        self.input_size_per_rank = _divide(input_size, get_tp_size(), "input size")
        self.output_size = output_size
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

    @property
    def lora_out_features(self) -> int:
        return self.output_size

    def lora_shard(self, a: torch.Tensor, b: torch.Tensor, shard_id: Any = None):
        """A's columns of this rank's inputs; B whole (the partial deltas sum in the
        all-reduce)."""
        n = self.input_size_per_rank
        return a.narrow(1, get_tp_rank() * n, n), b, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lora = self.lora if self.lora is not None and self.lora.active else None
        if get_tp_size() == 1:
            y = linear(x, self.weight, self.bias, self.method)
            return y if lora is None else lora.add(self, x, y)
        partial = linear(x, self.weight, None, self.method)
        if lora is not None:
            partial = lora.add(self, x, partial)
        out = tp_all_reduce(partial)
        return out if self.bias is None else out + self.bias


class RMSNorm(nn.Module):
    """HF Llama RMSNorm (statistics in float32), optionally fused with the residual add."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device,
                 backend: Backend):
        super().__init__()
        self.eps = eps
        self.backend = backend
        self.weight = _param((hidden_size,), dtype, device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Returns norm(x), or (norm(x + residual), x + residual) when residual is given."""
        out, summed = self.backend.rms_norm(x, residual, self.weight, self.eps)
        return out if residual is None else (out, summed)


class SiluAndMul(nn.Module):
    """[..., 2d] -> silu(x[..., :d]) * x[..., d:], the SwiGLU of a fused gate/up output."""

    def __init__(self, backend: Backend):
        super().__init__()
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.silu_and_mul(x)


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
        """cos, sin of shape [T, head_dim // 2] in `dtype` (HF rounds them to the model dtype)."""
        freqs = positions[:, None].float() * self.inv_freq  # [T, head_dim // 2]
        return freqs.cos().to(dtype), freqs.sin().to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, head_dim] by cos / sin [T, head_dim // 2]."""
        return rotate_half(x, cos.unsqueeze(1), sin.unsqueeze(1))

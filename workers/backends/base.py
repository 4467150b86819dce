"""The backend contract: what a model's ops run on, one object chosen once per engine.

A backend is immutable, built when the worker loads its model and handed to the model's layers
and to the sampler; nothing switches under a running engine, so a request's tokens never depend
on when a background build finished. The model calls nothing but this interface, and never
asks which backend it has: a new ISA or device is one new subclass.

  linear_method(weight, quant, head)   once per linear weight, at load: the object whose
                                       `linear(x, bias)` runs it (backends/linear.py)
  greedy_head(method, weight)          once for an LM head at TP=1: exact greedy tokens
                                       without the full logits, or None
  rotary_write_kv(...)                 rotate q and k, write k and v to their pool slots
  attention(q, k, v, kv_cache, attn, ...)  paged attention of a step's tokens
  rms_norm, silu_and_mul               the layer's elementwise ops
  lora_add(x, a_t, b_t, ..., out)      LoRA adapters' delta on a linear's output
  argmax_rows(logits)                  the greedy token of each row
  layer_stack(layers, ...)             once per model at TP=1: an object whose `run(...)`
                                       runs a step's decoder layers in one call, or None
  describe()                           what stats() and the start-up log show

Implementations: TorchBackend (portable.py: plain torch ops, correct on every CPU), the CPU
kernel backends (cpu.py: one class per ISA level), CudaBackend (cuda.py).
"""
from __future__ import annotations

import abc

import torch

__all__ = ["Backend", "QUANTIZATIONS", "lora_mask"]

# Block formats a dense checkpoint may be quantized to at load (the `quantization` option).
QUANTIZATIONS = ("q8_0", "q4_1")


class Backend(abc.ABC):
    name: str

    # ------------------------------------------------------------ linears

    @abc.abstractmethod
    def linear_method(self, weight: torch.Tensor, quantization: str | None = None,
                      head: bool = False):
        """The method that runs y = x W^T + b for this [N, K] weight from now on (it may keep
        the weight in another layout, or only its block codes: the caller drops its own
        reference unless it needs the plain weight). quantization: one of QUANTIZATIONS, the
        block format the weight is quantized to, or None. head: the weight is the LM head's
        (a greedy route may need its product in the backend's own arithmetic)."""

    def greedy_head(self, method, weight: torch.Tensor):
        """An object whose `tokens(x)` gives the argmax of method.linear(x) per row without
        the full logits (or None where it cannot decide), or None without such a route."""
        return None

    # ------------------------------------------------------------ attention

    @abc.abstractmethod
    def rotary_write_kv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        kv_cache: tuple[torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor,
                        heads: int, kv_heads: int, head_dim: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [T, (heads + 2 kv_heads) D], cos / sin [T, D / 2] -> q [T, heads, D], k and v
        [T, kv_heads, D], q and k rotated (rotate-half RoPE); k and v are written to their
        flat pool slots."""

    @abc.abstractmethod
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  kv_cache: tuple[torch.Tensor, torch.Tensor], attn, scale: float,
                  window: int | None = None) -> torch.Tensor:
        """A step's paged attention (workers/attention.py: AttentionMetadata) with the step's
        K/V already in the pool -> [T, heads * D]. window: each token sees the last `window`
        tokens of its context; None: all of it."""

    def layer_stack(self, layers: list, heads: int, head_dim: int, scale: float, eps: float,
                    dtype: torch.dtype):
        """An object whose `run(hidden, cos, sin, kv_caches, attn, keep)` gives a step's (last
        MLP output, residual stream), of the rows in keep where given, through all `layers`
        (backends/stack.py: StackLayer) in one call, bitwise the layer-by-layer result, or None
        for a step it does not take; None where the backend has no such route."""
        return None

    # ------------------------------------------------------------ elementwise

    @abc.abstractmethod
    def rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual) * weight, x + residual); without residual (norm(x) * weight,
        x). Statistics in fp32, as Hugging Face's RMSNorm."""

    @abc.abstractmethod
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """[..., 2d] -> silu(x[..., :d]) * x[..., d:]."""

    def lora_add(self, x: torch.Tensor, a_t: torch.Tensor, b_t: torch.Tensor,
                 offsets: torch.Tensor | None, rows: torch.Tensor | None,
                 mask: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
        """out += (x a_t) b_t in place (x [M, K], a_t [K, R], b_t [R, N], out [M, N]), the
        layer stack's way where the backend has one; returns out. Several adapters stacked
        along R: offsets (int64 [adapters + 1]) bound each one's columns and rows (int64 [M])
        name each row's adapter (-1: none), whose columns alone the row takes; mask is
        lora_mask(offsets, rows, x.dtype) where the caller has it."""
        xa = x @ a_t
        if rows is not None:
            xa.mul_(mask if mask is not None else lora_mask(offsets, rows, x.dtype))
        return out.addmm_(xa, b_t)

    @abc.abstractmethod
    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """[n, vocab] -> long[n], the first index of each row's maximum (NaN the maximum)."""

    @abc.abstractmethod
    def describe(self) -> dict:
        """name, paths (the fast paths it runs), device and CPU facts."""


def lora_mask(offsets: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[M, R]: 1 where row m's adapter (rows[m]; -1: none) owns column r (offsets[j] <= r <
    offsets[j + 1]), else 0."""
    adapter = rows.clamp_min(0)
    cols = torch.arange(int(offsets[-1]), device=rows.device)
    return ((cols >= offsets[adapter].unsqueeze(1)) & (cols < offsets[adapter + 1].unsqueeze(1))
            & (rows >= 0).unsqueeze(1)).to(dtype)

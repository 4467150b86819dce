"""The CPU kernel backends: one class per ISA level, each running that level's compiled kernels
(csrc/, built by kernels.py) where they apply and the torch backend's ops elsewhere.

What each level uses follows bench/ on CPUs of that level; a path is on only where it is
correct there and measured faster than the torch path. Every level runs the paged attention,
the fused elementwise ops, the panel kernel, the GGUF-code kernels and the greedy LM head; AMX
adds its prefill linear.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tierserve.workers import attention as paged
from tierserve.workers.backends.cpu_features import ISAS, CpuFeatures, detect_cpu_features
from tierserve.workers.backends.kernels import kernel_library
from tierserve.workers.backends.greedy import GreedyHead
from tierserve.workers.backends.host_memory import HugePageArena
from tierserve.workers.backends.int8_linear import Int8PanelWeight
from tierserve.workers.backends.coded import CodedPairPanels, CodedPanelWeight
from tierserve.workers.backends.linear import PackedWeight, PanelWeight
from tierserve.workers.backends.portable import TorchBackend, half_linear_plan, torch_backend
from tierserve.workers.backends.quant import QuantPanelWeight
from tierserve.workers.backends.stack import KernelLayerStack

__all__ = ["CpuKernelBackend", "Avx2Backend", "Avx512Backend", "AmxBackend", "KERNEL_BACKENDS",
           "kernel_backend", "plan_for", "torch_backend", "PANEL_MAX_ROWS",
           "KERNEL_PREFILL_MAX_CONTEXT"]

# Largest row count the fp32 panel kernel takes by default; larger (prefill-sized) inputs go to
# AMX where the backend has it, else to MKL. Beyond it AMX or MKL's blocking for large M wins on
# AVX-512 CPUs; on AVX2 the panel kernel keeps up with MKL further (bench/linear_kernels.py).
PANEL_MAX_ROWS = 160
AVX2_PANEL_MAX_ROWS = 1024
# On AMD CPUs torch's MKL runs no AVX-512 code, and the AVX-512 panel kernel matches or beats
# it (plus the weight's rebuild from panels) at every row count up to a default step's 2048
# (bench/linear_kernels.py on a Zen 4 EPYC).
AMD_AVX512_PANEL_MAX_ROWS = 2048

# Prefill chunks with contexts up to this many tokens go through the decode kernel, token by
# token; longer ones through the tiled prefill kernel, whose tiles reuse each K/V row across a
# block of queries (bench/prefill_attention.py times the token, tiled and SDPA routes by prompt
# length). Up to the limit a lone prompt breaks even; a batch of short prompts gains (one call
# instead of a call, gathers and copies per chunk).
KERNEL_PREFILL_MAX_CONTEXT = 192


@dataclass(frozen=True, eq=False)
class CpuKernelBackend(TorchBackend):
    """A kernel backend: the ops of torch.ops.tierserve_<isa> where they take the input."""

    ops: Any = None  # torch.ops.tierserve_<isa>
    attention_kernel: bool = True  # paged attention read in place (decodes, prefill chunks)
    fused: bool = True  # rms_norm(+residual), silu_and_mul, rotary + KV write, argmax_rows
    fp32_linear: bool = True  # panel kernel up to panel_max_rows rows
    panel_max_rows: int = PANEL_MAX_ROWS
    amx_linear: bool = False  # fp32 linears above panel_max_rows rows on AMX (bf16x3)
    greedy_head_route: bool = True  # exact greedy tokens from the LM head's Q8_0 codes
    # fp32 weights that are GGUF blocks dequantized run from their codes alone (quant.py).
    quant_linear: bool = True
    # A decoder's Q8_0 weights run with int8 activations, W8A8 (int8_linear.py).
    int8_linear: bool = True
    # Other fp32 weights run from coded panels, 28 bits a value (coded.py), with quant_linear.
    coded_linear: bool = True
    panel_width: int = 0
    # bf16 weights of an even K packed in k pairs for AVX512_BF16's dot product (PanelWeight).
    bf16_pairs: bool = False
    # The greedy head's batches take AVX512_VNNI's int8 dot product (greedy.py).
    int8_head: bool = False
    head_dims: frozenset = frozenset()
    # Where the weights the kernels stream are placed: huge pages (host_memory.py).
    arena: HugePageArena = field(default_factory=HugePageArena, repr=False)

    @classmethod
    def plan(cls, features: CpuFeatures, ops: Any, *, quant_linear: bool = True
             ) -> "CpuKernelBackend":
        """This level's backend on this CPU, its kernels loaded as `ops`."""
        isa = cls.isa
        if not features.has(isa):
            raise RuntimeError(f"the {isa} backend needs a CPU with {isa}; this one has "
                               f"{', '.join(features.isas) or 'none of ' + ', '.join(ISAS)}")
        return cls(isa, features, half_linear_plan(features, isa), "cpu", ops,
                   quant_linear=quant_linear, panel_width=int(ops.panel_width()),
                   bf16_pairs=bool(ops.bf16_pairs()), int8_head=bool(ops.int8_dot()),
                   head_dims=frozenset(ops.decode_head_dims()), **cls.level_paths(features, ops))

    @classmethod
    def level_paths(cls, features: CpuFeatures, ops: Any) -> dict:
        """The paths this level adds to or changes from the common plan."""
        return {}

    @property
    def has_kernels(self) -> bool:
        return True

    @property
    def paths(self) -> list[str]:
        flags = {"attention": self.attention_kernel, "fused": self.fused,
                 "fp32_linear": self.fp32_linear, "amx_linear": self.amx_linear,
                 "greedy_head": self.greedy_head_route, "quant_linear": self.quant_linear,
                 "coded_linear": self.coded_linear and self.quant_linear,
                 "bf16_pairs": self.bf16_pairs, "int8_head": self.int8_head,
                 "int8_linear": self.int8_linear}
        return [name for name, on in flags.items() if on]

    def fuses(self, x: torch.Tensor) -> bool:
        """Whether the fused elementwise ops take x."""
        return self.fused and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)

    def attends(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether attention takes the kernels: paged decode and the tiled causal prefill,
        which are built for the same dtypes and head sizes."""
        return self.attention_kernel and dtype in (torch.float32, torch.bfloat16) \
            and head_dim in self.head_dims

    # ------------------------------------------------------------ the contract

    def linear_method(self, weight: torch.Tensor, quantization: str | None = None,
                      head: bool = False):
        if weight.device.type != "cpu":
            return super().linear_method(weight, quantization, head)
        return self._cpu_linear_method(weight, quantization, head).place(self.arena)

    def _cpu_linear_method(self, weight: torch.Tensor, quantization: str | None, head: bool):
        if quantization is not None and QuantPanelWeight.applies_to(weight):
            return self._int8_or_codes(QuantPanelWeight.quantize(weight, quantization, self), head)
        if quantization is None:
            exact = QuantPanelWeight.encode(weight, self)
            if exact is not None:
                return self._int8_or_codes(exact, head)
        # A head with a greedy route runs the panel kernel, whose arithmetic the route repeats.
        greedy = head and GreedyHead.applies_to(weight, self)
        if self.half_linear_for(weight.dtype) == "onednn" and PackedWeight.applies_to(weight) \
                and not greedy:
            panel = PanelWeight(weight, self)
            return PackedWeight(weight, self, CodedPairPanels.encode(panel, self) or panel)
        if greedy:
            return PanelWeight(weight, self)
        if PanelWeight.applies_to(weight, self):
            # The narrowest exact form: half panels, coded fp32 panels (not for heads, whose
            # tied embedding looks rows up in their method), fp32 panels.
            return PanelWeight.half_panels(weight, self) \
                or (None if head else CodedPanelWeight.encode(weight, self)) \
                or PanelWeight(weight, self)
        return super().linear_method(weight, None, head)

    def _int8_or_codes(self, method: QuantPanelWeight, head: bool):
        """A decoder's Q8_0 weight runs with int8 activations (int8_linear.py); a head keeps
        the fp32 chain, which its greedy route and embedding lookups read."""
        if self.int8_linear and method.format == "q8_0" and not head:
            codes, d, _ = method.reference_codes()
            if Int8PanelWeight.takes(d):
                return Int8PanelWeight.from_codes(codes, d, self)
        return method

    def greedy_head(self, method, weight: torch.Tensor):
        if GreedyHead.applies_to(weight, self, method):
            return GreedyHead(method, weight, self).place(self.arena)
        return None

    def layer_stack(self, layers, heads, head_dim, scale, eps, dtype):
        if not (self.fused and dtype in (torch.float32, torch.bfloat16)
                and self.attends(dtype, head_dim)):
            return None
        stack = KernelLayerStack(self.ops, layers, heads, scale, eps, dtype,
                                 self.panel_max_rows, KERNEL_PREFILL_MAX_CONTEXT)
        return stack if stack.takes_any else None

    def rotary_write_kv(self, qkv, cos, sin, kv_cache, slot_mapping, heads, kv_heads, head_dim):
        if not self.fuses(qkv):
            return super().rotary_write_kv(qkv, cos, sin, kv_cache, slot_mapping, heads,
                                           kv_heads, head_dim)
        v = qkv[:, (heads + kv_heads) * head_dim :].view(qkv.shape[0], kv_heads, head_dim)
        # One pass: rotated q and k out, rotated k and v into their pool slots.
        q, k = self.ops.rotary_write_kv(qkv, cos, sin, *kv_cache, slot_mapping, heads)
        return q, k, v

    def attention(self, q, k, v, kv_cache, attn, scale, window=None):
        num_tokens, heads, head_dim = q.shape
        if q.device.type != "cpu" or not self.attends(q.dtype, head_dim):
            return super().attention(q, k, v, kv_cache, attn, scale, window)
        return self._kernel_step(q, k, v, kv_cache, attn, scale, window).view(
            num_tokens, heads * head_dim)

    def _kernel_step(self, q, k, v, kv_cache, attn, scale, window) -> torch.Tensor:
        """A step through the kernels -> [T, heads, D]. The decode kernel takes the decodes
        and the short chunks' tokens, each as one query over its causal context read in place
        from the pool, in one call: no gathers, padding, layout copies or per-chunk SDPA calls
        (bench/step_profile.py splits a step's time by op)."""
        k_cache, v_cache = kv_cache
        tables, lens, rows = attn.token_tables()
        long = attn.prefills_longer_than(KERNEL_PREFILL_MAX_CONTEXT)
        if not long:
            return self.paged_attention(q, k_cache, v_cache, tables, lens, scale, window, rows)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        keep = torch.ones(q.shape[0], dtype=torch.bool)
        for chunk in long:
            keep[chunk.query_start : chunk.query_end] = False
            keys, values = paged.chunk_context(k, v, k_cache, v_cache, chunk)
            out[chunk.query_start : chunk.query_end] = self.prefill_attention(
                q[chunk.query_start : chunk.query_end], keys, values, scale, window)
        kept = keep.nonzero().squeeze(1).to(q.device)
        if kept.numel():
            out[kept] = self.paged_attention(
                q.index_select(0, kept), k_cache, v_cache, tables, lens.index_select(0, kept),
                scale, window, rows.index_select(0, kept))
        return out

    def rms_norm(self, x, residual, weight, eps):
        if x.dim() == 2 and self.fuses(x):
            return self.ops.rms_norm(x, residual, weight, eps)
        return super().rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x):
        if x.dim() == 2 and self.fuses(x):
            return self.ops.silu_and_mul(x)
        return super().silu_and_mul(x)

    def lora_add(self, x, a_t, b_t, offsets, rows, mask, out):
        # The layer stack's op: a few rows in one loop, more as torch's two matmuls.
        if self.fuses(x):
            self.ops.lora_add(x, a_t, b_t, offsets, rows, mask, out)
            return out
        return super().lora_add(x, a_t, b_t, offsets, rows, mask, out)

    def argmax_rows(self, logits):
        if self.fuses(logits) and logits.dim() == 2 and logits.stride(-1) == 1 \
                and logits.shape[-1] > 0:
            return self.ops.argmax_rows(logits)
        return super().argmax_rows(logits)

    # ------------------------------------------------------------ kernel ops

    def paged_attention(self, q, k_cache, v_cache, block_tables, seq_lens, scale: float,
                        window: int | None = None, rows=None):
        """q [n, heads, D] over pools [num_blocks, block_size, kv_heads, D], block_tables int32
        [num_rows, max_blocks], seq_lens int32 [n] -> [n, heads, D] in q's dtype. Query i reads
        its context through table row rows[i] (int32 [n]), or row i without rows (then
        num_rows == n); it sees the last `window` tokens of its context where window is set."""
        return self.ops.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                               window or 0, rows)

    def prefill_attention(self, q, k, v, scale: float, window: int | None = None):
        """Causal attention of a chunk's queries q [L, heads, D] over its keys and values
        [S, kv_heads, D], S >= L, query i at position S - L + i -> [L, heads, D]; fp32 or
        bf16 (fp32 math)."""
        return self.ops.prefill_attention(q, k, v, scale, window or 0)

    def linear_f32(self, x, panels, bias, out_features: int):
        """x [M, K] float32 times a weight in panels [ceil(N / W), K, W] -> [M, N] (+ bias)."""
        return self.ops.linear_f32(x, panels, bias, out_features)

    def linear_half(self, x, panels, bias, out_features: int):
        """x [M, K] bf16/fp16 times a weight in panels of x's dtype -> [M, N] in that dtype:
        fp32 products and sums, rounded once."""
        return self.ops.linear_half(x, panels, bias, out_features)

    def linear_amx(self, x, panels, bias, out_features: int):
        """linear_f32's product on AMX, to fp32 accuracy (csrc/linear_amx.cpp)."""
        return self.ops.linear_amx(x, panels, bias, out_features)

    def greedy_tokens(self, approx, x, panels, norms, devs, out_features: int, gamma: float,
                      x_err=None, max_candidates: int = 0, q8_scales=None):
        """The first index of each row's maximum of the panel product of x [M, K] (fp32) and
        panels (fp32, or half precision rounded once; or Q8_0 codes in quant.cpp's panels,
        whose block scales q8_scales holds), from approx [M, N] fp32, whose rows deviate by at
        most devs from the weight's and, where x_err [M, 2] is given, were computed from x
        quantized (int8_head_logits' x_err; see csrc/greedy_head.cpp) -> long[M]; -1 for rows
        with non-finite values, -2 for rows with more than max_candidates (if > 0) columns
        left to compute."""
        return self.ops.greedy_tokens(approx, x, panels, norms, devs, out_features, gamma,
                                      x_err, max_candidates, q8_scales)

    def int8_head_logits(self, x, codes, scales, out_features: int, passes: int = 2):
        """(approx [M, N] fp32, x_err [M, 2]): x [M, K] quantized to 8 bits per block of 32 in
        one or two passes against a head's Q8_0 codes in int8_head.cpp's layout; per row, how
        far the quantized row is from x and the norm of its passes' absolute values."""
        return self.ops.int8_head_logits(x, codes, scales, out_features, passes)

    def int8_greedy_tokens(self, x, codes, scales, panels, norms, devs,
                           out_features: int, gamma: float, max_candidates: int = 0,
                           q8_scales=None):
        """greedy_tokens' answer for x [M, K] (fp32) from the head's codes in int8_head.cpp's
        layout instead of approximate logits: one pass of x's codes over every column, both
        over the candidates' panels -> long[M], with -1 and -2 as greedy_tokens gives them."""
        return self.ops.int8_greedy_tokens(x, codes, scales, panels, norms, devs,
                                           out_features, gamma, max_candidates, q8_scales)


class Avx2Backend(CpuKernelBackend):
    isa = "avx2"

    @classmethod
    def level_paths(cls, features, ops):
        # On AVX2 the panel kernel keeps up with MKL to far larger batches. Coded panels cost
        # more to decode there (8 operations per 8 values, half-width vectors) than their
        # bytes save, at one row and more (bench/linear_kernels.py, `coded` route).
        return {"panel_max_rows": AVX2_PANEL_MAX_ROWS, "coded_linear": False}


class Avx512Backend(CpuKernelBackend):
    isa = "avx512"

    @classmethod
    def level_paths(cls, features, ops):
        if features.vendor == "AuthenticAMD":
            return {"panel_max_rows": AMD_AVX512_PANEL_MAX_ROWS}
        return {}


class AmxBackend(Avx512Backend):
    isa = "amx"

    @classmethod
    def level_paths(cls, features, ops):
        return {**super().level_paths(features, ops), "amx_linear": bool(ops.has_amx())}


KERNEL_BACKENDS = {cls.isa: cls for cls in (Avx2Backend, Avx512Backend, AmxBackend)}
assert tuple(KERNEL_BACKENDS) == ISAS


def plan_for(isa: str, features: CpuFeatures, ops: Any, *, quant_linear: bool = True
             ) -> CpuKernelBackend:
    """The backend of a loaded ISA variant on this CPU."""
    return KERNEL_BACKENDS[isa].plan(features, ops, quant_linear=quant_linear)


def kernel_backend(isa: str, cache_root: str, *, features: CpuFeatures | None = None
                   ) -> TorchBackend:
    """The `isa` backend, its kernels built (or loaded from cache_root) first, synchronously.
    For tests and benches that pin a backend; engines go through the worker's start-up."""
    if isa == "torch":
        return torch_backend()
    features = features or detect_cpu_features()
    if not features.has(isa):
        raise ValueError(f"this CPU ({features.model_name}) cannot run the {isa} backend; it "
                         f"runs: {', '.join(('torch',) + features.isas)}")
    library = kernel_library(isa)
    library.start_build(cache_root, sync=True)
    if not library.available:
        raise RuntimeError(f"the {isa} kernels did not load: {library.error}")
    return plan_for(isa, features, library.ops)

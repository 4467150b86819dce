"""This machine's limits, measured with the threads an engine uses, and a model's cost per token:
the two halves of a roofline, so that any engine figure can be read as a fraction of its bound.

Limits (best of --repeats, after a warm-up):
- `bandwidth_gb_s`: streaming read bandwidth from memory, a buffer of --buffer-mib (far past
  the caches) read whole by torch reductions (sum, matrix-vector), on small pages and on huge
  pages (as the engine places its weights), and by the kernel backend's one-row panel product
  where it builds: the best of them;
- `matmul_gflop_s` (fp32) and `matmul_gflop_s_bf16`: matmul peak at the engine's shapes, the
  decoder's four products and the LM head of --model, at batch sizes of an offline run (64,
  256 and 1024 rows), by the best route this CPU has (MKL; oneDNN's packed bf16 where it runs
  bf16 natively, else torch's bf16; the kernel backend's panel linears where they build).

Costs of --model (each dtype, and each `quantization`), from its config:
- `bytes_per_token_<format>`: what one single-stream decode step must stream: every linear
  weight (LM head included) once, in its storage format, plus the K/V of a --context-token
  context; `decode_bound_tok_s_<format>` = bandwidth / bytes;
- `flops_per_token`: 2 x linear weights + the attention of a --context-token context;
  `offline_bound_tok_s` = fp32 peak / flops.

offline_throughput.py imports `measure_limits`, `ModelCost` and the fractions: decode_frac =
bytes per token x decode tok/s / bandwidth; offline_frac = the run's FLOPs / its seconds / peak.

Usage: python bench/roofline.py [--json] [--threads N] [--model PATH] [--context 576]
           [--buffer-mib 512] [--repeats 5]
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

os.environ.setdefault("TIERSERVE_CPU_KERNELS", "sync")

from report import best_of, emit  # noqa: E402
from tierserve.workers.backends.host_memory import mapped_zeros  # noqa: E402

# Bytes a weight takes per value in each storage format (GGUF blocks of 32: fp16 scale, Q4_1
# an fp16 offset too).
FORMAT_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "q8_0": 34 / 32,
                "q4_1": 20 / 32}
ROWS = (64, 256, 1024)


def measure_bandwidth(buffer_mib: int = 512, repeats: int = 5) -> float:
    """GB/s of streaming reads with torch's current thread count: the buffer on small pages
    (torch's allocator) and on huge pages (the engine's placement of weights and KV pools,
    host_memory.py), the better."""
    ones = torch.ones(1 << 14)
    nbytes = (buffer_mib << 18) * 4  # fp32: 4 bytes a value
    seconds = []
    # Random values: pages of equal bytes may be merged into one (KSM in a VM's host), which
    # reads from cache.
    for buf in (torch.empty(buffer_mib << 18), mapped_zeros((buffer_mib << 18,), torch.float32)):
        buf.uniform_()
        seconds += [best_of(lambda b=buf: b.sum(), repeats),
                    best_of(lambda r=buf.view(-1, 1 << 14): torch.mv(r, ones), repeats)]
    # The kernel backend's one-row panel product, which reads its weight once (a decode row).
    for name, make in _matmul_routes(torch.float32):
        if name == "panel":
            fn = make(torch.rand(buffer_mib << 4, 1 << 14))
            seconds.append(best_of(lambda: fn(ones.view(1, -1)), repeats))
    return nbytes / min(seconds) / 1e9


@dataclass(frozen=True)
class ModelCost:
    """A Llama-family model's per-token costs, from its config."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, path: str | None) -> "ModelCost":
        from tierserve.workers.model.loader import default_model_path, load_model_config
        c = load_model_config(path or default_model_path())
        return cls(c.hidden_size, c.intermediate_size, c.num_hidden_layers,
                   c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size)

    def shapes(self) -> list[tuple[int, int]]:
        """(N, K) of one decoder layer's products: qkv, o, gate_up, down."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return [(q + 2 * kv, self.hidden), (self.hidden, q),
                (2 * self.intermediate, self.hidden), (self.hidden, self.intermediate)]

    @property
    def layer_params(self) -> int:
        return sum(n * k for n, k in self.shapes())

    @property
    def head_params(self) -> int:
        return self.vocab * self.hidden

    def kv_bytes_per_token(self, dtype: str) -> float:
        elem = 2 if dtype in ("bfloat16", "float16") else 4
        return 2 * self.layers * self.kv_heads * self.head_dim * elem

    def bytes_per_token(self, dtype: str, quantization: str | None, context: int) -> float:
        """Bytes one single-stream decode step streams at least: weights and the context's
        K/V. q4_1's LM head is q8_0 (tierserve's layout, as llama.cpp's files)."""
        body = FORMAT_BYTES[quantization or dtype]
        head = FORMAT_BYTES["q8_0" if quantization else dtype]
        return (self.layers * self.layer_params * body + self.head_params * head
                + context * self.kv_bytes_per_token(dtype))

    def flops_per_token(self, context: int, with_head: bool = True) -> float:
        attention = 4 * context * self.heads * self.head_dim * self.layers
        return 2 * (self.layers * self.layer_params
                    + (self.head_params if with_head else 0)) + attention

    def run_flops(self, prompt_lens: list[int], output_len: int) -> float:
        """FLOPs of an offline run: each prompt's prefill (the LM head on its last token only),
        then output_len - 1 decode steps; attention at each token's own context."""
        total = 0.0
        for p in prompt_lens:
            total += p * self.flops_per_token(0, with_head=False) + 2 * self.head_params
            total += 4 * self.heads * self.head_dim * self.layers * p * (p + 1) / 2
            for i in range(1, output_len):
                total += self.flops_per_token(p + i)
        return total


def _matmul_routes(dtype: torch.dtype):
    """(name, make(weight) -> fn(x)) of the routes this CPU has for dtype."""
    from tierserve.runtime import envs
    from tierserve.workers.backends.cpu import kernel_backend
    from tierserve.workers.backends.cpu_features import detect_cpu_features
    from tierserve.workers.backends.linear import PackedWeight, PanelWeight
    routes = [("torch", lambda w: (lambda x: F.linear(x, w)))]
    features = detect_cpu_features()
    if dtype != torch.float32 and features.onednn_bf16 and PackedWeight.applies_to(
            torch.empty(1, 1, dtype=dtype)):
        routes.append(("onednn", lambda w: (lambda x, p=PackedWeight(w): p.linear(x, None))))
    if features.isas:
        try:
            backend = kernel_backend(features.best_isa(), envs.cache_dir())
        except (RuntimeError, ValueError):
            backend = None
        if backend is not None and PanelWeight.applies_to(torch.empty(1, 1, dtype=dtype),
                                                          backend):
            routes.append(("panel", lambda w: (lambda x, p=PanelWeight(w, backend):
                                                  p.linear(x, None))))
    return routes


def measure_matmul(cost: ModelCost, dtype: torch.dtype, repeats: int = 3) -> tuple[float, str]:
    """The best GFLOP/s over routes and ROWS on the model's decoder products, and its route."""
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=gen) * 0.05).to(dtype) for n, k in cost.shapes()]
    best, how = 0.0, ""
    for name, make in _matmul_routes(dtype):
        fns = [make(w) for w in weights]
        for m in ROWS:
            xs = [torch.randn(m, w.shape[1], generator=gen).to(dtype) for w in weights]
            flops = 2 * m * sum(w.numel() for w in weights)

            def run(fns=fns, xs=xs):
                for fn, x in zip(fns, xs):
                    fn(x)
            rate = flops / best_of(run, repeats) / 1e9
            if rate > best:
                best, how = rate, f"{name}, {m} rows"
    return best, how


def measure_limits(model: str | None = None, threads: int | None = None, buffer_mib: int = 512,
                   repeats: int = 5) -> dict:
    """bandwidth_gb_s, matmul_gflop_s (fp32), matmul_gflop_s_bf16 and how each was reached,
    with `threads` torch threads (default: the engine's, every core)."""
    threads = threads or os.cpu_count() or 1
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cost = ModelCost.of(model)
        fp32, fp32_how = measure_matmul(cost, torch.float32, max(repeats // 2, 2))
        bf16, bf16_how = measure_matmul(cost, torch.bfloat16, max(repeats // 2, 2))
        return {"threads": threads, "bandwidth_gb_s": measure_bandwidth(buffer_mib, repeats),
                "matmul_gflop_s": fp32, "matmul_route": fp32_how,
                "matmul_gflop_s_bf16": bf16, "matmul_route_bf16": bf16_how}
    finally:
        torch.set_num_threads(before)


def decode_frac(limits: dict, cost: ModelCost, tok_s: float, dtype: str,
                quantization: str | None, context: int, weight_bytes: int | None = None) -> float:
    """weight_bytes: what the engine's weights take as it holds them, where that is what a step
    streams (a GGUF model run from its codes, whose mix of formats the config does not tell);
    else the config's weights in `quantization` or `dtype`."""
    if weight_bytes is None:
        nbytes = cost.bytes_per_token(dtype, quantization, context)
    else:
        nbytes = weight_bytes + context * cost.kv_bytes_per_token(dtype)
    return nbytes * tok_s / (limits["bandwidth_gb_s"] * 1e9)


def offline_frac(limits: dict, cost: ModelCost, tok_s: float, dtype: str,
                 prompt_lens: list[int], output_len: int) -> float:
    peak = limits["matmul_gflop_s_bf16" if dtype in ("bfloat16", "float16")
                  else "matmul_gflop_s"]
    seconds = len(prompt_lens) * output_len / tok_s
    return cost.run_flops(prompt_lens, output_len) / seconds / (peak * 1e9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--threads", type=int, help="default: every core, as an engine at TP=1")
    ap.add_argument("--model", help="HF folder or .gguf whose shapes and costs to use "
                                    "(default: the default model)")
    ap.add_argument("--context", type=int, default=576,
                    help="context of the single-stream decode (512-token prompt + 64)")
    ap.add_argument("--buffer-mib", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from tierserve.workers.backends.cpu_features import detect_cpu_features
    limits = measure_limits(args.model, args.threads, args.buffer_mib, args.repeats)
    cost = ModelCost.of(args.model)
    result: dict = {"cpu": detect_cpu_features().model_name, **limits}
    for fmt in ("float32", "bfloat16", "q8_0", "q4_1"):
        dtype, quant = (fmt, None) if fmt in FORMAT_BYTES and not fmt.startswith("q") \
            else ("float32", fmt)
        nbytes = cost.bytes_per_token(dtype, quant, args.context)
        result[f"bytes_per_token_{fmt}"] = nbytes
        result[f"decode_bound_tok_s_{fmt}"] = limits["bandwidth_gb_s"] * 1e9 / nbytes
    result["flops_per_token"] = cost.flops_per_token(args.context)
    result["offline_bound_tok_s"] = limits["matmul_gflop_s"] * 1e9 / result["flops_per_token"]
    emit(result, args.json)


if __name__ == "__main__":
    main()

"""One decode step of a single sequence through the model: the decoder layers in one C++ call
(the kernel backend's layer stack, workers/backends/stack.py) against the same kernels called
layer by layer from Python.

A step is the model's forward for one token after a --context-token context (K/V pools of
random values, one per layer, as a worker allocates them) plus the greedy LM head: what a lone
decode costs without the engine around it. The two paths alternate --repeats times in one
process, --steps steps each (median), so that drift in this machine's memory bandwidth falls
on both; the table gives each path's median over the repeats. --model: `default` (the GGUF
default model, its linears run from their Q4_1 codes) or `dense-noise` (its weights plus 1%
Gaussian noise, an HF checkpoint exported once by bench/export_hf.py). --quantization q8_0|q4_1
adds, per dtype, the same model quantized at load (rows `<dtype>+<format>`).

--ops N adds where a step's time goes: the layer-by-layer path under torch.profiler for
--steps steps, the N ops of most self CPU time per dtype in milliseconds per step (the stack
path is one op: it runs these kernels in this order), the rest summed as `other` (small
tensor ops, allocations), and `python`: the path's step time (layers_ms) less all its ops.

Usage: python bench/decode_step.py [--json] [--model default|dense-noise|PATH]
                                   [--dtypes float32,bfloat16] [--context 580] [--repeats 6]
                                   [--ops 6] [--quantization q8_0]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from report import print_table
from tierserve.runtime import envs
from tierserve.workers.attention import AttentionMetadata
from tierserve.workers.backends.cpu import kernel_backend
from tierserve.workers.backends.cpu_features import detect_cpu_features
from tierserve.workers.kv_pool import allocate_kv_cache
from tierserve.workers.model.loader import default_model_path, load_model

BLOCK_SIZE = 16


def model_path(name: str) -> str:
    if name == "default":
        return default_model_path()
    if name == "dense-noise":
        from export_hf import export_hf
        return export_hf(noise=0.01)
    return name


def step_fn(model, config, dtype: torch.dtype, context: int):
    """A callable running one decode step of a `context`-token sequence."""
    blocks = -(-context // BLOCK_SIZE)
    kv = allocate_kv_cache(config.num_hidden_layers, blocks + 4, BLOCK_SIZE,
                           model.kv_heads_per_rank, config.head_dim, dtype, "cpu")
    for k, v in kv:
        k.normal_()
        v.normal_()
    table = list(range(blocks))
    last = context - 1
    slot = table[last // BLOCK_SIZE] * BLOCK_SIZE + last % BLOCK_SIZE

    def step() -> None:
        attn = AttentionMetadata.build(slot_mapping=[slot], query_lens=[1], seq_lens=[context],
                                       block_tables=[table], num_decodes=1,
                                       block_size=BLOCK_SIZE)
        hidden = model(torch.tensor([123]), torch.tensor([last]), attn, kv)
        if model.greedy_tokens(hidden) is None:
            model.compute_logits(hidden).argmax(-1)
    return step


def time_paths(model, step, repeats: int, steps: int) -> dict[str, float]:
    """Median ms per step of each path, alternating the paths `repeats` times."""
    runs: dict[str, list[float]] = {"stack": [], "layers": []}
    for _ in range(repeats):
        for name in runs:
            model.model.use_layer_stack = name == "stack"
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            runs[name].append(statistics.median(times) * 1e3)
    model.model.use_layer_stack = True
    return {name: statistics.median(ms) for name, ms in runs.items()}


def op_split(step, steps: int, top: int, wall_ms: float) -> dict[str, float]:
    """Milliseconds per step of the `top` ops of most self CPU time, then `other` (the rest of
    the ops) and `python` (wall_ms, the path's unprofiled step, less all the ops)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    ops = sorted(((e.key.split("::")[-1], e.self_cpu_time_total / 1e3 / steps)
                  for e in prof.key_averages()), key=lambda kv: -kv[1])
    split = {f"{name}_ms": round(ms, 3) for name, ms in ops[:top]}
    split["other_ms"] = round(sum(ms for _, ms in ops[top:]), 3)
    split["python_ms"] = round(max(0.0, wall_ms - sum(ms for _, ms in ops)), 3)
    return split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--model", default="dense-noise")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--context", type=int, default=580)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--ops", type=int, default=0, help="add the N costliest ops per step")
    parser.add_argument("--quantization", choices=("q8_0", "q4_1"),
                        help="also each dtype with its weights quantized at load")
    args = parser.parse_args()
    features = detect_cpu_features()
    if features.best_isa() == "torch":
        raise SystemExit("this CPU runs no kernel backend: there is no layer stack to time")
    backend = kernel_backend(features.best_isa(), envs.cache_dir())
    path = model_path(args.model)
    rows, splits = [], {}
    with torch.inference_mode():
        variants = [(d, q) for d in args.dtypes.split(",")
                    for q in (None, args.quantization) if q or q is None]
        for dtype_name, quantization in variants:
            dtype = getattr(torch, dtype_name)
            name = dtype_name + (f"+{quantization}" if quantization else "")
            config, model = load_model(path, dtype, "cpu", backend, quantization=quantization)
            step = step_fn(model, config, dtype, args.context)
            for _ in range(5):  # warm-up: kernels, pages, caches
                step()
            ms = time_paths(model, step, args.repeats, args.steps)
            rows.append({"dtype": name, "stack_ms": round(ms["stack"], 2),
                         "layers_ms": round(ms["layers"], 2),
                         "stack_tok_s": round(1e3 / ms["stack"], 1),
                         "saved_ms": round(ms["layers"] - ms["stack"], 2)})
            if args.ops:
                model.model.use_layer_stack = False
                splits[name] = op_split(step, args.steps, args.ops, ms["layers"])
                model.model.use_layer_stack = True
    result = {"cpu": features.model_name, "backend": backend.name, "model": args.model,
              "context": args.context, "threads": torch.get_num_threads(), "rows": rows}
    if splits:
        result["ops"] = splits
    if args.json:
        import json
        print(json.dumps(result))
        return
    print(f"# {result['cpu']}, {backend.name}, {result['threads']} threads; {args.model}, one "
          f"sequence of {args.context} tokens")
    print_table(rows)
    if splits:
        print("\n# ms per step of the layer-by-layer path, by op (self CPU time)")
        names = list(dict.fromkeys(k for split in splits.values() for k in split))
        print_table([{"op": k.removesuffix("_ms"), **{d: split.get(k, "") for d, split
                                                      in splits.items()}} for k in names])


if __name__ == "__main__":
    main()

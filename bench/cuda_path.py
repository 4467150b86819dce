"""The CUDA path against the GPU's own limits: offline throughput, single-stream decode and TTFT
of tierserve on one GPU, beside transformers' batched generate on the same GPU and weights,
each as a fraction of its roofline bound.

Limits, measured first on the GPU (best of --repeats after a warm-up, CUDA events):
- `bandwidth_gb_s`: streaming reads of a --buffer-mib buffer (a sum; a copy counted as read
  plus write), the better of the two;
- `matmul_gflop_s_<dtype>`: the best matmul rate at the model's decoder shapes (qkv, o,
  gate_up, down) over batches of 64 to 16,384 rows; fp32 with TF32 off, as the engine runs it.

Workload (as offline_throughput.py's): --num-prompts chat prompts of 20-200 tokens, --output-len
greedy tokens each, EOS ignored; decode: one request alone, the time of 1 + output-len tokens
minus that of 1 token after a --prompt-len prompt; TTFT: a fresh --prompt-len prompt, then again
with its prefix cached (medians of three). Each engine runs the whole workload once untimed
first (its decode CUDA graphs captured). On CUDA tierserve runs twice: with its decode graphs
(`tierserve_*`) and with enforce_eager (`tierserve_eager_*`).
decode_frac = bytes a decode step streams (weights + the context's K/V) x tok/s / bandwidth;
offline_frac = the run's FLOPs / its seconds / the matmul peak of its dtype.

--shape DIR: a folder with a config.json and tokenizer (e.g. the default model's export, less
its weights); the weights are drawn at random (seeded) from the config: speed does not depend
on their values, and a dense checkpoint of the default model's size does not need to be
carried to the GPU machine. --model DIR: an HF folder with its weights.
--device cpu runs the same code on this machine's CPU (roofline.py's limits), for checking.

Usage: python bench/cuda_path.py (--shape DIR | --model DIR) [--json] [--dtypes bfloat16,float32]
           [--num-prompts 64] [--output-len 128] [--prompt-len 512] [--skip-hf] [--skip-eager]
           [--device cuda]
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import tempfile
import time

import torch

from report import emit
from roofline import ModelCost

ROWS = (64, 256, 1024, 4096, 16384)


def cuda_time(fn, repeats: int) -> float:
    """Best seconds of fn over repeats, after one warm-up, timed with CUDA events."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def cuda_bandwidth(buffer_mib: int, repeats: int) -> tuple[float, str]:
    buf = torch.ones(buffer_mib << 18, device="cuda")
    dst = torch.empty_like(buf)
    nbytes = buf.numel() * 4
    read = nbytes / cuda_time(lambda: buf.sum(), repeats) / 1e9
    copy = 2 * nbytes / cuda_time(lambda: dst.copy_(buf), repeats) / 1e9
    buf = dst = None  # freed before the cache is emptied
    torch.cuda.empty_cache()
    return max((read, "sum"), (copy, "copy"))


def cuda_matmul(cost: ModelCost, dtype: torch.dtype, repeats: int) -> tuple[float, str]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(n, k, device="cuda", generator=gen).mul_(0.05).to(dtype)
               for n, k in cost.shapes()]
    best, how = 0.0, ""
    for m in ROWS:
        xs = [torch.randn(m, w.shape[1], device="cuda", generator=gen).to(dtype) for w in weights]

        def run(xs=xs):
            for w, x in zip(weights, xs):
                torch.nn.functional.linear(x, w)
        rate = 2 * m * sum(w.numel() for w in weights) / cuda_time(run, repeats) / 1e9
        if rate > best:
            best, how = rate, f"{m} rows"
    return best, how


def gpu_limits(cost: ModelCost, buffer_mib: int, repeats: int) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    bandwidth, route = cuda_bandwidth(buffer_mib, repeats)
    limits = {"gpu": torch.cuda.get_device_name(), "bandwidth_gb_s": bandwidth,
              "bandwidth_route": route}
    for dtype, short in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        rate, how = cuda_matmul(cost, dtype, repeats)
        limits[f"matmul_gflop_s_{short}"], limits[f"matmul_route_{short}"] = rate, how
    return limits


def cpu_limits(model: str, buffer_mib: int, repeats: int) -> dict:
    from roofline import measure_limits
    from tierserve.workers.backends.cpu_features import detect_cpu_features
    limits = measure_limits(model, buffer_mib=buffer_mib, repeats=repeats)
    return {"cpu": detect_cpu_features().model_name, "bandwidth_gb_s": limits["bandwidth_gb_s"],
            "matmul_gflop_s_fp32": limits["matmul_gflop_s"],
            "matmul_gflop_s_bf16": limits["matmul_gflop_s_bf16"]}


def random_weights(shape_dir: str, seed: int = 0) -> str:
    """A copy of shape_dir (config, tokenizer) with seeded random fp32 weights."""
    from transformers import AutoConfig, AutoModelForCausalLM
    out = tempfile.mkdtemp(prefix="tierserve-shape-")
    for name in os.listdir(shape_dir):
        if not name.endswith((".safetensors", ".bin", ".gguf")):
            shutil.copy(os.path.join(shape_dir, name), out)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(shape_dir),
                                             dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    return out


def chat_prompts(model: str, n: int) -> list[list[int]]:
    from offline_throughput import make_chat_prompts
    from tierserve.runtime.tokenizer import load_tokenizer
    return make_chat_prompts(load_tokenizer(model), n)


def run_tierserve(model: str, dtype: str, device: str, prompts, args,
                  enforce_eager: bool = False) -> dict:
    from tierserve import LLM, SamplingParams

    def timed(batch, n):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        assert all(o.error is None and len(o.outputs[0].token_ids) == n for o in outs)
        return seconds, outs

    rng = random.Random(1)
    long = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(6)]
    with LLM(model, dtype=dtype, device=device, max_model_len=2048,
             enforce_eager=enforce_eager) as llm:
        backend = llm.stats()["cpu_backend"]
        # Warm-up: every shape the timed runs see (on CUDA, decode graphs are captured and
        # cuDNN builds its attention per shape): the workload fresh, then with its prefixes
        # cached as the timed run sees it, and a long prompt fresh, then cached.
        timed(prompts, args.output_len)
        timed(prompts, args.output_len)
        timed([long[5]], 1 + args.output_len)
        timed([long[5]], 1)
        seconds, _ = timed(prompts, args.output_len)
        result = {"backend": backend, "offline_tok_s": len(prompts) * args.output_len / seconds}
        prefill_s, _ = timed([long[0]], 1)
        total_s, _ = timed([long[1]], 1 + args.output_len)
        result["decode_tok_s"] = args.output_len / (total_s - prefill_s)
        cold, cached = [], []
        for prompt in long[2:]:
            cold.append(timed([prompt], 1)[0] * 1e3)
            cached.append(timed([prompt], 1)[0] * 1e3)
        result["ttft_ms"], result["ttft_cached_ms"] = statistics.median(cold), \
            statistics.median(cached)
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
    return result


def run_transformers(model: str, dtype: str, device: str, prompts, output_len: int) -> float:
    from offline_throughput import bench_transformers
    return bench_transformers(dtype, prompts, output_len, model, device)


def fractions(result: dict, limits: dict, cost: ModelCost, dtype: str, prompts,
              args, prefix: str) -> None:
    short = {"bfloat16": "bf16", "float32": "fp32"}[dtype]
    lengths = [len(p) for p in prompts]
    tok_s = result[f"{prefix}_offline_tok_s_{short}"]
    seconds = len(prompts) * args.output_len / tok_s
    result[f"{prefix}_offline_frac_{short}"] = cost.run_flops(lengths, args.output_len) / \
        seconds / (limits[f"matmul_gflop_s_{short}"] * 1e9)
    decode = result.get(f"{prefix}_decode_tok_s_{short}")
    if decode is not None:
        context = args.prompt_len + args.output_len // 2
        result[f"{prefix}_decode_frac_{short}"] = cost.bytes_per_token(dtype, None, context) * \
            decode / (limits["bandwidth_gb_s"] * 1e9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--shape", help="config + tokenizer folder; random weights")
    where.add_argument("--model", help="HF folder with weights")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-eager", action="store_true",
                    help="no second tierserve run with enforce_eager (no CUDA graphs)")
    ap.add_argument("--buffer-mib", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    model = args.model or random_weights(args.shape)
    cost = ModelCost.of(model)
    result: dict = {"torch": torch.__version__, "weights": "random" if args.shape else model}
    limits = gpu_limits(cost, args.buffer_mib, args.repeats) if args.device == "cuda" \
        else cpu_limits(model, min(args.buffer_mib, 512), args.repeats)
    result.update(limits)
    prompts = chat_prompts(model, args.num_prompts)
    for dtype in args.dtypes.split(","):
        short = {"bfloat16": "bf16", "float32": "fp32"}[dtype]
        for prefix, eager in (("tierserve", False), ("tierserve_eager", True)):
            if eager and (args.skip_eager or args.device != "cuda"):
                continue
            ours = run_tierserve(model, dtype, args.device, prompts, args, eager)
            result["tierserve_backend"] = ours.pop("backend")
            result.update({f"{prefix}_{k.replace('_tok_s', '_tok_s_' + short)}"
                           if "tok_s" in k else f"{prefix}_{k}_{short}": v
                           for k, v in ours.items()})
            fractions(result, limits, cost, dtype, prompts, args, prefix)
        if not args.skip_hf:
            result[f"transformers_offline_tok_s_{short}"] = run_transformers(
                model, dtype, args.device, prompts, args.output_len)
            fractions(result, limits, cost, dtype, prompts, args, "transformers")
            result[f"offline_ratio_{short}"] = result[f"tierserve_offline_tok_s_{short}"] / \
                result[f"transformers_offline_tok_s_{short}"]
    emit(result, args.json)


if __name__ == "__main__":
    main()

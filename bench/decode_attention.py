"""Per-layer decode attention time: the torch gather + SDPA path against the C++ paged kernel.

SmolLM2-135M shapes: 64 decode sequences of 40-330 tokens (seeded), 9 query heads over 3 KV
heads, head_dim 64, block_size 16, block ids scattered over the pool. Each of 30 layers has its
own pool (on huge pages, as the engine's), as in a real step, so one step's K/V does not sit in
cache from the previous layer;
a step is `paged_attention` over all 30 layers (the pools already hold the step's K/V),
reported per layer. Median of --steps steps per run, then the median over --repeats runs.
--single N times one sequence of N tokens instead (a lone decode: the kernel splits its context
so that every thread has work).

--model-step also times whole decode steps of SmolLM2-135M (the default GGUF) over the same 64
sequences, torch path against kernel. There the gather is dearer than in the isolated loop: its
multi-megabyte outputs land on freshly mapped pages every layer (about 200k minor page faults
per float32 step, none with the kernel).

The kernel is the one of --cpu-isa's backend (default: the best this CPU runs).

Usage: python bench/decode_attention.py [--json] [--dtypes float32,bfloat16] [--repeats 3]
                                        [--single N] [--model-step]
                                        [--cpu-isa avx2|avx512|amx]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from report import emit
from tierserve.runtime import envs
from tierserve.workers.attention import AttentionMetadata, paged_attention
from tierserve.workers.backends.base import Backend
from tierserve.workers.backends.cpu import kernel_backend
from tierserve.workers.backends.portable import torch_backend
from tierserve.workers.backends.cpu_features import detect_cpu_features
from tierserve.workers.backends.host_memory import mapped_zeros

NUM_SEQS, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, LAYERS = 64, 9, 3, 64, 16, 30


def make_batch(num_blocks_factor: int = 2, seed: int = 0, single: int = 0):
    """Context lengths, scattered block tables, last-token slots and the pool size: NUM_SEQS
    ragged contexts, or one of `single` tokens."""
    rng = random.Random(seed)
    lens = [single] if single else [rng.randint(40, 330) for _ in range(NUM_SEQS)]
    need = sum(-(-n // BLOCK_SIZE) for n in lens)
    ids = list(range(num_blocks_factor * need))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in lens:
        k = -(-n // BLOCK_SIZE)
        tables.append(ids[at : at + k])
        at += k
    slots = [t[(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE
             for t, n in zip(tables, lens)]
    return lens, tables, slots, len(ids)


def metadata(lens, tables, slots) -> AttentionMetadata:
    return AttentionMetadata.build(slot_mapping=slots, query_lens=[1] * len(lens), seq_lens=lens,
                                   block_tables=tables, num_decodes=len(lens),
                                   block_size=BLOCK_SIZE)


def random_pool(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Random K or V rows on huge pages where the kernel allows, as the engine places its
    pools (workers/backends/host_memory.py): on 4 KiB pages the kernel reads them slower."""
    return mapped_zeros(shape, dtype).copy_(torch.randn(shape))


def make_step(dtype: torch.dtype, single: int = 0):
    lens, tables, slots, num_blocks = make_batch(single=single)
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    pools = [(random_pool(shape, dtype), random_pool(shape, dtype)) for _ in range(LAYERS)]
    q = torch.randn(len(lens), HEADS, HEAD_DIM).to(dtype)
    return q, pools, (lens, tables, slots)


def time_step(q, pools, attn, backend: Backend, steps: int) -> float:
    """Median per-layer microseconds of one step (all layers' attention)."""
    scale = HEAD_DIM ** -0.5
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        for k_cache, v_cache in pools:
            paged_attention(q, None, None, (k_cache, v_cache), attn, scale, backend,
                            kv_written=True)
        if i >= 2:  # the first steps build the gather mask and warm the allocator
            times.append((time.perf_counter() - t0) / len(pools) * 1e6)
    return statistics.median(times)


def run(dtype: torch.dtype, steps: int, backend: Backend, single: int = 0) -> dict:
    q, pools, batch = make_step(dtype, single)
    return {"attn_torch_us": time_step(q, pools, metadata(*batch), torch_backend(), steps),
            "attn_kernel_us": time_step(q, pools, metadata(*batch), backend, steps)}


def model_step_ms(dtype: torch.dtype, steps: int, backend: Backend) -> dict:
    """Median ms of one SmolLM2-135M decode step (forward + logits), torch backend and the
    kernel backend."""
    from tierserve.workers.kv_pool import allocate_kv_cache
    from tierserve.workers.model.loader import default_model_path, load_model

    lens, tables, slots, num_blocks = make_batch(num_blocks_factor=1)
    tokens = torch.randint(100, 1000, (NUM_SEQS,))
    positions = torch.tensor([n - 1 for n in lens])
    result = {}
    with torch.inference_mode():
        for name, chosen in (("step_torch_ms", torch_backend()), ("step_kernel_ms", backend)):
            config, model = load_model(default_model_path(), dtype, torch.device("cpu"), chosen)
            kv = allocate_kv_cache(config.num_hidden_layers, num_blocks, BLOCK_SIZE,
                                   model.kv_heads_per_rank, config.head_dim, dtype, "cpu")
            for k_cache, v_cache in kv:
                k_cache.normal_()
                v_cache.normal_()
            times = []
            for i in range(steps + 2):
                t0 = time.perf_counter()
                attn = metadata(lens, tables, slots)
                model.compute_logits(model(tokens, positions, attn, kv))
                if i >= 2:
                    times.append((time.perf_counter() - t0) * 1e3)
            result[name] = statistics.median(times)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--single", type=int, default=0, metavar="N",
                        help="one sequence of N tokens instead of 64 ragged ones")
    parser.add_argument("--model-step", action="store_true")
    parser.add_argument("--cpu-isa", choices=("avx2", "avx512", "amx"),
                        default=detect_cpu_features().best_isa())
    args = parser.parse_args()
    if args.single < 0 or args.single and args.model_step:
        parser.error("--single takes a positive length, and times attention alone (no "
                     "--model-step)")
    if args.cpu_isa == "torch":
        raise SystemExit("this CPU runs no kernel backend")
    backend = kernel_backend(args.cpu_isa, envs.cache_dir())
    torch.manual_seed(0)
    result = {"backend": backend.name, "threads": torch.get_num_threads()}
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        runs = [run(dtype, args.steps, backend, args.single) for _ in range(args.repeats)]
        if args.model_step:
            runs = [r | model_step_ms(dtype, args.steps, backend) for r in runs]
        for key in runs[0]:
            result[f"{name}_{key}"] = statistics.median(r[key] for r in runs)
        result[f"{name}_attn_speedup"] = (result[f"{name}_attn_torch_us"]
                                          / result[f"{name}_attn_kernel_us"])
    emit(result, args.json)


if __name__ == "__main__":
    main()

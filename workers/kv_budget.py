"""How many KV blocks one rank's pool can hold: the spec's block count or byte budget, else a
default budget (on CPU a share of the node's available memory, on CUDA the free memory a
profiled max-size forward leaves). The runtime takes the minimum over the ranks, so that a block
id names the same slot on every rank."""
from __future__ import annotations

import os
from typing import Callable

import torch

from tierserve.scheduler.messages import NewRequestData, SchedulerOutput
from tierserve.scheduler.params import SamplingParams
from tierserve.workers.kv_pool import kv_cache_bytes_per_block
from tierserve.workers.model_runner import ModelRunner
from tierserve.workers.worker_spec import WorkerSpec

__all__ = ["determine_num_blocks"]

# CPU pools default to this much for the whole engine (or a fifth of available memory, if
# less), and to at most this many blocks: a tiny model would otherwise get millions of blocks
# of bookkeeping.
_CPU_DEFAULT_KV_BYTES = 1 << 30
# A default budget's pool (no kv_cache_memory_bytes) holds at most this many blocks: the
# bookkeeping (one KVCacheBlock per id, O(blocks) integrity checks) grows with the count, and a
# small model's blocks are small enough for a GPU's memory to hold tens of millions.
_DEFAULT_MAX_BLOCKS = {"cpu": 32768, "cuda": 1 << 19}

# Builds a runner over a fresh pool of that many blocks (the Worker's own factory, so that the
# profiled forward runs exactly what the rank will serve with).
MakeRunner = Callable[[int], ModelRunner]


def determine_num_blocks(spec: WorkerSpec, config, device: torch.device, dtype: torch.dtype,
                         make_runner: MakeRunner) -> int:
    """How many blocks this rank can hold, for the model config it has loaded."""
    if spec.num_kv_blocks is not None:
        return spec.num_kv_blocks
    per_block = kv_cache_bytes_per_block(config, spec.tensor_parallel_size, spec.block_size,
                                         dtype)
    budget = spec.kv_cache_memory_bytes or _default_budget(spec, device, make_runner)
    num_blocks = budget // per_block
    if spec.kv_cache_memory_bytes is None:
        num_blocks = min(num_blocks, _DEFAULT_MAX_BLOCKS[device.type])
    if num_blocks < 2:
        raise ValueError(f"KV cache budget of {budget} bytes holds {num_blocks} blocks of "
                         f"{per_block} bytes, and an engine needs 2 at least; set "
                         f"kv_cache_memory_bytes={2 * per_block} or more")
    return int(num_blocks)


def _default_budget(spec: WorkerSpec, device: torch.device, make_runner: MakeRunner) -> int:
    if device.type == "cuda":
        return _profile_cuda_budget(spec, device, make_runner)
    # The engine's whole pool, split between its ranks (each holds its heads' share of a
    # block): the same tokens at any TP size, where ranks share a node's memory.
    available = _available_memory_bytes()
    return min(_CPU_DEFAULT_KV_BYTES, available // 5) // spec.tensor_parallel_size


def _profile_cuda_budget(spec: WorkerSpec, device: torch.device,
                         make_runner: MakeRunner) -> int:
    """Free memory times utilisation, less the peak a max-size forward needs."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    _dummy_forward(make_runner, spec.block_size, spec.max_num_batched_tokens)
    torch.cuda.synchronize(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - before
    free, total = torch.cuda.mem_get_info(device)
    used_by_others = total - free
    budget = int(total * spec.gpu_memory_utilization) - used_by_others - activation_peak
    return max(budget, 0)


def _dummy_forward(make_runner: MakeRunner, block_size: int, num_tokens: int) -> None:
    num_blocks = -(-num_tokens // block_size) + 1
    runner = make_runner(num_blocks)
    prompt = [0] * num_tokens
    new = NewRequestData("profile", prompt, SamplingParams(temperature=0),
                         list(range(num_blocks - 1)))
    out = SchedulerOutput(0, scheduled_new_reqs=[new], num_scheduled_tokens=[num_tokens])
    runner.execute(out)
    del runner


def _available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

"""EngineConfig: the one frozen, validated configuration, built at the entry point.

Names follow vLLM's where vLLM has one. Unknown options are errors (with a suggestion), never
dropped. Leaf classes (Scheduler, KVCacheManager, Worker) receive plain values taken from it.
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass

from tierserve.kvcache import HASH_ALGORITHMS
from tierserve.runtime.envs import CPU_ISAS
from tierserve.scheduler.queues import POLICIES

__all__ = ["EngineConfig", "DTYPES"]

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
PLACEMENT_STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None  # HF folder or .gguf file; None = the default SmolLM2 GGUF
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"
    tensor_parallel_size: int = 1
    block_size: int = 16
    max_model_len: int | None = None  # None: min(model's max positions, 8192)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    verify_prefix_hits: bool = True
    prefix_caching_hash_algo: str = "xxhash"
    scheduling_policy: str = "fcfs"
    kv_cache_memory_bytes: int | None = None  # None: a share of free memory (see workers)
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None  # exact override, for tests
    hash_seed: int = 0
    seed: int = 0
    distributed: bool = False  # run on Ray even at TP=1
    placement_strategy: str = "PACK"
    cpus_per_worker: int | None = None  # CPUs (and torch threads) per rank; None: cores / TP
    step_timeout_s: float = 60.0
    tokenizer: str | None = None  # a separate tokenizer folder; default: the model's
    # Highest ISA level of the CPU kernels: auto / amx / avx512 / avx2 / torch (none);
    # None: TIERSERVE_CPU_ISA, else auto.
    cpu_isa: str | None = None

    def __post_init__(self) -> None:
        _one_of("dtype", self.dtype, DTYPES)
        _one_of("device", self.device, DEVICES)
        _one_of("scheduling_policy", self.scheduling_policy, POLICIES)
        _one_of("prefix_caching_hash_algo", self.prefix_caching_hash_algo, HASH_ALGORITHMS)
        _one_of("placement_strategy", self.placement_strategy, PLACEMENT_STRATEGIES)
        if self.cpu_isa is not None:
            _one_of("cpu_isa", self.cpu_isa, CPU_ISAS)
        for name in ("tensor_parallel_size", "block_size", "max_num_seqs",
                     "max_num_batched_tokens"):
            _positive_int(name, getattr(self, name))
        for name in ("max_model_len", "kv_cache_memory_bytes", "num_kv_blocks",
                     "cpus_per_worker"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        if not isinstance(self.long_prefill_token_threshold, int) or (
                self.long_prefill_token_threshold < 0):
            raise ValueError("long_prefill_token_threshold must be an int >= 0 (0 disables it)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if not 0 <= self.hash_seed < 2**64:
            raise ValueError("hash_seed must be in [0, 2**64)")
        if self.step_timeout_s <= 0:
            raise ValueError("step_timeout_s must be positive")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError("num_kv_blocks must be >= 2 (one block is the null block)")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(key, names, n=1)
                hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ValueError(f"unknown engine option(s): {', '.join(hints)}; valid options: "
                             f"{', '.join(names)}")
        return cls(**kwargs)

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    @property
    def use_ray(self) -> bool:
        return self.distributed or self.tensor_parallel_size > 1


def _one_of(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}; got {value!r}")


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")

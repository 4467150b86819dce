"""What the runtime and a rank exchange over the control plane: the plain values a rank is
built from (WorkerSpec), what it reports once its shard is loaded (ModelInfo) and once its KV
tiers exist (TierReport), and the device a spec names."""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["WorkerSpec", "ModelInfo", "TierReport", "resolve_device"]


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Plain values a rank needs; built by the runtime from its EngineConfig (make_worker_spec),
    which owns every default."""

    model: str
    dtype: str  # float32 / bfloat16 / float16 (already resolved from "auto")
    device: str  # cpu / cuda (already resolved from "auto")
    block_size: int
    tensor_parallel_size: int
    max_num_batched_tokens: int
    seed: int
    kv_cache_memory_bytes: int | None
    gpu_memory_utilization: float
    num_kv_blocks: int | None
    cpu_threads: int | None
    collective_timeout_s: float
    # Compiled CPU kernels: "background", "sync" or "off" (see workers/backends/kernels.py),
    # built into cache_dir; None cache_dir means no kernels. cpu_isa caps the kernels' ISA level
    # ("auto": the CPU's best; "torch": none).
    cpu_kernels: str
    cpu_isa: str
    cache_dir: str | None
    quantized_linears: bool
    # KV tiers below the pool (workers/tier_copier.py): CPU bytes per rank (0: none); the SSD
    # folder shared by every engine on it, its capacity in bytes, and the KV fingerprint that
    # names its entries (workers/kv_fingerprint.py; "" without an SSD folder).
    kv_offload_cpu_bytes: int
    kv_offload_ssd_path: str | None
    kv_offload_ssd_bytes: int
    kv_fingerprint: str = ""
    # Capacities of the persistent input batch (rows, tokens per row); None: grown on demand.
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    # The engine schedules a step before it knows the tokens of the step before (async
    # scheduling): the ranks append their sampled tokens to the batch themselves.
    async_scheduling: bool = False
    # The tokenizer.json structured outputs compile grammars against (on the driver rank).
    tokenizer_file: str | None = None
    # Block format the linears are quantized to at load ("q8_0", "q4_1"), or None.
    quantization: str | None = None
    # On CUDA, run decode steps eagerly instead of replaying CUDA graphs (workers/cuda_graphs.py).
    enforce_eager: bool = False
    # LoRA adapters a rank keeps loaded (0: LoRA is off) and the largest rank accepted.
    max_loaded_loras: int = 0
    max_lora_rank: int = 16
    # Test-only fault injection (rank, step id, seconds): that rank sleeps before that step.
    debug_stall: tuple[int, int, float] | None = None
    # Test-only fault injection (rank, token id): that rank crashes on a new request holding
    # the token (Worker.crash).
    debug_crash: tuple[int, int] | None = None
    # Test-only: tier copies complete late, destinations poisoned until then
    # (workers/tier_streams.py LateCopies).
    debug_late_copies: bool = False


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What a rank reports once its shard is loaded."""

    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    backend: dict  # Backend.describe() of the backend the rank runs
    kv_block_bytes: int  # one block id of the pool on this rank, all layers, K and V
    weight_bytes: int = 0  # the model shard's weights as this rank holds them
    decode_weight_bytes: int = 0  # of them, what a lone greedy decode step reads


@dataclass(frozen=True, slots=True)
class TierReport:
    """A rank's KV tiers once allocated: its CPU slots, the KV heads [lo, hi) its SSD entries
    hold, and its pool <-> CPU tier copy bandwidth."""

    cpu_slots: int
    kv_heads: tuple[int, int]
    copy_bytes_per_s: float


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but CUDA is not available")
    return device

"""Tensor-parallel process state.

TP is the only parallelism, so the TP group is the default (world) group. Every collective here
is a no-op at TP=1, which keeps single-device runs free of torch.distributed entirely.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

_TP_RANK = 0
_TP_SIZE = 1
_TP_GROUP: dist.ProcessGroup | None = None


def init_distributed(
    rank: int,
    world_size: int,
    init_method: str,
    backend: str | None = None,
    timeout_s: float = 300.0,
) -> None:
    """Join the TP group. `timeout_s` bounds every collective, so a dead peer fails loudly."""
    global _TP_RANK, _TP_SIZE, _TP_GROUP
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world of size {world_size}")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if world_size > 1:
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised in this process")
        dist.init_process_group(
            backend=backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        _TP_GROUP = dist.group.WORLD
    _TP_RANK, _TP_SIZE = rank, world_size


def destroy_distributed() -> None:
    global _TP_RANK, _TP_SIZE, _TP_GROUP
    if _TP_GROUP is not None and dist.is_initialized():
        dist.destroy_process_group()
    _TP_RANK, _TP_SIZE, _TP_GROUP = 0, 1, None


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the TP group in place and return it."""
    if _TP_SIZE == 1:
        return x
    dist.all_reduce(x, group=_TP_GROUP)
    return x


def tp_all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    """Element-wise maximum of `x` over the TP group, in place."""
    if _TP_SIZE == 1:
        return x
    dist.all_reduce(x, op=dist.ReduceOp.MAX, group=_TP_GROUP)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order (all shards have equal shape)."""
    if _TP_SIZE == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x, group=_TP_GROUP)
    return torch.cat(parts, dim=dim)

"""Tensor-parallel process state.

TP is the only parallelism, so the TP group is the default (world) group. Every collective here
is a no-op at TP=1, which keeps single-device runs free of torch.distributed entirely.
"""
from __future__ import annotations

import socket
from datetime import timedelta
from urllib.parse import urlsplit

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
    listen_fd: int | None = None,
) -> None:
    """Join the TP group. `timeout_s` bounds every collective, so a dead peer fails loudly.
    init_method is tcp://HOST:PORT, the store rank 0 serves; listen_fd, on rank 0, is a socket
    already listening there (`listen_socket`)."""
    global _TP_RANK, _TP_SIZE, _TP_GROUP
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world of size {world_size}")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if world_size > 1:
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised in this process")
        timeout = timedelta(seconds=timeout_s)
        store = _make_store(init_method, rank, world_size, timeout, listen_fd)
        dist.init_process_group(backend=backend, store=store, rank=rank,
                                world_size=world_size, timeout=timeout)
        _TP_GROUP = dist.group.WORLD
    _TP_RANK, _TP_SIZE = rank, world_size


def listen_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket listening on host alone, for rank 0's store."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=128)


def _make_store(init_method: str, rank: int, world_size: int, timeout: timedelta,
                listen_fd: int | None) -> dist.TCPStore:
    """The TCPStore of init_method. torch's own store server listens on every interface
    whatever host it is given, so rank 0 serves it from a socket bound to host alone."""
    url = urlsplit(init_method)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise ValueError(f"init_method must be tcp://HOST:PORT, got {init_method!r}")
    if rank != 0:
        return dist.TCPStore(url.hostname, url.port, world_size, False, timeout)
    if listen_fd is None:
        listen_fd = listen_socket(url.hostname, url.port).detach()
    return dist.TCPStore(url.hostname, url.port, world_size, True, timeout,
                         wait_for_workers=False, master_listen_fd=listen_fd)


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


def tp_gather(x: torch.Tensor, dim: int = -1, dst: int = 0) -> torch.Tensor | None:
    """Every rank's `x` concatenated along `dim`, in rank order, on rank `dst`; None on the
    other ranks (all shards have equal shape)."""
    if _TP_SIZE == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)] if _TP_RANK == dst else None
    dist.gather(x, parts, dst=dst, group=_TP_GROUP)
    return torch.cat(parts, dim=dim) if parts is not None else None


def tp_broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Rank `src`'s `x` on every rank, in place (every rank passes a tensor of its shape)."""
    if _TP_SIZE == 1:
        return x
    dist.broadcast(x, src=src, group=_TP_GROUP)
    return x

"""The CUDA backend: torch's own CUDA ops (cuBLAS linears, SDPA attention over gathered
blocks), the torch backend's formulation on another device."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tierserve.workers.backends.cpu_features import detect_cpu_features
from tierserve.workers.backends.portable import TorchBackend

__all__ = ["CudaBackend", "cuda_backend"]


@dataclass(frozen=True, eq=False)
class CudaBackend(TorchBackend):
    gpu: str = ""

    def describe(self) -> dict:
        return {**super().describe(), "gpu": self.gpu}


def cuda_backend(device: torch.device) -> CudaBackend:
    """The backend of one CUDA device of this process."""
    return CudaBackend("cuda", detect_cpu_features(), {}, "cuda",
                       gpu=torch.cuda.get_device_name(device))

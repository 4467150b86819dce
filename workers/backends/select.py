"""The one choice of backend per engine: the device's, and on CPU the kernel variant every rank
has loaded (the worker decides whether the engine runs kernels; this builds the object)."""
from __future__ import annotations

import torch

from tierserve.workers.backends.base import Backend
from tierserve.workers.backends.cpu import plan_for
from tierserve.workers.backends.cpu_features import detect_cpu_features
from tierserve.workers.backends.portable import torch_backend

__all__ = ["select_backend"]


def select_backend(device: torch.device, kernels=None, *, quant_linear: bool = True) -> Backend:
    """CUDA's backend on a GPU; on CPU the loaded kernel library's ISA level (a
    kernels.KernelLibrary whose ops are loaded), else the torch backend."""
    if device.type == "cuda":
        from tierserve.workers.backends.cuda import cuda_backend
        return cuda_backend(device)
    if kernels is not None:
        return plan_for(kernels.isa, detect_cpu_features(), kernels.ops,
                        quant_linear=quant_linear)
    return torch_backend()

"""Every environment variable tierserve reads, in one place."""
from __future__ import annotations

import os

__all__ = ["cache_dir", "log_level", "ray_address", "default_namespace", "cpu_kernels", "cpu_amx"]


def cache_dir() -> str:
    """Where converted tokenizers and the SSD tier live by default."""
    return os.environ.get("TIERSERVE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "tierserve")


def log_level() -> str:
    return os.environ.get("TIERSERVE_LOG_LEVEL", "WARNING").upper()


def ray_address() -> str | None:
    """RAY_ADDRESS as Ray itself reads it; None starts or joins a local instance."""
    return os.environ.get("RAY_ADDRESS") or None


def default_namespace() -> str:
    return os.environ.get("TIERSERVE_NAMESPACE", "tierserve")


CPU_KERNEL_MODES = ("background", "sync", "off")


def cpu_kernels() -> str:
    """How workers get the compiled CPU kernels: build in the background and use them once
    ready (default; the torch path serves meanwhile), build before serving, or never."""
    mode = os.environ.get("TIERSERVE_CPU_KERNELS", "background")
    if mode not in CPU_KERNEL_MODES:
        raise ValueError(f"TIERSERVE_CPU_KERNELS must be one of {', '.join(CPU_KERNEL_MODES)}, "
                         f"got {mode!r}")
    return mode


def cpu_amx() -> bool:
    """Whether prefill-sized fp32 linears may run on Intel AMX (bf16x3, fp32-accurate) where the
    CPU has it: TIERSERVE_CPU_AMX=1 (default) or 0."""
    value = os.environ.get("TIERSERVE_CPU_AMX", "1")
    if value not in ("0", "1"):
        raise ValueError(f"TIERSERVE_CPU_AMX must be 0 or 1, got {value!r}")
    return value == "1"

"""Every environment variable tierserve reads, in one place."""
from __future__ import annotations

import os

__all__ = ["cache_dir", "hf_hub_cache", "log_level", "ray_address", "default_namespace", "cpu_kernels", "cpu_isa",
           "CPU_ISAS", "debug_stall", "debug_crash", "debug_late_copies", "actor_variables",
           "pin_gloo_interface"]


def cache_dir() -> str:
    """Where converted tokenizers and the SSD tier live by default."""
    return os.environ.get("TIERSERVE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "tierserve")


def hf_hub_cache() -> str:
    """Where Hugging Face's tools keep downloaded models (HF_HUB_CACHE, else HF_HOME/hub, else
    XDG_CACHE_HOME/huggingface/hub or ~/.cache/huggingface/hub), which a Hub id resolves in."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "huggingface", "hub")


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


CPU_ISAS = ("auto", "amx", "avx512", "avx2", "torch")


def cpu_isa() -> str:
    """The highest ISA level the CPU kernels may use (TIERSERVE_CPU_ISA): "auto" (default, the
    CPU's best), amx, avx512, avx2, or torch (no kernels). A cap above what the CPU has gives
    the CPU's best; the engine option cpu_isa overrides it."""
    value = os.environ.get("TIERSERVE_CPU_ISA", "auto").lower()
    if value not in CPU_ISAS:
        raise ValueError(f"TIERSERVE_CPU_ISA must be one of {', '.join(CPU_ISAS)}, got {value!r}")
    return value


def debug_stall() -> tuple[int, int, float] | None:
    """Test-only fault injection, TIERSERVE_DEBUG_STALL=RANK:STEP:SECONDS: that rank sleeps that
    long before running that step (the step ids of one engine count from 0), as a rank stuck
    in a forward or a collective would. Unset (the default) injects nothing."""
    value = os.environ.get("TIERSERVE_DEBUG_STALL")
    if not value:
        return None
    try:
        rank, step, seconds = value.split(":")
        return int(rank), int(step), float(seconds)
    except ValueError:
        raise ValueError(f"TIERSERVE_DEBUG_STALL must be RANK:STEP:SECONDS, got {value!r}") from None


def debug_crash() -> tuple[int, int] | None:
    """Test-only fault injection, TIERSERVE_DEBUG_CRASH=RANK:TOKEN_ID: that rank exits at once
    (as if killed) when a step sends it a request whose tokens hold TOKEN_ID, which makes such
    a request crash the workers every time it is sent; in-process the step raises instead.
    Unset (the default) injects nothing."""
    value = os.environ.get("TIERSERVE_DEBUG_CRASH")
    if not value:
        return None
    try:
        rank, token = value.split(":")
        return int(rank), int(token)
    except ValueError:
        raise ValueError(f"TIERSERVE_DEBUG_CRASH must be RANK:TOKEN_ID, got {value!r}") from None


def debug_late_copies() -> bool:
    """Test-only, TIERSERVE_DEBUG_LATE_COPIES=1: the workers' KV tier copies complete late and
    their destinations read NaN until the reader waits for them as the protocol requires
    (workers/tier_streams.py LateCopies), so that a read before completion fails a test.
    Unset (the default): real copies."""
    value = os.environ.get("TIERSERVE_DEBUG_LATE_COPIES", "")
    if value not in ("", "0", "1"):
        raise ValueError(f"TIERSERVE_DEBUG_LATE_COPIES must be 0 or 1, got {value!r}")
    return value == "1"


# Ray's switch for its warning on a blocking ray.get inside an async actor.
_RAY_ASYNC_GET_WARNING = "RAY_WARN_BLOCKING_GET_INSIDE_ASYNC"


def actor_variables() -> dict[str, str]:
    """The environment of a deployment's actors: this process's TIERSERVE_* variables (they
    run with the settings of the process that started them, whatever the Ray cluster's
    processes were started with), and Ray's warning on a blocking get in an async actor off:
    ours block only in constructors and worker threads, which the warning cannot tell from
    the event loop (Ray Train turns it off for its actors too). An operator's own setting of
    it wins."""
    env = {k: v for k, v in os.environ.items() if k.startswith("TIERSERVE_")}
    env[_RAY_ASYNC_GET_WARNING] = os.environ.get(_RAY_ASYNC_GET_WARNING, "0")
    return env


def pin_gloo_interface(interface: str) -> None:
    """Makes gloo (torch.distributed on CPU) listen on `interface`'s address
    (GLOO_SOCKET_IFNAME), not the one the host name resolves to; an operator's own setting
    wins. Set before the process group is made: gloo reads it then."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)

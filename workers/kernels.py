"""Optional C++ CPU kernels (csrc/), JIT-compiled with the machine's compiler and cached on disk.

The torch path stays the reference and the fallback: the kernels are used only once loaded, and a
missing compiler or failed build is logged once and changes nothing else.

Build protocol, safe for several processes (TP ranks) at once:
  * The compile runs in a child process (`python -m tierserve.workers.kernels BUILD_DIR`) in its
    own session. A background build therefore never blocks the caller, and a caller that exits
    early leaves the child to finish, so the next process finds the cache warm.
  * The child compiles under an exclusive flock on BUILD_DIR/build.lock. The kernel releases a
    flock when its holder dies, so a crashed builder never wedges the others; with the flock
    held, a leftover torch baton file (BUILD_DIR/lock) can only be stale and is removed.
  * Success is published last, by atomically renaming the `ready` marker into place; a process
    that sees the marker loads the library directly without importing torch's build machinery.
BUILD_DIR must be specific to the sources, flags, torch version and CPU (see `build_dir_for`),
because -march=native code only runs where it was built.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import torch

from tierserve.runtime import envs

__all__ = ["CpuKernels", "cpu_kernels", "build_dir_for"]

log = logging.getLogger("tierserve.kernels")

_NAME = "tierserve_cpu_kernels"
_CSRC = Path(__file__).with_name("csrc")
_SOURCES = ("paged_attention.cpp", "linear.cpp", "linear_amx.cpp", "fused.cpp")
_HEADERS = ("vec.h", "panels.h")  # included by the sources; part of the build's identity
# -fopenmp: at::parallel_for is an inline `omp parallel` region, serial without it. The .so then
# needs libgomp.so.1, which resolves to the copy torch has already loaded. -ffp-contract=fast:
# -std=c++20 otherwise forbids fusing a * b + c into one FMA.
_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=fast")
_LDFLAGS = ("-fopenmp",)
_READY = "ready"


def _cpu_fingerprint() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return os.uname().machine


def build_dir_for(cache_root: str | os.PathLike) -> Path:
    """`<cache_root>/kernels/<torch version>-<hash of sources, headers, flags and CPU features>`."""
    digest = hashlib.sha256()
    for name in _SOURCES + _HEADERS:
        digest.update((_CSRC / name).read_bytes())
    digest.update(repr((_CFLAGS, _LDFLAGS, _cpu_fingerprint())).encode())
    return Path(cache_root) / "kernels" / f"{torch.__version__}-{digest.hexdigest()[:16]}"


def _ready_library(build_dir: Path) -> Path | None:
    """The published library, or None when there is none (or it has since been deleted)."""
    try:
        library = build_dir / (build_dir / _READY).read_text().strip()
    except FileNotFoundError:
        return None
    return library if library.is_file() else None


def compile_locked(build_dir: str | os.PathLike) -> Path:
    """Compile (or find) the library in build_dir under the cross-process lock; returns its path."""
    build_dir = Path(build_dir)
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        library = _ready_library(build_dir)
        if library is not None:
            return library
        (build_dir / "lock").unlink(missing_ok=True)
        from torch.utils.cpp_extension import load

        path = Path(load(_NAME, [str(_CSRC / s) for s in _SOURCES], extra_cflags=list(_CFLAGS),
                         extra_ldflags=list(_LDFLAGS), build_directory=str(build_dir),
                         is_python_module=False, verbose=False))
        marker = build_dir / f"{_READY}.{os.getpid()}"
        marker.write_text(path.name)
        marker.replace(build_dir / _READY)
        return path


class CpuKernels:
    """The process's handle on the compiled kernels; one per process (`cpu_kernels`), because
    the library registers the `torch.ops.tierserve` namespace, which can be loaded only once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started = False
        self._done = threading.Event()
        self._ops = None
        self._head_dims: frozenset[int] = frozenset()
        self._amx = False
        self.error: str | None = None

    def start_build(self, build_dir: str | os.PathLike, *, sync: bool = False) -> None:
        """Load the kernels from build_dir, compiling them there first if needed. The compiler
        is started before this returns, so it runs to completion (and fills the cache) even if
        this process exits at once; the wait and the load happen on a background thread, or on
        this thread when sync. Later calls do nothing."""
        with self._lock:
            if self._started:
                return
            self._started = True
        build_dir = Path(build_dir)
        try:
            builder = None if _ready_library(build_dir) else _Builder(build_dir)
        except Exception as e:  # e.g. an unwritable cache folder
            self._give_up(e)
            return
        if sync:
            self._load(build_dir, builder)
        else:
            threading.Thread(target=self._load, args=(build_dir, builder), daemon=True,
                             name="tierserve-kernel-build").start()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a started build has finished (or timeout); returns `available`."""
        if self._started:
            self._done.wait(timeout)
        return self.available

    @property
    def building(self) -> bool:
        """A started build (or load) has not finished yet."""
        return self._started and not self._done.is_set()

    @property
    def available(self) -> bool:
        return self._ops is not None

    def supports_decode(self, dtype: torch.dtype, head_dim: int) -> bool:
        return self.available and dtype in (torch.float32, torch.bfloat16) \
            and head_dim in self._head_dims

    def paged_decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor,
                               scale: float) -> torch.Tensor:
        """q [nd, heads, D] over pools [num_blocks, block_size, kv_heads, D], block_tables int32
        [nd, max_blocks], seq_lens int32 [nd] -> [nd, heads, D] in q's dtype."""
        return self._ops.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)

    def linear_f32(self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None,
                   out_features: int) -> torch.Tensor:
        """x [M, K] float32 times a weight in panels [ceil(N / 32), K, 32] -> [M, N] (+ bias)."""
        return self._ops.linear_f32(x, panels, bias, out_features)

    @property
    def has_amx(self) -> bool:
        """linear_amx runs here: the build targets AMX-BF16, Linux granted this process the
        tile state, and TIERSERVE_CPU_AMX does not turn it off."""
        return self._amx

    def linear_amx(self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None,
                   out_features: int) -> torch.Tensor:
        """linear_f32's product on AMX, to fp32 accuracy (csrc/linear_amx.cpp); for
        prefill-sized x, as it splits the weight into bf16 pieces on every call."""
        return self._ops.linear_amx(x, panels, bias, out_features)

    def greedy_from_approx(self, approx: torch.Tensor, x: torch.Tensor, panels: torch.Tensor,
                           norms: torch.Tensor, out_features: int, rel: float,
                           out_rel: float) -> torch.Tensor:
        """The first index of each row's maximum of linear_f32(x, panels), from approx [M, N]
        bf16 within rel * |x| * norms + out_rel * |approx| of it -> long[M]; -1 for rows with
        non-finite values (see csrc/linear.cpp)."""
        return self._ops.greedy_from_approx(approx, x, panels, norms, out_features, rel, out_rel)

    def fuses(self, x: torch.Tensor) -> bool:
        """Whether the fused elementwise ops (rms_norm, silu_and_mul, rotary_write_kv) and
        argmax_rows take x."""
        return self.available and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)

    def rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual) * weight, x + residual); without residual (norm(x) * weight, x)."""
        return self._ops.rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """[M, 2d] -> silu(x[:, :d]) * x[:, d:]."""
        return self._ops.silu_and_mul(x)

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[M, n] float32/bfloat16 with contiguous rows -> long[M], the first index of each row's
        maximum, NaN counting as the maximum (what x.max(dim=-1).indices gives)."""
        return self._ops.argmax_rows(x)

    def rotary_write_kv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k of qkv [T, (heads + 2 kv_heads) D] by cos/sin [T, D/2]; write k and v
        to their pool slots; returns q [T, heads, D] and k [T, kv_heads, D]."""
        return self._ops.rotary_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, heads)

    def _load(self, build_dir: Path, builder: "_Builder | None") -> None:
        try:
            library = _ready_library(build_dir) if builder is None else builder.wait()
            torch.ops.load_library(str(library))
            ops = torch.ops.tierserve
            self._head_dims = frozenset(ops.decode_head_dims())
            self._amx = envs.cpu_amx() and ops.has_amx()
            self._ops = ops
        except Exception as e:  # any failure leaves the torch path in place
            self._give_up(e)
        self._done.set()

    def _give_up(self, error: Exception) -> None:
        self.error = f"{type(error).__name__}: {error}"
        log.warning("C++ CPU kernels unavailable, using the torch path: %s", self.error)
        self._done.set()


class _Builder:
    """A compile in a child process (`compile_locked` there), in its own session so that it
    outlives this process; its output goes to a log in build_dir, kept only on failure."""

    def __init__(self, build_dir: Path) -> None:
        build_dir.mkdir(parents=True, exist_ok=True)
        self.build_dir = build_dir
        self.log_path = build_dir / f"build-{os.getpid()}.log"
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tierserve.workers.kernels", str(build_dir),
                 str(self.log_path)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, env={**os.environ, "MAX_JOBS": "1"})

    def wait(self) -> Path:
        rc = self.proc.wait()
        library = _ready_library(self.build_dir)
        if rc != 0 or library is None:
            tail = self.log_path.read_text(errors="replace")[-2000:].strip()
            raise RuntimeError(f"kernel build failed (exit {rc}, log {self.log_path}):\n{tail}")
        return library


cpu_kernels = CpuKernels()


if __name__ == "__main__":
    # python -m tierserve.workers.kernels BUILD_DIR [LOG]: LOG (this run's output) is removed on
    # success, here rather than by the caller, which may have exited before the build ends.
    # Lowest priority and one compiler at a time (MAX_JOBS, set by _Builder): a first run serves
    # through the torch path meanwhile, and parallel compilers on its cores tripled the cold
    # start to the first token on a 2-core machine.
    os.nice(19)
    print(compile_locked(sys.argv[1]), flush=True)
    if len(sys.argv) > 2:
        Path(sys.argv[2]).unlink(missing_ok=True)

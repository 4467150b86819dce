"""C++ CPU kernels (csrc/), compiled on the user's machine once per ISA variant and cached on disk.

Each variant (`avx2`, `avx512`, `amx`; see cpu_features.py) is built from the same sources with
that ISA's compiler flags, so its vectors are the width, and its register blocking the depth,
the ISA has; it registers its ops under its own namespace (`torch.ops.tierserve_avx2`, ...), so
several variants can live in one process (tests and benches compare them). Which variant, if
any, serves a model is the backend's decision (cpu.py), made once per engine.

Build protocol, safe for several processes (TP ranks) at once:
  * The compile runs in a child process (`python -m tierserve.workers.backends.kernels BUILD_DIR ISA`) in
    its own session. A background build therefore never blocks the caller, and a caller that
    exits early leaves the child to finish, so the next process finds the cache warm.
  * The child compiles under an exclusive flock on BUILD_DIR/build.lock. The kernel releases a
    flock when its holder dies, so a crashed builder never wedges the others; with the flock
    held, a leftover torch baton file (BUILD_DIR/lock) can only be stale and is removed.
  * Success is published last, by atomically renaming the `ready` marker into place; a process
    that sees the marker loads the library directly without importing torch's build machinery.
BUILD_DIR is keyed by torch's version, the ISA and a hash of the sources and flags
(`build_dir_for`): a variant runs on any CPU with its ISA, so no CPU model goes into the key.
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

from tierserve.workers.backends.cpu_features import ISAS

__all__ = ["KernelLibrary", "kernel_library", "build_dir_for", "ISA_CFLAGS"]

log = logging.getLogger("tierserve.kernels")

_CSRC = Path(__file__).with_name("csrc")
_UNIT = "kernels.cpp"  # includes the other sources: one translation unit
_SOURCES = ("kernels.cpp", "paged_attention.cpp", "prefill_attention.cpp", "linear_pairs.cpp",
            "linear.cpp", "linear_coded.cpp", "coded_encode.cpp", "linear_coded_pairs.cpp",
            "linear_amx.cpp", "greedy_head.cpp", "int8_head.cpp", "int8_greedy.cpp", "fused.cpp",
            "quant.cpp", "quant_encode.cpp", "linear_int8.cpp", "lora.cpp", "layer_stack.cpp")
# Part of the build's identity.
_HEADERS = ("vec.h", "panels.h", "attention_math.h", "decode_tiles.h", "decode_plan.h")
# -fopenmp: at::parallel_for is an inline `omp parallel` region, serial without it. The .so then
# needs libgomp.so.1, which resolves to the copy torch has already loaded. -ffp-contract=fast:
# -std=c++20 otherwise forbids fusing a * b + c into one FMA.
_CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=fast")
_LDFLAGS = ("-fopenmp",)
# Targets by ISA level, never -march=native: a variant must run on every CPU of its level.
ISA_CFLAGS = {
    "avx2": ("-march=x86-64-v3",),
    "avx512": ("-march=x86-64-v4",),
    "amx": ("-march=x86-64-v4", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"),
}
assert tuple(ISA_CFLAGS) == ISAS
_READY = "ready"


def _flags(isa: str) -> list[str]:
    return [*_CFLAGS, *ISA_CFLAGS[isa], f"-DTIERSERVE_OPS=tierserve_{isa}",
            f"-DTIERSERVE_ISA={isa}"]


def build_dir_for(cache_root: str | os.PathLike, isa: str) -> Path:
    """`<cache_root>/kernels/<torch version>-<isa>-<hash of sources, headers, flags, compiler>`."""
    if isa not in ISA_CFLAGS:
        raise ValueError(f"no kernel variant for ISA {isa!r}; variants: {', '.join(ISA_CFLAGS)}")
    digest = hashlib.sha256()
    for name in _SOURCES + _HEADERS:
        digest.update((_CSRC / name).read_bytes())
    digest.update(repr((_flags(isa), _LDFLAGS, os.environ.get("CXX", "c++"))).encode())
    return Path(cache_root) / "kernels" / f"{torch.__version__}-{isa}-{digest.hexdigest()[:16]}"


def _ready_library(build_dir: Path) -> Path | None:
    """The published library, or None when there is none (or it has since been deleted)."""
    try:
        library = build_dir / (build_dir / _READY).read_text().strip()
    except FileNotFoundError:
        return None
    return library if library.is_file() else None


def compile_locked(build_dir: str | os.PathLike, isa: str) -> Path:
    """Compile (or find) `isa`'s library in build_dir under the cross-process lock; its path."""
    build_dir = Path(build_dir)
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        library = _ready_library(build_dir)
        if library is not None:
            return library
        (build_dir / "lock").unlink(missing_ok=True)
        from torch.utils.cpp_extension import load

        path = Path(load(f"tierserve_kernels_{isa}", [str(_CSRC / _UNIT)],
                         extra_cflags=_flags(isa), extra_ldflags=list(_LDFLAGS),
                         build_directory=str(build_dir), is_python_module=False, verbose=False))
        marker = build_dir / f"{_READY}.{os.getpid()}"
        marker.write_text(path.name)
        marker.replace(build_dir / _READY)
        return path


class KernelLibrary:
    """This process's handle on one ISA variant: built (or found in the cache) and loaded at
    most once, because its op namespace can be registered only once per process."""

    def __init__(self, isa: str) -> None:
        self.isa = isa
        self._lock = threading.Lock()
        self._started = False
        self._done = threading.Event()
        self.ops = None  # torch.ops.tierserve_<isa> once loaded
        self.error: str | None = None

    def start_build(self, cache_root: str | os.PathLike, *, sync: bool = False) -> None:
        """Load the variant from the cache under cache_root, compiling it there first if
        needed. A cached library is loaded before this returns; otherwise the compiler is
        started before this returns, so it runs to completion (and fills the cache) even if
        this process exits at once, and the wait and the load happen on a background thread,
        or on this thread when sync. Later calls only wait, when sync."""
        with self._lock:
            started, self._started = self._started, True
        if started:
            if sync:
                self._done.wait()
            return
        try:
            build_dir = build_dir_for(cache_root, self.isa)
            builder = None if _ready_library(build_dir) else _Builder(build_dir, self.isa)
        except Exception as e:  # e.g. an unwritable cache folder
            self._give_up(e)
            return
        if sync or builder is None:
            self._load(build_dir, builder)
        else:
            threading.Thread(target=self._load, args=(build_dir, builder), daemon=True,
                             name=f"tierserve-kernel-build-{self.isa}").start()

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
        return self.ops is not None

    def _load(self, build_dir: Path, builder: "_Builder | None") -> None:
        try:
            library = _ready_library(build_dir) if builder is None else builder.wait()
            torch.ops.load_library(str(library))
            ops = getattr(torch.ops, f"tierserve_{self.isa}")
            if ops.build_isa() != self.isa:
                raise RuntimeError(f"{library} was built for {ops.build_isa()}, not {self.isa}")
            self.ops = ops
        except Exception as e:  # any failure leaves the torch path in place
            self._give_up(e)
        self._done.set()

    def _give_up(self, error: Exception) -> None:
        self.error = f"{type(error).__name__}: {error}"
        log.warning("C++ CPU kernels (%s) unavailable, using the torch path: %s", self.isa,
                    self.error)
        self._done.set()


_libraries: dict[str, KernelLibrary] = {}
_libraries_lock = threading.Lock()


def kernel_library(isa: str) -> KernelLibrary:
    """The process's one KernelLibrary for `isa` (not yet built or loaded until asked)."""
    if isa not in ISA_CFLAGS:
        raise ValueError(f"no kernel variant for ISA {isa!r}; variants: {', '.join(ISA_CFLAGS)}")
    with _libraries_lock:
        if isa not in _libraries:
            _libraries[isa] = KernelLibrary(isa)
        return _libraries[isa]


class _Builder:
    """A compile in a child process (`compile_locked` there), in its own session so that it
    outlives this process; its output goes to a log in build_dir, kept only on failure."""

    def __init__(self, build_dir: Path, isa: str) -> None:
        build_dir.mkdir(parents=True, exist_ok=True)
        self.build_dir = build_dir
        self.log_path = build_dir / f"build-{os.getpid()}.log"
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tierserve.workers.backends.kernels", str(build_dir), isa,
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


if __name__ == "__main__":
    # python -m tierserve.workers.backends.kernels BUILD_DIR ISA [LOG]: LOG (this run's output) is removed
    # on success, here rather than by the caller, which may have exited before the build ends.
    # Lowest priority: a first run serves through the torch path meanwhile, and a compiler at
    # normal priority on its cores tripled the cold start to the first token on 2 cores.
    os.nice(19)
    print(compile_locked(sys.argv[1], sys.argv[2]), flush=True)
    if len(sys.argv) > 3:
        Path(sys.argv[3]).unlink(missing_ok=True)

"""What the CPU this process runs on can execute, read at run time.

The machines tierserve runs on change from one start to the next (an AMX server today, an AVX2
laptop or cloud VM tomorrow), so nothing here is assumed from the build or from an earlier run.
Sources: the kernel's view of CPUID (/proc/cpuinfo flags), the OS's grant of the AMX tile state
(arch_prctl), and what torch's own dispatch and oneDNN accept on this CPU.

ISA levels, lowest first; each includes the one before:
  avx2    x86-64-v3: AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE
  avx512  x86-64-v4: AVX-512 F, BW, CD, DQ, VL
  amx     avx512 plus AVX512-BF16, AMX-TILE and AMX-BF16, with the tile state granted by the OS
"""
from __future__ import annotations

import ctypes
import functools
import platform
from dataclasses import dataclass

import torch

__all__ = ["ISAS", "CpuFeatures", "detect_cpu_features", "isa_rank"]

ISAS = ("avx2", "avx512", "amx")

# /proc/cpuinfo flag names each level needs (LZCNT is reported as "abm").
_NEEDS = {
    "avx2": frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"}),
    "avx512": frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
    "amx": frozenset({"avx512_bf16", "amx_tile", "amx_bf16"}),
}


def isa_rank(isa: str) -> int:
    """0 for the torch path, then 1.. for ISAS in order."""
    return 0 if isa == "torch" else ISAS.index(isa) + 1


@dataclass(frozen=True, slots=True)
class CpuFeatures:
    model_name: str
    machine: str  # platform.machine(): x86_64, aarch64, ...
    flags: frozenset[str]
    amx_permitted: bool  # Linux granted this process the AMX tile state
    torch_capability: str  # torch's own CPU dispatch level: DEFAULT, AVX2, AVX512, ...
    onednn_bf16: bool  # oneDNN runs bf16 matmuls natively (its reorders accept bf16 weights)
    onednn_fp16: bool
    vendor: str = ""  # /proc/cpuinfo's vendor_id: GenuineIntel, AuthenticAMD, ...

    def has(self, isa: str) -> bool:
        """Whether this CPU runs code built for `isa` (and every level below it)."""
        if isa == "torch":
            return True
        if self.machine not in ("x86_64", "AMD64"):
            return False
        levels = ISAS[: ISAS.index(isa) + 1]
        if not all(_NEEDS[level] <= self.flags for level in levels):
            return False
        return isa != "amx" or self.amx_permitted

    @property
    def isas(self) -> tuple[str, ...]:
        """The ISA levels this CPU runs, lowest first."""
        return tuple(isa for isa in ISAS if self.has(isa))

    def best_isa(self, cap: str = "amx") -> str:
        """The highest level this CPU runs, at most `cap` ("auto": no cap); "torch" when
        none."""
        allowed = [isa for isa in self.isas if cap == "auto" or isa_rank(isa) <= isa_rank(cap)]
        return allowed[-1] if allowed else "torch"

    def describe(self) -> dict:
        interesting = sorted(self.flags & frozenset().union(*_NEEDS.values()))
        return {"model_name": self.model_name, "vendor": self.vendor, "machine": self.machine,
                "isas": list(self.isas), "flags": interesting,
                "amx_permitted": self.amx_permitted, "torch_capability": self.torch_capability,
                "onednn_bf16": self.onednn_bf16, "onednn_fp16": self.onednn_fp16}


@functools.cache
def detect_cpu_features() -> CpuFeatures:
    """This process's CPU, read once (the answer cannot change while it runs)."""
    model_name, flags, vendor = _read_cpuinfo()
    machine = platform.machine()
    amx = _NEEDS["amx"] <= flags and _request_amx_permission()
    return CpuFeatures(model_name=model_name, machine=machine, flags=flags, amx_permitted=amx,
                       torch_capability=_torch_capability(),
                       onednn_bf16=_onednn_supports("_is_mkldnn_bf16_supported"),
                       onednn_fp16=_onednn_supports("_is_mkldnn_fp16_supported"),
                       vendor=vendor)


def _read_cpuinfo(path: str = "/proc/cpuinfo") -> tuple[str, frozenset[str], str]:
    """(model name, flags, vendor id) of the first processor listed."""
    model_name, flags, vendor = platform.processor() or "unknown", frozenset(), ""
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model_name in ("", "unknown", platform.machine()):
                    model_name = value.strip()
                elif key == "vendor_id" and not vendor:
                    vendor = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = frozenset(value.split())
                if flags and vendor and model_name not in ("", "unknown", platform.machine()):
                    break
    except OSError:
        pass
    return model_name, flags, vendor


def _request_amx_permission() -> bool:
    """Linux (5.16+) hands the AMX tile state only to processes that ask for it; a tile
    instruction without it kills the process. The grant is process-wide and idempotent."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) == 0
    except (OSError, AttributeError):
        return False


def _torch_capability() -> str:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except Exception:  # an older torch without it
        return "unknown"


def _onednn_supports(probe: str) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(getattr(torch.ops.mkldnn, probe)())
    except (AttributeError, RuntimeError):
        return False


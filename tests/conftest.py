"""One local Ray instance for the whole test session, started lazily by the tests that need it,
and the CPU backends tests pin.

Ray reads its environment when it starts, so the auth, usage-stats and temp-folder settings are
made here, before any test can start it. Engines started by tests build their CPU kernels before
serving (TIERSERVE_CPU_KERNELS=sync), so which backend a test runs never depends on a build's
timing; TIERSERVE_CPU_ISA, if set, caps them (and skips the pinned backends above it).
"""
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TIERSERVE_CPU_KERNELS", "sync")
_RAY_TMP = tempfile.mkdtemp(prefix="tierserve-ray-", dir="/tmp")
os.environ["RAY_TMPDIR"] = _RAY_TMP
os.environ.pop("RAY_ADDRESS", None)

from hypothesis import settings as hypothesis_settings  # noqa: E402

from tierserve.runtime import envs  # noqa: E402

# Property tests draw the same examples on every run, so that a run passes or fails on the code
# alone (a failure is replayed by rerunning); `--hypothesis-profile=explore` draws fresh ones
# (with `--hypothesis-seed=N`, a chosen set), which is how new cases get found.
hypothesis_settings.register_profile("pinned", derandomize=True, database=None)
hypothesis_settings.register_profile("explore")
hypothesis_settings.load_profile("pinned")
from tierserve.workers.backends.cpu_features import detect_cpu_features, isa_rank  # noqa: E402


def _kernel_isas() -> tuple[str, ...]:
    """The kernel backends this machine runs, under TIERSERVE_CPU_ISA's cap: read from the CPU
    at collection, so that each test runs once per backend the machine has and no more."""
    cap = envs.cpu_isa()
    return tuple(isa for isa in detect_cpu_features().isas
                 if cap == "auto" or isa_rank(isa) <= isa_rank(cap))


KERNEL_ISAS = _kernel_isas()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "parity: transformers-parity tests, run once per CPU backend this machine "
                   "runs (avx2 included wherever the CPU has AVX-512 or AMX)")


# Runs first: where the user cache has no avx2 kernels yet, its compile is the session's avx2
# build (test_kernels.py), beside the other variants' compiles started below.
_COLD_BUILD_TEST = "test_concurrent_cold_builds_share_one_compile"


@pytest.hookimpl(trylast=True)  # after -m / -k deselection
def pytest_collection_modifyitems(session, config, items):
    first = [item for item in items if getattr(item, "originalname", None) == _COLD_BUILD_TEST]
    items[:] = first + [item for item in items if item not in first]
    if not config.option.collectonly:
        _start_kernel_builds(skip=("avx2",) if first else ())


def _start_kernel_builds(skip: tuple[str, ...]) -> None:
    """Starts every kernel variant's build (or cached load) the tests will pin, in the
    background: on a fresh cache the compiles (one core each) run side by side, while the
    first tests run, instead of one after another when each is first needed."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return
    from tierserve.workers.backends.kernels import kernel_library
    for isa in KERNEL_ISAS:
        if isa not in skip:
            kernel_library(isa).start_build(envs.cache_dir())


def pytest_report_header(config):
    features = detect_cpu_features()
    return (f"CPU: {features.model_name}; ISAs: {', '.join(features.isas) or 'none'}; "
            f"backends under test: {', '.join(('torch',) + KERNEL_ISAS)} "
            f"(TIERSERVE_CPU_ISA={envs.cpu_isa()})")


@pytest.fixture(scope="session")
def ray_session():
    import ray
    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, object_store_memory=256 * 1024 * 1024,
                 _temp_dir=_RAY_TMP, namespace="tierserve-tests", log_to_driver=False)
    yield ray
    ray.shutdown()


def pinned_backend(name: str):
    """The CPU backend `name`, its kernels built (or loaded from the user cache); skips where
    this CPU lacks its ISA, TIERSERVE_CPU_ISA caps it away, or there is no compiler."""
    from tierserve.workers.backends.cpu import kernel_backend
    from tierserve.workers.backends.portable import torch_backend

    if name == "torch":
        return torch_backend()
    features = detect_cpu_features()
    if not features.has(name):
        pytest.skip(f"this CPU ({features.model_name}) lacks {name}")
    cap = envs.cpu_isa()
    if cap != "auto" and isa_rank(name) > isa_rank(cap):
        pytest.skip(f"TIERSERVE_CPU_ISA={cap} caps the backends below {name}")
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        pytest.skip(f"no C++ compiler ({compiler}) to build the CPU kernels")
    return kernel_backend(name, envs.cache_dir())


@pytest.fixture(scope="session", params=KERNEL_ISAS or [None])
def kernels(request):
    """Each kernel backend (avx2, avx512, amx) this machine runs, pinned explicitly."""
    if request.param is None:
        pytest.skip("this CPU runs no kernel backend")
    return pinned_backend(request.param)


@pytest.fixture(scope="session", params=("torch",) + KERNEL_ISAS)
def backend(request):
    """The torch backend and each kernel backend this machine runs, pinned explicitly."""
    return pinned_backend(request.param)

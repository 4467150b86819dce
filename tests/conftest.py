"""One local Ray instance for the whole test session, started lazily by the tests that need it.

Ray reads its environment when it starts, so the auth, usage-stats and temp-folder settings are
made here, before any test can start it.
"""
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
_RAY_TMP = tempfile.mkdtemp(prefix="tierserve-ray-", dir="/tmp")
os.environ["RAY_TMPDIR"] = _RAY_TMP
os.environ.pop("RAY_ADDRESS", None)


@pytest.fixture(scope="session")
def ray_session():
    import ray
    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, object_store_memory=256 * 1024 * 1024,
                 _temp_dir=_RAY_TMP, namespace="tierserve-tests", log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def kernels():
    """The process-wide C++ CPU kernels, built (or loaded from the user cache) synchronously;
    tests that need them are skipped where there is no compiler."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        pytest.skip(f"no C++ compiler ({compiler}) to build the CPU kernels")
    from tierserve.runtime import envs
    from tierserve.workers.kernels import build_dir_for, cpu_kernels
    cpu_kernels.start_build(build_dir_for(envs.cache_dir()), sync=True)
    assert cpu_kernels.available, cpu_kernels.error
    return cpu_kernels

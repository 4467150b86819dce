"""One local Ray instance for the whole test session, started lazily by the tests that need it.

Ray reads its environment when it starts, so the auth, usage-stats and temp-folder settings are
made here, before any test can start it.
"""
import os
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

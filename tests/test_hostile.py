"""Hostile clients, round two (issue 29): no client touches another's request, nothing stalls
the step loop, a stopped engine is noticed, every bad input is the client's error.

Each test reproduces one finding against the real components (the in-process engine, the
session's Ray instance) and checks that the engine serves afterwards and leaks nothing;
docs/reliability.md maps each scenario to its test. The HTTP server's side is in
tests/test_http_hostile.py."""
from __future__ import annotations

import os
import stat
import time

import pytest

from tests.checkpoints import add_tiny_tokenizer, make_tiny_llama
from tierserve import LLM
from tierserve.runtime.config import EngineConfig


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory):
    """A tiny llama with a tokenizer of its own (a chat template too)."""
    return str(add_tiny_tokenizer(make_tiny_llama(tmp_path_factory.mktemp("hostile") / "l")))


# ---------------------------------------------------------------- 7: SSD path validation


def test_a_bad_ssd_path_is_refused_at_option_validation(tiny_tok, tmp_path):
    """Finding 7: an SSD tier folder that is a file, cannot be written, or is "" is a
    ValueError naming kv_offload_ssd_path when the options are made, before any model loads."""
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(stat.S_IRUSR | stat.S_IXUSR)
    if os.access(read_only, os.W_OK):  # root writes anywhere: procfs refuses even root
        read_only = "/proc/self"
    cases = {"": "must be a folder path", str(a_file): "is a file, not a folder",
             str(a_file / "sub"): "which is a file", str(read_only): "cannot write in"}
    for path, message in cases.items():
        with pytest.raises(ValueError, match="kv_offload_ssd_path") as e:
            EngineConfig(kv_offload_cpu_bytes=1 << 20, kv_offload_ssd_path=path)
        assert message in str(e.value)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="kv_offload_ssd_path: .* is a file"):
        LLM(tiny_tok, kv_offload_cpu_bytes=1 << 20, kv_offload_ssd_path=str(a_file))
    assert time.monotonic() - t0 < 5  # nothing was loaded
    fresh = tmp_path / "new" / "tier"  # a folder the engine can make is fine
    EngineConfig(kv_offload_cpu_bytes=1 << 20, kv_offload_ssd_path=str(fresh))

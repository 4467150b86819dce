"""Every error message that suggests a fix: the fix, applied as the message words it, works.

Each test provokes the error, reads the suggestion out of the message (never restating it), and
runs again with it applied. `tierserve status` without a cluster (its suggestion is `tierserve
serve --name NAME`) is run by test_readme.py's flow, whose next step is that very command.
"""
from __future__ import annotations

import re

import pytest

from tests.checkpoints import make_tiny_llama
from tierserve import LLM, EngineConfig, SamplingParams
from tierserve.deploy.ray_engine import _fitting_cpus, _room, default_cpus_per_worker
from tierserve.runtime.engine_setup import make_worker_spec

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Four query heads over two KV heads: TP sizes 1, 2 and 4; 512 positions."""
    return str(make_tiny_llama(tmp_path_factory.mktemp("fixes") / "llama"))


def _fix(error: pytest.ExceptionInfo, pattern: str) -> str:
    match = re.search(pattern, str(error.value))
    assert match, f"no suggestion matching {pattern!r} in: {error.value}"
    return match.group(1)


def _tokens(llm: LLM) -> list[int]:
    return llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.usefixtures("ray_session")
def test_tp_and_cpu_suggestions_applied_start_a_tp_engine(tiny):
    with LLM(tiny) as llm:
        reference = _tokens(llm)
    with pytest.raises(ValueError) as tp_error:
        LLM(tiny, tensor_parallel_size=3)
    sizes = [int(s) for s in _fix(tp_error, r"tensor_parallel_size for this model: ([\d, ]+)")
             .split(", ")]
    tp = max(s for s in sizes if s < 3)
    # The session's cluster has 4 CPUs: two ranks of 3 do not fit, and the message says what
    # does.
    with pytest.raises(ValueError) as cpu_error:
        LLM(tiny, tensor_parallel_size=tp, cpus_per_worker=3)
    cpus = float(_fix(cpu_error, r"--cpus-per-worker ([\d.]+)"))
    with LLM(tiny, tensor_parallel_size=tp, cpus_per_worker=cpus) as llm:
        assert _tokens(llm) == reference


def test_in_process_suggestions_applied_work(tiny, tmp_path):
    with pytest.raises(ValueError) as e:
        LLM(tiny, max_model_len=1024)
    assert _fix(e, r"set (allow_long_max_model_len)=True") == "allow_long_max_model_len"
    with pytest.raises(ValueError) as e:
        LLM(tiny, max_model_lenn=256)
    fixed = _fix(e, r"did you mean '(\w+)'\?")
    with pytest.raises(ValueError) as e:
        LLM(tiny, kv_cache_memory_bytes=1024)
    kv_bytes = int(_fix(e, r"set kv_cache_memory_bytes=(\d+)"))
    with pytest.raises(ValueError) as e:
        LLM(tiny, kv_offload_ssd_path=str(tmp_path / "ssd"))
    assert _fix(e, r"\(set (kv_offload_cpu_bytes)\)") == "kv_offload_cpu_bytes"
    with pytest.raises(ValueError) as e:
        LLM(tiny, generation_config=str(tmp_path))
    source = _fix(e, r"give '\w+', '(\w+)'")
    with LLM(tiny, max_model_len=1024, allow_long_max_model_len=True,
             kv_offload_cpu_bytes=1 << 20, kv_offload_ssd_path=str(tmp_path / "ssd"),
             kv_offload_ssd_bytes=1 << 20, generation_config=source) as llm:
        assert len(_tokens(llm)) == 4
    with LLM(tiny, kv_cache_memory_bytes=kv_bytes) as llm:
        assert len(_tokens(llm)) == 4
    with pytest.raises(ValueError) as e:
        LLM(tiny, kv_cache_memory_bytes=kv_bytes, **{fixed: 256})
    more_bytes = int(_fix(e, r"set kv_cache_memory_bytes=(\d+)"))
    shorter = int(_fix(e, r"or max_model_len=(\d+)"))
    for options in ({"kv_cache_memory_bytes": more_bytes, fixed: 256},
                    {"kv_cache_memory_bytes": kv_bytes, fixed: shorter}):
        with LLM(tiny, **options) as llm:
            assert len(_tokens(llm)) == 4


def test_a_collective_outlasts_the_step_timeout():
    """A stuck rank must be found by the engine's step timeout, which replaces every rank and
    names the cause, not first by a peer's collective timing out in the same instant."""
    for step_timeout in (3.0, 60.0):
        spec = make_worker_spec(EngineConfig(step_timeout_s=step_timeout))
        assert spec.collective_timeout_s >= 2 * step_timeout


def test_fractional_cpus_per_worker():
    """Ranks share cores: Ray gets the fraction (at its 1e-4 resolution, rounded down so that
    the ranks fit), torch a whole thread."""
    assert default_cpus_per_worker(3, cores=2) == 0.6666
    assert default_cpus_per_worker(2, cores=2) == 1
    assert default_cpus_per_worker(3, cores=16) == 5
    assert make_worker_spec(EngineConfig(cpus_per_worker=0.6666)).cpu_threads == 1
    assert make_worker_spec(EngineConfig(cpus_per_worker=2.5)).cpu_threads == 3
    nodes = [{"CPU": 2.0}]
    assert _room(nodes, {"CPU": 0.6666}, "PACK")[0] == 3
    assert _room(nodes, {"CPU": 1}, "PACK")[0] == 2
    assert _fitting_cpus(nodes, "cpu", "PACK", 3, 1) == 0.6666
    assert _fitting_cpus([{"CPU": 2.0}, {"CPU": 4.0}], "cpu", "STRICT_PACK", 3, 2) == 1
    with pytest.raises(ValueError, match="cpus_per_worker must be > 0"):
        EngineConfig(cpus_per_worker=0)

"""Which CPU backend runs where: feature detection, the ISA cap, the choice made once per engine
(never above what the CPU has, never switched by a build finishing later), and what stats show."""
from __future__ import annotations

import dataclasses
import logging
import stat

import pytest
import torch

from tests.checkpoints import make_tiny_llama
from tierserve import LLM, SamplingParams
from tierserve.runtime import envs
from tierserve.runtime.config import EngineConfig
from tierserve.runtime.engine_setup import make_worker_spec
from tierserve.workers import worker as worker_module
from tierserve.workers.backends.cpu import Avx512Backend, plan_for
from tierserve.workers.backends.portable import half_linear_plan as _half_linear, torch_backend
from tierserve.workers.backends.cpu_features import CpuFeatures, detect_cpu_features, isa_rank
from tierserve.workers.backends.kernels import KernelLibrary
from tierserve.workers.worker import Worker

V3 = {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"}
V4 = V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
AMX = V4 | {"avx512_bf16", "amx_tile", "amx_bf16"}


def fake_cpu(flags, *, permitted=True, machine="x86_64", onednn=False) -> CpuFeatures:
    return CpuFeatures("test CPU", machine, frozenset(flags), permitted, "AVX2", onednn, onednn)


@pytest.mark.parametrize("flags,permitted,machine,isas", [
    (V3, True, "x86_64", ("avx2",)),
    (V3 - {"fma"}, True, "x86_64", ()),
    (V4, True, "x86_64", ("avx2", "avx512")),
    (V4 - {"avx512bw"}, True, "x86_64", ("avx2",)),
    (AMX, True, "x86_64", ("avx2", "avx512", "amx")),
    (AMX, False, "x86_64", ("avx2", "avx512")),  # Linux refused the tile state
    (AMX, True, "aarch64", ()),
])
def test_isa_levels_from_cpu_flags(flags, permitted, machine, isas):
    cpu = fake_cpu(flags, permitted=permitted, machine=machine)
    assert cpu.isas == isas
    assert cpu.best_isa() == (isas[-1] if isas else "torch")
    assert cpu.best_isa("auto") == cpu.best_isa()  # TIERSERVE_CPU_ISA's default: no cap
    assert cpu.best_isa("avx2") == ("avx2" if isas else "torch")
    assert cpu.best_isa("torch") == "torch"


def test_no_backend_plans_above_its_cpu():
    """plan_for refuses a level the CPU lacks; the cap plans a capped machine's paths."""
    avx2_only = fake_cpu(V3, onednn=True)
    for isa in ("avx512", "amx"):
        with pytest.raises(RuntimeError, match=f"needs a CPU with {isa}"):
            plan_for(isa, avx2_only, ops=None)
    # oneDNN may run bf16 natively on a bigger CPU, but an avx2 backend plans as on AVX2.
    assert _half_linear(fake_cpu(AMX, onednn=True), "avx2") == {
        torch.bfloat16: "kernel", torch.float16: "kernel"}
    assert _half_linear(fake_cpu(AMX, onednn=True), "avx512")[torch.bfloat16] == "onednn"
    assert _half_linear(fake_cpu(V3), "torch") == {}


def test_amd_avx512_takes_the_panel_kernel_to_a_whole_step():
    """On AMD, torch's MKL runs no AVX-512 code: the AVX-512 panel kernel takes fp32 products
    of up to a default step's 2048 rows there, of up to 160 elsewhere (then MKL or AMX)."""
    amd = dataclasses.replace(fake_cpu(V4), vendor="AuthenticAMD")
    intel = dataclasses.replace(fake_cpu(V4), vendor="GenuineIntel")
    assert Avx512Backend.level_paths(amd, None) == {"panel_max_rows": 2048}
    assert Avx512Backend.level_paths(intel, None) == {}


def test_this_cpu_is_read_at_run_time():
    features = detect_cpu_features()
    with open("/proc/cpuinfo") as f:
        lines = f.readlines()
    flags = next(line for line in lines if line.startswith(("flags", "Features"))).split(":")[1]
    vendor = next((line.split(":")[1].strip() for line in lines
                   if line.startswith("vendor_id")), "")
    assert features.flags == frozenset(flags.split()) and features.vendor == vendor
    for isa in features.isas:
        assert features.has(isa)
    assert features.onednn_bf16 == torch.ops.mkldnn._is_mkldnn_bf16_supported()


def test_cap_option_and_environment(monkeypatch):
    with pytest.raises(ValueError, match="cpu_isa"):
        EngineConfig(cpu_isa="sse4")
    monkeypatch.setenv("TIERSERVE_CPU_ISA", "AVX2")
    assert envs.cpu_isa() == "avx2"
    monkeypatch.setenv("TIERSERVE_CPU_ISA", "neon")
    with pytest.raises(ValueError, match="TIERSERVE_CPU_ISA"):
        envs.cpu_isa()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_llama(tmp_path_factory.mktemp("backend") / "llama"))


def test_engine_runs_the_best_backend_under_the_cap(tiny):
    features = detect_cpu_features()
    cap = envs.cpu_isa()
    want = features.best_isa("amx" if cap == "auto" else cap)
    with LLM(tiny, block_size=4) as llm:
        stats = llm.stats()
        assert stats["cpu_backend"] == want
        assert stats["backend"]["cpu"] == features.model_name
        assert stats["backend"]["cpu_isas"] == list(features.isas)
    # "amx" is a cap, not a demand: a CPU without it gets its best level below.
    with LLM(tiny, block_size=4, cpu_isa="amx") as llm:
        assert llm.stats()["cpu_backend"] == features.best_isa("amx")
    with LLM(tiny, block_size=4, cpu_isa="torch") as llm:
        assert llm.stats()["cpu_backend"] == "torch"
        assert llm.stats()["backend"]["paths"] == []


def _slow_failing_compiler(tmp_path) -> str:
    script = tmp_path / "slow-cxx"
    script.write_text("#!/bin/sh\nsleep 3\nexit 1\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_engine_keeps_the_torch_backend_when_kernels_finish_later(tiny, tmp_path, monkeypatch,
                                                                  caplog):
    """A background build that has not finished when the model loads leaves the engine on the
    torch backend for its whole life: its tokens never depend on when the build ends."""
    isa = detect_cpu_features().best_isa()
    if isa == "torch":
        pytest.skip("this CPU runs no kernel backend")
    monkeypatch.setenv("CXX", _slow_failing_compiler(tmp_path))
    library = KernelLibrary(isa)  # not the process's loaded one: this one must build
    monkeypatch.setattr(worker_module, "kernel_library", lambda _: library)
    config = EngineConfig(model=tiny, block_size=4, max_num_batched_tokens=64, num_kv_blocks=16)
    spec = dataclasses.replace(make_worker_spec(config), cpu_kernels="background",
                               cpu_isa="auto", cache_dir=str(tmp_path / "cache"))
    worker = Worker(spec)
    worker.init_device()
    assert library.building and not worker.kernels_ready()
    with pytest.raises(RuntimeError, match="not loaded"):
        worker.load_model(use_kernels=True)
    with caplog.at_level(logging.INFO, logger="tierserve.worker"):
        info = worker.load_model(use_kernels=False)
    assert info.backend["name"] == "torch"
    assert "still building" in caplog.text
    library.wait(60)
    assert worker.model.backend is torch_backend()
    assert all(getattr(m, "backend", torch_backend()) is torch_backend()
               for m in worker.model.modules())


def test_kernel_and_torch_backends_agree_on_greedy_tokens(tiny, kernels):
    prompts = [[(3 * i + 1) % 380 + 3 for i in range(n)] for n in (4, 23, 9)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = {}
    for name in ("torch", kernels.name):
        with LLM(tiny, block_size=4, cpu_isa=name) as llm:
            assert llm.stats()["cpu_backend"] == name
            outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy,
                                                                        use_tqdm=False)]
    assert outs["torch"] == outs[kernels.name]


def test_isa_rank_orders_levels():
    assert [isa_rank(n) for n in ("torch", "avx2", "avx512", "amx")] == [0, 1, 2, 3]

"""No request can hang, poison or outlive the engine; a dead deployment comes back.

One test per finding of the robustness issue, each against the real components (the session's
Ray instance, subprocess clients killed with SIGKILL, the in-process LLM), each checking that the
engine serves afterwards and leaks no block, request, actor, placement group or IPC folder.
docs/reliability.md maps each scenario to its test."""
from __future__ import annotations

import asyncio
import glob
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

import tierserve
from tests.checkpoints import make_tiny_llama
from tierserve import LLM, SamplingParams
from tierserve.deploy import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NS = "tierserve-tests"
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_llama(tmp_path_factory.mktemp("rel") / "llama", num_layers=2))


def _hostile_params() -> SamplingParams:
    """Parameters that passed SamplingParams' checks and were changed afterwards."""
    params = SamplingParams(temperature=0, max_tokens=4)
    msgspec.structs.force_setattr(params, "stop_token_ids", [10**30])
    return params


BAD_PROMPTS = {
    "surrogate": ("\ud800", "not valid Unicode"),
    "bool ids": ([True, 5, 6], "is a bool"),
    "role 1": ({"messages": [{"role": 1, "content": "hi"}]}, "role must be one of"),
    "both prompts": ({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]},
                     "exactly one of"),
    "float ids": ([5, 6.5], "must be an int"),
    "huge id": ([5, 2**70], "outside int64"),
}


def _assert_idle(stats: dict) -> None:
    assert stats["num_running"] == stats["num_waiting"] == 0, stats
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats


def _wait_idle(llm, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = llm.stats()
        if (stats["num_running"] == stats["num_waiting"] == 0
                and stats["num_free_blocks"] == stats["num_total_blocks"]) \
                or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


# ---------------------------------------------------------------- 2: the in-process LLM


def test_bad_requests_in_a_batch_fail_alone_and_poison_nothing():
    """Finding 2: each bad input fails its own request, with its reason; the good ones in the
    same call complete, later calls work, and no request or block is left behind."""
    with LLM(block_size=16) as llm:  # the default model, with its tokenizer
        good = "The capital of France is"
        batch = [good] + [p for p, _ in BAD_PROMPTS.values()] + [good]
        params = [GREEDY] * len(batch)
        batch.append(good)
        params.append(_hostile_params())
        outs = llm.generate(batch, params, use_tqdm=False)
        assert outs[0].error is None and outs[-2].error is None
        assert outs[0].outputs[0].token_ids == outs[-2].outputs[0].token_ids
        for out, (_, message) in zip(outs[1:-2], BAD_PROMPTS.values()):
            assert out.outputs[0].finish_reason == "error" and message in out.error, out.error
        assert "stop_token_ids" in outs[-1].error
        llm.engine.scheduler.check_integrity()
        _assert_idle(llm.stats())
        again = llm.generate([good], GREEDY, use_tqdm=False)[0]
        assert again.error is None and again.outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_an_unexpected_error_in_a_step_kills_the_engine_visibly(tiny, monkeypatch):
    """An exception nobody expected, inside a step, fails every request with it and every later
    call with EngineDeadError: never a hang, never a silent half-dead engine."""
    with LLM(tiny, block_size=4) as llm:
        def broken(*args):
            raise KeyError("boom")
        monkeypatch.setattr(llm.engine.scheduler, "update_from_output", broken)
        outs = llm.generate([[5, 6, 7], [8, 9]], GREEDY, use_tqdm=False)
        assert all("KeyError" in o.error and o.outputs[0].finish_reason == "error" for o in outs)
        with pytest.raises(tierserve.EngineDeadError, match="boom"):
            llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)


def test_an_error_in_the_async_step_loop_reaches_every_stream(tiny, monkeypatch):
    with tierserve.AsyncLLM(tiny, block_size=4) as llm:
        streaming = asyncio.Event()

        async def stream():
            async for _ in llm.generate([5, 6, 7], LONG):
                streaming.set()

        async def scenario():
            task = asyncio.create_task(stream())
            # The bug lands while the stream runs (a fixed wait can outlast a fast decode).
            await asyncio.wait_for(streaming.wait(), 30)
            monkeypatch.setattr(llm.engine.core.scheduler, "schedule",
                                lambda: (_ for _ in ()).throw(RuntimeError("scheduler bug")))
            with pytest.raises(tierserve.EngineDeadError, match="scheduler bug"):
                await asyncio.wait_for(task, 10)

        asyncio.run(scenario())
        with pytest.raises(tierserve.EngineDeadError):
            llm.engine.health()
        assert llm.stats()["dead"]


# ---------------------------------------------------------------- 5: configuration


def test_configuration_errors_name_the_option_at_once(tiny, tmp_path):
    """Each bad option fails at once, naming itself, and before any Ray instance is started
    for it (a TP size the model cannot split is found before the cluster is joined)."""
    import ray
    ray_before = ray.is_initialized()
    cases = []
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text("{not json")
    for options, message in [
        (dict(model="/nonexistent/model"), "model: '/nonexistent/model' does not exist"),
        (dict(model=str(corrupt)), "model: cannot read the model config"),
        (dict(model=tiny, max_model_len=20000), "exceeds the model's max_position_embeddings"),
        (dict(tensor_parallel_size=2), "tensor_parallel_size for this model: 1, 3, 9"),
        (dict(hash_seed="x"), "hash_seed must be an int"),
        (dict(step_timeout_s=float("nan")), "step_timeout_s must be a finite number"),
    ]:
        t0 = time.monotonic()
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            LLM(**options)
        cases.append(time.monotonic() - t0)
    assert max(cases) < 10, cases
    assert ray.is_initialized() == ray_before
    # The documented override lets a longer max_model_len through.
    with LLM(tiny, max_model_len=600, allow_long_max_model_len=True, block_size=4) as llm:
        assert llm.engine.max_model_len == 600


# ---------------------------------------------------------------- on Ray


def _tsdp_dirs() -> set[str]:
    return set(glob.glob("/tmp/tsdp-*"))


def _named_actors() -> set[str]:
    import ray
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == NS}


def _live_placement_groups() -> int:
    from ray.util import placement_group_table
    return sum(1 for pg in placement_group_table().values() if pg["state"] != "REMOVED")


@pytest.mark.usefixtures("ray_session")
def test_bad_requests_never_hang_a_deployment():
    """Finding 1, on the deployment the issue saw it on (the default model at TP=3): bad
    prompts, bad chat messages, tampered parameters and bool token ids each fail alone and at
    once; the deployment keeps serving and says it is healthy."""
    llm = tierserve.serve("rel-bad", namespace=NS, tensor_parallel_size=3)
    try:
        async def one(prompt, params=GREEDY):
            outs = [d async for d in llm.generate(prompt, params)]
            return outs[-1]

        async def scenario():
            bad = [one(p) for p, _ in BAD_PROMPTS.values()]
            bad.append(one("hello", _hostile_params()))
            good = one("The capital of France is")
            return await asyncio.wait_for(asyncio.gather(*bad, good,
                                                         return_exceptions=True), 60)

        results = asyncio.run(scenario())
        *bad, good = results
        for r in bad:
            assert isinstance(r, Exception) or r.outputs[0].finish_reason == "error", r
        assert not isinstance(good, Exception) and good.error is None
        assert llm.engine.health()
        _assert_idle(_wait_idle(llm))
        assert cli.main(["status", "rel-bad", "--namespace", NS]) == 0
    finally:
        assert tierserve.stop("rel-bad", namespace=NS)


CLIENT = """
import asyncio, sys
import tierserve
from tierserve import SamplingParams
llm = tierserve.connect(sys.argv[1], namespace=sys.argv[2])
async def main():
    first = True
    async for d in llm.generate([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=100000,
                                                             ignore_eos=True),
                                request_id="doomed"):
        if first:
            print("streaming", flush=True)
            first = False
asyncio.run(main())
"""


@pytest.mark.usefixtures("ray_session")
def test_a_killed_client_does_not_leave_its_request_running(tiny):
    """Finding 3: a client killed with SIGKILL mid-stream stops renewing its request's lease;
    the engine aborts the request within seconds and frees its blocks. Meanwhile `tierserve
    status --requests` lists it, and `tierserve abort` ends another one."""
    # A long context keeps a request running for minutes.
    llm = tierserve.serve("rel-kill", namespace=NS, model=tiny, distributed=True, block_size=4,
                          max_model_len=60000, allow_long_max_model_len=True)
    try:
        import ray
        env = dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address,
                   PYTHONPATH=REPO)
        child = subprocess.Popen([sys.executable, "-c", CLIENT, "rel-kill", NS], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            assert child.stdout.readline().strip() == "streaming"
            assert [r["request_id"] for r in llm.list_requests()] == ["doomed"]
            out = subprocess.run([sys.executable, "-m", "tierserve", "status", "rel-kill",
                                  "--namespace", NS, "--requests"], env=env,
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0 and "doomed" in out.stdout, out.stderr[-2000:]
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
        killed_at = time.monotonic()
        stats = _wait_idle(llm, timeout=30)
        _assert_idle(stats)
        assert time.monotonic() - killed_at < 15

        async def aborted_by_cli():
            async for d in llm.generate([9, 8, 7], LONG, request_id="victim"):
                if d.finished:
                    return d.outputs[0].finish_reason
                await asyncio.get_running_loop().run_in_executor(
                    None, cli.main, ["abort", "rel-kill", "victim", "--namespace", NS])
        assert asyncio.run(asyncio.wait_for(aborted_by_cli(), 60)) == "abort"
        assert cli.main(["abort", "rel-kill", "victim", "--namespace", NS]) == 1
        _assert_idle(_wait_idle(llm))
    finally:
        assert tierserve.stop("rel-kill", namespace=NS)


@pytest.mark.usefixtures("ray_session")
def test_a_dead_deployment_is_stopped_and_served_again(tiny):
    """Finding 4: after its engine actor dies, stop() still removes everything (workers,
    placement group, holder, IPC folder); after a worker dies in a deployment that may not
    restart its workers (max_restarts=0), serve() replaces the deployment with a working one
    at once."""
    import ray
    before_dirs, before_actors, before_pgs = _tsdp_dirs(), _named_actors(), \
        _live_placement_groups()
    llm = tierserve.serve("rel-dead", namespace=NS, model=tiny, tensor_parallel_size=2,
                          block_size=4)
    try:
        assert len(_tsdp_dirs() - before_dirs) == 1
        ray.kill(llm.engine.actor, no_restart=True)
        # ray.kill is asynchronous: a call made at once may still be served before the kill
        # lands. Within seconds, every call is answered EngineDeadError.
        deadline = time.monotonic() + 10
        with pytest.raises(tierserve.EngineDeadError):
            while time.monotonic() < deadline:
                llm.stats()
                time.sleep(0.05)
        assert cli.main(["status", "rel-dead", "--namespace", NS]) == 1
        t0 = time.monotonic()
        assert tierserve.stop("rel-dead", namespace=NS)
        assert time.monotonic() - t0 < 30
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (
                _named_actors() != before_actors or _live_placement_groups() != before_pgs):
            time.sleep(0.5)
        assert _named_actors() == before_actors
        assert _live_placement_groups() == before_pgs
        assert _tsdp_dirs() == before_dirs

        llm = tierserve.serve("rel-dead", namespace=NS, model=tiny, tensor_parallel_size=2,
                              block_size=4, max_restarts=0)
        worker = ray.get_actor(llm.info()["worker_names"][1], namespace=NS)
        ray.kill(worker, no_restart=True)

        async def fails():
            with pytest.raises(tierserve.EngineDeadError):
                async for _ in llm.generate([5, 6, 7], LONG):
                    pass
        asyncio.run(asyncio.wait_for(fails(), 30))
        t0 = time.monotonic()
        fresh = tierserve.serve("rel-dead", namespace=NS, model=tiny, tensor_parallel_size=2,
                                block_size=4)
        assert time.monotonic() - t0 < 60
        assert fresh.engine.health()

        async def works():
            return [d async for d in fresh.generate([5, 6, 7], GREEDY)][-1].finished
        assert asyncio.run(works())
    finally:
        tierserve.stop("rel-dead", namespace=NS)
    assert _tsdp_dirs() == before_dirs


@pytest.mark.usefixtures("ray_session")
def test_placement_that_cannot_succeed_fails_at_once(tiny):
    """Finding 5: TP=7 with a CPU per rank on the 4-CPU test instance fails before waiting on
    Ray, naming the option and a cpus_per_worker that fits; nothing is left behind."""
    before = _live_placement_groups()
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="tensor_parallel_size=7 needs 7 bundles.*"
                                         "--cpus-per-worker 0.5714"):
        tierserve.serve("rel-big", namespace=NS, model=str(_seven_heads(tiny)),
                        tensor_parallel_size=7, cpus_per_worker=1)
    assert time.monotonic() - t0 < 10
    assert _live_placement_groups() == before
    assert not tierserve.stop("rel-big", namespace=NS)


def _seven_heads(tiny: str):
    """A checkpoint whose heads TP=7 can split (so that only placement is at fault)."""
    path = os.path.join(os.path.dirname(tiny), "seven")
    if not os.path.exists(path):
        make_tiny_llama(Path(path), hidden_size=112, num_heads=7, num_kv_heads=7,
                        num_layers=1)
    return path


@pytest.mark.usefixtures("ray_session")
def test_a_stuck_rank_is_replaced_and_past_max_restarts_the_engine_dies(tiny, monkeypatch):
    """A rank that sleeps in a step (TIERSERVE_DEBUG_STALL, test-only) makes the step exceed
    step_timeout_s: new workers replace the ranks and every request completes. The next
    failure in the window, one past max_restarts=1 (a rank SIGKILLed), kills the engine:
    every in-flight request fails within seconds, health() says so, later calls fail at
    once."""
    monkeypatch.setenv("TIERSERVE_DEBUG_STALL", "1:6:120")
    llm = tierserve.AsyncLLM(tiny, tensor_parallel_size=2, block_size=4, step_timeout_s=3.0,
                             max_restarts=1)
    try:
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

        async def stream(prompt, params, started=None):
            toks = []
            try:
                async for d in llm.generate(prompt, params):
                    toks += d.outputs[0].token_ids
                    if started is not None:
                        started.set()
            except tierserve.EngineDeadError:
                return time.monotonic()
            return toks

        async def stalled():
            return await asyncio.wait_for(asyncio.gather(
                *[stream([5 + i, 6, 7], params) for i in range(3)]), 120)

        t0 = time.monotonic()
        assert [len(t) for t in asyncio.run(stalled())] == [20] * 3
        stats = llm.stats()
        assert stats["restarts"] == 1 and "step timeout" in stats["restart_reason"], stats
        assert time.monotonic() - t0 < 3.0 + 60  # the timeout, then one worker start

        async def killed():
            started = asyncio.Event()
            tasks = [asyncio.create_task(stream([5 + i, 6, 7], LONG, started))
                     for i in range(3)]
            await asyncio.wait_for(started.wait(), 60)
            killed_at = time.monotonic()
            os.kill(llm.info()["worker_pids"][1], signal.SIGKILL)
            return killed_at, await asyncio.wait_for(asyncio.gather(*tasks), 30)

        killed_at, failed = asyncio.run(killed())
        assert all(isinstance(t, float) and t - killed_at < 10 for t in failed), failed
        with pytest.raises(tierserve.EngineDeadError, match="max_restarts=1"):
            llm.engine.health()
        t0 = time.monotonic()
        assert isinstance(asyncio.run(stream([5, 6, 7], params)), float)  # EngineDeadError
        assert time.monotonic() - t0 < 5
    finally:
        llm.shutdown()

"""The distributed runtime on a real local Ray instance: TP on Ray equals TP=1 in-process,
named deployments and streaming from other processes, cancellation, worker death."""
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import tierserve
from tests.checkpoints import add_tiny_tokenizer, make_tiny_llama
from tierserve import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("ray_session")

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 47)), [3, 1, 4, 1, 5, 9, 2, 6], list(range(100, 121))]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _thread_niceness(pid: int) -> dict[int, int]:
    """Each thread's nice value (field 19 of /proc/PID/task/TID/stat)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended
            continue
        out[int(tid)] = int(fields[16])
    return out


def _may_renice() -> bool:
    import resource
    return os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray-ckpt")
    return {"llama": str(add_tiny_tokenizer(make_tiny_llama(root / "llama"))),
            # 6 heads and 3 KV heads divide by TP=3 (and by 1).
            "llama6": str(make_tiny_llama(root / "llama6", hidden_size=96, num_heads=6,
                                          num_kv_heads=3, seed=5))}


def tokens(llm, prompts, params=GREEDY):
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(tiny):
    ref = {}
    for name, path in tiny.items():
        with LLM(path, block_size=4) as llm:
            ref[name] = tokens(llm, PROMPTS)
            if name == "llama":
                ref["prompt_logprobs"] = _prompt_logprobs(llm)
    return ref


def _prompt_logprobs(llm) -> list[float]:
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    return [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], PROMPTS[1][1:])]


@pytest.mark.parametrize("name,tp", [("llama", 1), ("llama", 2), ("llama6", 3)])
def test_tp_on_ray_equals_tp1_in_process(tiny, reference, name, tp):
    with LLM(tiny[name], tensor_parallel_size=tp, distributed=True, block_size=4) as llm:
        assert tokens(llm, PROMPTS) == reference[name]
        info = llm.engine.info()
        assert len(info["worker_names"]) == tp
        if _may_renice() and sys.platform == "linux":
            # Ray starts actors at nice 15; every thread of the engine (its event loop, which
            # every request and output batch passes through) and of the ranks runs at 0.
            for pid in [info["pid"], *info["worker_pids"]]:
                assert set(_thread_niceness(pid).values()) == {0}, (pid, _thread_niceness(pid))
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_async_scheduling_on_ray_tp2_equals_tp1_in_process(tiny, reference):
    """Every rank appends rank 0's sampled tokens itself (a broadcast): a rank that fed its
    placeholder the wrong token would change the logits, and so the greedy tokens. A queue of
    one request: LLM's batches are held in the engine actor's stream and go in as it drains."""
    with LLM(tiny["llama"], tensor_parallel_size=2, block_size=4,
             async_scheduling=True, max_queued_requests=1) as llm:
        assert tokens(llm, PROMPTS) == reference["llama"]
        seeded = SamplingParams(temperature=1.0, top_k=20, max_tokens=10, seed=9,
                                ignore_eos=True)
        alone = tokens(llm, PROMPTS[1:2], seeded)
        assert tokens(llm, PROMPTS, [GREEDY, seeded, GREEDY, GREEDY])[1] == alone[0]
        # Only rank 0 samples: its grammar matchers and prompt logprobs need no other rank.
        code = SamplingParams(temperature=1.0, seed=4, max_tokens=30, n=2,
                              structured_outputs={"regex": "[0-9]{3}-[a-z]{2}"})
        out = llm.generate(["a code:"], code, use_tqdm=False)[0]
        assert all(re.fullmatch("[0-9]{3}-[a-z]{2}", c.text) for c in out.outputs), out
        got = _prompt_logprobs(llm)
        assert max(abs(a - b) for a, b in zip(got, reference["prompt_logprobs"])) < 1e-4
        # Embeddings: rank 0's pooled hidden states (after the ranks' all-reduce).
        vectors = [o.outputs.embedding for o in llm.embed(PROMPTS, use_tqdm=False)]
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
    with LLM(tiny["llama"], block_size=4) as alone:
        want = [o.outputs.embedding for o in alone.embed(PROMPTS, use_tqdm=False)]
    assert max(abs(a - b) for v, w in zip(vectors, want) for a, b in zip(v, w)) < 1e-5


def test_speculation_on_ray_tp3_equals_plain_in_process(tiny):
    """N-gram speculation at TP=3 with async scheduling (on Ray's default): rank 0 verifies the
    drafts and every rank appends the accepted tokens itself; greedy output equals TP=1
    in-process without speculation."""
    prompts = [[5, 6, 7, 8, 9, 10, 11] * 4, [3, 4, 5] * 6 + [9]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with LLM(tiny["llama6"], block_size=4) as llm:
        want = tokens(llm, prompts, params)
    with LLM(tiny["llama6"], tensor_parallel_size=3, block_size=4,
             speculative_config={"method": "ngram", "num_speculative_tokens": 3}) as llm:
        assert tokens(llm, prompts, params) == want
        stats = llm.stats()
        assert stats["spec_num_accepted_tokens"] > 0
        assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_a_start_failing_after_its_workers_started_raises_the_error_at_once(tiny):
    """The scheduler refuses a pool smaller than max_model_len once the workers run: the
    engine shuts them down, and the caller gets the ValueError (never a hang)."""
    with pytest.raises(ValueError, match="does not fit the KV pool"):
        LLM(tiny["llama"], distributed=True, block_size=4, num_kv_blocks=4, max_model_len=64)


def test_default_smollm2_tp3_on_ray_equals_in_process():
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    with LLM() as llm:
        ref = tokens(llm, prompts)
    with LLM(tensor_parallel_size=3) as llm:
        assert tokens(llm, prompts) == ref
        answer = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                          SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    assert "Paris" in answer.outputs[0].text


async def _collect(handle, prompt, params=GREEDY):
    toks = []
    async for delta in handle.generate(prompt, params):
        assert delta.error is None
        toks.extend(delta.outputs[0].token_ids)
    return toks


def _driver_env():
    import ray
    env = dict(os.environ)
    env["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    env["PYTHONPATH"] = REPO
    return env


SECOND_DRIVER = """
import asyncio, json, sys
import tierserve
from tierserve import SamplingParams
handle = tierserve.connect(sys.argv[1], namespace=sys.argv[2])
async def main():
    out = []
    for prompt in json.loads(sys.argv[3]):
        toks = []
        async for d in handle.generate(prompt, SamplingParams(temperature=0, max_tokens=12,
                                                              ignore_eos=True)):
            toks.extend(d.outputs[0].token_ids)
        out.append(toks)
    print(json.dumps(out))
asyncio.run(main())
"""


def _wait_idle(handle, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = handle.stats()
        if stats["num_running"] == stats["num_waiting"] == 0 and (
                stats["num_free_blocks"] == stats["num_total_blocks"]):
            return stats
        time.sleep(0.1)
    raise AssertionError(f"engine never went idle: {handle.stats()}")


def test_named_deployment_streams_to_other_drivers_tasks_and_many_callers(tiny, reference):
    import ray
    ns = "tierserve-tests"
    handle = tierserve.serve("t-stream", namespace=ns, model=tiny["llama"],
                             tensor_parallel_size=2, block_size=4)
    try:
        # The same deployment is reused, not started twice.
        assert tierserve.serve("t-stream", namespace=ns).engine.actor == handle.engine.actor
        # A second driver process.
        run = subprocess.run([sys.executable, "-c", SECOND_DRIVER, "t-stream", ns,
                              json.dumps(PROMPTS)], env=_driver_env(), capture_output=True,
                             text=True, timeout=180)
        assert run.returncode == 0, run.stderr[-3000:]
        assert json.loads(run.stdout.strip().splitlines()[-1]) == reference["llama"]

        # The handle pickles into a Ray task.
        @ray.remote
        def use(h, prompt):
            return asyncio.run(_collect(h, prompt))
        assert ray.get(use.remote(handle, PROMPTS[1]), timeout=120) == reference["llama"][1]

        # 32 concurrent streams share the engine.
        async def many():
            return await asyncio.gather(*[_collect(handle, PROMPTS[i % 4]) for i in range(32)])
        results = asyncio.run(many())
        assert results == [reference["llama"][i % 4] for i in range(32)]

        # Leaving a stream early aborts the request and frees its blocks.
        async def cancel_early():
            stream = handle.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=400,
                                                                ignore_eos=True))
            got = 0
            async for _ in stream:
                got += 1
                if got == 2:
                    break
            await stream.aclose()
        asyncio.run(cancel_early())
        _wait_idle(handle)
    finally:
        assert tierserve.stop("t-stream", namespace=ns)
    with pytest.raises(ValueError, match="no tierserve deployment"):
        tierserve.connect("t-stream", namespace=ns)


POISON = 383  # no prompt or reference output below holds it (the test checks)
HEAL_STREAMS = [(PROMPTS[i], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
                for i in range(3)] + [(PROMPTS[1], SamplingParams(
                    temperature=1.0, top_k=20, max_tokens=40, seed=9, ignore_eos=True))]


async def _stream(llm, prompt, params, started=None):
    """The request's tokens, or its error; sets `started` once it has 3 tokens."""
    toks = []
    async for delta in llm.generate(prompt, params):
        if delta.error is not None:
            return delta.error
        toks.extend(delta.outputs[0].token_ids)
        if started is not None and len(toks) >= 3:
            started.set()
    return toks


async def _streams(llm, streams, during=None):
    """Every stream at once; `during` runs once each stream has its first tokens."""
    events = [asyncio.Event() for _ in streams]
    tasks = [asyncio.create_task(_stream(llm, p, sp, e)) for (p, sp), e in zip(streams, events)]
    if during is not None:
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 120)
        await during()
    return await asyncio.wait_for(asyncio.gather(*tasks), 300)


def test_a_killed_worker_is_replaced_and_every_stream_continues(tiny, tmp_path, monkeypatch,
                                                                capsys):
    """A rank SIGKILLed mid-stream (TP=2 on Ray, CPU and SSD tiers on): new workers replace
    both ranks, reattach the SSD folder, and every stream completes with an undisturbed run's
    tokens (greedy, and seeded sampling too); no block is left in any tier. A request that
    crashes a rank each time it is sent (TIERSERVE_DEBUG_CRASH) fails alone at the second
    crash, naming it; the streams beside it continue. `tierserve status` counts the
    restarts."""
    import ray
    from tierserve.deploy import cli
    monkeypatch.setenv("TIERSERVE_DEBUG_CRASH", f"1:{POISON}")
    ns = "tierserve-tests"
    llm = tierserve.serve("t-heal", namespace=ns, model=tiny["llama"], tensor_parallel_size=2,
                          block_size=4, kv_offload_cpu_bytes=64 * 1536,
                          kv_offload_ssd_bytes=256 * 1536,
                          kv_offload_ssd_path=str(tmp_path / "ssd"))
    try:
        actor = llm.engine.actor
        reference = asyncio.run(_streams(llm, HEAL_STREAMS))
        assert all(POISON not in toks + prompt for toks, (prompt, _) in
                   zip(reference, HEAL_STREAMS)), "pick another POISON"
        before = llm.info()["worker_pids"]

        async def kill_rank1():
            os.kill(before[1], signal.SIGKILL)
        assert asyncio.run(_streams(llm, HEAL_STREAMS, kill_rank1)) == reference
        stats = llm.stats()
        assert stats["restarts"] == 1 and "rank" in stats["restart_reason"], stats
        info = llm.info()
        assert not set(info["worker_pids"]) & set(before)
        assert all(n.endswith("-b") for n in info["worker_names"])  # the spares took over
        ray.get(actor.check_integrity.remote())

        poisoned = HEAL_STREAMS[:2] + [([4, POISON, 4], HEAL_STREAMS[0][1])]
        got = asyncio.run(_poison_beside(llm, poisoned))
        assert got[:2] == reference[:2]
        assert isinstance(got[2], str) and "two consecutive worker failures" in got[2], got[2]
        stats = _wait_idle(llm)
        assert stats["restarts"] == 3 and "rank 1" in stats["restart_reason"], stats
        ray.get(actor.check_integrity.remote())
        assert llm.engine.health()
        capsys.readouterr()
        assert cli.main(["status", "t-heal", "--namespace", ns]) == 0
        assert "worker restarts    3" in capsys.readouterr().out
    finally:
        tierserve.stop("t-heal", namespace=ns)


async def _poison_beside(llm, streams):
    """The last stream starts once the others have their first tokens."""
    events = [asyncio.Event() for _ in streams[:-1]]
    tasks = [asyncio.create_task(_stream(llm, p, sp, e)) for (p, sp), e in zip(streams, events)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 120)
    tasks.append(asyncio.create_task(_stream(llm, *streams[-1])))
    return await asyncio.wait_for(asyncio.gather(*tasks), 300)

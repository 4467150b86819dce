"""Hostile clients, round two (issue 29): no client touches another's request, nothing stalls
the step loop, a stopped engine is noticed, every bad input is the client's error.

Each test reproduces one finding against the real components (the in-process engine, the
session's Ray instance) and checks that the engine serves afterwards and leaks nothing;
docs/reliability.md maps each scenario to its test. The HTTP server's side is in
tests/test_http_hostile.py."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import stat
import threading
import time

import httpx
import pytest

import tierserve
from tests.checkpoints import add_tiny_tokenizer, make_tiny_llama
from tests.http_thread import Server, wait_idle
from tierserve import LLM, AsyncLLM, SamplingParams
from tierserve.runtime.config import EngineConfig

NS = "tierserve-tests"
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
STEP_TIMEOUT_S = 10.0


def _params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory):
    """A tiny llama with a tokenizer of its own (a chat template too)."""
    return str(add_tiny_tokenizer(make_tiny_llama(tmp_path_factory.mktemp("hostile") / "l")))


async def _last(gen):
    last = None
    async for delta in gen:
        last = delta
    return last


# ---------------------------------------------------------------- 3: text work off the loop


def test_text_work_never_stalls_the_step_loop(tiny_tok, monkeypatch):
    """Finding 3: while a long prompt is being tokenized (here: held inside the tokenizer),
    another stream keeps getting tokens: tokenizing is not the step loop's work."""
    with AsyncLLM(tiny_tok, block_size=4, max_model_len=4096,
                  allow_long_max_model_len=True) as llm:
        tok = llm.tokenizer
        entered, release = threading.Event(), threading.Event()
        encode = tok.encode

        def held_encode(text, add_special_tokens=True):
            if len(text) > 5000:
                entered.set()
                release.wait(60)
            return encode(text, add_special_tokens)

        monkeypatch.setattr(tok, "encode", held_encode)

        async def scenario():
            running = llm.generate([5, 6, 7], _params(200))
            await running.__anext__()
            long = asyncio.ensure_future(_last(llm.generate("hello world " * 900, _params(1))))
            loop = asyncio.get_running_loop()
            assert await loop.run_in_executor(None, entered.wait, 30)
            try:
                for _ in range(5):  # the step loop runs while the tokenizer is held
                    delta = await asyncio.wait_for(running.__anext__(), 30)
                    assert delta.outputs[0].token_ids
            finally:
                release.set()
            done = await asyncio.wait_for(long, 60)
            await running.aclose()
            return done

        done = asyncio.run(scenario())
        assert done.error is None and done.outputs[0].finish_reason == "length"
        wait_idle(llm)


def test_a_prompt_too_long_in_bytes_is_refused_before_tokenizing(tiny_tok, monkeypatch):
    """A 1 MiB prompt cannot fit max_model_len whatever its tokens: refused on its byte length,
    naming the field and the limit, without the tokenizer ever seeing it."""
    with LLM(tiny_tok, block_size=4) as llm:
        seen = []
        encode = llm.tokenizer.encode
        monkeypatch.setattr(llm.tokenizer, "encode",
                            lambda text, *a, **k: seen.append(len(text)) or encode(text, *a, **k))
        big = "x" * (1 << 20)
        outs = llm.generate([big, {"messages": [{"role": "user", "content": big}]}, "hi"],
                            GREEDY, use_tqdm=False)
        assert [o.error_kind for o in outs] == ["bad_request", "bad_request", None]
        assert outs[0].error.startswith("prompt holds 1048576 bytes") and \
            "max_model_len 512" in outs[0].error, outs[0].error
        assert outs[1].error.startswith("messages holds")
        assert max(seen) < 1000  # only "hi" was tokenized
        assert outs[2].outputs[0].token_ids


# ---------------------------------------------------------------- 5: token ids out of range


def test_out_of_range_token_ids_are_bad_requests(tiny_tok):
    """Finding 5: ids below 0 or past the vocabulary (2**32 and up included) fail their own
    request as bad input naming the field; nothing decodes them first (no OverflowError), and
    the good request beside them completes."""
    bad = [[-1], [5, 2**32], [5, 2**40 + 7], [384]]
    with LLM(tiny_tok, block_size=4) as llm:
        *outs, good = llm.generate(bad + [[5, 6, 7]], GREEDY, use_tqdm=False)
        for out in outs:
            assert out.error_kind == "bad_request", out.error
            assert out.error.startswith("prompt_token_ids[") and "out of range" in out.error
        assert good.error is None and len(good.outputs[0].token_ids) == 8
        wait_idle(llm)


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


# ---------------------------------------------------------------- on Ray


@pytest.fixture(scope="module")
def deployment(tiny_tok, ray_session):
    """A named deployment two clients connect to; its step timeout is short, so that a
    stopped engine is noticed within seconds."""
    llm = tierserve.serve("hostile", namespace=NS, model=tiny_tok, distributed=True,
                          block_size=4, step_timeout_s=STEP_TIMEOUT_S)
    yield llm
    tierserve.stop("hostile", namespace=NS)


def test_a_client_cannot_touch_another_clients_request(deployment):
    """Finding 1: two clients of one deployment use the same request_id; the second's request
    runs beside the first's and neither is aborted. A client that names the other's request
    to the engine (its engine id, read off list_requests) reaches nothing: aborts and stops
    carry their client's token. A second unfinished request of one client with the same
    request_id is refused alone."""
    a = tierserve.connect("hostile", namespace=NS)
    b = tierserve.connect("hostile", namespace=NS)

    async def scenario():
        # Long enough (the model's whole context) to outlast b's request and the lookups
        # below on a loaded machine.
        first = a.generate([5, 6, 7], _params(500), request_id="same")
        await first.__anext__()
        theirs = await _last(b.generate([9, 8, 7], _params(6), request_id="same"))
        [mine] = [r for r in a.list_requests() if r["request_id"] == "same"]
        b.engine.abort([mine["engine_id"]])
        b.engine.stop([(mine["engine_id"], 0)])
        with pytest.raises(ValueError, match="same"):  # DuplicateRequestError
            await _last(a.generate([1, 2], GREEDY, request_id="same"))
        rest = [d async for d in first]
        return theirs, rest

    theirs, rest = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert theirs.error is None and theirs.outputs[0].finish_reason == "length"
    assert rest[-1].outputs[0].finish_reason == "length" and rest[-1].finished
    assert sum(len(d.outputs[0].token_ids) for d in rest) == 499
    wait_idle(deployment)


def test_a_stopped_engine_is_noticed_and_a_short_stop_is_survived(deployment):
    """Finding 2: with the engine's process stopped (SIGSTOP), health answers at once that it
    cannot tell (a timeout, not a hang); a stop shorter than the step timeout but longer than
    a client's lease costs no request (leases run only while the engine does); a longer one
    fails the in-flight stream within the step timeout, and the engine serves once resumed."""
    pid = deployment.info()["pid"]
    step_timeout = STEP_TIMEOUT_S

    async def stopped_for(seconds: float, stream):
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(deployment.check_health(), 1.0)
            assert time.monotonic() - t0 < 2.0
            done, _ = await asyncio.wait({stream}, timeout=seconds)
            return done, time.monotonic() - t0
        finally:
            os.kill(pid, signal.SIGCONT)

    async def streaming(max_tokens: int):
        """A stream under way (some tokens in), consumed by a task; its last delta."""
        got = []

        async def consume():
            async for d in deployment.generate([5, 6, 7], _params(max_tokens)):
                got.append(d)
            return got[-1]

        task = asyncio.ensure_future(consume())
        while len(got) < 3 and not task.done():
            await asyncio.sleep(0.02)
        return task

    async def scenario():
        # 7 s: past the 6 s lease, short of the 10 s step timeout.
        survivor = await streaming(300)
        done, _ = await stopped_for(7.0, survivor)
        assert not done
        out = await asyncio.wait_for(survivor, 120)
        assert out.error is None and out.outputs[0].finish_reason == "length"
        victim = await streaming(100000)
        done, waited = await stopped_for(step_timeout + 8.0, victim)
        assert done, "the stream of a stopped engine did not fail"
        with pytest.raises(tierserve.EngineDeadError, match="unresponsive"):
            victim.result()
        assert waited < step_timeout + 4.0
        await asyncio.wait_for(deployment.check_health(), 30)
        return [d async for d in deployment.generate([5, 6, 9], GREEDY)]

    again = asyncio.run(scenario())
    assert again[-1].error is None and sum(len(d.outputs[0].token_ids) for d in again) == 8
    wait_idle(deployment)


# ---------------------------------------------------------------- the HTTP server on Ray


def test_over_http_a_duplicate_id_is_409_and_a_stopped_engine_503_at_once(deployment):
    """Findings 1 and 2 through the HTTP server in front of the deployment: client B posting
    client A's request_id gets 409 (OpenAI's JSON, nothing of Ray in it) and A's stream goes
    on to its end; with the engine's process stopped, /health answers 503 "engine
    unresponsive" within 2 s and /metrics its last values with their age."""
    pid = deployment.info()["pid"]
    with Server(tierserve.connect("hostile", namespace=NS)) as srv:
        url = srv.base + "/v1/completions"
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 80, "stream": True,
                "ignore_eos": True, "temperature": 0, "request_id": "victim"}
        with httpx.stream("POST", url, json=body, timeout=60) as a:
            lines = a.iter_lines()
            assert next(lines).startswith("data: {")
            b = httpx.post(url, json=dict(body, stream=False, max_tokens=2), timeout=60)
            assert b.status_code == 409, b.text
            err = b.json()["error"]
            assert err["type"] == "ConflictError" and "victim" in err["message"]
            chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert httpx.get(srv.base + "/health", timeout=10).status_code == 200
        httpx.get(srv.base + "/metrics", timeout=10)
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            r = httpx.get(srv.base + "/health", timeout=10)
            assert time.monotonic() - t0 < 2.0
            assert r.status_code == 503 and "engine unresponsive" in r.json()["error"]["message"]
            t0 = time.monotonic()
            text = httpx.get(srv.base + "/metrics", timeout=10).text
            assert time.monotonic() - t0 < 2.0
            age = [float(x.split()[-1]) for x in text.splitlines()
                   if x.startswith("tierserve:engine_stats_age_seconds")]
            assert age and age[0] > 0.5 and "tierserve:kv_cache_total_blocks" in text
        finally:
            os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while httpx.get(srv.base + "/health", timeout=10).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    wait_idle(deployment)


def test_error_bodies_carry_no_traceback_pid_address_or_actor_id(deployment, caplog):
    """Finding 1's 500: once the engine actor is gone, every error body (a stream's error
    event, a new request's 503, /health) says so in words of ours with a correlation id that
    the server's log carries; no traceback, pid, address or actor id. Runs last: it kills the
    module's deployment."""
    import ray
    leaks = re.compile(r"Traceback|pid=\d|\b\d{1,3}(\.\d{1,3}){3}\b|actor_id|[0-9a-f]{24,}|"
                       r"\x1b\[")
    with Server(tierserve.connect("hostile", namespace=NS)) as srv:
        url = srv.base + "/v1/completions"
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 100000, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", url, json=body, timeout=60) as a:
            lines = a.iter_lines()
            assert next(lines).startswith("data: {")
            ray.kill(deployment.engine.actor, no_restart=True)
            events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        failure = events[-1]["error"]
        r = httpx.post(url, json=dict(body, stream=False, max_tokens=2), timeout=60)
        health = httpx.get(srv.base + "/health", timeout=10)
        assert r.status_code == health.status_code == 503
        for message in (failure["message"], r.json()["error"]["message"],
                        health.json()["error"]["message"]):
            assert not leaks.search(message), message
        cid = re.search(r"correlation id (\w+)", failure["message"]).group(1)
        assert any(cid in rec.getMessage() for rec in caplog.records)

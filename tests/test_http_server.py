"""The OpenAI-compatible server, driven by the real `openai` client and raw HTTP on a loopback
port, in front of an in-process engine on a tiny checkpoint with a tokenizer trained here."""
import concurrent.futures
import json
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.checkpoints import add_tiny_tokenizer, make_tiny_llama
from tests.http_fixtures import *  # noqa: F403 (checkpoint, engine, server, client)
from tests.http_thread import MODEL, Server, wait_idle
from tierserve import AsyncLLM
from tierserve.deploy.openai import KeyTable


def test_chat_and_completions_with_usage(client, engine):
    tok = engine.tokenizer
    prompt = "The capital of France is"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=7, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.object == "text_completion" and out.model == MODEL
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(tok.encode(prompt))
    assert out.usage.completion_tokens == 7
    assert out.usage.total_tokens == out.usage.prompt_tokens + 7

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens == len(tok.apply_chat_template(messages))
    assert chat.usage.completion_tokens == 5
    # token-id prompts take the same path
    ids = tok.encode(prompt)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=7, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == out.choices[0].text


def test_streaming_equals_non_streaming_and_reports_usage(client):
    kwargs = dict(model=MODEL, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    messages = [{"role": "user", "content": "hello server"}]
    full = client.chat.completions.create(messages=messages, **kwargs)
    chunks = list(client.chat.completions.create(
        messages=messages, stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens

    done = client.completions.create(prompt="hello world", max_tokens=6, **{
        k: v for k, v in kwargs.items() if k != "max_tokens"})
    pieces = list(client.completions.create(prompt="hello world", max_tokens=6, stream=True,
                                            **{k: v for k, v in kwargs.items()
                                               if k != "max_tokens"}))
    assert "".join(p.choices[0].text for p in pieces) == done.choices[0].text
    # vLLM's continuous_usage_stats: every chunk carries the usage so far.
    counted = list(client.chat.completions.create(
        messages=messages, stream=True, stream_options={
            "include_usage": True, "continuous_usage_stats": True}, **kwargs))
    made = [c.usage.completion_tokens for c in counted]
    assert all(c.usage is not None for c in counted) and made == sorted(made)
    assert made[-1] == 12 and made[0] == 0


def test_models_list_and_retrieve(client):
    listed = client.models.list().data
    assert [m.id for m in listed] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


def test_raw_sse_ends_with_done(server):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)


def test_n_samples_and_seeds(client):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "tell me"}], n=3, max_tokens=8,
        temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.usage.completion_tokens == 24
    texts = [c.message.content for c in out.choices]
    assert len(set(texts)) > 1
    again = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "tell me"}], n=3, max_tokens=8,
        temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == texts
    stream = list(client.completions.create(model=MODEL, prompt=["a b", "c d"], n=2,
                                            max_tokens=4, temperature=1.0, seed=3, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert {p.choices[0].index for p in stream} == {0, 1, 2, 3}


def test_completions_top_logprobs_hold_the_sampled_token_as_openais(client):
    """The legacy API's top_logprobs: the sampled token, then the top k (k + 1 at most, as
    vLLM gives them); logprobs=0 the sampled token alone."""
    base = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.5, seed=7,
                extra_body={"ignore_eos": True})
    for k in (0, 1, 3):
        lp = client.completions.create(logprobs=k, **base).choices[0].logprobs
        for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert top[token] == value and 1 <= len(top) <= k + 1
            assert k or len(top) == 1


def test_stop_strings_end_the_text(client):
    base = dict(model=MODEL, prompt="The capital of Italy", max_tokens=24, temperature=0,
                extra_body={"ignore_eos": True})
    text = client.completions.create(**base).choices[0].text
    stop = next(text[i:i + 2] for i in range(4, len(text) - 2) if text[i:i + 2].strip())
    cut = client.completions.create(stop=[stop], **base).choices[0]
    assert cut.finish_reason == "stop"
    assert stop not in cut.text and text.startswith(cut.text)


def test_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                         max_tokens=3, temperature=0, logprobs=True,
                                         top_logprobs=2, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 3
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    # greedy: the sampled token is the most likely one
    assert all(t.top_logprobs[0].token == t.token for t in content)
    comp = client.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=0,
                                     logprobs=1, extra_body={"ignore_eos": True})
    assert len(comp.choices[0].logprobs.token_logprobs) == 3


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=-1), "temperature"),
    (dict(top_p=2.0), "top_p"),
    (dict(n=0), "n"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(presence_penalty=5), "presence_penalty"),
    (dict(extra_body={"bogus_field": 1}), "bogus_field"),
    (dict(extra_body={"top_logprobs": 2}), "top_logprobs"),
    (dict(messages=[{"role": "wizard", "content": "x"}]), "messages"),
    (dict(extra_body={"stop_token_ids": [-1]}), "stop_token_ids"),
])
def test_bad_parameters_are_400_naming_the_field(client, engine, kwargs, param):
    args = dict(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2) | kwargs
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**args)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param, e.value.body
    wait_idle(engine)


def test_too_long_prompt_is_400_and_unknown_model_404(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[5] * 400, max_tokens=2)
    assert "max_model_len" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-5", prompt="x", max_tokens=2)
    assert e.value.body["param"] == "model"
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    import tierserve
    assert httpx.get(server.base + "/version").json() == {"version": tierserve.__version__}


def test_a_two_megabyte_body_is_413(server):
    big = {"model": MODEL, "prompt": "x" * (2 << 20), "max_tokens": 1}
    r = httpx.post(server.base + "/v1/completions", json=big, timeout=30)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == 413
    # a chunked body (no Content-Length) is cut off too
    r = httpx.post(server.base + "/v1/completions", content=iter([b"{" + b" " * (1 << 20)] * 3),
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413


ABORTED = ("tierserve:request_success_total", (("finished_reason", "abort"), ("tenant", "")))


def test_disconnect_mid_stream_frees_the_request(server, engine):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 200, "stream": True,
            "ignore_eos": True, "n": 2}
    before = _metrics(server.base)[ABORTED]
    with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        assert engine.stats()["num_running"] == 2
    wait_idle(engine)  # the server aborted it: its blocks are back
    assert _metrics(server.base)[ABORTED] - before == 2  # each sample, finished "abort"


def test_disconnect_while_waiting_for_a_full_response_frees_the_request(server, engine):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 250, "ignore_eos": True}
    hold, held = threading.Event(), threading.Event()

    def pause(core):  # until the client has left: its response cannot be ready before
        held.set()
        hold.wait(30)

    engine.engine.run_on_loop(pause)
    assert held.wait(10)
    try:
        before = _metrics(server.base)[ABORTED]
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.base + "/v1/completions", json=body,
                       timeout=httpx.Timeout(30, read=0.3))
    finally:
        hold.set()
    wait_idle(engine)
    deadline = time.monotonic() + 10
    while _metrics(server.base)[ABORTED] - before < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metrics(server.base)[ABORTED] - before == 1


NO_TENANT = (("tenant", ""),)


def _metrics(base) -> dict:
    text = httpx.get(base + "/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_metrics_parse_and_move_with_traffic(server, client):
    before = _metrics(server.base)
    assert before[("tierserve:num_requests_running", ())] == 0
    assert ("tierserve:kv_cache_usage_perc", (("tier", "device"),)) in before
    assert before[("tierserve:worker_restarts_total", ())] == 0
    prompt = "A tiny model writes tiny words; tests read them back"
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = _metrics(server.base)

    def moved(name, labels=()):
        return after[(name, labels)] - before.get((name, labels), 0)

    assert moved("tierserve:generation_tokens_total", NO_TENANT) == 10
    assert moved("tierserve:prompt_tokens_total", NO_TENANT) > 0
    assert moved("tierserve:time_to_first_token_seconds_count") == 2
    assert moved("tierserve:e2e_request_latency_seconds_count") == 2
    assert moved("tierserve:inter_token_latency_seconds_count") == 8
    assert moved("tierserve:request_success_total",
                 (("finished_reason", "length"), ("tenant", ""))) == 2
    assert moved("tierserve:prompt_cached_tokens_total", (("tenant", ""), ("tier", "device"))) > 0
    assert moved("tierserve:prefix_cache_queries_total") > 0
    assert moved("tierserve:prefix_cache_hits_total") > 0  # the second one hit the first's
    assert ("tierserve:num_preemptions_total", ()) in after


def test_every_series_exists_from_the_start_and_says_whose_it_is(engine):
    """A fresh server (tiers off, no traffic) already has every series, at zero, and each
    family's HELP names the engine's or this server's scope."""
    srv = Server(engine)
    try:
        text = httpx.get(srv.base + "/metrics", timeout=10).text
        first = _metrics(srv.base)
    finally:
        srv.stop()
    zero = [("tierserve:kv_cache_usage_perc", (("tier", "cpu"),)),
            ("tierserve:kv_cache_usage_perc", (("tier", "ssd"),)),
            *[(f"tierserve:kv_tier_{k}_total", ()) for k in
              ("promotions", "demotions", "loads", "spills")],
            ("tierserve:requests_refused_total", (("status", "404"), ("tenant", ""))),
            ("tierserve:request_success_total", (("finished_reason", "stop"), ("tenant", ""))),
            ("tierserve:prompt_cached_tokens_total", (("tenant", ""), ("tier", "cpu"))),
            ("tierserve:generation_tokens_total", (("tenant", ""),))]
    for key in zero:
        assert first.get(key) == 0, key
    for family in text_string_to_metric_families(text):
        if family.name.startswith("tierserve:") and family.name != "tierserve:engine_dead":
            assert "(the engine: every client" in family.documentation or \
                "(this server's: its requests" in family.documentation, family.name


def test_a_full_queue_answers_503_at_once(engine):
    """With the engine held between steps, no request gets a first token: two are admitted,
    the rest are refused at once; once the engine goes on, the admitted ones complete."""
    srv = Server(engine, max_queued_requests=2)
    hold, held = threading.Event(), threading.Event()

    def pause(core):
        held.set()
        hold.wait(30)

    try:
        engine.engine.run_on_loop(pause)
        assert held.wait(10)
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "ignore_eos": True}
        pool = concurrent.futures.ThreadPoolExecutor(6)
        admitted = [pool.submit(httpx.post, srv.base + "/v1/completions", json=body, timeout=60)
                    for _ in range(2)]
        time.sleep(0.5)  # both are in the server's queue
        t0 = time.monotonic()
        refused = [httpx.post(srv.base + "/v1/completions", json=body, timeout=10)
                   for _ in range(3)]
        assert all(r.status_code == 503 for r in refused)
        assert time.monotonic() - t0 < 5  # at once, not after the queue drains
        assert refused[0].json()["error"]["code"] == 503
        assert not any(f.done() for f in admitted)
        hold.set()
        assert [f.result().status_code for f in admitted] == [200, 200]
        metrics = _metrics(srv.base)
        assert metrics[("tierserve:requests_refused_total",
                        (("status", "503"), ("tenant", "")))] == 3
    finally:
        hold.set()
        srv.stop()
    wait_idle(engine)


def test_health_is_503_once_the_engine_is_dead(tmp_path):
    path = add_tiny_tokenizer(make_tiny_llama(tmp_path / "llama"))
    llm = AsyncLLM(str(path), block_size=4, max_model_len=128)
    srv = Server(llm)
    try:
        assert httpx.get(srv.base + "/health", timeout=10).status_code == 200
        llm.engine.run_on_loop(lambda core: core._die("killed by the test")).result(10)
        r = httpx.get(srv.base + "/health", timeout=10)
        assert r.status_code == 503 and "killed by the test" in r.json()["error"]["message"]
        r = httpx.post(srv.base + "/v1/completions", json={"model": MODEL, "prompt": "x"},
                       timeout=10)
        assert r.status_code == 503
    finally:
        srv.stop()
        llm.shutdown()


# ---------------------------------------------------------------------------- keys and tenants

KEYS = {"secret": "tests", "keys": {"sk-alpha": "alpha", "sk-beta": "beta", "sk-slow": "slow",
                                    "sk-thrifty": "thrifty", "sk-embed": "embed",
                                    "sk-beams": "beams"},
        "tenants": {"slow": {"requests_per_second": 0.05}, "beta": {"kv_share": 0.5},
                    "thrifty": {"tokens_per_minute": 4}, "embed": {"tokens_per_minute": 4},
                    "beams": {"tokens_per_minute": 4}}}


@pytest.fixture(scope="module")
def keyed(engine):
    srv = Server(engine, keys=KeyTable.from_dict(KEYS))
    yield srv
    srv.stop()


def _as(srv, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base + "/v1", api_key=key, max_retries=0)


def test_without_a_valid_key_it_is_401(keyed):
    for key in ("sk-wrong", "sk-alph", "sk-alpha2"):
        with pytest.raises(openai.AuthenticationError) as e:
            _as(keyed, key).completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert e.value.status_code == 401 and e.value.body["code"] == 401
        assert key not in e.value.body["message"]
    # no key at all, even with a bad body: 401 before the body is read
    r = httpx.post(keyed.base + "/v1/completions", json={"prompt": 5}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
    assert httpx.get(keyed.base + "/v1/models", timeout=10).status_code == 401
    assert httpx.get(keyed.base + "/health", timeout=10).status_code == 200
    out = _as(keyed, "sk-alpha").completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert out.usage.completion_tokens == 1


def test_two_tenants_never_share_a_prefix_whatever_salt_they_send(keyed):
    prompt = "Tenants keep their caches apart, even for one and the same long prompt"
    alpha, beta = _as(keyed, "sk-alpha"), _as(keyed, "sk-beta")

    def cached(client, salt):
        body = {"cache_salt": salt} if salt else {}
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                        extra_body=body)
        return out.usage.prompt_tokens_details.cached_tokens

    for salt in (None, "shared"):
        cached(alpha, salt)
        assert cached(alpha, salt) > 0  # a tenant hits its own prefix
        assert cached(beta, salt) == 0  # the other one, with the same salt, does not
    # a client's own salt is a cache of its own inside its tenant's
    assert cached(alpha, "elsewhere") == 0
    tenants = KeyTable.from_dict(KEYS).tenants
    assert tenants["alpha"].salt != tenants["beta"].salt
    assert tenants["alpha"].salt == KeyTable.from_dict(KEYS).tenants["alpha"].salt


def test_a_tenant_over_its_rate_gets_429_and_the_others_are_served(keyed):
    slow, thrifty = _as(keyed, "sk-slow"), _as(keyed, "sk-thrifty")
    slow.completions.create(model=MODEL, prompt="x", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as e:
        slow.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert e.value.status_code == 429 and "requests per second" in e.value.body["message"]
    assert int(e.value.response.headers["retry-after"]) >= 1
    # tokens per minute: the first request spends past the budget, the next waits
    thrifty.completions.create(model=MODEL, prompt="a few words", max_tokens=4)
    with pytest.raises(openai.RateLimitError) as e:
        thrifty.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert "tokens per minute" in e.value.body["message"]
    out = _as(keyed, "sk-beta").completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert out.usage.completion_tokens == 1
    metrics = _metrics(keyed.base)
    assert metrics[("tierserve:requests_refused_total",
                    (("status", "429"), ("tenant", "slow")))] == 1
    assert metrics[("tierserve:generation_tokens_total", (("tenant", "beta"),))] >= 1


def test_embeddings_and_beam_searches_count_against_a_tenants_token_rate(keyed):
    """Bodies answered whole (embeddings, beam search) charge their tokens as streamed ones
    do: past the budget, the tenant's next body is a 429, and the server's counters have
    them."""
    embed, beams = _as(keyed, "sk-embed"), _as(keyed, "sk-beams")
    embed.embeddings.create(model=MODEL, input="a few words more than four tokens")
    with pytest.raises(openai.RateLimitError):
        embed.embeddings.create(model=MODEL, input="x")
    beams.completions.create(model=MODEL, prompt="a few words", n=2, max_tokens=4,
                             extra_body={"use_beam_search": True})
    with pytest.raises(openai.RateLimitError):
        beams.completions.create(model=MODEL, prompt="x", max_tokens=1)
    metrics = _metrics(keyed.base)
    assert metrics[("tierserve:prompt_tokens_total", (("tenant", "embed"),))] > 4
    assert metrics[("tierserve:generation_tokens_total", (("tenant", "beams"),))] >= 2


def test_a_flooding_tenant_cannot_evict_anothers_warm_prefix_nor_share_a_tier(checkpoint):
    """On a 32-block pool over a CPU tier, tenant beta floods unique prompts, each under a salt
    of its own (as if it were many tenants); alpha's warm prefix stays: beta's salts are all
    beta's. Beta's evicted blocks hit again from the CPU tier, but never for alpha, whatever
    salt alpha sends."""
    llm = AsyncLLM(str(checkpoint), block_size=4, max_model_len=64, num_kv_blocks=33,
                   kv_offload_cpu_bytes=1 << 20)
    srv = Server(llm, keys=KeyTable.from_dict(KEYS))
    try:
        alpha, beta = _as(srv, "sk-alpha"), _as(srv, "sk-beta")

        def cached(client, prompt, salt=None):
            out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                            extra_body={"cache_salt": salt} if salt else {})
            return out.usage.prompt_tokens_details.cached_tokens

        warm = list(range(10, 30))  # 5 blocks
        cached(alpha, warm)
        flood = [[100 + i] + list(range(40, 59)) for i in range(12)]  # the pool over and over
        for i, prompt in enumerate(flood):
            cached(beta, prompt, f"s{i}")
        assert cached(alpha, warm) >= 16
        assert llm.stats()["cpu_tier_usage"] > 0
        assert cached(alpha, flood[0], "s0") == 0
        assert cached(beta, flood[0], "s0") >= 16  # back from the CPU tier
        hits = _metrics(srv.base)
        assert hits[("tierserve:prompt_cached_tokens_total",
                     (("tenant", "beta"), ("tier", "cpu")))] >= 16
        # Every tenant's series exists from its first request, at zero until it hits.
        assert hits[("tierserve:prompt_cached_tokens_total",
                     (("tenant", "alpha"), ("tier", "cpu")))] == 0
    finally:
        srv.stop()
        llm.shutdown()


def test_a_flooding_tenant_cannot_push_anothers_prefix_out_of_the_cpu_tier(checkpoint):
    """Alpha's warm prefix leaves the 32-block pool for a 64-slot CPU tier (alpha's own later
    prompts push it out); beta (kv_share 0.5) then floods the pool and the CPU tier with twice
    the tier's size, and alpha's prefix still hits from the CPU tier: over its half, beta's
    demoted blocks take beta's own slots."""
    block_bytes = 2 * 3 * 2 * 16 * 4 * 4  # k and v, layers, KV heads, head dim, block, fp32
    llm = AsyncLLM(str(checkpoint), block_size=4, max_model_len=64, num_kv_blocks=33,
                   kv_offload_cpu_bytes=64 * block_bytes)
    srv = Server(llm, keys=KeyTable.from_dict(KEYS))
    try:
        alpha, beta = _as(srv, "sk-alpha"), _as(srv, "sk-beta")

        def cached(client, prompt):
            out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
            return out.usage.prompt_tokens_details.cached_tokens

        warm = list(range(10, 30))  # 5 blocks
        cached(alpha, warm)
        for i in range(8):  # 40 blocks of alpha's own: the prefix goes to the CPU tier
            cached(alpha, [200 + i] + list(range(60, 79)))
        for i in range(26):  # 130 blocks
            cached(beta, [100 + i] + list(range(40, 59)))
        assert llm.stats()["cpu_tier_slots"] == 64
        assert cached(alpha, warm) >= 16
        hits = _metrics(srv.base)
        assert hits[("tierserve:prompt_cached_tokens_total",
                     (("tenant", "alpha"), ("tier", "cpu")))] >= 16
    finally:
        srv.stop()
        llm.shutdown()


# ---------------------------------------------------------------------------- structured outputs

PERSON = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "tags", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                  "maxItems": 3},
                         "ok": {"type": "boolean"}}}
WORDS = ["alpha", "the cat", "a list of", "Give me JSON", "hello world", "x", "numbers 1 2 3",
         "quick brown fox", "tests read them back", "!?"]


def test_json_schema_outputs_parse_and_validate(client):
    import jsonschema
    prompts = [f"{WORDS[i % 10]} {WORDS[(i * 3) % 10]} {i}" for i in range(50)]
    for temperature in (0.0, 1.0):
        out = client.completions.create(
            model=MODEL, prompt=prompts, max_tokens=160, temperature=temperature, seed=5,
            extra_body={"structured_outputs": {"json": PERSON}})
        assert len(out.choices) == 50
        for choice in out.choices:
            assert choice.finish_reason == "stop", choice.text
            jsonschema.validate(json.loads(choice.text), PERSON)
    for rf in ({"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
               {"type": "json_object"}):
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "who?"}], max_tokens=160,
            temperature=1.0, seed=2, response_format=rf)
        value = json.loads(chat.choices[0].message.content)
        assert isinstance(value, dict)
        if rf["type"] == "json_schema":
            jsonschema.validate(value, PERSON)


def test_regex_and_choice_outputs_match(client):
    import re
    out = client.completions.create(model=MODEL, prompt="a code:", n=4, max_tokens=20,
                                    temperature=1.0, seed=9,
                                    extra_body={"guided_regex": r"[0-9]{3}-[a-z]{2,4}"})
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", c.text) for c in out.choices), out.choices
    options = ["yes", "no", "maybe so"]
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "well?"}], n=6, max_tokens=10,
        temperature=1.0, seed=3, extra_body={"guided_choice": options})
    assert all(c.message.content in options for c in chat.choices)
    # A grammar in GBNF (llama.cpp's, as vLLM takes it) or in Lark.
    for grammar in ('root ::= "yes" | "no" | "maybe" " " [0-9]', 'start: "yes" | "no"'):
        out = client.completions.create(model=MODEL, prompt="well?", n=4, max_tokens=10,
                                        temperature=1.0, seed=5,
                                        extra_body={"guided_grammar": grammar})
        assert all(re.fullmatch(r"yes|no|maybe [0-9]", c.text) for c in out.choices), out


def test_a_mixed_batch_gives_free_requests_the_tokens_they_get_alone(client):
    free = dict(model=MODEL, prompt=["free one", "free two"], max_tokens=24, temperature=0,
                extra_body={"ignore_eos": True})
    alone = [c.text for c in client.completions.create(**free).choices]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        held = pool.submit(client.completions.create, model=MODEL, prompt=WORDS, max_tokens=120,
                           temperature=1.0, extra_body={"guided_json": PERSON})
        mixed = [c.text for c in client.completions.create(**free).choices]
        assert all(json.loads(c.text) for c in held.result().choices)
    assert mixed == alone


@pytest.mark.parametrize("extra, param", [
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_grammar": "start: (("}, "guided_grammar"),
    ({"guided_grammar": 'root ::= "yes | '}, "guided_grammar"),
])
def test_a_schema_that_cannot_compile_is_400_naming_it(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body=extra)
    assert e.value.body["param"] == param, e.value.body


# ---------------------------------------------------------------------------- tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False,
                                       "required": ["zone"],
                                       "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}


def _check_call(call) -> None:
    import jsonschema
    tool = {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_parse_match_and_stream_the_same(client, tool_choice):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "weather in Paris?"}],
                  tools=[WEATHER, CLOCK], tool_choice=tool_choice, max_tokens=120,
                  temperature=0)
    for seed in range(3):
        out = client.chat.completions.create(seed=seed, **dict(kwargs, temperature=1.0))
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            _check_call(call)
        if isinstance(tool_choice, dict):
            assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    if tool_choice == "required":  # a seed that writes two calls writes one without parallel
        sampled = dict(kwargs, temperature=1.0)
        seed = next(seed for seed in range(40) if len(client.chat.completions.create(
            seed=seed, **sampled).choices[0].message.tool_calls or ()) > 1)
        one = client.chat.completions.create(seed=seed, parallel_tool_calls=False, **sampled)
        assert len(one.choices[0].message.tool_calls) == 1
    full = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        reasons.append(chunk.choices[0].finish_reason)
        for tc in delta.tool_calls or ():
            call = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            call["name"] += (tc.function.name or "") if tc.function else ""
            call["arguments"] += (tc.function.arguments or "") if tc.function else ""
    assert reasons[-1] == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in full]


# ---------------------------------------------------------------------------- tokens, sampling

def test_tokenize_and_detokenize_equal_the_engines_tokenizer(server, engine):
    tok = engine.tokenizer
    r = httpx.post(server.base + "/tokenize", json={"model": MODEL, "prompt": "hello world"},
                   timeout=10).json()
    assert r["tokens"] == tok.encode("hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 256
    messages = [{"role": "user", "content": "hi there"}]
    r = httpx.post(server.base + "/tokenize", json={"messages": messages}, timeout=10).json()
    assert r["tokens"] == tok.apply_chat_template(messages)
    ids = tok.encode("round trip", add_special_tokens=False)
    r = httpx.post(server.base + "/detokenize", json={"tokens": ids}, timeout=10).json()
    assert r == {"prompt": "round trip"}
    r = httpx.post(server.base + "/detokenize", json={"tokens": [10 ** 6]}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_logit_bias_allowed_tokens_and_min_tokens(client, engine):
    tok = engine.tokenizer
    x, y = (tok.encode(c, add_special_tokens=False)[0] for c in "xy")
    base = dict(model=MODEL, prompt="choose", max_tokens=8, temperature=0)
    free = client.completions.create(**base, extra_body={"allowed_token_ids": [x, y],
                                                         "ignore_eos": True})
    assert set(free.choices[0].text) <= {"x", "y"}
    first = free.choices[0].text[0]
    banned = client.completions.create(**base, logit_bias={str(tok.encode(
        first, add_special_tokens=False)[0]): -100}, extra_body={"allowed_token_ids": [x, y],
                                                                 "ignore_eos": True})
    assert first not in banned.choices[0].text and len(banned.choices[0].text) == 8
    eos = {str(tok.eos_token_id): 100}
    assert client.completions.create(**base, logit_bias=eos).usage.completion_tokens == 1
    held = client.completions.create(**base, logit_bias=eos, extra_body={"min_tokens": 5})
    assert held.usage.completion_tokens == 6 and held.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**base, logit_bias={"1000000": 1})
    assert "out of range" in e.value.body["message"]


def test_echo_and_a_stop_string_kept_in_the_output(client):
    base = dict(model=MODEL, prompt="The capital of Italy", max_tokens=24, temperature=0,
                extra_body={"ignore_eos": True})
    text = client.completions.create(**base).choices[0].text
    echoed = client.completions.create(**base, echo=True).choices[0].text
    assert echoed == "The capital of Italy" + text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        **base, echo=True, stream=True))
    assert streamed == echoed
    stop = next(text[i:i + 2] for i in range(4, len(text) - 2) if text[i:i + 2].strip())
    kept = client.completions.create(**dict(base, extra_body={
        "ignore_eos": True, "include_stop_str_in_output": True}), stop=[stop]).choices[0]
    assert kept.finish_reason == "stop" and kept.text == text[:text.index(stop) + len(stop)]


def test_prompt_logprobs_equal_the_full_forwards_log_softmax(client, checkpoint):
    import torch
    from transformers import AutoModelForCausalLM
    prompt = list(range(5, 31))
    hf = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
    for _ in range(2):  # the second one would hit the first's prefix: it is computed again
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                        temperature=0, extra_body={"prompt_logprobs": 2})
        assert out.usage.prompt_tokens_details.cached_tokens == 0
        got = out.choices[0].prompt_logprobs
        assert got[0] is None and len(got) == len(prompt)
        for i in range(1, len(prompt)):
            entry = got[i][str(prompt[i])]
            assert abs(entry["logprob"] - ref[i - 1, prompt[i]].item()) < 1e-4
            assert entry["rank"] == int((ref[i - 1] > ref[i - 1, prompt[i]]).sum()) + 1
            best = min(got[i].items(), key=lambda e: e[1]["rank"])
            assert int(best[0]) == int(ref[i - 1].argmax())


def test_echo_with_logprobs_scores_the_prompt_as_evaluation_harnesses_read_it(
        client, checkpoint, engine):
    """lm-evaluation-harness' loglikelihood request (token ids, echo, logprobs 1, max_tokens 1)
    and OpenAI's max_tokens 0: the prompt's tokens carry their logprobs (the first None) and
    top k, then the made token's; streamed, the same pieces."""
    import torch
    from transformers import AutoModelForCausalLM
    tok = engine.tokenizer
    prompt = tok.encode("the quick brown fox jumps over the lazy dog", add_special_tokens=False)
    hf = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
    text = tok.decode(prompt, skip_special_tokens=False)
    base = dict(model=MODEL, prompt=[prompt], echo=True, logprobs=2, temperature=0, seed=1234)
    one = client.completions.create(max_tokens=1, **base).choices[0]
    lp = one.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(prompt) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(prompt)):
        assert abs(lp.token_logprobs[i] - ref[i - 1, prompt[i]].item()) < 1e-4
        # Keyed by token text, as OpenAI's shape is: the token itself, then the top 2 (of
        # tokens reading the same, the first keeps the key).
        want = {}
        for t in [prompt[i], *ref[i - 1].topk(2).indices.tolist()]:
            want.setdefault(tok.decode([t], skip_special_tokens=False), ref[i - 1, t].item())
        assert lp.top_logprobs[i].keys() == want.keys()
        assert all(abs(lp.top_logprobs[i][t] - v) < 1e-4 for t, v in want.items())
    made = tok.decode([int(ref[-1].argmax())], skip_special_tokens=False)
    assert lp.tokens[-1] == made and one.text == text + made
    assert abs(lp.token_logprobs[-1] - ref[-1].max().item()) < 1e-4
    assert one.text.startswith(text) and lp.text_offset[0] == 0
    assert lp.text_offset[-1] == len(text) and lp.text_offset == sorted(lp.text_offset)
    zero = client.completions.create(max_tokens=0, **base)
    assert zero.choices[0].text == text and zero.usage.completion_tokens == 0
    assert zero.choices[0].logprobs.token_logprobs == lp.token_logprobs[:-1]
    assert zero.choices[0].finish_reason == "length"
    assert getattr(zero.choices[0], "prompt_logprobs", None) is None  # not asked for
    chunks = [c.choices[0] for c in client.completions.create(max_tokens=1, stream=True,
                                                                **base)]
    assert "".join(c.text for c in chunks) == one.text
    assert sum((c.logprobs.token_logprobs for c in chunks if c.logprobs), []) == \
        lp.token_logprobs
    assert sum((c.logprobs.text_offset for c in chunks if c.logprobs), []) == lp.text_offset


def test_auto_parses_tool_calls_and_earlier_calls_go_back_in_the_prompt(client, server,
                                                                         engine):
    """auto: text in the Hermes format becomes tool_calls (here forced by a regex, as a
    model trained for it would write it); a conversation carrying an assistant's calls and the
    tool's answer is rendered with the calls written the same way."""
    call = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "time?"}], tools=[WEATHER, CLOCK],
        max_tokens=200, extra_body={"guided_regex": call.replace("{", r"\{").replace(
            "}", r"\}")})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in choice.message.tool_calls] == [("get_time", {"zone": "UTC"})]
    # Two calls written: both parsed, or with parallel_tool_calls false only the first.
    two = call + call.replace("UTC", "CET")
    for parallel, zones in ((True, ["UTC", "CET"]), (False, ["UTC"])):
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "time?"}], tools=[WEATHER, CLOCK],
            max_tokens=200, parallel_tool_calls=parallel, extra_body={
                "guided_regex": two.replace("{", r"\{").replace("}", r"\}")})
        assert [json.loads(c.function.arguments)["zone"]
                for c in out.choices[0].message.tool_calls] == zones
    history = [{"role": "user", "content": "time?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {
                       "name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
    r = httpx.post(server.base + "/tokenize", json={"messages": history}, timeout=10).json()
    text = engine.tokenizer.decode(r["tokens"], skip_special_tokens=False)
    assert call in text and "12:00" in text


def _regex_of(text: str) -> str:
    return "".join("\\" + ch if ch in "{}[]().*+?|^$\\" else ch for ch in text)


@pytest.mark.parametrize("written", [
    '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>',
    'Sure, <tool the clock:\n<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}'
    '</tool_call><tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>',
    'no call: <tool_call>{"name": "nope"}</tool_call> after',
])
def test_auto_tool_calls_stream_as_the_full_response_gives_them(client, written):
    """A streamed `auto` choice sends its text as content while it may not be a call, then
    its calls as tool_calls deltas: content deltas join to the full response's content (None
    there: none sent), calls and finish reason equal; text whose calls do not parse streams
    whole."""
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "time?"}],
                  tools=[WEATHER, CLOCK], max_tokens=200, temperature=0,
                  extra_body={"guided_regex": _regex_of(written)})
    full = client.chat.completions.create(**kwargs).choices[0]
    content, calls, reasons, deltas = "", {}, [], 0
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        reasons.append(choice.finish_reason)
        if choice.delta.content:
            content += choice.delta.content
            deltas += 1
            assert "<tool_call>" not in choice.delta.content or full.message.tool_calls is None
        for tc in choice.delta.tool_calls or ():
            calls[tc.index] = (tc.function.name, tc.function.arguments)
    assert reasons[-1] == full.finish_reason
    assert (content or None) == full.message.content
    assert [calls[i] for i in sorted(calls)] == [
        (c.function.name, c.function.arguments) for c in full.message.tool_calls or ()]
    if full.message.tool_calls is None:
        assert full.message.content == written and full.finish_reason == "stop"
    else:
        assert full.finish_reason == "tool_calls"
    if written.startswith("Sure"):
        assert full.message.content == "Sure, <tool the clock:\n" and deltas >= 2


@pytest.mark.parametrize("parser, written, content", [
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; '
                    '{"name": "get_time", "parameters": {"zone": "CET"}}', None),
    ("mistral", 'Let me see. [TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}, '
                '{"name": "get_time", "arguments": {"zone": "CET"}}]', "Let me see. "),
    ("pythonic", '[get_time(zone="UTC"), get_time(zone="CET")]', None),
])
def test_other_tool_call_formats_parse_and_stream_alike(engine, parser, written, content):
    """--tool-call-parser: Llama 3's JSON calls, Mistral's [TOOL_CALLS] list and Python's
    call lists become tool_calls, whole and streamed, and an earlier turn's call is written
    back in the same format."""
    with Server(engine, tool_call_parser=parser) as srv:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0)
        kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "time?"}],
                      tools=[WEATHER, CLOCK], max_tokens=200, temperature=0,
                      extra_body={"guided_regex": _regex_of(written)})
        full = client.chat.completions.create(**kwargs).choices[0]
        assert full.finish_reason == "tool_calls" and full.message.content == content
        assert [json.loads(c.function.arguments)["zone"] for c in full.message.tool_calls] == \
            ["UTC", "CET"]
        streamed, calls = "", {}
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            delta = chunk.choices[0].delta
            streamed += delta.content or ""
            for tc in delta.tool_calls or ():
                calls[tc.index] = (tc.function.name, tc.function.arguments)
        assert (streamed or None) == content
        assert [calls[i] for i in sorted(calls)] == [
            (c.function.name, c.function.arguments) for c in full.message.tool_calls]
        history = [{"role": "user", "content": "time?"},
                   {"role": "assistant", "content": None, "tool_calls": [
                       {"id": "c1", "type": "function", "function": {
                           "name": "get_time", "arguments": '{"zone": "UTC"}'}}]}]
        r = httpx.post(srv.base + "/tokenize", json={"messages": history}, timeout=10).json()
        text = engine.tokenizer.decode(r["tokens"], skip_special_tokens=False)
        assert {"mistral": "[TOOL_CALLS]", "llama3_json": '"parameters"',
                "pythonic": '[get_time(zone="UTC")]'}[parser] in text


def test_api_keys_files_in_toml_and_json(tmp_path):
    toml = tmp_path / "keys.toml"
    toml.write_text('secret = "s"\n[keys]\n"sk-1" = "acme"\n"sk-2" = "acme"\n"sk-3" = "globex"\n'
                    '[tenants.acme]\nrequests_per_second = 5\nkv_share = 0.25\n')
    table = KeyTable.from_file(str(toml))
    assert table.authenticate("Bearer sk-2").name == "acme"
    assert table.authenticate("bearer  sk-3 ").name == "globex"
    assert table.tenants["acme"].salt.endswith("@0.25")
    as_json = tmp_path / "keys.json"
    as_json.write_text(json.dumps({"secret": "s", "keys": {"sk-9": "acme"}}))
    assert KeyTable.from_file(str(as_json)).tenants["acme"].salt.partition("@")[0] == \
        table.tenants["acme"].salt.partition("@")[0]  # one secret, one salt
    for bad, needle in (({"keys": {"k": "a"}, "tenants": {"a": {"rps": 1}}}, "unknown limits"),
                        ({"keys": {"k": "a"}, "tenants": {"b": {}}}, "no key belongs"),
                        ({"keys": {"k": "a"}, "tenants": {"a": {"kv_share": 2}}}, "kv_share"),
                        ({"keyz": {}}, "unknown fields"), ({"keys": {}}, "at least one key")):
        with pytest.raises(ValueError, match=needle):
            KeyTable.from_dict(bad)
    with pytest.raises(ValueError, match="cannot read"):
        KeyTable.from_file(str(tmp_path / "missing.toml"))

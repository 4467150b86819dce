"""Hostile clients of the HTTP server (issue 29), in front of an in-process engine on a tiny
checkpoint with a tokenizer: bad inputs are 4xx naming the field, a client gone before its
first token costs at most the chunk in flight, slow and greedy connections are cut off, and the
framework's own errors are OpenAI's error JSON. The Ray-backed findings (request ids of two
clients, a stopped engine, error bodies) are in tests/test_hostile.py."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from tests.checkpoints import add_tiny_tokenizer, make_tiny_llama
from tests.http_thread import MODEL, Server, wait_idle
from tierserve import AsyncLLM
from tierserve.deploy.openai.connections import ConnectionLimits


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """Chunked prefill (8 tokens a step), so that a long prompt takes many steps."""
    path = add_tiny_tokenizer(make_tiny_llama(tmp_path_factory.mktemp("ckpt") / "llama"))
    llm = AsyncLLM(str(path), block_size=4, max_model_len=512, long_prefill_token_threshold=8)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    with Server(engine, max_queued_requests=8, max_body_bytes=2 << 20) as srv:
        yield srv


def _error(r: httpx.Response, status: int) -> dict:
    """OpenAI's error JSON of a response, checked."""
    assert r.status_code == status, (r.status_code, r.text[:500])
    body = r.json()
    assert set(body) == {"error"} and body["error"]["code"] == status, body
    return body["error"]


# ---------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("prompt", [[5, -1], [5, 2**32], [2**63 + 5]])
def test_out_of_range_token_ids_are_400_naming_prompt(server, engine, prompt):
    """Finding 5: no OverflowError, no 500: a 400 naming the field."""
    r = httpx.post(server.base + "/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
    err = _error(r, 400)
    assert err["param"] == "prompt" and "Overflow" not in err["message"], err
    wait_idle(engine)


def test_more_prompts_than_the_queue_holds_is_400_not_503(server):
    """Finding 6: a body no retry could ever get admitted is the client's error."""
    r = httpx.post(server.base + "/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": ["a b"] * 9, "max_tokens": 2})
    err = _error(r, 400)
    assert err["param"] == "prompt" and "max_queued_requests" in err["message"]


def test_a_megabyte_prompt_is_400_before_it_is_tokenized(server, engine, monkeypatch):
    """Finding 3: a 1 MiB prompt is refused on its byte length (it cannot fit max_model_len
    whatever its tokens), naming the field; the tokenizer never sees it."""
    seen = []
    encode = engine.tokenizer.encode
    monkeypatch.setattr(engine.tokenizer, "encode",
                        lambda text, *a, **k: seen.append(len(text)) or encode(text, *a, **k))
    big = "y" * (1 << 20)
    for body in ({"prompt": big}, {"messages": [{"role": "user", "content": big}]}):
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        r = httpx.post(server.base + path, json={"model": MODEL, "max_tokens": 2, **body},
                       timeout=30)
        err = _error(r, 400)
        assert "max_model_len" in err["message"] and err["param"] in ("prompt", "messages")
    assert not seen or max(seen) < 1000


# ---------------------------------------------------------------- abort anywhere


def _hold_mid_prefill(engine, held: threading.Event, release: threading.Event,
                      computed: list) -> None:
    """Holds the engine's step loop between two steps of a prompt's prefill (looked at
    between steps until then), noting how many of its tokens were computed."""
    def check(core):
        partial = [r.num_computed_tokens for r in core.scheduler.requests.values()
                   if 0 < r.num_computed_tokens < r.num_prompt_tokens]
        if not partial:
            threading.Timer(0.002, engine.engine.run_on_loop, args=(check,)).start()
            return
        computed.append(partial[0])
        held.set()
        release.wait(60)

    engine.engine.run_on_loop(check)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_gone_before_its_first_token_costs_at_most_a_chunk(server, engine, stream):
    """Finding 4: a client that leaves while its 400-token prompt is being prefilled (8
    tokens a step) is noticed before its first token, and the abort reaches the request mid-
    prefill: the engine computes nothing more of it. (The prefix cache keeps what it did
    compute, which a second request of that prompt reuses: that is the measure.)"""
    app = server.app.app.state.server
    prompt = [(7 * i + int(stream)) % 300 + 3 for i in range(400)]
    held, release, computed = threading.Event(), threading.Event(), []
    _hold_mid_prefill(engine, held, release, computed)
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": stream})
    client = _raw(server.port)
    client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                   b"application/json\r\ncontent-length: %d\r\n\r\n%s"
                   % (len(body), body.encode()))
    try:
        assert held.wait(60), "the request never started its prefill"
        client.close()  # gone, with no token sent
        deadline = time.monotonic() + 30
        while app.admission.pending and time.monotonic() < deadline:
            time.sleep(0.02)  # the server notices and aborts, the loop still held
        assert app.admission.pending == 0
    finally:
        release.set()
    wait_idle(engine)
    before = engine.stats()["prefix_cache_hit_tokens"]
    r = httpx.post(server.base + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200
    reused = engine.stats()["prefix_cache_hit_tokens"] - before
    assert reused <= computed[0] < len(prompt), (reused, computed)
    wait_idle(engine)


# ---------------------------------------------------------------- slow and greedy clients


def _raw(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    return s


def _read_response(s: socket.socket) -> tuple[int, dict]:
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    return int(head.split()[1]), json.loads(body)


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def test_slow_heads_and_bodies_are_cut_off_and_greedy_clients_capped(engine):
    """Finding 8: a head trickled past the header timeout, and a body past the body timeout,
    are answered 408 (OpenAI's JSON) and closed; a client address past its connection cap
    gets 429 at once; a well-behaved request still works beside them."""
    limits = ConnectionLimits(header_timeout_s=0.5, max_connections_per_client=4)
    with Server(engine, connections=limits, body_timeout_s=0.5) as srv:
        slow_head = _raw(srv.port)
        slow_head.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")  # never ends
        status, body = _read_response(slow_head)
        assert status == 408 and body["error"]["code"] == 408
        assert slow_head.recv(1) == b""  # closed
        slow_body = _raw(srv.port)
        slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                          b"application/json\r\ncontent-length: 100\r\n\r\n{\"model\"")
        status, body = _read_response(slow_body)
        assert status == 408 and "body" in body["error"]["message"]
        idle = [_raw(srv.port) for _ in range(4)]
        extra = _raw(srv.port)
        status, body = _read_response(extra)
        assert status == 429 and body["error"]["type"] == "RateLimitError"
        for s in idle + [extra, slow_head, slow_body]:
            s.close()
        deadline = time.monotonic() + 10
        while True:  # the cap frees as connections close
            r = httpx.get(srv.base + "/v1/models", timeout=10)
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert r.status_code == 200


def test_the_frameworks_errors_are_openai_json(server):
    """Finding 8: no route (404), a method a route does not take (405), a body that is not
    JSON, not UTF-8, or not an object (400): OpenAI's error JSON, never {"detail": ...}."""
    _error(httpx.get(server.base + "/v1/nothing-here", timeout=10), 404)
    err = _error(httpx.get(server.base + "/v1/completions", timeout=10), 405)
    assert "GET" in err["message"]
    for content in (b"{not json", b"\xff\xfe{}", b"[1, 2]", b""):
        r = httpx.post(server.base + "/v1/completions", content=content, timeout=10,
                       headers={"content-type": "application/json"})
        _error(r, 400)


def test_metrics_carry_the_age_of_the_engine_values(server):
    text = httpx.get(server.base + "/metrics", timeout=10).text
    [line] = [x for x in text.splitlines() if x.startswith("tierserve:engine_stats_age_seconds")]
    assert 0 <= float(line.split()[-1]) < 5
    assert httpx.get(server.base + "/health", timeout=10).status_code == 200

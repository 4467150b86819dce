"""OpenAI's own fields that clients send as a matter of course: a reply's message as the client
model dumps it, sent back in the next turn, and request fields (store, metadata, service_tier,
...) that change nothing this server answers. Each is taken and changes nothing; what the
server cannot do (audio, web search, the deprecated functions) is a 400 naming the field;
a typo is still a 400. And SageMaker's /ping and /invocations, which such clients call too."""
import httpx
import openai
import pytest

from tests.http_fixtures import *  # noqa: F403 (checkpoint, engine, server, client)
from tests.http_thread import MODEL, wait_idle

HI = [{"role": "user", "content": "hi"}]
# Fields OpenAI's chat completions take that do not change what this server answers.
INERT = dict(store=False, metadata={"app": "test"}, service_tier="auto",
             prompt_cache_key="k1", prompt_cache_retention="24h", safety_identifier="s1",
             prediction={"type": "content", "content": "hello"}, verbosity="low",
             modalities=["text"], user="u1")


def _tokens(server, messages) -> list[int]:
    r = httpx.post(server.base + "/tokenize", json={"model": MODEL, "messages": messages},
                   timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_a_reply_sent_back_as_the_client_dumps_it_renders_as_its_text(server, client):
    reply = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=6,
                                           temperature=0).choices[0].message
    dumped = reply.model_dump()  # refusal, annotations, audio, function_call: None
    assert {"refusal", "annotations", "audio", "function_call"} <= set(dumped)
    plain = {"role": "assistant", "content": reply.content}
    assert _tokens(server, [*HI, dumped]) == _tokens(server, [*HI, plain])
    nxt = [{"role": "user", "content": "and?"}]
    kwargs = dict(model=MODEL, max_tokens=6, temperature=0)
    assert client.chat.completions.create(messages=[*HI, dumped, *nxt], **kwargs).choices[
        0].message.content == client.chat.completions.create(
        messages=[*HI, plain, *nxt], **kwargs).choices[0].message.content
    # A refusal stands for its text; an earlier turn's reasoning is not re-read.
    assert _tokens(server, [*HI, {"role": "assistant", "content": None, "refusal": "No."}]) == \
        _tokens(server, [*HI, {"role": "assistant", "content": "No."}])
    assert _tokens(server, [*HI, dict(plain, reasoning="hm", reasoning_content="hm")]) == \
        _tokens(server, [*HI, plain])


def test_openais_inert_fields_change_nothing(client, engine):
    kwargs = dict(model=MODEL, messages=HI, max_tokens=8, temperature=0)
    bare = client.chat.completions.create(**kwargs)
    dressed = client.chat.completions.create(**kwargs, **INERT)
    assert dressed.choices[0].message.content == bare.choices[0].message.content
    assert dressed.usage.prompt_tokens == bare.usage.prompt_tokens
    wait_idle(engine)


@pytest.mark.parametrize("fields, param", [
    (dict(modalities=["text", "audio"]), "modalities"),
    (dict(audio={"voice": "alloy", "format": "wav"}), "audio"),
    (dict(web_search_options={}), "web_search_options"),
    (dict(functions=[{"name": "f", "parameters": {"type": "object"}}]), "functions"),
    (dict(function_call="auto"), "function_call"),
    (dict(reasoning_effort="high"), "reasoning_effort"),  # a model that answers directly
    (dict(service_tier="turbo"), "service_tier"),
    (dict(stor=False), "stor"),  # a typo is still named
    (dict(messages=[*HI, {"role": "assistant", "content": None, "audio": {"id": "a1"}}]),
     "messages[1].audio"),
    (dict(messages=[*HI, {"role": "assistant", "content": None,
                          "function_call": {"name": "f", "arguments": "{}"}}]),
     "messages[1].function_call"),
])
def test_what_the_server_cannot_do_is_a_400_naming_it(server, engine, fields, param):
    body = dict(model=MODEL, messages=HI, max_tokens=2) | fields
    r = httpx.post(server.base + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    wait_idle(engine)


def test_responses_and_messages_take_their_inert_fields(server, client):
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=4, temperature=0,
                                service_tier="auto", prompt_cache_key="k",
                                safety_identifier="s", max_tool_calls=2,
                                reasoning={"summary": "auto"})
    assert r.status in ("completed", "incomplete")
    for field, value in (("conversation", "conv_1"), ("prompt", {"id": "pmpt_1"})):
        bad = httpx.post(server.base + "/v1/responses", timeout=30, json={
            "model": MODEL, "input": "hi", field: value})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == field, bad.text
    m = httpx.post(server.base + "/v1/messages", timeout=30, json={
        "model": MODEL, "max_tokens": 4, "messages": HI, "service_tier": "auto"})
    assert m.status_code == 200 and m.json()["type"] == "message", m.text


def test_sagemakers_ping_and_invocations_route_by_the_bodys_shape(server, client):
    """SageMaker's contract as vLLM serves it: /ping is /health; /invocations answers a chat,
    completion or embedding body as its own endpoint does."""
    assert httpx.get(server.base + "/ping").status_code == 200
    assert httpx.post(server.base + "/ping").status_code == 200
    greedy = dict(model=MODEL, max_tokens=5, temperature=0)
    def answer(r: dict):
        if r["object"] == "list":
            return r["data"][0]["embedding"]
        choice = r["choices"][0]
        return choice["text"] if "text" in choice else choice["message"]["content"]

    for path, body in (("/v1/chat/completions", dict(greedy, messages=HI)),
                       ("/v1/completions", dict(greedy, prompt="hello")),
                       ("/v1/embeddings", {"model": MODEL, "input": "hello"})):
        direct = httpx.post(server.base + path, json=body, timeout=30)
        via = httpx.post(server.base + "/invocations", json=body, timeout=30)
        assert direct.status_code == via.status_code == 200, via.text
        assert via.json()["object"] == direct.json()["object"]
        assert answer(via.json()) == answer(direct.json())
    for body, param in (({"messages": HI, "max_tokens": -1}, "max_tokens"),
                        ({"prompt": "x", "temprature": 0}, "temprature"),
                        ({"nothing": 1}, None)):
        bad = httpx.post(server.base + "/invocations", json=body, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text

"""Anthropic's Messages API (`/v1/messages`) through the `anthropic` client: a message is the
chat completion of its conversation, streamed as Anthropic's events, with stop sequences and
tool use; bad blocks are 400s."""
import json

import anthropic
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.http_fixtures import *  # noqa: F403 (checkpoint, engine, server, client)
from tests.http_thread import MODEL

WEATHER = {"name": "get_weather", "description": "the weather in a city",
           "input_schema": {"type": "object", "additionalProperties": False,
                            "required": ["city"],
                            "properties": {"city": {"type": "string", "maxLength": 10}}}}


# The client no longer takes sampling fields (recent models fix them); older ones send them.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.base, api_key="unused", max_retries=0)


def test_a_message_is_the_chat_completion_of_its_conversation(claude, client):
    m = claude.messages.create(model=MODEL, max_tokens=12, system="be brief", extra_body=GREEDY,
                               messages=[{"role": "user", "content": "hello there"}])
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": "be brief"},
                  {"role": "user", "content": "hello there"}]).choices[0]
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.content[0].type == "text" and m.content[0].text == chat.message.content
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.finish_reason]
    assert m.usage.input_tokens > 0 and m.usage.output_tokens > 0
    text = ""
    with claude.messages.stream(model=MODEL, max_tokens=12, system="be brief",
                                extra_body=GREEDY,
                                messages=[{"role": "user", "content": "hello there"}]) as s:
        for piece in s.text_stream:
            text += piece
        final = s.get_final_message()
    assert text == m.content[0].text == final.content[0].text
    assert final.stop_reason == m.stop_reason and final.usage.output_tokens == \
        m.usage.output_tokens


def test_a_stop_sequence_ends_the_text_and_is_named(claude, client):
    base = dict(model=MODEL, max_tokens=30, extra_body=GREEDY,
                messages=[{"role": "user", "content": "tell me more"}])
    text = claude.messages.create(**base).content[0].text
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].strip())
    m = claude.messages.create(stop_sequences=[stop], **base)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[:text.index(stop)]
    streamed = ""
    with claude.messages.stream(stop_sequences=[stop], **base) as s:
        for piece in s.text_stream:
            streamed += piece
        assert s.get_final_message().stop_sequence == stop
    assert streamed == m.content[0].text


def test_tool_use_blocks_and_their_results_go_on(claude):
    base = dict(model=MODEL, max_tokens=80, extra_body=GREEDY, tools=[WEATHER],
                messages=[{"role": "user", "content": "weather in Paris?"}])
    m = claude.messages.create(tool_choice={"type": "any"}, **base)
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and uses and uses[0].name == "get_weather"
    assert isinstance(uses[0].input, dict) and uses[0].id.startswith("toolu_")
    with claude.messages.stream(tool_choice={"type": "any"}, **base) as s:
        streamed = s.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == \
        [(b.name, b.input) for b in uses]
    named = claude.messages.create(tool_choice={"type": "tool", "name": "get_weather"}, **base)
    assert [b.name for b in named.content if b.type == "tool_use"] == ["get_weather"]
    follow = claude.messages.create(model=MODEL, max_tokens=6, tools=[WEATHER], messages=[
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                      "content": "sunny"}]}])
    assert follow.stop_reason in ("end_turn", "max_tokens")
    # A forced call cut short by max_tokens is the text so far, never a failed request.
    short = dict(base, max_tokens=3)
    cut = claude.messages.create(tool_choice={"type": "tool", "name": "get_weather"}, **short)
    assert cut.stop_reason == "max_tokens" and [b.type for b in cut.content] == ["text"]
    with claude.messages.stream(tool_choice={"type": "tool", "name": "get_weather"},
                                **short) as s:
        assert s.get_final_message().content[0].text == cut.content[0].text


def test_a_tool_uses_input_is_an_object_whatever_the_arguments():
    from tierserve.deploy.openai.anthropic import _tool_input
    assert _tool_input('{"city": "Oslo"}') == {"city": "Oslo"} and _tool_input("") == {}
    assert _tool_input('"Rome"') == {"arguments": "Rome"}
    assert _tool_input('{"city": "Os') == {"arguments": '{"city": "Os'}


def test_count_tokens_is_what_the_message_prefills(claude, server):
    """`messages.count_tokens` (Claude Code asks it before sending) equals the usage of the
    same message, with a system prompt, tools and a tool-use turn."""
    convs = [dict(system="be brief", messages=[{"role": "user", "content": "hello there"}]),
             dict(tools=[WEATHER], messages=[
                 {"role": "user", "content": "weather in Paris?"},
                 {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                                    "name": "get_weather",
                                                    "input": {"city": "Paris"}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                               "content": "sunny"}]}])]
    for conv in convs:
        counted = claude.messages.count_tokens(model=MODEL, **conv).input_tokens
        used = claude.messages.create(model=MODEL, max_tokens=2, extra_body=GREEDY, **conv)
        again = claude.messages.create(model=MODEL, max_tokens=2, extra_body=GREEDY, **conv)
        # Anthropic's usage: input_tokens leave out what was read from the cache.
        assert again.usage.cache_read_input_tokens > 0
        for u in (used.usage, again.usage):
            assert counted == u.input_tokens + u.cache_read_input_tokens and u.input_tokens > 0
    bad = httpx.post(server.base + "/v1/messages/count_tokens", timeout=30, json={
        "model": MODEL, "messages": [{"role": "system", "content": "x"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[0].role"
    unknown = httpx.post(server.base + "/v1/messages/count_tokens", timeout=30, json={
        "model": "claude-9", "messages": [{"role": "user", "content": "x"}]})
    assert unknown.status_code == 404


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "maybe"}},
     "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled"}},
     "thinking"),
])
def test_bad_bodies_are_400s_naming_the_field(server, body, param):
    r = httpx.post(server.base + "/v1/messages", timeout=30,
                   json=dict({"model": MODEL, "max_tokens": 4}, **body))
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_raw_events_are_anthropics(server):
    body = {"model": MODEL, "max_tokens": 4, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}
    with httpx.stream("POST", server.base + "/v1/messages", json=body, timeout=30) as r:
        events = [e for e in r.read().decode().split("\n\n") if e.strip()]
    kinds = [e.split("\n")[0].removeprefix("event: ") for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    assert json.loads(events[-2].split("data: ", 1)[1])["usage"]["output_tokens"] == 4


def test_anthropics_key_header_authenticates(engine):
    from tests.http_thread import Server
    from tierserve.deploy.openai import KeyTable
    with Server(engine, keys=KeyTable.single("sk-claude")) as srv:
        ok = anthropic.Anthropic(base_url=srv.base, api_key="sk-claude", max_retries=0)
        assert ok.messages.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": "hi"}]).usage.output_tokens == 2
        bad = anthropic.Anthropic(base_url=srv.base, api_key="sk-nope", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError):
            bad.messages.create(model=MODEL, max_tokens=2,
                                messages=[{"role": "user", "content": "hi"}])


_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2, 400), st.text(max_size=6),
                  st.floats(allow_nan=False, allow_infinity=False, width=32))
_json = st.recursive(_leaf, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)
_block = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["text", "tool_use", "tool_result", "image", "thinking"]) | _json,
    "text": st.text(max_size=8) | _json, "id": st.text(max_size=5) | _json,
    "name": st.sampled_from(["get_weather", "x"]) | _json,
    "input": st.fixed_dictionaries({"city": st.text(max_size=5)}) | _json,
    "tool_use_id": st.text(max_size=5) | _json, "content": st.text(max_size=5) | _json})
_message = st.fixed_dictionaries({}, optional={
    "role": st.sampled_from(["user", "assistant", "system"]) | _json,
    "content": st.text(max_size=8) | st.lists(_block, max_size=3) | _json})
_body = st.fixed_dictionaries({
    "messages": st.lists(_message, min_size=1, max_size=3) | _json,
    "max_tokens": st.integers(-1, 3)}, optional={
    "system": st.text(max_size=8) | st.lists(_block, max_size=2) | _json,
    "stop_sequences": st.lists(st.text(max_size=3), max_size=2) | _json,
    "temperature": _leaf, "top_p": _leaf, "top_k": _leaf,
    "tools": st.lists(st.fixed_dictionaries({}, optional={
        "name": st.sampled_from(["get_weather", ""]) | _json,
        "input_schema": st.just(WEATHER["input_schema"]) | _json,
        "type": st.sampled_from(["custom", "web_search"]) | _json}), max_size=2) | _json,
    "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "any"},
                                    {"type": "tool", "name": "get_weather"}]) | _json,
    "stream": st.booleans(), "metadata": _json})


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=_body)
def test_any_body_is_answered_or_refused_never_a_500(server, body):
    r = httpx.post(server.base + "/v1/messages", json=dict(body, model=MODEL), timeout=60)
    assert r.status_code in (200, 400, 404), (r.status_code, r.text)
    if r.status_code != 200:
        assert r.json()["error"]["message"], r.text
    elif body.get("stream"):
        assert r.text.rstrip().split("\n\n")[-1].startswith("event: message_stop"), r.text
    else:
        assert r.json()["type"] == "message", r.text

"""OpenAI's Responses API (`/v1/responses`) through the `openai` client: a response is the chat
completion of the same conversation, streamed as OpenAI's typed events, stored and continued
by `previous_response_id`, constrained by `text.format` and tools; bad items are 400s."""
import json

import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.http_fixtures import *  # noqa: F403
from tierserve.deploy.openai.responses_store import ResponseStore

from tests.http_thread import MODEL
GREEDY = dict(model=MODEL, temperature=0, max_output_tokens=12)
WEATHER = {"type": "function", "name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "additionalProperties": False,
                          "required": ["city"],
                          "properties": {"city": {"type": "string", "maxLength": 12}}}}


def _chat(client, messages, max_tokens=12, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                          max_tokens=max_tokens, **kwargs)


def test_a_response_is_the_chat_completion_of_its_conversation(client):
    r = client.responses.create(input="hello there", instructions="be brief", **GREEDY)
    chat = _chat(client, [{"role": "system", "content": "be brief"},
                          {"role": "user", "content": "hello there"}])
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if chat.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed" and r.incomplete_details is None
    message = r.output[0]
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text"
    # Items as the client sends them: typed parts, a developer message, earlier output.
    items = [{"role": "developer", "content": "be brief"},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "hello "},
                          {"type": "input_text", "text": "there"}]}]
    assert client.responses.create(input=items, **GREEDY).output_text == r.output_text
    follow = [{"role": "user", "content": "hello there"},
              *[o.model_dump(exclude_none=True) for o in r.output],
              {"role": "user", "content": "and?"}]
    again = client.responses.create(input=follow, **GREEDY)
    assert again.output_text == _chat(client, [
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": r.output_text},
        {"role": "user", "content": "and?"}]).choices[0].message.content


def test_a_stream_is_openais_events_and_ends_with_the_response(client):
    whole = client.responses.create(input="tell me a story", **dict(GREEDY,
                                                                    max_output_tokens=20))
    events = list(client.responses.create(input="tell me a story", stream=True,
                                          **dict(GREEDY, max_output_tokens=20)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{whole.status}"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == whole.output_text == final.output_text == events[-4].text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert {e.item_id for e in events if hasattr(e, "item_id")} == {final.output[0].id}


def test_stored_responses_continue_retrieve_and_delete(client):
    first = client.responses.create(input="my name is Ada", instructions="be brief", **GREEDY)
    second = client.responses.create(input="what is it?", previous_response_id=first.id,
                                     **GREEDY)
    # The instructions are not carried over (OpenAI's rule); the conversation is.
    assert second.output_text == _chat(client, [
        {"role": "user", "content": "my name is Ada"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "what is it?"}]).choices[0].message.content
    assert second.previous_response_id == first.id
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(input="x", previous_response_id=first.id, **GREEDY)
    assert e.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(input="x", store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    streamed = list(client.responses.create(input="y", stream=True, **GREEDY))[-1].response
    assert client.responses.retrieve(streamed.id).output_text == streamed.output_text


def test_text_format_constrains_the_output(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "ok"],
              "properties": {"city": {"type": "string", "maxLength": 10},
                             "ok": {"type": "boolean"}}}
    for seed in range(3):
        r = client.responses.create(
            model=MODEL, input="where?", max_output_tokens=80, temperature=1.0,
            extra_body={"seed": seed},
            text={"format": {"type": "json_schema", "name": "place", "schema": schema}})
        assert r.status == "completed", r.output_text
        jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_forced_tool_calls_are_function_call_items_and_their_outputs_continue(client):
    kwargs = dict(model=MODEL, input="weather in Paris?", tools=[WEATHER],
                  tool_choice="required", max_output_tokens=80, temperature=0)
    r = client.responses.create(**kwargs)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls)
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), WEATHER["parameters"])
        assert c.call_id.startswith("call_") and c.id.startswith("fc_")
    events = list(client.responses.create(stream=True, **kwargs))
    streamed = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(e.name, e.arguments) for e in streamed] == [(c.name, c.arguments) for c in calls]
    assert events[-1].response.output[-1].call_id == \
        [e for e in events if e.type == "response.output_item.done"][-1].item.call_id
    # The calls and their outputs go back as input, as an agent loop sends them.
    follow = [{"role": "user", "content": "weather in Paris?"},
              *[c.model_dump(exclude_none=True) for c in calls],
              *[{"type": "function_call_output", "call_id": c.call_id, "output": "sunny"}
                for c in calls]]
    done = client.responses.create(model=MODEL, input=follow, tools=[WEATHER],
                                   max_output_tokens=8, temperature=0)
    assert done.status in ("completed", "incomplete")
    named = client.responses.create(**dict(kwargs, tool_choice={"type": "function",
                                                                "name": "get_weather"}))
    assert [o.name for o in named.output if o.type == "function_call"] == ["get_weather"]


def test_logprobs_come_on_the_output_text(client):
    r = client.responses.create(input="hi", top_logprobs=2,
                                include=["message.output_text.logprobs"], **GREEDY)
    lps = r.output[0].content[0].logprobs
    assert len(lps) == r.usage.output_tokens
    assert all(len(lp.top_logprobs) == 2 and lp.top_logprobs[0].logprob >= lp.logprob - 1e-6
               for lp in lps)
    assert "".join(lp.token for lp in lps) == r.output_text


@pytest.mark.parametrize("body, status, param", [
    ({"input": [{"type": "input_image", "image_url": "x"}]}, 400, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, 400,
     "input[0].content[0]"),
    ({"input": [{"role": "robot", "content": "hi"}]}, 400, "input[0].role"),
    ({"input": "x", "background": True}, 400, "background"),
    ({"input": "x", "truncation": "auto"}, 400, "truncation"),
    ({"input": "x", "include": ["file_search_call.results"]}, 400, "include"),
    ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0]"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": 3}]}, 400,
     "tools[0].parameters"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, 400, "text.format"),
    ({"input": "x", "reasoning": {"effort": "high"}}, 400, "reasoning"),
    ({"input": "x", "frobnicate": 1}, 400, "frobnicate"),
    ({"input": "x", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
    ({"input": "x", "model": "gpt-9"}, 404, "model"),
])
def test_bad_bodies_are_refused_naming_the_field(server, body, status, param):
    r = httpx.post(server.base + "/v1/responses", json=dict({"model": MODEL}, **body),
                   timeout=30)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.json()
    # The server goes on serving.
    ok = httpx.post(server.base + "/v1/responses", timeout=30,
                    json={"model": MODEL, "input": "x", "max_output_tokens": 2})
    assert ok.status_code == 200 and ok.json()["status"] in ("completed", "incomplete")


def test_the_store_is_bounded_by_bytes_and_kept_per_client():
    store = ResponseStore(max_bytes=600)
    for i in range(5):
        store.put("a:", {"id": f"r{i}", "output": "x" * 100}, [])
    assert store.nbytes <= 600 and store.get("a:", "r0") is None
    assert store.get("a:", "r4") is not None and store.get("b:", "r4") is None
    store.get("a:", "r1")  # used: the least recently used (r2) goes first
    store.put("a:", {"id": "r5", "output": "x" * 100}, [])
    assert store.get("a:", "r1") is not None and store.get("a:", "r2") is None
    store.put("a:", {"id": "big", "output": "x" * 1000}, [])
    assert store.get("a:", "big") is None  # larger than the store: not kept
    assert not store.delete("b:", "r5") and store.delete("a:", "r5")
    assert ResponseStore(0).put("a:", {"id": "r"}, []) is None and len(ResponseStore(0)) == 0


# ---------------------------------------------------------------------------- any body

_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2, 400), st.text(max_size=6),
                  st.floats(allow_nan=False, allow_infinity=False, width=32))
_json = st.recursive(_leaf, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)
_part = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["input_text", "output_text", "input_image", "refusal"]) | _json,
    "text": st.text(max_size=8) | _json})
_item = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning"])
    | _json,
    "role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]) | _json,
    "content": st.text(max_size=8) | st.lists(_part, max_size=2) | _json,
    "call_id": st.text(max_size=6) | _json, "name": st.text(max_size=6) | _json,
    "arguments": st.just('{"city": "x"}') | _json, "output": st.text(max_size=6) | _json})
_tool = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["function", "web_search"]) | _json,
    "name": st.sampled_from(["get_weather", ""]) | _json,
    "parameters": st.just(WEATHER["parameters"]) | _json})
_body = st.fixed_dictionaries({
    "input": st.text(min_size=1, max_size=12) | st.lists(_item, max_size=3) | _json,
    "max_output_tokens": st.integers(-1, 3)}, optional={
    "instructions": st.text(max_size=8) | _json, "temperature": _leaf, "top_p": _leaf,
    "top_logprobs": _leaf, "include": st.lists(st.sampled_from(
        ["message.output_text.logprobs", "x"]), max_size=2) | _json,
    "text": st.fixed_dictionaries({"format": st.sampled_from(
        [{"type": "json_object"}, {"type": "json_schema", "schema": {"type": "integer"}},
         {"type": "text"}]) | _json}) | _json,
    "tools": st.lists(_tool, max_size=2) | _json,
    "tool_choice": st.sampled_from(["auto", "none", "required"]) | _json,
    "previous_response_id": st.text(max_size=6) | _json, "store": _leaf,
    "stream": st.booleans(), "metadata": _json, "seed": _leaf})


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=_body)
def test_any_body_is_answered_or_refused_never_a_500(server, body):
    """Whatever a client sends, the answer is a response or an error naming the request's
    fault (400, 404), never a server error; the server goes on serving."""
    r = httpx.post(server.base + "/v1/responses", json=dict(body, model=MODEL), timeout=60)
    assert r.status_code in (200, 400, 404), (r.status_code, r.text)
    if r.status_code != 200:
        assert r.json()["error"]["message"], r.text
    elif body.get("stream"):
        last = [e for e in r.text.split("\n\n") if e.strip()][-1]
        assert last.split("\n")[0] in ("event: response.completed",
                                       "event: response.incomplete"), last
    else:
        assert r.json()["status"] in ("completed", "incomplete"), r.text


def test_auto_tool_text_streams_until_a_call_begins_then_the_calls_whole():
    """The builder alone (a model trained for Hermes calls writes them unconstrained): text
    before a call streams as deltas, a tail that may begin one waits, the calls come as
    function_call items when the text ends, and what was streamed equals the response."""
    from tierserve.deploy.openai.responses import Fold
    from tierserve.deploy.openai.responses_output import ResponseBuilder
    from tierserve.deploy.openai.responses_protocol import ResponsesRequest
    from tierserve.deploy.openai.structured import tool_plan
    from tierserve.runtime.outputs import CompletionOutput, RequestOutput
    from tierserve.scheduler.params import SamplingParams
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    chunks = ["Let me ", "check. <to", "ol", call[5:30], call[30:]]
    for with_call in (True, False):
        texts = chunks if with_call else chunks[:3] + [" and no call"]
        plan = tool_plan([{"type": "function", "function": {
            "name": "get_weather", "parameters": WEATHER["parameters"]}}], "auto")
        builder = ResponseBuilder("resp_x", MODEL, ResponsesRequest(input="x"),
                                  SamplingParams(), plan, str, 0)
        fold = Fold(1, 1, False)
        events = builder.opening()
        for k, text in enumerate(texts):
            last = k == len(texts) - 1
            delta = RequestOutput("r", None, [1, 2] if k == 0 else [], [CompletionOutput(
                0, text, [7], None, None, "stop" if last else None)], finished=last)
            for piece in fold.add(0, delta):
                events += builder.piece(piece, fold)
        events += builder.closing(fold)
        parsed = [json.loads(e.split(b"\ndata: ", 1)[1]) for e in events]
        deltas = [e["delta"] for e in parsed if e["type"] == "response.output_text.delta"]
        final = parsed[-1]["response"]
        assert [e["sequence_number"] for e in parsed] == list(range(len(parsed)))
        if with_call:
            assert deltas == ["Let me ", "check. "]  # "<to" waited, then the call began
            assert [o["type"] for o in final["output"]] == ["message", "function_call"]
            assert final["output"][0]["content"][0]["text"] == "Let me check. "
            assert json.loads(final["output"][1]["arguments"]) == {"city": "Paris"}
            assert [e["type"] for e in parsed].count("response.output_item.added") == 2
        else:
            assert "".join(deltas) == "Let me check. <tool and no call"
            assert deltas[:2] == ["Let me ", "check. "]
            assert [o["type"] for o in final["output"]] == ["message"]
        assert parsed[-1]["type"] == "response.completed"

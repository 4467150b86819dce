"""`--reasoning-parser`: a thinking model's `<think>` text comes back as chat's `reasoning`
apart from its answer, whole and streamed alike."""
import openai
import pytest

from tests.http_fixtures import *  # noqa: F403 (checkpoint, engine)
from tests.http_thread import MODEL, Server
from tierserve.deploy.openai.reasoning import split_reasoning
from tierserve.deploy.openai.responses import Fold, Responder
from tierserve.runtime.outputs import CompletionOutput, RequestOutput

# A template that opens the model's reasoning for it (as DeepSeek-R1's and Qwen3.5's do).
THINKING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}<|im_start|>assistant\n<think>\n")


@pytest.mark.parametrize("text, inside, want", [
    ("<think>\nplan</think>\n\nanswer", False, ("\nplan", "answer")),
    ("  <think>plan</think>answer", False, ("plan", "answer")),
    ("just an answer", False, ("", "just an answer")),
    ("plan</think>answer", True, ("plan", "answer")),
    ("plan, cut short", True, ("plan, cut short", "")),
    ("<think>plan, cut short", False, ("plan, cut short", "")),
    ("<think>\n</think>\n\nanswer", True, ("\n", "answer")),  # an empty think the model wrote
])
def test_split(text, inside, want):
    assert split_reasoning(text, inside, final=True) == want
    for k in range(len(text) + 1):  # streamed: every prefix's parts grow toward the end's
        r, a = split_reasoning(text[:k], inside, final=False)
        assert want[0].startswith(r) and want[1].startswith(a), (k, r, a)


def _deltas(text_pieces: list[str], prompt_ids: list[int]) -> list[RequestOutput]:
    out = []
    for k, piece in enumerate(text_pieces):
        last = k == len(text_pieces) - 1
        out.append(RequestOutput("r", None, prompt_ids if k == 0 else [], [CompletionOutput(
            0, piece, [9], None, None, "stop" if last else None)], finished=last))
    return out


@pytest.mark.parametrize("prompt_tail", ["x", "<think>\n"])
def test_streamed_reasoning_joins_to_the_full_response(prompt_tail):
    """The parts a stream sends join to the full response's reasoning and content."""
    decode = {1: "user: hi\n", 2: prompt_tail}.get
    body = "<think>" if prompt_tail == "x" else ""
    pieces = [body + "\nI", " should", " say hi.</th", "ink>", "\n\nHel", "lo!"]
    responder = Responder("chat", "c", 0, MODEL, decode, 0, False, reasoning=True)
    fold = Fold(1, 1, False)
    reasoning = content = ""
    for delta in _deltas(pieces, [1, 2]):
        for piece in fold.add(0, delta):
            for chunk in responder.piece(piece, fold):
                d = openai.types.chat.ChatCompletionChunk.model_validate_json(
                    chunk[len(b"data: "):]).choices[0].delta
                extra = d.model_extra or {}
                assert extra.get("reasoning") == extra.get("reasoning_content")
                reasoning += extra.get("reasoning") or ""
                content += d.content or ""
    message = responder.full(fold)["choices"][0]["message"]
    assert (reasoning, content) == ("\nI should say hi.", "Hello!")
    assert message["reasoning"] == message["reasoning_content"] == reasoning
    assert message["content"] == content


@pytest.fixture(scope="module")
def thinking_client(engine):
    with Server(engine, reasoning_parser="qwen3", chat_template=THINKING,
                trust_request_chat_template=True) as srv:
        yield openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0)


def test_a_prompt_that_opens_the_reasoning_returns_it_apart(thinking_client):
    """The template leaves <think> open and the tiny model never closes it: everything it
    writes is reasoning, none of it answer, whole and streamed."""
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=12,
                  temperature=0)
    full = thinking_client.chat.completions.create(**kwargs).choices[0].message
    extra = full.model_extra
    assert full.content is None and extra["reasoning"] and extra["reasoning_content"]
    streamed = ""
    for chunk in thinking_client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        assert not delta.content
        streamed += (delta.model_extra or {}).get("reasoning") or ""
    assert streamed == extra["reasoning"]
    # Without the open tag (the model's own template), the text is all answer.
    plain = thinking_client.chat.completions.create(**kwargs, extra_body={
        "chat_template": THINKING.replace("<think>\n", "")}).choices[0].message
    assert plain.content and plain.model_extra["reasoning"] is None


def test_an_unknown_parser_is_refused():
    from tierserve.deploy.openai import ServerConfig
    with pytest.raises(ValueError, match="reasoning_parser"):
        ServerConfig(served_model_name="m", reasoning_parser="granite")


def test_the_responses_api_gives_reasoning_an_item_of_its_own(thinking_client):
    kwargs = dict(model=MODEL, input="hi", max_output_tokens=12, temperature=0)
    chat = thinking_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=12,
        temperature=0).choices[0].message.model_extra["reasoning"]
    r = thinking_client.responses.create(**kwargs)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == chat and r.output_text == ""
    events = list(thinking_client.responses.create(stream=True, **kwargs))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == chat
    assert [o.type for o in events[-1].response.output] == ["reasoning", "message"]
    # A response's output, reasoning included, goes back as input.
    again = thinking_client.responses.create(model=MODEL, max_output_tokens=4, input=[
        {"role": "user", "content": "hi"}, *[o.model_dump(exclude_none=True) for o in r.output],
        {"role": "user", "content": "and?"}])
    assert again.status in ("completed", "incomplete")


def test_streamed_reasoning_and_answer_items_in_order():
    """The builder alone: the reasoning item opens with its first text and closes when the
    answer begins; the message comes after it, at output index 1."""
    import json

    from tierserve.deploy.openai.responses_output import ResponseBuilder
    from tierserve.deploy.openai.responses_protocol import ResponsesRequest
    from tierserve.scheduler.params import SamplingParams
    builder = ResponseBuilder("resp_x", MODEL, ResponsesRequest(input="x"), SamplingParams(),
                              None, {1: "a"}.get, 0, reasoning=True)
    fold = Fold(1, 1, False)
    events = builder.opening()
    for delta in _deltas(["<think>pl", "an</think>\n", "\nans", "wer"], [1]):
        for piece in fold.add(0, delta):
            events += builder.piece(piece, fold)
    events += builder.closing(fold)
    parsed = [json.loads(e.split(b"\ndata: ", 1)[1]) for e in events]
    kinds = [(e["type"], e.get("output_index")) for e in parsed]
    assert kinds[2:] == [
        ("response.output_item.added", 0), ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.delta", 0), ("response.reasoning_text.done", 0),
        ("response.output_item.done", 0), ("response.output_item.added", 1),
        ("response.content_part.added", 1), ("response.output_text.delta", 1),
        ("response.output_text.delta", 1), ("response.output_text.done", 1),
        ("response.content_part.done", 1), ("response.output_item.done", 1),
        ("response.completed", None)]
    final = parsed[-1]["response"]["output"]
    assert final[0]["content"][0]["text"] == "plan" and final[1]["content"][0]["text"] == \
        "answer"


@pytest.mark.parametrize("start, accepted, refused", [
    ("MAY_OPEN", ['{"a":1}', '<think>\nplan\n</think>\n\n{"a":3}'],
     ['plan</think>{"a":1}', '  {"a":1}', '<think>plan</think>oops']),
    ("OPEN", ['plan</think>\n\n{"a":1}', '<think>x</think>{"a":2}'],
     ['plan</think>oops']),
])
def test_a_constraint_after_reasoning_holds_the_answer_alone(checkpoint, start, accepted,
                                                              refused):
    """The grammar of StructuredOutputs.reasoning: a reasoning block (optional where the
    output may open one; required, from the first token, where the prompt opened it), then
    the constraint on the answer alone. Checked token by token with the tiny tokenizer."""
    import llguidance
    from transformers import AutoTokenizer

    from tierserve.scheduler.output_rules import ReasoningStart, StructuredOutputs
    from tierserve.workers.grammar import check_structured
    hf = AutoTokenizer.from_pretrained(checkpoint)
    tok = llguidance.LLTokenizer((checkpoint / "tokenizer.json").read_text(), n_vocab=len(hf),
                                 eos_token=[hf.eos_token_id])
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
    grammar = check_structured(StructuredOutputs(json=schema,
                                                 reasoning=ReasoningStart[start]))

    def takes(text: str) -> bool:
        matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        ok = matcher.consume_tokens(hf.encode(text, add_special_tokens=False))
        return ok and not matcher.is_error() and matcher.is_accepting()
    assert [takes(t) for t in accepted] == [True] * len(accepted)
    assert [takes(t) for t in refused] == [False] * len(refused)


def test_a_thinking_servers_constrained_reply_reasons_first(thinking_client):
    """With the parser on, response_format holds the answer after the reasoning: what comes
    back as content is the schema's, and a reply cut short is all reasoning."""
    import json

    import jsonschema
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    for template in (None, THINKING.replace("<think>\n", "")):
        out = thinking_client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "a?"}], max_tokens=40,
            temperature=1.0, seed=3, response_format={"type": "json_schema", "json_schema": {
                "name": "a", "schema": schema}},
            extra_body={"chat_template": template} if template else {}).choices[0]
        if out.message.content is not None:
            jsonschema.validate(json.loads(out.message.content), schema)
        else:
            assert out.finish_reason == "length" and out.message.model_extra["reasoning"]


def test_reasoning_effort_reaches_the_template_as_vllm_passes_it(thinking_client):
    """reasoning_effort is the template's `reasoning_effort`, and its `enable_thinking` (off
    for "none") unless chat_template_kwargs set that; the Responses API's reasoning.effort
    alike."""
    template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                "{{ reasoning_effort }}{% if enable_thinking %} think{% endif %}")

    def prompt_tokens(**fields) -> int:
        return thinking_client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
            temperature=0, extra_body={"chat_template": template, **fields}).usage.prompt_tokens

    def given(effort: str, thinking: bool) -> int:  # the same variables, set by the client
        return prompt_tokens(chat_template_kwargs={"reasoning_effort": effort,
                                                   "enable_thinking": thinking})

    assert given("high", True) > given("high", False) > prompt_tokens()
    assert prompt_tokens(reasoning_effort="high") == given("high", True)
    assert prompt_tokens(reasoning_effort="none") == given("none", False)
    assert prompt_tokens(reasoning_effort="none",
                         chat_template_kwargs={"enable_thinking": True}) == given("none", True)
    r = thinking_client.responses.create(model=MODEL, input="hi", max_output_tokens=2,
                                         reasoning={"effort": "low", "summary": "auto"})
    assert r.status in ("completed", "incomplete")


def test_a_thinking_budget_ends_the_reasoning_and_the_answer_follows(thinking_client):
    """The THINKING template opens <think> and the tiny model never closes it: all of its
    reply is reasoning, unless thinking_token_budget closes it, after which the rest is the
    answer."""
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=16,
                  temperature=0, extra_body={"ignore_eos": True})
    free = thinking_client.chat.completions.create(**kwargs).choices[0].message
    assert free.content is None and free.model_extra["reasoning"]
    capped = thinking_client.chat.completions.create(
        **dict(kwargs, extra_body={"ignore_eos": True, "thinking_token_budget": 4})
    ).choices[0].message
    assert capped.content  # the answer after the forced </think>
    assert free.model_extra["reasoning"].startswith(capped.model_extra["reasoning"])

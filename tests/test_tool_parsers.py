"""The tool-call formats `auto` reads (deploy/openai/tool_parsers.py), on texts alone."""
import json

import pytest

from tierserve.deploy.openai.tool_parsers import TOOL_CALL_PARSERS

H, L, M, P = (TOOL_CALL_PARSERS[n]
              for n in ("hermes", "llama3_json", "mistral", "pythonic"))


@pytest.mark.parametrize("fmt, text, want", [
    (H, 'a <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> b',
     ([("f", {"x": 1})], "a  b")),
    (H, "<tool_call>{broken}</tool_call>", None),
    (L, '{"name": "f", "parameters": {"x": 1}}', ([("f", {"x": 1})], None)),
    (L, '<|python_tag|>{"name": "f", "parameters": {}};{"name": "g", "arguments": {"y": 2}}',
     ([("f", {}), ("g", {"y": 2})], None)),
    (L, '{"name": "f", "parameters": {}} and then prose', None),
    (L, '{"not a call": 1}', None),
    (L, "Plain prose.", None),
    (M, 'Sure. [TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}]', ([("f", {"x": 1})],
                                                                   "Sure. ")),
    (M, '[TOOL_CALLS] {"name": "f", "arguments": {}}', ([("f", {})], None)),
    (M, "[TOOL_CALLS] not json", None),
    (P, '[f(x=1, y="a"), g()]', ([("f", {"x": 1, "y": "a"}), ("g", {})], None)),
    (P, '<|python_start|>[f(z=[True, None, {"k": 2.5}])]<|python_end|>',
     ([("f", {"z": [True, None, {"k": 2.5}]})], None)),
    (P, "[f(1)]", None),  # a positional argument: no call of a tool
    (P, "[f(x=y)]", None),  # not a literal
    (P, "Sure: [f()]", None), (P, "[]", None), (P, "[f(**kw)]", None),
])
def test_found(fmt, text, want):
    assert fmt.found(text) == want


@pytest.mark.parametrize("fmt, text, held", [
    (H, "Hello <tool", 6), (H, "Hello <tool_call>{", 6), (H, "  ", 0), (H, "Hello", 5),
    (L, "{", 0), (L, " <|python", 0), (L, "Hello {", 7), (L, "", 0),
    (M, "Hi [TOOL", 3), (M, "Hi there", 8), (M, "\n", 0),
    (P, " [get", 0), (P, "<|python", 0), (P, "Hi [", 4),
])
def test_held_from(fmt, text, held):
    assert fmt.held_from(text) == held


@pytest.mark.parametrize("fmt", [H, L, M, P])
def test_a_written_call_reads_back(fmt):
    text = fmt.write("f", {"x": [1, 2]})
    calls, _ = fmt.found(text)
    assert calls == [("f", {"x": [1, 2]})] and json.dumps(calls[0][1])


@pytest.mark.parametrize("args", [{"city": "Rome"}, "Rome", ["a", 1], "{\"x\": 1}"])
def test_auto_calls_arguments_are_json_text_whatever_the_model_wrote(args):
    """A client json.loads a call's arguments: a bare value the model wrote comes encoded,
    as vLLM's parsers give it (a string that holds JSON stays that string)."""
    from tierserve.deploy.openai.structured import ToolPlan, parse_tool_calls
    plan = ToolPlan("auto", {"f": {}})
    text = H.write("f", args)
    (call,), _ = parse_tool_calls(plan, text)
    assert json.loads(call["function"]["arguments"]) == args


def test_the_cli_offers_every_format():
    """`api-server --tool-call-parser` (whose --help loads no server code) names each one."""
    from tierserve.deploy.cli_parser import build_parser
    parser = build_parser()
    api = next(a for a in parser._subparsers._group_actions[0].choices.values()
               if any("--tool-call-parser" in o.option_strings for o in a._actions))
    option = next(o for o in api._actions if "--tool-call-parser" in o.option_strings)
    assert set(option.choices) == set(TOOL_CALL_PARSERS)

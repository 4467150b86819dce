"""Constrained outputs from a body: `response_format`, vLLM's `structured_outputs` and
`guided_*` fields, and tool calls (`tools` + `tool_choice`) with the schema that enforces them
and the parsing of what the model wrote back into OpenAI's `tool_calls`."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from tierserve.deploy.openai.errors import BadField
from tierserve.deploy.openai.tool_parsers import TOOL_CALL_PARSERS, ToolCallFormat
from tierserve.scheduler.output_rules import StructuredOutputs
from tierserve.workers.grammar import check_structured

__all__ = ["structured_of", "ToolPlan", "tool_plan", "parse_tool_calls", "written_call"]

HERMES = TOOL_CALL_PARSERS["hermes"]

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def _bad(param: str, message: str) -> BadField:
    return BadField(param, message)


def structured_of(req, tools: "ToolPlan | None" = None) -> StructuredOutputs | None:
    """The one constraint a body asks for (None: free text); a BadField naming the field when
    it is malformed, asks for two, or cannot be compiled."""
    found: list[tuple[str, StructuredOutputs]] = []
    rf = getattr(req, "response_format", None)
    if rf:
        spec = _response_format(rf)
        if spec is not None:
            found.append(("response_format", spec))
    if req.structured_outputs:
        fields = dict(req.structured_outputs)
        if isinstance(fields.get("json"), (dict, bool)):
            fields["json"] = json.dumps(fields["json"])
        found.append(("structured_outputs", _build("structured_outputs", fields)))
    for name, kind in _GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            if kind == "json" and not isinstance(value, str):
                value = json.dumps(value)
            found.append((name, _build(name, {kind: value})))
    if tools is not None and tools.schema is not None:
        found.append(("tool_choice", StructuredOutputs(json=json.dumps(tools.schema))))
    if len(found) > 1:
        raise _bad(found[1][0], f"{found[0][0]} and {found[1][0]} both constrain the output; "
                                f"send one")
    if not found:
        return None
    param, spec = found[0]
    try:
        check_structured(spec)
    except ValueError as e:
        raise _bad(param, f"{param}: {e}") from None
    return spec


def _build(param: str, fields: dict) -> StructuredOutputs:
    try:
        return StructuredOutputs(**fields)
    except (TypeError, ValueError) as e:
        raise _bad(param, f"{param}: {str(e).replace('SamplingParams.', '')}") from None


def _response_format(rf: dict) -> StructuredOutputs | None:
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        inner = rf.get("json_schema")
        schema = inner.get("schema", inner.get("json_schema")) if isinstance(inner, dict) \
            else None
        if not isinstance(schema, dict):
            raise _bad("response_format", "response_format.json_schema.schema must be a JSON "
                                          "schema object")
        return StructuredOutputs(json=json.dumps(schema))
    raise _bad("response_format", f"response_format.type must be text, json_object or "
                                  f"json_schema, got {kind!r}")


# ---------------------------------------------------------------------------- tools

@dataclass(frozen=True)
class ToolPlan:
    """How a chat body's tools shape its output: `schema` constrains it (required: a list of
    {name, parameters}; named: the function's parameters); `named` is the forced function."""

    mode: str                       # none | auto | required | named
    tools: dict[str, dict]          # name -> the function's parameters schema
    named: str | None = None
    schema: dict | None = None
    parallel: bool = True           # OpenAI's parallel_tool_calls: False keeps one call
    format: ToolCallFormat = HERMES  # how the model writes calls (`auto` parses them)


def tool_plan(tools: list | None, tool_choice, parallel: bool = True,
              fmt: ToolCallFormat = HERMES) -> ToolPlan | None:
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise _bad("tool_choice", "tool_choice needs tools")
        return None
    by_name: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
                or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"tools[{i}]", "a tool is {\"type\": \"function\", \"function\": "
                                      "{\"name\", \"parameters\"}}")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise _bad(f"tools[{i}].function.parameters", "parameters must be a JSON schema")
        by_name[fn["name"]] = params
    choice = "auto" if tool_choice is None else tool_choice
    if choice in ("none", "auto"):
        return ToolPlan(choice, by_name, parallel=parallel, format=fmt)
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": p},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, p in by_name.items()]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not parallel:
            schema["maxItems"] = 1
        return ToolPlan("required", by_name, schema=schema, parallel=parallel)
    if isinstance(choice, dict) and choice.get("type", "function") == "function":
        name = (choice.get("function") or {}).get("name")
        if name not in by_name:
            raise _bad("tool_choice", f"tool_choice names {name!r}, which is not in tools")
        return ToolPlan("named", by_name, named=name, schema=by_name[name])
    raise _bad("tool_choice", "tool_choice is none, auto, required or {\"type\": \"function\", "
                              "\"function\": {\"name\": ...}}")


def parse_tool_calls(plan: ToolPlan, text: str) -> tuple[list[dict], str | None]:
    """(tool calls, remaining content) of a finished choice's text; no calls: ([], text)."""
    if plan.mode == "named":
        return [_call(plan.named, text)], None
    if plan.mode == "required":
        try:
            items = json.loads(text)
        except ValueError:
            return [], text  # cut short by max_tokens: the text as it is
        return [_call(it["name"], json.dumps(it["parameters"])) for it in items], None
    if plan.mode == "auto":
        found = plan.format.found(text)
        # Arguments are JSON text whatever the model wrote (a bare string too), as vLLM's
        # parsers give them: a client json.loads them.
        calls = [_call(name, json.dumps(args, ensure_ascii=False))
                 for name, args in (found[0] if found else ()) if name in plan.tools]
        if calls:
            return calls if plan.parallel else calls[:1], found[1]
    return [], text


def written_call(call: dict, param: str, fmt: ToolCallFormat = HERMES) -> str:
    """An earlier turn's tool call as text, as the model writes it (what `auto` parses)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise _bad(param, "a tool call is {\"type\": \"function\", \"function\": {\"name\", "
                          "\"arguments\"}}")
    args = fn.get("arguments") or "{}"
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        raise _bad(param, "a tool call's arguments are a JSON string") from None
    return fmt.write(fn["name"], args)


def _call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}

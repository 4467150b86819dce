"""How a model writes tool calls in its text, for `tool_choice: auto` (`api-server
--tool-call-parser`, vLLM's flag and names): one object per format, chosen once per server,
that finds a finished text's calls, says where a streamed text may begin one, and writes an
earlier turn's call back the way the model would.

- hermes (default; Hermes, Qwen2.5/Qwen3): `<tool_call>{"name", "arguments"}</tool_call>`
  blocks anywhere in the text; the content is the text around them.
- llama3_json (Llama 3.1-3.3): the whole reply is the calls, `{"name", "parameters"}` JSON
  objects separated by `;`, after an optional `<|python_tag|>`.
- mistral: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}`; the content is the text
  before it.
- pythonic (Llama 3.2 and 4, ToolACE): the whole reply is a Python list of calls with keyword
  arguments of literal values, `[get_weather(city="Paris"), get_time()]`, inside an optional
  `<|python_start|>` ... `<|python_end|>`.
"""
from __future__ import annotations

import ast
import json
import re

__all__ = ["ToolCallFormat", "TOOL_CALL_PARSERS"]

_DECODER = json.JSONDecoder()


def _tail_may_begin(text: str, tag: str) -> int:
    """Where a tail of text that may begin `tag` starts (len(text): none)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return len(text) - k
    return len(text)


def _held_if_calls(text: str, opener: str, tag: str) -> int:
    """held_from of a format whose reply is all calls when it is any: held whole once it
    opens with `opener` or `tag` (or may still be opening the tag)."""
    lead = text.lstrip()
    if not lead or lead.startswith((opener, tag)) or tag.startswith(lead):
        return 0
    return len(text)


def _call_of(obj, arg_keys: tuple[str, ...]) -> tuple[str, object] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in arg_keys if k in obj), {})
    return obj["name"], args


class ToolCallFormat:
    """One way of writing calls. `found`: (name, arguments) of each call a finished text
    holds, in order, and the content beside them (None: none), or None where it holds none."""

    name = ""

    def found(self, text: str) -> tuple[list[tuple[str, object]], str | None] | None:
        raise NotImplementedError

    def held_from(self, text: str) -> int:
        """Where a streamed text stops being sent as content before it ends: where a call
        begins or may begin; none of it while it is all whitespace."""
        raise NotImplementedError

    def write(self, name: str, arguments: object) -> str:
        raise NotImplementedError


class Hermes(ToolCallFormat):
    name = "hermes"
    OPEN = "<tool_call>"
    BLOCK = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)

    def found(self, text):
        calls = []
        for m in self.BLOCK.finditer(text):
            try:
                call = _call_of(json.loads(m.group(1)), ("arguments", "parameters"))
            except ValueError:
                continue
            if call is not None:
                calls.append(call)
        if not calls:
            return None
        rest = self.BLOCK.sub("", text)  # the text around the calls, as written
        return calls, rest if rest.strip() else None

    def held_from(self, text):
        at = text.find(self.OPEN)
        at = _tail_may_begin(text, self.OPEN) if at < 0 else at
        return at if text[:at].strip() else 0

    def write(self, name, arguments):
        return self.OPEN + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


class Llama3Json(ToolCallFormat):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def found(self, text):
        body = text.strip()
        body = body[len(self.TAG):].lstrip() if body.startswith(self.TAG) else body
        calls, at = [], 0
        while at < len(body):
            try:
                obj, at = _DECODER.raw_decode(body, at)
            except ValueError:
                return None
            call = _call_of(obj, ("parameters", "arguments"))
            if call is None:
                return None
            calls.append(call)
            while at < len(body) and body[at] in " \t\r\n;":
                at += 1
        return (calls, None) if calls else None

    def held_from(self, text):
        return _held_if_calls(text, "{", self.TAG)

    def write(self, name, arguments):
        return json.dumps({"name": name, "parameters": arguments})


class MistralJson(ToolCallFormat):
    name = "mistral"
    TAG = "[TOOL_CALLS]"

    def found(self, text):
        at = text.find(self.TAG)
        if at < 0:
            return None
        try:
            items, _ = _DECODER.raw_decode(text[at + len(self.TAG):].lstrip())
        except ValueError:
            return None
        calls = [_call_of(it, ("arguments", "parameters"))
                 for it in (items if isinstance(items, list) else [items])]
        if not calls or None in calls:
            return None
        return calls, text[:at] if text[:at].strip() else None

    def held_from(self, text):
        at = text.find(self.TAG)
        at = _tail_may_begin(text, self.TAG) if at < 0 else at
        return at if text[:at].strip() else 0

    def write(self, name, arguments):
        return self.TAG + json.dumps([{"name": name, "arguments": arguments}])


class Pythonic(ToolCallFormat):
    name = "pythonic"
    START, END = "<|python_start|>", "<|python_end|>"

    def found(self, text):
        body = text.strip()
        body = body[len(self.START):] if body.startswith(self.START) else body
        body = body[:-len(self.END)] if body.endswith(self.END) else body
        try:
            tree = ast.parse(body.strip(), mode="eval").body
        except SyntaxError:
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) \
                    or node.args or any(k.arg is None for k in node.keywords):
                return None
            try:
                calls.append((node.func.id, {k.arg: ast.literal_eval(k.value)
                                             for k in node.keywords}))
            except ValueError:  # not a literal
                return None
        return calls, None

    def held_from(self, text):
        return _held_if_calls(text, "[", self.START)

    def write(self, name, arguments):
        args = arguments if isinstance(arguments, dict) else {}
        return f"[{name}(" + ", ".join(f"{k}={_python_literal(v)}" for k, v in args.items()) \
            + ")]"


def _python_literal(value) -> str:
    """A JSON value as Python source (true -> True, null -> None; strings as JSON writes
    them, which Python reads alike)."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {_python_literal(v)}"
                               for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_python_literal(v) for v in value) + "]"
    return json.dumps(value)


TOOL_CALL_PARSERS: dict[str, ToolCallFormat] = {
    f.name: f for f in (Hermes(), Llama3Json(), MistralJson(), Pythonic())}

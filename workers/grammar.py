"""Grammars of structured outputs, torch-free: the llguidance grammar of a StructuredOutputs
and its validation, which a client runs before a request reaches the engine (a bad schema is
the request's own error, and a client that checks it imports no torch)."""
from __future__ import annotations

import json as jsonlib
import re

from tierserve.scheduler.output_rules import ReasoningStart, StructuredOutputs

__all__ = ["grammar_of", "check_structured", "llguidance_module"]

# Compact JSON (no whitespace between tokens, as json.dumps(separators=(",", ":")) writes):
# a model cannot spend its tokens on blanks. A schema's "x-guidance" overrides it.
_JSON_OPTIONS = {"whitespace_flexible": False}


def llguidance_module():
    try:
        import llguidance
        return llguidance
    except ImportError:  # pragma: no cover - a dependency; a clear error if it went missing
        raise ValueError("structured outputs need the llguidance package "
                         "(pip install llguidance)") from None


# A thinking model's reasoning before a constrained answer (ReasoningStart): a block from
# `<think>` (MAY_OPEN: optional), or any text (OPEN: the prompt opened it), lazily up to the
# first `</think>`; then optional whitespace, then the answer.
_REASONING = {
    ReasoningStart.MAY_OPEN: ("start: (reasoning WS)? answer\n"
                              "reasoning[lazy]: /<think>(.|\\n)*<\\/think>/\n"),
    ReasoningStart.OPEN: ("start: reasoning WS answer\n"
                          "reasoning[lazy]: /(.|\\n)*<\\/think>/\n"),
}
_ANSWER = "WS: /[ \\t\\r\\n]*/\nanswer: "


def grammar_of(spec: StructuredOutputs) -> str:
    """The llguidance grammar of a constraint; ValueError naming the field it cannot parse."""
    matcher = llguidance_module().LLMatcher
    if spec.reasoning:
        return matcher.grammar_from_lark(_REASONING[spec.reasoning] + _ANSWER
                                         + _lark_answer(spec))
    if spec.json is not None:
        try:
            schema = jsonlib.loads(spec.json)
        except ValueError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        return matcher.grammar_from_json_schema(schema, _JSON_OPTIONS)
    if spec.json_object:
        return matcher.grammar_from_json_schema({"type": "object"}, _JSON_OPTIONS)
    if spec.regex is not None:
        return matcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return matcher.grammar_from_regex("|".join(re.escape(c) for c in spec.choice))
    grammar = spec.grammar
    if "::=" in grammar:  # GBNF (llama.cpp's), as vLLM's guided_grammar takes it
        grammar = _gbnf_to_lark(grammar)
    return matcher.grammar_from_lark(grammar)


def _gbnf_to_lark(grammar: str) -> str:
    llguidance_module()
    from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark
    try:
        return gbnf_to_lark(grammar)
    except GbnfToLarkError as e:
        raise ValueError(f"structured_outputs.grammar is not valid GBNF: {e}") from None


def _lark_answer(spec: StructuredOutputs) -> str:
    """The constraint as the body of a Lark rule."""
    if spec.json is not None or spec.json_object:
        try:
            schema = jsonlib.loads(spec.json) if spec.json is not None else {"type": "object"}
        except ValueError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if isinstance(schema, dict) and "x-guidance" not in schema:
            schema = dict(schema, **{"x-guidance": _JSON_OPTIONS})
        return "%json " + jsonlib.dumps(schema)
    if spec.regex is not None:
        return "/" + spec.regex.replace("/", "\\/") + "/"
    return " | ".join(jsonlib.dumps(c) for c in spec.choice)


def check_structured(spec: StructuredOutputs) -> str:
    """The grammar of a constraint, validated without a tokenizer; ValueError naming the field
    and what the library could not compile."""
    grammar = grammar_of(spec)
    error = llguidance_module().LLMatcher.validate_grammar(grammar)
    if error:
        kind = spec.kinds()[0]
        raise ValueError(f"structured_outputs.{kind} cannot be compiled: {error.strip()}")
    return grammar

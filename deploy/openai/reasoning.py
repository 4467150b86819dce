"""Reasoning outputs (`api-server --reasoning-parser`, vLLM's flag): a thinking model's
`<think> ... </think>` text comes back apart from its answer, as `reasoning` (and under the
older name `reasoning_content`) beside `content`.

A choice is inside its reasoning from its start when its prompt ends inside an open `<think>`
(templates that open it for the model: DeepSeek-R1's, Qwen3.5's), or once its text opens one;
the reasoning runs to `</think>`, the answer after it (its leading newlines dropped). Text that
never opens one is all answer; a reasoning cut short (max_tokens) is all reasoning. While a
choice streams, a tail that may be the start of a tag waits for the text after it.

A constrained reply (response_format, guided_*) of a thinking model reasons first: its grammar
lets it (StructuredOutputs.reasoning), inside the `<think>` its prompt opened or in one it may
open, and holds the answer after `</think>` (constrained_after_reasoning).
"""
from __future__ import annotations

import asyncio

import msgspec

from tierserve.runtime.requests import CHAT_OPTIONS
from tierserve.scheduler.output_rules import ReasoningStart
from tierserve.scheduler.params import SamplingParams

__all__ = ["REASONING_PARSERS", "OPEN", "CLOSE", "opens_inside", "split_reasoning",
           "constrained_after_reasoning", "parses_reasoning"]

# The parsers' names as vLLM's flag takes them; both read the same tags.
REASONING_PARSERS = ("qwen3", "deepseek_r1")
OPEN, CLOSE = "<think>", "</think>"


def opens_inside(prompt_tail: str) -> bool:
    """Whether a prompt ending in this text leaves a `<think>` open."""
    return prompt_tail.rfind(OPEN) > prompt_tail.rfind(CLOSE)


def split_reasoning(text: str, inside: bool, final: bool) -> tuple[str, str]:
    """(reasoning, answer) of a choice's text so far; `inside`: the prompt left a `<think>`
    open. Not `final`: only what can no longer change (each grows as the text does)."""
    lead = text.lstrip()
    if lead.startswith(OPEN):  # opened here (or again, after a template's own)
        inside, text = True, lead[len(OPEN):]
    elif not final and OPEN.startswith(lead):  # nothing yet, or a tag still coming
        return "", ""
    elif not inside:
        return "", text
    end = text.find(CLOSE)
    if end < 0:
        return (text if final else _held_back(text, CLOSE)), ""
    return text[:end], text[end + len(CLOSE):].lstrip("\n")


def _held_back(text: str, tag: str) -> str:
    """text without a tail that may begin `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return text[:-k]
    return text


async def constrained_after_reasoning(tokenizer, prompt: dict, params: SamplingParams,
                                      forced_calls: bool) -> SamplingParams:
    """params with a chat prompt's constraint moved after the reasoning (its prompt rendered
    to see whether it opens a `<think>`); as they are without a constraint, for a Lark
    grammar (which says for itself what comes first) and for forced tool calls."""
    spec = params.structured_outputs
    if spec is None or spec.grammar is not None or forced_calls:
        return params
    options = {k: prompt[k] for k in CHAT_OPTIONS if k in prompt}
    text = await asyncio.to_thread(tokenizer.render_chat, prompt["messages"], **options)
    start = ReasoningStart.OPEN if opens_inside(text[-64:]) else ReasoningStart.MAY_OPEN
    return msgspec.structs.replace(params, structured_outputs=msgspec.structs.replace(
        spec, reasoning=start))


def parses_reasoning(params: SamplingParams) -> bool:
    """Whether a reply under these params may hold reasoning to part from its answer: not a
    constrained one, unless its constraint holds after the reasoning."""
    spec = params.structured_outputs
    return spec is None or bool(spec.reasoning)

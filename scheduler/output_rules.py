"""What shapes or ends a request's output besides its sampling parameters: a constraint
(StructuredOutputs, with where its reasoning stands), a loop detector (RepetitionDetection)
and the tags a thinking budget is held by (ThinkingTags). Wire structs, each a field of
SamplingParams, validated where they are built."""
from __future__ import annotations

import enum
from json import dumps as _json_text

import msgspec

__all__ = ["ReasoningStart", "StructuredOutputs", "StructuredOutputsParams",
           "RepetitionDetection", "RepetitionDetectionParams", "ThinkingTags"]


class ReasoningStart(enum.IntEnum):
    """Where a constrained output's reasoning stands (StructuredOutputs.reasoning): none
    (the constraint holds from the first token); MAY_OPEN, the output may open with a
    `<think> ... </think>` block; OPEN, it starts inside one (its prompt opened it) that runs
    to `</think>`."""
    NONE = 0
    MAY_OPEN = 1
    OPEN = 2


class StructuredOutputs(msgspec.Struct, kw_only=True, omit_defaults=True, array_like=True,
                        gc=False):
    """One constraint on a request's output (vLLM's names): `json` a JSON schema (its JSON
    text, or the schema as a dict, which becomes its text), `json_object` any JSON object,
    `regex`, `choice` one of the strings, `grammar` a Lark (or GBNF) grammar.
    `reasoning` (ReasoningStart; json, json_object, regex and choice): a thinking model
    reasons freely first, and the constraint holds for the answer after its `</think>`.
    workers/structured.py compiles it."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    reasoning: ReasoningStart = ReasoningStart.NONE

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):  # as vLLM's StructuredOutputsParams takes it
            try:
                self.json = _json_text(self.json)
            except (TypeError, ValueError) as e:
                raise ValueError(f"SamplingParams.structured_outputs.json is not a JSON "
                                 f"schema: {e}") from None
        kinds = self.kinds()
        if len(kinds) != 1:
            raise ValueError(f"SamplingParams.structured_outputs takes exactly one of json, "
                             f"json_object, regex, choice, grammar; got {kinds or 'none'}")
        try:
            self.reasoning = ReasoningStart(self.reasoning)
        except ValueError:
            raise ValueError(f"SamplingParams.structured_outputs.reasoning must be a "
                             f"ReasoningStart (0, 1, 2), got {self.reasoning!r}") from None
        if self.reasoning and kinds == ["grammar"]:
            raise ValueError("SamplingParams.structured_outputs.reasoning takes json, "
                             "json_object, regex or choice")
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"SamplingParams.structured_outputs.{name} must be a "
                                 f"non-empty string")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or any(not isinstance(c, str) or not c
                                               for c in self.choice)):
            raise ValueError("SamplingParams.structured_outputs.choice must be non-empty strings")

    def kinds(self) -> list[str]:
        return [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None
                ] + (["json_object"] if self.json_object is True else [])


# vLLM's name for it: code written for vLLM runs with its import changed.
StructuredOutputsParams = StructuredOutputs


class RepetitionDetection(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True,
                          gc=False):
    """vLLM's RepetitionDetectionParams: the output ends (finish_reason "repetition") once
    its tail is one pattern of min_pattern_size..max_pattern_size tokens (0: 1) repeated
    min_count times in a row; max_pattern_size 0 turns it off."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    def __post_init__(self) -> None:
        for name in ("max_pattern_size", "min_pattern_size", "min_count"):
            value = getattr(self, name)
            if type(value) is not int or not 0 <= value <= 1 << 16:
                raise ValueError(f"SamplingParams.repetition_detection.{name} must be in "
                                 f"[0, 65536] (an int), got {value!r}")
        if self.min_pattern_size > self.max_pattern_size:
            raise ValueError("SamplingParams.repetition_detection.min_pattern_size must be <= "
                             "max_pattern_size")
        if self.max_pattern_size and self.min_count < 2:
            raise ValueError("SamplingParams.repetition_detection.min_count must be >= 2 (the "
                             "times a pattern repeats)")

    def found(self, tokens: list[int]) -> bool:
        """Whether tokens end with a pattern repeated min_count times."""
        for n in range(max(self.min_pattern_size, 1), self.max_pattern_size + 1):
            span = n * self.min_count
            if span > len(tokens):
                return False
            tail = tokens[-span:]
            if tail == tail[:n] * self.min_count:
                return True
        return False


RepetitionDetectionParams = RepetitionDetection  # vLLM's name


class ThinkingTags(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    """What a thinking_token_budget is enforced by, tokenized by the caller's processor: the
    reasoning's opening and closing token ids, and whether the prompt leaves it open."""

    start: list[int]
    end: list[int]
    open: bool = False

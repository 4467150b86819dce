"""Per-request sampling parameters, request status codes and finish reasons.

SamplingParams is a msgspec Struct so it travels on the wire unchanged (once per request, inside
NewRequestData) and is validated where it is built: a bad value raises ValueError naming the field.
"""
from __future__ import annotations

import enum
import math

import msgspec

from tierserve.scheduler.output_rules import RepetitionDetection, StructuredOutputs, ThinkingTags

__all__ = ["SamplingParams", "RequestStatus", "RequestOutputKind", "Pooling", "LoRARef",
           "FinishReason", "ErrorKind", "QueueFullError", "MAX_N"]

# Most samples one request may ask for (OpenAI's limit).
MAX_N = 128
MAX_LOGPROB_TOKEN_IDS = 128  # vLLM's bound on logprob_token_ids


class LoRARef(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    """A LoRA adapter as the engine and its workers name it: its id (> 0, in every block hash
    of its requests, so one id is one adapter for the engine's life), its name, and its folder
    (PEFT's adapter_config.json and adapter_model.safetensors), which every rank reads. Its
    digest (of those files, set by the engine at its door) keys the prefix cache, the SSD tier
    and the ranks' loaded adapters, so a changed adapter never meets another's KV."""

    lora_id: int
    name: str
    path: str
    digest: int = 0


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished; is_finished() relies on the ordering.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6
    FINISHED_REPETITION = 7

    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    REPETITION = 4  # a repeated pattern ended it (repetition_detection)

    def __str__(self) -> str:  # vLLM's user-facing strings
        return self.name.lower()


class RequestOutputKind(enum.IntEnum):
    """What AsyncLLM.generate yields per step (vLLM's names and values): everything so far,
    the new part, or only the finished request."""
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class Pooling(enum.IntEnum):
    """What an embedding request returns beside its one token: the final hidden state of its
    last prompt token (LAST), or that vector divided by its L2 norm (LAST_NORMALIZED)."""
    NONE = 0
    LAST = 1
    LAST_NORMALIZED = 2


class ErrorKind(enum.IntEnum):
    """Why a request failed, for a client to answer by (HTTP: 400, 503, 503, 500)."""

    NONE = 0
    BAD_REQUEST = 1
    OVERLOADED = 2
    ENGINE_DEAD = 3
    INTERNAL = 4

    def __str__(self) -> str:
        return self.name.lower()


class QueueFullError(ValueError):
    """The waiting queue is at its bound (max_queued_requests): the request is refused now,
    rather than queued behind work it could only wait for."""


_STATUS_TO_REASON = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
    RequestStatus.FINISHED_REPETITION: FinishReason.REPETITION,
}


def finish_reason_of(status: RequestStatus) -> FinishReason | None:
    return _STATUS_TO_REASON.get(status)


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True, array_like=True, gc=False):
    """vLLM's names and defaults. temperature 0 is greedy; top_k 0 or -1 disables top-k."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int | None = 16
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    # Token ids whose logprobs come with every sampled token's, after its top `logprobs`
    # (which they set to 0 when it is None), each with its true rank (vLLM's field).
    logprob_token_ids: list[int] | None = None
    # Samples per prompt: the prompt's KV is computed once and each sample forks from it.
    n: int = 1
    # A grammar the output must follow; its matcher lives on the rank that samples.
    structured_outputs: StructuredOutputs | None = None
    # EOS and stop_token_ids cannot end the output before it has this many tokens.
    min_tokens: int = 0
    # Token id -> a bias in [-100, 100] added to its logit (OpenAI's logit_bias).
    logit_bias: dict[int, float] | None = None
    # Only these tokens may be sampled.
    allowed_token_ids: list[int] | None = None
    # Token sequences the output never ends with (vLLM's bad_words, tokenized by the caller):
    # a sequence's last token is banned wherever the output ends with the rest of it.
    bad_words_token_ids: list[list[int]] | None = None
    # A stop string that ends the output stays in its text.
    include_stop_str_in_output: bool = False
    # Logprobs of each prompt token given the ones before (and the top-n there); the prompt
    # is then computed in full, without prefix cache hits.
    prompt_logprobs: int | None = None
    # vLLM's: the prompt reads no cached blocks of any tier (its own are still cached).
    skip_reading_prefix_cache: bool = False
    # vLLM's: ends an output that loops (RepetitionDetection); a dict is taken too.
    repetition_detection: RepetitionDetection | None = None
    # Text work in the caller's process (runtime/processor.py), which the engine never reads:
    # words tokenized into bad_words_token_ids (alone and after a space, vLLM's spellings);
    # special tokens left out of the text; no text at all; only the prompt's last k tokens
    # (-1: max_model_len of them).
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    truncate_prompt_tokens: int | None = None
    # What AsyncLLM.generate yields (LLM returns finished requests whatever it says); vLLM's
    # AsyncLLM defaults to CUMULATIVE, ours to the deltas a stream is made of.
    output_kind: RequestOutputKind = RequestOutputKind.DELTA
    # vLLM's: a stream's outputs carry this many new tokens each (a sample's first and last
    # go at once); None or 1: every step's.
    stream_interval: int | None = None
    # vLLM's: at most this many tokens of reasoning; past them the closing tag is forced
    # (workers/token_rules.py). `thinking` is set from it by the input processor.
    thinking_token_budget: int | None = None
    thinking: ThinkingTags | None = None
    # Set by the embedding frontends (LLM.embed, AsyncLLM.encode, /v1/embeddings), not a
    # sampling choice: the request's output carries its pooled hidden state (Pooling).
    pooling: Pooling = Pooling.NONE

    def __post_init__(self) -> None:
        self._normalize()
        _check(self.temperature, "temperature", lambda v: 0.0 <= v <= 2.0, "must be in [0, 2]")
        _check(self.top_p, "top_p", lambda v: 0.0 < v <= 1.0, "must be in (0, 1]")
        _check_int(self.top_k, "top_k", lambda v: -1 <= v < 2**63,
                   "must be -1, 0 (disabled) or >= 1")
        _check(self.min_p, "min_p", lambda v: 0.0 <= v <= 1.0, "must be in [0, 1]")
        if self.max_tokens is not None:
            _check_int(self.max_tokens, "max_tokens", lambda v: 1 <= v < 2**63, "must be >= 1")
        _check(self.presence_penalty, "presence_penalty", lambda v: -2.0 <= v <= 2.0,
               "must be in [-2, 2]")
        _check(self.frequency_penalty, "frequency_penalty", lambda v: -2.0 <= v <= 2.0,
               "must be in [-2, 2]")
        _check(self.repetition_penalty, "repetition_penalty", lambda v: 0.0 < v < math.inf,
               "must be finite and > 0")
        if self.logprobs is not None:
            _check_int(self.logprobs, "logprobs", lambda v: 0 <= v <= 20, "must be in [0, 20]")
        if self.prompt_logprobs is not None:
            _check_int(self.prompt_logprobs, "prompt_logprobs", lambda v: 0 <= v <= 20,
                       "must be in [0, 20]")
        _check_int(self.n, "n", lambda v: 1 <= v <= MAX_N, f"must be in [1, {MAX_N}]")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**64):
            raise ValueError(f"SamplingParams.seed must be an int in [0, 2**64), got {self.seed!r}")
        if not isinstance(self.stop, list) or any(not isinstance(s, str) or not s
                                                  for s in self.stop):
            raise ValueError(f"SamplingParams.stop must be non-empty strings, got {self.stop!r}")
        for s in self.stop:
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"SamplingParams.stop holds invalid Unicode: {s!r}") from None
        if not isinstance(self.stop_token_ids, list) or any(
                type(t) is not int or not 0 <= t < 2**63 for t in self.stop_token_ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be ints in [0, 2**63), got "
                             f"{self.stop_token_ids!r}")
        self._check_token_fields()
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputs(**self.structured_outputs)
        elif self.structured_outputs is not None and \
                not isinstance(self.structured_outputs, StructuredOutputs):
            raise ValueError("SamplingParams.structured_outputs must be StructuredOutputs or "
                             "a dict of its fields")
        if type(self.ignore_eos) is not bool:
            raise ValueError(f"SamplingParams.ignore_eos must be True or False, got "
                             f"{self.ignore_eos!r}")
        self._check_text_fields()

    def _normalize(self) -> None:
        """vLLM's spellings of the defaults: None lists, seed -1 (none), logprobs True (1)."""
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        if self.seed == -1 and type(self.seed) is int:
            self.seed = None
        if self.logprobs is True:
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1

    def _check_text_fields(self) -> None:
        if self.bad_words is not None and (not isinstance(self.bad_words, list) or any(
                not isinstance(w, str) or not w.strip() for w in self.bad_words)):
            raise ValueError(f"SamplingParams.bad_words must be non-blank strings, got "
                             f"{self.bad_words!r}")
        for name in ("skip_special_tokens", "detokenize"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"SamplingParams.{name} must be True or False")
        if self.stop and not self.detokenize:
            raise ValueError("SamplingParams.stop strings need detokenize=True (stop_token_ids "
                             "need no text)")
        if type(self.output_kind) is not RequestOutputKind:
            try:
                if isinstance(self.output_kind, bool):
                    raise ValueError
                self.output_kind = RequestOutputKind(self.output_kind)
            except ValueError:
                raise ValueError(f"SamplingParams.output_kind must be a RequestOutputKind "
                                 f"(0, 1, 2), got {self.output_kind!r}") from None
        if self.truncate_prompt_tokens is not None:
            _check_int(self.truncate_prompt_tokens, "truncate_prompt_tokens",
                       lambda v: v == -1 or 1 <= v < 2**63, "must be -1 or >= 1")
        self._check_pooling()

    def _check_pooling(self) -> None:
        try:
            self.pooling = Pooling(self.pooling)
        except ValueError:
            raise ValueError(f"SamplingParams.pooling must be a Pooling (0, 1, 2), got "
                             f"{self.pooling!r}") from None
        if self.pooling and (self.max_tokens != 1 or self.n != 1 or self.logprobs is not None
                             or self.prompt_logprobs is not None
                             or self.structured_outputs is not None):
            raise ValueError("SamplingParams.pooling needs max_tokens 1 and n 1, without "
                             "logprobs or structured outputs")

    def _check_token_fields(self) -> None:
        _check_int(self.min_tokens, "min_tokens", lambda v: 0 <= v < 2**63, "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"SamplingParams.min_tokens must be <= max_tokens, got "
                             f"{self.min_tokens} > {self.max_tokens}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError("SamplingParams.logit_bias must be a dict of token id -> bias")
            for t, b in self.logit_bias.items():
                _check_token(t, "logit_bias")
                _check(b, "logit_bias", lambda v: -100.0 <= v <= 100.0, "must be in [-100, 100]")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                raise ValueError("SamplingParams.allowed_token_ids must be a non-empty list")
            for t in self.allowed_token_ids:
                _check_token(t, "allowed_token_ids")
        if self.bad_words_token_ids is not None:
            if not isinstance(self.bad_words_token_ids, list) or any(
                    not isinstance(w, list) or not w for w in self.bad_words_token_ids):
                raise ValueError("SamplingParams.bad_words_token_ids must be non-empty lists")
            for w in self.bad_words_token_ids:
                for t in w:
                    _check_token(t, "bad_words_token_ids")
        if isinstance(self.logprob_token_ids, tuple):
            self.logprob_token_ids = list(self.logprob_token_ids)
        if self.logprob_token_ids is not None:
            if not isinstance(self.logprob_token_ids, list) or \
                    not 1 <= len(self.logprob_token_ids) <= MAX_LOGPROB_TOKEN_IDS:
                raise ValueError(f"SamplingParams.logprob_token_ids must be a list of 1 to "
                                 f"{MAX_LOGPROB_TOKEN_IDS} token ids")
            for t in self.logprob_token_ids:
                _check_token(t, "logprob_token_ids")
            if self.logprobs is None:
                self.logprobs = 0
        if self.thinking_token_budget is not None:
            _check_int(self.thinking_token_budget, "thinking_token_budget",
                       lambda v: 0 <= v < 2**63, "must be >= 0")
        if isinstance(self.repetition_detection, dict):
            try:
                self.repetition_detection = RepetitionDetection(**self.repetition_detection)
            except TypeError as e:  # a field it does not have
                raise ValueError(f"SamplingParams.repetition_detection: {e}") from None
        if self.repetition_detection is not None and not isinstance(
                self.repetition_detection, RepetitionDetection):
            raise ValueError("SamplingParams.repetition_detection must be a "
                             "RepetitionDetectionParams or a dict of its fields")
        if self.stream_interval is not None:
            _check_int(self.stream_interval, "stream_interval", lambda v: 1 <= v <= 1 << 20,
                       "must be >= 1")
        if type(self.skip_reading_prefix_cache) is not bool:
            raise ValueError("SamplingParams.skip_reading_prefix_cache must be True or False")
        if type(self.include_stop_str_in_output) is not bool:
            raise ValueError("SamplingParams.include_stop_str_in_output must be True or False")

    @classmethod
    def from_optional(cls, **kwargs) -> "SamplingParams":
        """vLLM's constructor whose None arguments take their defaults; as vLLM's, it takes
        logit_bias keys as strings of token ids and clamps the biases to [-100, 100]."""
        bias = kwargs.get("logit_bias")
        if isinstance(bias, dict):
            kwargs["logit_bias"] = _clamped_bias(bias)
        return cls(**{k: v for k, v in kwargs.items() if v is not None})

    def clone(self) -> "SamplingParams":
        """A deep copy (vLLM's): changing its lists leaves this one as it is."""
        return msgspec.convert(msgspec.to_builtins(self), SamplingParams)

    def token_ids_named(self) -> list[int]:
        """Every token id the parameters name (the engine checks them against the vocab)."""
        ids = list(self.stop_token_ids)
        ids += list(self.logit_bias or ())
        ids += self.allowed_token_ids or []
        ids += self.logprob_token_ids or []
        if self.thinking is not None:
            ids += self.thinking.start + self.thinking.end
        for w in self.bad_words_token_ids or ():
            ids += w
        return ids


def _check_token(value, name: str) -> None:
    if type(value) is not int or not 0 <= value < 2**63:
        raise ValueError(f"SamplingParams.{name} token ids must be ints >= 0, got {value!r}")


def _check_int(value, name: str, ok, requirement: str) -> None:
    if type(value) is not int or not ok(value):
        raise ValueError(f"SamplingParams.{name} {requirement} (an int), got {value!r}")


def _clamped_bias(bias: dict) -> dict[int, float]:
    out = {}
    for token, value in bias.items():
        try:
            token_id = int(token) if not isinstance(token, bool) else None
        except (TypeError, ValueError):
            token_id = None
        if token_id is None:
            raise ValueError(f"SamplingParams.logit_bias keys must be token ids, got {token!r}")
        _check(value, "logit_bias", lambda v: True, "must be a number")
        out[token_id] = min(100.0, max(-100.0, float(value)))
    return out


def _check(value, name: str, ok, requirement: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
        isinstance(value, float) and math.isnan(value)
    ) or not ok(value):
        raise ValueError(f"SamplingParams.{name} {requirement}, got {value!r}")

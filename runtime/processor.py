"""Text work in the client's process: a user's prompt becomes token ids (InputProcessor), the
engine's token ids become text (OutputProcessor).

The EngineCore takes token ids and emits token ids, so its step loop never tokenizes, renders
a chat template or detokenizes: a long prompt costs the process that sent it, not every stream
the engine serves. Every frontend runs these two over whichever engine client it has (an
in-process EngineCore or AsyncEngine, a Ray deployment, a router): `LLM`, `AsyncLLM`, and
through `AsyncLLM` the HTTP server.

Limits come before work: a prompt's length in bytes bounds its length in tokens from below
(Tokenizer.max_token_bytes), so a text that cannot fit max_model_len is refused before it is
tokenized; a long text is tokenized on a pool thread of lowered priority, off the caller's
event loop. Stop strings are matched here: a sample's text ends at the match at once, and the
caller tells the engine to finish that sequence; the tokens the engine made meanwhile (a step,
two with async scheduling) are dropped here, so the text is what matching in the engine gave.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import msgspec

from tierserve.runtime.detokenizer import IncrementalDetokenizer
from tierserve.runtime.lora import LoRARequest, lora_ref
from tierserve.runtime.requests import (
    Prompt, check_params, check_prompt, prompt_fields, token_ids,
)
from tierserve.runtime.tokenizer import Tokenizer
from tierserve.scheduler.messages import EngineCoreOutput, EngineCoreRequest
from tierserve.scheduler.output_rules import ThinkingTags
from tierserve.scheduler.params import FinishReason, LoRARef, SamplingParams

__all__ = ["InputProcessor", "OutputProcessor", "Processed", "text_pool", "bad_word_ids",
           "thinking_tags"]

log = logging.getLogger("tierserve.processor")

# A text up to this many bytes is tokenized on the caller's thread: handing it to the pool
# costs more than tokenizing it.
INLINE_BYTES = 4096
_POOL_THREADS = 2
# The pool's threads run at this niceness, so that on a busy machine text work yields the
# CPU to the engine's steps instead of stretching them.
_POOL_NICENESS = 10

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _lower_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _POOL_NICENESS)
    except (OSError, AttributeError):  # not Linux, or not allowed: run at normal priority
        pass


def text_pool() -> ThreadPoolExecutor:
    """This process's pool for text work (tokenizing long prompts, loading tokenizers)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_POOL_THREADS, thread_name_prefix="tierserve-text",
                                       initializer=_lower_priority)
        return _pool


@dataclass(slots=True)
class Processed:
    request: EngineCoreRequest
    prompt: str | None  # the prompt's text, as RequestOutput.prompt reports it


class InputProcessor:
    """Checks a user's prompt and parameters and tokenizes it: a ValueError naming the field
    for anything the engine would refuse, so that a bad request costs no round trip."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def process(self, req_id: str, prompt, params: SamplingParams, priority: int = 0,
                cache_salt: str | None = None, label: str = "",
                lora_request: LoRARequest | None = None) -> Processed:
        fields = self.check(prompt, params, priority, cache_salt)
        lora = lora_ref(lora_request)
        return self.tokenize(req_id, fields, params, priority, label, lora)

    async def process_async(self, req_id: str, prompt, params: SamplingParams,
                            priority: int = 0, cache_salt: str | None = None,
                            label: str = "", lora_request: LoRARequest | None = None
                            ) -> Processed:
        """process(), with a long text's bound check and tokenization on the text pool, as a
        chat's with a template given to it (the caller's: its run time is not the model's)."""
        fields = self.check(prompt, params, priority, cache_salt)
        lora = lora_ref(lora_request)
        if _text_bytes(fields) <= INLINE_BYTES and not (fields.chat or {}).get("chat_template"):
            return self.tokenize(req_id, fields, params, priority, label, lora)
        return await asyncio.get_running_loop().run_in_executor(
            text_pool(), self.tokenize, req_id, fields, params, priority, label, lora)

    def check(self, prompt, params: SamplingParams, priority: int,
              cache_salt: str | None) -> Prompt:
        """What is cheap to check: types, Unicode, parameters, a token-id prompt whole."""
        fields = prompt_fields(prompt)
        check_prompt(fields)
        if fields.cache_salt is None:
            fields.cache_salt = cache_salt
        elif cache_salt is not None and cache_salt != fields.cache_salt:
            raise ValueError("the prompt's cache_salt differs from the request's cache_salt")
        check_params(params, priority, fields.cache_salt)
        keep = self._kept(params)
        if fields.token_ids is not None:
            if keep is None and hasattr(fields.token_ids, "__len__") and \
                    len(fields.token_ids) > self.max_model_len:
                raise ValueError(self._too_long(len(fields.token_ids)))
            fields.token_ids = token_ids(fields.token_ids, vocab_size=self.vocab_size)
        elif self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompt token ids")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; use stop_token_ids")
        if params.thinking_token_budget is not None and self.tokenizer is None:
            raise ValueError("thinking_token_budget needs a tokenizer (its <think> tags)")
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer; use bad_words_token_ids")
        return fields

    def tokenize(self, req_id: str, fields: Prompt, params: SamplingParams, priority: int,
                 label: str, lora: LoRARef | None = None) -> Processed:
        """The engine request of checked fields (check(): its cache salt resolved there)."""
        ids, shown = fields.token_ids, fields.text
        if ids is None:
            ids, shown = self._encode(fields)
        keep = self._kept(params)
        if keep is not None:
            ids = ids[-keep:]
        if len(ids) > self.max_model_len:
            raise ValueError(self._too_long(len(ids)))
        if params.bad_words:
            params = msgspec.structs.replace(params, bad_words=None, bad_words_token_ids=(
                params.bad_words_token_ids or []) + bad_word_ids(params.bad_words,
                                                                 self.tokenizer))
        if params.thinking_token_budget is not None:
            params = msgspec.structs.replace(params, thinking=thinking_tags(ids, self.tokenizer))
        request = EngineCoreRequest(req_id, params, prompt_token_ids=ids, priority=priority,
                                    cache_salt=fields.cache_salt, label=label, lora=lora)
        return Processed(request, shown)

    def _kept(self, params: SamplingParams) -> int | None:
        """How many of the prompt's last tokens truncate_prompt_tokens keeps (None: all)."""
        k = params.truncate_prompt_tokens
        if k is None:
            return None
        if k > self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens {k} is more than max_model_len "
                             f"{self.max_model_len}")
        return self.max_model_len if k == -1 else k

    def _encode(self, fields: Prompt) -> tuple[list[int], str]:
        """The prompt's token ids and its text (a chat's as its template rendered it, which
        RequestOutput.prompt reports, as vLLM's does)."""
        tok = self.tokenizer
        try:
            if fields.messages is not None:
                self._check_bytes("messages", sum(len(m["content"].encode())
                                                  for m in fields.messages))
                text = tok.render_chat(fields.messages, **(fields.chat or {}))
                self._check_bytes("messages", len(text.encode()))
                return tok.encode(text, add_special_tokens=bool(fields.add_special_tokens)), text
            self._check_bytes("prompt", len(fields.text.encode()))
            return tok.encode(fields.text, add_special_tokens=fields.add_special_tokens
                              is not False), fields.text
        except ValueError:
            raise
        except Exception as e:
            # Opens with the field, as every request error does (the server's `param`).
            field = "messages" if fields.messages is not None else "prompt"
            raise ValueError(f"{field} cannot be tokenized (the chat template or the tokenizer "
                             f"failed): {type(e).__name__}: {e}") from e

    def _check_bytes(self, field: str, nbytes: int) -> None:
        check_text_bytes(field, nbytes, self.max_model_len, self.tokenizer.max_token_bytes)

    def _too_long(self, n: int) -> str:
        return f"prompt has {n} tokens, more than max_model_len {self.max_model_len}"


# The reasoning tags of Qwen3's and DeepSeek-R1's templates (the HTTP server's parsers').
THINK_START, THINK_END = "<think>", "</think>"
_OPEN_TAIL = 256  # prompt tokens searched for a reasoning the template left open


def thinking_tags(prompt_ids: list[int], tokenizer: Tokenizer) -> ThinkingTags:
    """The tags' token ids, and whether the prompt's last tag (in its last tokens) opens."""
    start = tokenizer.encode(THINK_START, add_special_tokens=False)
    end = tokenizer.encode(THINK_END, add_special_tokens=False)
    if not start or not end:
        raise ValueError(f"thinking_token_budget: this tokenizer writes {THINK_START!r} or "
                         f"{THINK_END!r} as no tokens")
    tail = list(prompt_ids[-_OPEN_TAIL:])
    return ThinkingTags(start, end, _last_at(tail, start) > _last_at(tail, end))


def _last_at(ids: list[int], seq: list[int]) -> int:
    """Where the last occurrence of seq in ids begins; -1: nowhere."""
    n = len(seq)
    return next((i for i in range(len(ids) - n, -1, -1) if ids[i:i + n] == seq), -1)


def bad_word_ids(words: list[str], tokenizer: Tokenizer) -> list[list[int]]:
    """Each bad word's token ids as the model writes it alone and after a space (vLLM's two
    spellings), without repeats."""
    out: list[list[int]] = []
    for word in words:
        for spelling in (word, " " + word.lstrip()):
            ids = tokenizer.encode(spelling, add_special_tokens=False)
            if ids and ids not in out:
                out.append(ids)
    return out


def _text_bytes(fields: Prompt) -> int:
    """How much text there is to tokenize (characters: a cheap bound of the work)."""
    if fields.text is not None:
        return len(fields.text)
    if fields.messages is not None:
        return sum(len(m["content"]) for m in fields.messages)
    return 0


class _Sample:
    __slots__ = ("detok", "done")

    def __init__(self, detok: IncrementalDetokenizer | None) -> None:
        self.detok, self.done = detok, False


class _RequestState:
    __slots__ = ("prompt_ids", "params", "samples", "announced", "left")

    def __init__(self, request: EngineCoreRequest) -> None:
        self.prompt_ids = request.prompt_token_ids
        self.params = request.sampling_params
        self.samples: dict[int, _Sample] = {}
        self.announced = False
        self.left = request.sampling_params.n


class OutputProcessor:
    """Each request's detokenizers (one per sample) and stop strings. `process` fills each
    output's text (and the request's prompt ids on its first output), drops what a sample
    made after its stop string, and names the sequences the engine should finish."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}

    def add(self, request: EngineCoreRequest) -> None:
        self._requests[request.req_id] = _RequestState(request)

    def remove(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def finished(self, req_id: str) -> bool:
        """Whether every sample of the request has finished (or it is not known here)."""
        state = self._requests.get(req_id)
        return state is None or state.left <= 0

    def process(self, outputs: list[EngineCoreOutput]
                ) -> tuple[list[EngineCoreOutput], list[tuple[str, int]]]:
        """(the outputs to deliver, the (request id, sample index) of samples a stop string
        ended this time, for the engine to finish)."""
        kept, stopped = [], []
        for o in outputs:
            state = self._requests.get(o.req_id)
            if state is None:
                continue
            sample = state.samples.get(o.index)
            if sample is None:
                sample = state.samples[o.index] = _Sample(self._detokenizer(state))
            if sample.done:
                continue  # made after its stop string (or its request's error)
            if o.error:
                state.left = 0
                for s in state.samples.values():
                    s.done = True
                sample.done = True
                kept.append(o)
                continue
            if sample.detok is not None and self._detokenize(o, sample.detok):
                stopped.append((o.req_id, o.index))
            if not state.announced:
                o.prompt_token_ids, state.announced = state.prompt_ids, True
            if o.finish_reason is not None:
                sample.done = True
                state.left -= 1
            kept.append(o)
        return kept, stopped

    def decoder(self, req_id: str) -> Callable[[int], str] | None:
        """One token's text (a logprob's decoded_token) for a request that detokenizes."""
        state = self._requests.get(req_id)
        if self.tokenizer is None or state is None or not state.params.detokenize:
            return None
        return self._token_text

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _detokenizer(self, state: _RequestState) -> IncrementalDetokenizer | None:
        params = state.params
        if self.tokenizer is None or not params.detokenize:
            return None
        return IncrementalDetokenizer(self.tokenizer, state.prompt_ids,
                                      skip_special_tokens=params.skip_special_tokens,
                                      stop=params.stop,
                                      include_stop=params.include_stop_str_in_output,
                                      min_tokens=params.min_tokens)

    @staticmethod
    def _detokenize(o: EngineCoreOutput, detok: IncrementalDetokenizer) -> bool:
        """Fills o's text; True where a stop string ended the sample here."""
        # The engine finishes with STOP only on a stop token or EOS, which is then the last
        # new token (a stop string is matched here, and its finishing output has no tokens).
        by_token = o.finish_reason == FinishReason.STOP
        text, hit_stop = detok.update(o.new_token_ids, ended_by_token=by_token)
        stopped = hit_stop and o.finish_reason is None
        if hit_stop:  # the text ends at the stop string, whatever else ended the tokens
            o.finish_reason, o.stop_reason = FinishReason.STOP, detok.stop_reason
        elif o.finish_reason is not None:
            text += detok.finish()
        o.new_text = text
        return stopped


def check_text_bytes(field: str, nbytes: int, max_model_len: int, max_token_bytes: int) -> None:
    """Refuses a text too long for max_model_len whatever its tokens, before tokenizing: more
    bytes than max_model_len tokens of the vocabulary's longest can hold."""
    if nbytes > max_model_len * max_token_bytes:
        raise ValueError(f"{field} holds {nbytes} bytes of text: at least "
                         f"{-(-nbytes // max_token_bytes)} tokens, more than max_model_len "
                         f"{max_model_len}")

"""Incremental detokenization with stop strings, for streaming one request's output.

Decoding: `_ids` holds a small window of token ids; ids[:read_offset] were already turned into
text and stay as left context, so tokenizers that treat the start of a sequence specially (e.g.
SentencePiece dropping a leading space) render the new tokens as they would mid-text. Each update
decodes only the window (the context and the new tokens), so a token costs O(window), not
O(output). While the window's text ends in U+FFFD the newest token stopped inside a UTF-8
sequence and nothing is produced until a later token completes it.

Stop strings: text produced by decoding lands in `_pending`; the longest tail of it that could
still begin a stop string is held back and the rest is streamed. Hence a stop string can only
start inside `_pending`: searching it finds every match, streamed text is never retracted, and
`_pending` stays shorter than the longest stop string between updates. As in vLLM, a match
counts only if it ends in text of the tokens after the first min_tokens (it may begin before),
and among several matches the one that ends first wins (ties: the earlier in the stop list),
which is what feeding the tokens one at a time would give.

A stop token or EOS that ends the request (update(..., ended_by_token=True)) is counted but
its text is left out unless include_stop, as vLLM's detokenizer leaves it out.
"""
from __future__ import annotations

from typing import Sequence

from tierserve.runtime.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer"]

# Prompt tokens kept as left context for the first output token (as vLLM does).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True, stop: Sequence[str] | None = None,
                 include_stop: bool = False, min_tokens: int = 0) -> None:
        self._tokenizer = tokenizer
        self._include_stop = include_stop
        self._skip_special = skip_special_tokens
        self._stop = [s for s in (stop or ()) if s]
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        context = list(prompt_token_ids)[-_PROMPT_CONTEXT_TOKENS:]
        if tokenizer.decode(context, skip_special_tokens).endswith(_REPLACEMENT_CHAR):
            # The prompt ends inside a character: as context, the first output bytes would
            # complete that character and it would belong to neither side. Decode the output on
            # its own instead, which matches tokenizer.decode(output_ids).
            context = []
        self._ids: list[int] = context  # decode window: context, then undecoded tokens
        self._read_offset = len(context)
        self._emitted: list[str] = []   # streamed text, in pieces (joined on demand)
        self._emitted_len = 0
        self._pending = ""              # decoded, not yet streamed (held back for stops)
        self._min_tokens = min_tokens
        self._num_tokens = 0
        # Where the text of the tokens after the first min_tokens begins (None: not reached);
        # a stop string must end beyond it.
        self._stop_from: int | None = 0 if min_tokens <= 0 else None
        self._stopped = False
        self.stop_reason: str | None = None  # the stop string that ended the text

    @property
    def text(self) -> str:
        """All output text so far, including text still held back from the stream; once a stop
        string matched, the text before it."""
        if len(self._emitted) > 1:
            self._emitted = ["".join(self._emitted)]
        return (self._emitted[0] if self._emitted else "") + self._pending

    @property
    def stopped(self) -> bool:
        return self._stopped

    def update(self, new_token_ids: Sequence[int],
               ended_by_token: bool = False) -> tuple[str, bool]:
        """Add generated tokens; returns (text safe to stream now, whether a stop string hit).
        ended_by_token: the last of them is the stop token or EOS that ended the request.

        After a stop, further calls return ("", True)."""
        if self._stopped:
            return "", True
        ids = list(new_token_ids)
        silent = int(ended_by_token and bool(ids) and not self._include_stop)
        if silent:
            del ids[-1]
        exempt = min(len(ids), self._min_tokens - self._num_tokens)
        if exempt > 0:  # the boundary may fall inside this update: decode up to it first
            self._add(ids[:exempt])
            ids = ids[exempt:]
        self._add(ids, silent)
        if self._cut_at_stop():
            return self._release(len(self._pending)), True
        return self._release(len(self._pending) - self._held_back()), False

    def finish(self) -> str:
        """The request ended for another reason (eos, length, abort): returns what is pending,
        including a trailing incomplete UTF-8 sequence (as U+FFFD) and any held-back tail."""
        if not self._stopped:
            self._pending += self._decode_window(force=True)
            self._cut_at_stop()
        return self._release(len(self._pending))

    def _add(self, ids: list[int], silent: int = 0) -> None:
        """Decodes ids into the pending text, then counts `silent` more tokens that add none;
        notes where min_tokens is reached."""
        self._ids.extend(ids)
        self._num_tokens += len(ids) + silent
        self._pending += self._decode_window(force=False)
        if self._stop_from is None and self._num_tokens >= self._min_tokens:
            self._stop_from = self._emitted_len + len(self._pending)

    def _decode_window(self, force: bool) -> str:
        """Text of the tokens after read_offset; '' while they end mid-character (unless forced).
        On success the decoded tokens become the next call's context."""
        ids, read = self._ids, self._read_offset
        if read >= len(ids):
            return ""
        context_text = self._tokenizer.decode(ids[:read], self._skip_special)
        full_text = self._tokenizer.decode(ids, self._skip_special)
        if not force and (len(full_text) <= len(context_text)
                          or full_text.endswith(_REPLACEMENT_CHAR)):
            return ""
        del ids[:read]
        self._read_offset = len(ids)
        return full_text[len(context_text):]

    def _cut_at_stop(self) -> bool:
        """On a match of any stop string in the pending text, keep only the text before the
        first to end (through it, with include_stop) and mark the detokenizer stopped."""
        if self._stop_from is None:
            return False
        # Offset in _pending where the text a stop string must end in begins.
        rel_from = self._stop_from - self._emitted_len
        best_end, best_pos = -1, -1
        for stop in self._stop:
            pos = self._pending.find(stop, max(0, rel_from - len(stop) + 1))
            if pos != -1 and (best_end == -1 or pos + len(stop) < best_end):
                best_end, best_pos, self.stop_reason = pos + len(stop), pos, stop
        if best_end == -1:
            return False
        self._pending = self._pending[:best_end if self._include_stop else best_pos]
        self._stopped = True
        return True

    def _held_back(self) -> int:
        """Length of the longest tail of the pending text that is a proper prefix of a stop."""
        text = self._pending
        for n in range(min(self._max_stop_len - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(len(stop) > n and stop.startswith(tail) for stop in self._stop):
                return n
        return 0

    def _release(self, end: int) -> str:
        """Stream pending[:end]."""
        delta, self._pending = self._pending[:end], self._pending[end:]
        if delta:
            self._emitted.append(delta)
            self._emitted_len += len(delta)
        return delta

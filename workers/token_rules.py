"""Per-request logit adjustments named by token ids: logit_bias, allowed_token_ids, bad words,
min_tokens and a thinking budget, as one additive row over the vocabulary per request and step.

The static part (bias, allowed tokens, one-token bad words) is built once per request; the part
that moves with the output (EOS and stop tokens banned before min_tokens, the last token of a
longer bad word banned where the output ends with the rest of it) is added each step from the
request's last few tokens, never its whole context.
"""
from __future__ import annotations

from collections import deque
from typing import Sequence

import torch

from tierserve.scheduler.output_rules import ThinkingTags
from tierserve.scheduler.params import SamplingParams

__all__ = ["TokenRules"]

_NEG_INF = -float("inf")


class ThinkingLimit:
    """thinking_token_budget: counts the reasoning's tokens (from its opening tag, or from the
    first token where the prompt left it open) and, once the budget is spent before the model
    closed it, forces the closing tag's tokens one by one; after that, nothing."""

    __slots__ = ("budget", "start", "end", "inside", "count", "forced", "done", "recent")

    def __init__(self, budget: int, tags: ThinkingTags) -> None:
        self.budget, self.start, self.end = budget, list(tags.start), list(tags.end)
        self.inside, self.count, self.done = False, 0, False
        self.forced: int | None = None  # tokens of the closing tag forced so far
        self.recent: deque[int] = deque(maxlen=max(len(self.start), len(self.end)))
        if tags.open:
            self._open()

    def push(self, token: int) -> None:
        self.recent.append(token)
        if self.done:
            return
        if self.forced is not None:
            self.forced += 1
            self.done = self.forced == len(self.end)
        elif self.inside:
            if _ends_with(self.recent, self.end):
                self.done = True  # closed within the budget
            else:
                self.count += 1
                self._spent()
        elif _ends_with(self.recent, self.start):
            self._open()

    def forced_token(self) -> int | None:
        """The token this step must be (None: any)."""
        return None if self.forced is None or self.done else self.end[self.forced]

    def _open(self) -> None:
        self.inside = True
        self._spent()

    def _spent(self) -> None:
        """Once the budget is spent, the closing tag is forced, from what of its start the
        model has just written."""
        if self.count >= self.budget:
            self.forced = next(k for k in range(len(self.end) - 1, -1, -1)
                               if _ends_with(self.recent, self.end[:k]))


def _ends_with(recent: deque[int], seq: list[int]) -> bool:
    return not seq or (len(recent) >= len(seq) and list(recent)[len(recent) - len(seq):] == seq)


class TokenRules:
    __slots__ = ("static", "min_tokens", "ends", "multi", "num_out", "recent", "vocab", "device",
                 "thinking")

    def __init__(self, params: SamplingParams, vocab_size: int, eos_token_ids: Sequence[int],
                 device: torch.device) -> None:
        self.vocab, self.device = vocab_size, device
        static = None
        if params.logit_bias or params.allowed_token_ids or params.bad_words_token_ids:
            static = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            if params.allowed_token_ids:
                static.fill_(_NEG_INF)
                static[torch.tensor(params.allowed_token_ids, device=device)] = 0.0
            for token, bias in (params.logit_bias or {}).items():
                static[token] += bias
            singles = [w[0] for w in params.bad_words_token_ids or () if len(w) == 1]
            if singles:
                static[torch.tensor(singles, device=device)] = _NEG_INF
        self.static = static
        self.min_tokens = params.min_tokens
        self.ends = sorted(set(eos_token_ids) | set(params.stop_token_ids))
        self.multi = [list(w) for w in params.bad_words_token_ids or () if len(w) > 1]
        self.num_out = 0
        self.recent: deque[int] = deque(maxlen=max((len(w) - 1 for w in self.multi),
                                                   default=0))
        self.thinking = None
        if params.thinking_token_budget is not None and params.thinking is not None:
            self.thinking = ThinkingLimit(params.thinking_token_budget, params.thinking)

    @staticmethod
    def needed(params: SamplingParams) -> bool:
        return bool(params.logit_bias or params.allowed_token_ids or params.bad_words_token_ids
                    or params.min_tokens or (params.thinking_token_budget is not None
                                             and params.thinking is not None))

    def push(self, token: int) -> None:
        self.num_out += 1
        if self.recent.maxlen:
            self.recent.append(token)
        if self.thinking is not None:
            self.thinking.push(token)

    def row(self) -> torch.Tensor | None:
        """This step's additive row float32[vocab] (None: nothing to add)."""
        forced = self.thinking.forced_token() if self.thinking is not None else None
        if forced is not None:  # the closing tag overrides every other rule
            row = torch.full((self.vocab,), _NEG_INF, device=self.device)
            row[forced] = 0.0
            return row
        bans = []
        if self.num_out < self.min_tokens:
            bans += self.ends
        if self.multi:
            recent = list(self.recent)
            for word in self.multi:
                head = word[:-1]
                if len(recent) >= len(head) and recent[len(recent) - len(head):] == head:
                    bans.append(word[-1])
        if not bans:
            return self.static
        row = self.static.clone() if self.static is not None else torch.zeros(self.vocab, device=self.device)
        row[torch.tensor(bans, dtype=torch.long, device=row.device)] = _NEG_INF
        return row

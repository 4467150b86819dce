"""Per-request logit adjustments named by token ids: logit_bias, allowed_token_ids, bad words
and min_tokens, as one additive row over the vocabulary per request and step.

The static part (bias, allowed tokens, one-token bad words) is built once per request; the part
that moves with the output (EOS and stop tokens banned before min_tokens, the last token of a
longer bad word banned where the output ends with the rest of it) is added each step from the
request's last few tokens, never its whole context.
"""
from __future__ import annotations

from collections import deque
from typing import Sequence

import torch

from tierserve.scheduler.params import SamplingParams

__all__ = ["TokenRules"]

_NEG_INF = -float("inf")


class TokenRules:
    __slots__ = ("static", "min_tokens", "ends", "multi", "num_out", "recent", "vocab", "device")

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

    @staticmethod
    def needed(params: SamplingParams) -> bool:
        return bool(params.logit_bias or params.allowed_token_ids or params.bad_words_token_ids
                    or params.min_tokens)

    def push(self, token: int) -> None:
        self.num_out += 1
        if self.recent.maxlen:
            self.recent.append(token)

    def row(self) -> torch.Tensor | None:
        """This step's additive row float32[vocab] (None: nothing to add)."""
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

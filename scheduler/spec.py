"""N-gram speculative decoding (prompt lookup), the scheduler's side: drafts from a request's own
tokens, and what verification tells back.

Each step, a decoding request whose latest n tokens (n from prompt_lookup_max down to
prompt_lookup_min) occurred earlier in its prompt or output is scheduled with the tokens that
followed that occurrence as drafts, up to num_speculative_tokens: one forward computes them
all, and the sampler on the workers keeps the longest run of drafts that equal its own samples
at their positions, plus the first sample that differs (or one past the last draft). Sampling
each position independently and accepting a draft iff the sample equals it is rejection
sampling for a draft distribution that is all on one token (accept with probability p(d),
else draw from p without d, renormalised), so sampled output is distributed exactly as
without speculation, and greedy output is the same tokens. The workers return how many drafts
each request accepted; the scheduler knows the drafts, so no token travels back.

Requests whose sampling reads their own output token by token (penalties, logprobs,
structured outputs, logit bias, min_tokens, bad words) are not speculated.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass

from tierserve.scheduler.params import SamplingParams

__all__ = ["SpeculativeConfig", "NgramIndex", "Speculator", "SPEC_METHODS", "RATE_BUCKETS"]

SPEC_METHODS = ("ngram",)
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
# Requests whose acceptance is reported in stats() (the most recently finished ones).
_RECENT = 64
# Upper bounds of the buckets of the per-request acceptance rate histogram.
RATE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """vLLM's speculative_config names. prompt_lookup_max defaults to 4 and prompt_lookup_min
    to 2 (a one-token match drafts too often in plain text to pay)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig":
        """From a dict of vLLM's keys (or an instance); ValueError naming a bad key."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict of {', '.join(_KEYS)}, got "
                             f"{type(value).__name__}")
        unknown = set(value) - set(_KEYS)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(sorted(unknown))};"
                             f" known: {', '.join(_KEYS)}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs num_speculative_tokens")
        for key in _KEYS[1:]:
            v = value.get(key, 1)
            if type(v) is not int or v < 1:
                raise ValueError(f"speculative_config.{key} must be an int >= 1, got {v!r}")
        method = value.get("method", "ngram")
        if method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method must be one of "
                             f"{', '.join(SPEC_METHODS)}, got {method!r}")
        high = value.get("prompt_lookup_max", max(4, value.get("prompt_lookup_min", 0)))
        low = value.get("prompt_lookup_min", min(2, high))
        if low > high:
            raise ValueError(f"speculative_config: prompt_lookup_min {low} > prompt_lookup_max "
                             f"{high}")
        return cls(method, value["num_speculative_tokens"], high, low)


class NgramIndex:
    """The latest earlier occurrence of every n-gram (low <= n <= high) of a token list that
    only grows, kept incrementally: each new token costs O(high - low) dict updates, and a
    lookup as much, whatever the context's length."""

    __slots__ = ("low", "high", "ends", "indexed")

    def __init__(self, low: int, high: int) -> None:
        self.low, self.high = low, high
        # Per n: the n-gram -> the end (exclusive) of its latest occurrence indexed.
        self.ends: dict[int, dict[tuple, int]] = {n: {} for n in range(low, high + 1)}
        self.indexed = 0  # occurrences ending at positions <= indexed are in `ends`

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
        tokens (of low..high tokens) that occurred before; [] when none did."""
        length = len(tokens)
        # Occurrences ending before the suffix's own end: at positions indexed+1 .. length-1.
        for end in range(max(self.indexed + 1, self.low), length):
            for n, table in self.ends.items():
                if n <= end:
                    table[tuple(tokens[end - n : end])] = end
        self.indexed = max(self.indexed, length - 1)
        for n in range(min(self.high, length - 1), self.low - 1, -1):
            end = self.ends[n].get(tuple(tokens[length - n :]))
            if end is not None:
                return tokens[end : end + k]
        return []


def speculable(params: SamplingParams) -> bool:
    """Whether a request's sampling depends only on each position's logits (see above)."""
    return (params.repetition_penalty == 1.0 and params.presence_penalty == 0.0
            and params.frequency_penalty == 0.0 and params.logprobs is None
            and params.structured_outputs is None and not params.logit_bias
            and not params.min_tokens and not params.bad_words_token_ids
            and params.allowed_token_ids is None and params.thinking_token_budget is None)


class Speculator:
    """Proposes drafts for the scheduler and counts what verification accepted."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._indexes: dict[str, NgramIndex] = {}
        # Per live request: (drafts proposed, drafts accepted, steps with drafts).
        self._counts: dict[str, list[int]] = {}
        self.recent: collections.OrderedDict[str, float] = collections.OrderedDict()
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * config.num_speculative_tokens
        # Finished requests with drafts, by acceptance rate (cumulative: the count at or
        # below each of RATE_BUCKETS), and the sum of their rates.
        self.rate_counts = [0] * len(RATE_BUCKETS)
        self.rate_sum = 0.0

    def drafts(self, request_id: str, params: SamplingParams, tokens: list[int],
               limit: int) -> list[int]:
        """Up to min(num_speculative_tokens, limit) drafts for a request about to decode."""
        k = min(self.config.num_speculative_tokens, limit)
        if k <= 0 or not speculable(params):
            return []
        index = self._indexes.get(request_id)
        if index is None:
            index = self._indexes[request_id] = NgramIndex(self.config.prompt_lookup_min,
                                                           self.config.prompt_lookup_max)
        return index.propose(tokens, k)

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        counts = self._counts.setdefault(request_id, [0, 0, 0])
        counts[0] += num_drafts
        counts[1] += num_accepted
        counts[2] += 1
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    def forget(self, request_id: str) -> float | None:
        """Drops a finished request's state; returns its acceptance rate (accepted drafts per
        draft) where it had drafts, else None."""
        self._indexes.pop(request_id, None)
        counts = self._counts.pop(request_id, None)
        if counts is None or not counts[0]:
            return None
        rate = counts[1] / counts[0]
        self.recent[request_id] = rate
        self.rate_sum += rate
        for i, bound in enumerate(RATE_BUCKETS):
            self.rate_counts[i] += rate <= bound
        while len(self.recent) > _RECENT:
            self.recent.popitem(last=False)
        return rate

    def stats(self) -> dict:
        live = {rid: c[1] / c[0] for rid, c in self._counts.items() if c[0]}
        return {
            "spec_num_drafts": self.num_drafts,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_acceptance_rate": (self.num_accepted_tokens / self.num_draft_tokens
                                     if self.num_draft_tokens else 0.0),
            "spec_accepted_per_position": list(self.accepted_per_pos),
            # Acceptance rate per request: the running ones, and the last finished ones.
            "spec_acceptance_by_request": {**self.recent, **live},
            # Over every finished request with drafts: cumulative counts per RATE_BUCKETS.
            "spec_request_acceptance_bounds": list(RATE_BUCKETS),
            "spec_request_acceptance_buckets": list(self.rate_counts),
            "spec_request_acceptance_sum": self.rate_sum,
        }

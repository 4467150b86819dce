"""Beam search over the engine's next-token logprobs, vLLM's `LLM.beam_search` shape.

A search keeps, per prompt, the `beam_width` best sequences so far. Each round asks the
engine, for every live beam, for the log-probabilities of its next token's 2 x beam_width most
likely candidates (one request per beam, `max_tokens=1`: the prefix cache holds each beam's
earlier tokens, so a round computes about a block per beam); every beam x candidate extension
is scored, an extension ending in EOS becomes a finished hypothesis, and the best `beam_width`
of the rest carry on. After `max_tokens` rounds (or when no beam is left) the finished and live
sequences are ranked together and the best `beam_width` returned.

Score: cum_logprob / length ** length_penalty, length counting the prompt's tokens and the
generated ones, less a final EOS (as vLLM and transformers rank). Logprobs are the model's raw
ones (the engine's logprobs), so there is no temperature here. This module is the search's
bookkeeping alone; the frontends (llm.py, client.py) run its rounds through the engine.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from tierserve.runtime.outputs import Logprob

__all__ = ["BeamSearchParams", "BeamSearchSequence", "BeamSearchOutput", "BeamSearch",
           "beam_score", "MAX_BEAM_WIDTH", "round_requests", "take_round", "step_params"]

# 2 x beam_width candidates a beam, and logprobs stop at 20 (SamplingParams, as vLLM's).
MAX_BEAM_WIDTH = 10


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    # A sequence's text: whether a final EOS's text is in it, and special tokens' (vLLM's).
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) \
                or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be an int in [1, {MAX_BEAM_WIDTH}], got "
                             f"{self.beam_width!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.temperature != 0:
            raise ValueError(f"temperature must be 0, got {self.temperature!r}: beam search "
                             f"ranks by the model's own log-probabilities")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be finite, got {self.length_penalty!r}")


@dataclass
class BeamSearchSequence:
    """A prompt's tokens and the generated ones after them (`tokens`), the generated tokens'
    logprobs (each: the candidates the round saw), and their sum."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


def beam_score(tokens: list[int], cum_logprob: float, eos_token_id: int | None,
               length_penalty: float) -> float:
    length = len(tokens) - (1 if tokens and tokens[-1] == eos_token_id else 0)
    return cum_logprob / max(length, 1) ** length_penalty


class BeamSearch:
    """One prompt's search state: `pending()` are the sequences whose next-token candidates
    the next round needs; `advance()` takes them, in that order."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams,
                 eos_token_id: int | None) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt is empty")
        self.prompt_len = len(prompt_token_ids)
        self.params, self.eos = params, eos_token_id
        self.beams = [BeamSearchSequence(list(prompt_token_ids))]
        self.finished: list[BeamSearchSequence] = []
        self.rounds = 0

    @property
    def done(self) -> bool:
        return not self.beams or self.rounds >= self.params.max_tokens

    def pending(self) -> list[list[int]]:
        return [] if self.done else [b.tokens for b in self.beams]

    def cap(self, max_len: int) -> None:
        """Beams that fill the context end there (finish reason "length")."""
        for beam in self.beams:
            if len(beam.tokens) >= max_len:
                beam.finish_reason = "length"
                self.finished.append(beam)
        self.beams = [b for b in self.beams if len(b.tokens) < max_len]

    def _score(self, seq: BeamSearchSequence) -> float:
        return beam_score(seq.tokens, seq.cum_logprob, self.eos, self.params.length_penalty)

    def advance(self, candidates: list[dict[int, Logprob]]) -> None:
        """candidates[i]: beam i's next-token logprobs (at least its top 2 x beam_width)."""
        assert len(candidates) == len(self.beams) and not self.done
        width = self.params.beam_width
        grown = []
        for beam, cands in zip(self.beams, candidates):
            top = sorted((lp.rank, t, lp) for t, lp in cands.items()
                         if lp.rank is not None and lp.rank <= 2 * width)
            for _, token, lp in top:
                seq = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [cands],
                                         beam.cum_logprob + lp.logprob)
                if token == self.eos and not self.params.ignore_eos:
                    seq.finish_reason = "stop"
                    self.finished.append(seq)
                else:
                    grown.append(seq)
        self.rounds += 1
        grown.sort(key=self._score, reverse=True)
        self.beams = grown[:width]

    def result(self, decode=None) -> list[BeamSearchSequence]:
        """The best beam_width of the finished and live sequences, best first; with
        `decode` (the tokenizer's), each one's generated text (a final EOS's only with
        include_stop_str_in_output)."""
        for beam in self.beams:
            beam.finish_reason = beam.finish_reason or "length"
        ranked = sorted(self.finished + self.beams, key=self._score, reverse=True)
        best = ranked[:self.params.beam_width]
        if decode is not None:
            for seq in best:
                end = len(seq.tokens) - (seq.finish_reason == "stop"
                                         and not self.params.include_stop_str_in_output)
                seq.text = decode(seq.tokens[self.prompt_len:end],
                                  skip_special_tokens=self.params.skip_special_tokens)
        return best


def step_params(params: BeamSearchParams) -> dict:
    """A round's request: one token, its 2 x beam_width candidates' logprobs, no text."""
    return dict(max_tokens=1, temperature=0.0, ignore_eos=True,
                logprobs=2 * params.beam_width, detokenize=False)



def round_requests(searches: list[BeamSearch], max_len: int
                   ) -> tuple[list[BeamSearch], list[list[int]]]:
    """The searches still going and the sequences this round asks for, in order (beams that
    fill the context end first)."""
    for s in searches:
        s.cap(max_len)
    live = [s for s in searches if not s.done]
    return live, [seq for s in live for seq in s.pending()]


def take_round(live: list[BeamSearch], outputs: list) -> None:
    """Advances each search by its beams' RequestOutputs, in the order round_requests asked."""
    outs = iter(outputs)
    for s in live:
        mine = [next(outs) for _ in s.beams]
        bad = next((o for o in mine if o.error), None)
        if bad is not None:  # the request's fault (a beam past the context) or the engine's
            error = ValueError if bad.error_kind == "bad_request" else RuntimeError
            raise error(f"a beam search round failed: {bad.error}")
        s.advance([o.outputs[0].logprobs[0] for o in mine])

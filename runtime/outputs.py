"""User-facing results, shaped like vLLM's RequestOutput / CompletionOutput."""
from __future__ import annotations

from dataclasses import dataclass, field

from tierserve.scheduler.messages import EngineCoreOutput
from tierserve.scheduler.params import FinishReason

__all__ = ["CompletionOutput", "RequestOutput", "Logprob", "logprob_dict"]


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    # One dict per generated token: token id -> Logprob (the sampled token and the top-n).
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    # Set when the request failed (bad input, engine error); outputs then hold what was made.
    error: str | None = None

    @classmethod
    def start(cls, request_id: str, prompt: str | None, want_logprobs: bool) -> "RequestOutput":
        completion = CompletionOutput(0, "", [], 0.0 if want_logprobs else None,
                                      [] if want_logprobs else None)
        return cls(request_id, prompt, [], [completion])

    @classmethod
    def failed(cls, request_id: str, prompt: str | None, prompt_token_ids: list[int],
               error: str) -> "RequestOutput":
        out = cls.start(request_id, prompt, False)
        out.prompt_token_ids = prompt_token_ids
        out.outputs[0].finish_reason = str(FinishReason.ERROR)
        out.finished, out.error = True, error
        return out

    def add(self, delta: EngineCoreOutput) -> None:
        """Folds one step's delta in (the cumulative, non-streaming view)."""
        completion = self.outputs[0]
        if delta.prompt_token_ids:
            self.prompt_token_ids = delta.prompt_token_ids
        completion.token_ids.extend(delta.new_token_ids)
        completion.text += delta.new_text
        if completion.logprobs is not None:
            for lp in delta.logprobs:
                completion.logprobs.append(logprob_dict(lp))
                completion.cumulative_logprob += lp.logprobs[0]
        self.num_cached_tokens = max(delta.num_cached_tokens, 0)
        if delta.error:
            self.error = delta.error
        if delta.finish_reason is not None:
            completion.finish_reason = str(FinishReason(delta.finish_reason))
            self.finished = True


def logprob_dict(lp) -> dict[int, Logprob]:
    out = {lp.token_ids[0]: Logprob(lp.logprobs[0], lp.sampled_rank)}
    for rank, (tid, value) in enumerate(zip(lp.token_ids[1:], lp.logprobs[1:]), start=1):
        out.setdefault(tid, Logprob(value, rank))
    return out

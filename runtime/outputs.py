"""User-facing results, shaped like vLLM's RequestOutput / CompletionOutput."""
from __future__ import annotations

import array
import dataclasses
from collections import deque
from dataclasses import dataclass
from typing import Callable

from tierserve.scheduler.messages import EngineCoreOutput
from tierserve.scheduler.params import ErrorKind, FinishReason

__all__ = ["CompletionOutput", "RequestOutput", "Logprob", "logprob_dict", "prompt_logprobs_of",
           "Outstanding", "BatchFeed", "StreamInterval"]


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
    # With finish_reason "stop": the stop string or stop_token_ids entry that ended the
    # output; None when the EOS token did (vLLM's stop_reason).
    stop_reason: int | str | None = None

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
    # Of those, the prompt tokens the CPU tier held (loaded from SSD or demoted there).
    num_tier_cached_tokens: int = 0
    # Set when the request failed (bad input, engine error); outputs then hold what was made.
    error: str | None = None
    # Why it failed: an ErrorKind name (bad_request, overloaded, engine_dead, internal).
    error_kind: str | None = None
    # With prompt_logprobs: one per prompt token, None for the first (nothing precedes it).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # An embedding request's pooled hidden state (SamplingParams.pooling), once finished.
    embedding: list[float] | None = None

    @classmethod
    def start(cls, request_id: str, prompt: str | None, want_logprobs: bool,
              n: int = 1, want_prompt_logprobs: bool = False) -> "RequestOutput":
        completions = [CompletionOutput(i, "", [], 0.0 if want_logprobs else None,
                                        [] if want_logprobs else None) for i in range(n)]
        # A one-token prompt's are [None]: its first output brings no others.
        return cls(request_id, prompt, [], completions,
                   prompt_logprobs=[None] if want_prompt_logprobs else None)

    @classmethod
    def failed(cls, request_id: str, prompt: str | None, prompt_token_ids: list[int],
               error: str) -> "RequestOutput":
        out = cls.start(request_id, prompt, False)
        out.prompt_token_ids = prompt_token_ids
        out.outputs[0].finish_reason = str(FinishReason.ERROR)
        out.finished, out.error, out.error_kind = True, error, str(ErrorKind.BAD_REQUEST)
        return out

    def snapshot(self) -> "RequestOutput":
        """A copy that later add()s leave as it is."""
        return dataclasses.replace(self, prompt_token_ids=list(self.prompt_token_ids), outputs=[
            dataclasses.replace(c, token_ids=list(c.token_ids),
                                logprobs=None if c.logprobs is None else list(c.logprobs))
            for c in self.outputs])

    def add(self, delta: EngineCoreOutput, decode: Callable[[int], str] | None = None) -> None:
        """Folds one step's delta in (the cumulative, non-streaming view); `decode` gives the
        logprobs' decoded_token. The request has finished once each of its samples has, or
        at once on an error."""
        completion = self.outputs[delta.index if delta.index < len(self.outputs) else 0]
        if delta.prompt_token_ids:
            self.prompt_token_ids = delta.prompt_token_ids
        if delta.prompt_logprobs:
            self.prompt_logprobs = prompt_logprobs_of(delta.prompt_logprobs, decode)
        if delta.pooled:
            self.embedding = floats_of(delta.pooled)
        completion.token_ids.extend(delta.new_token_ids)
        completion.text += delta.new_text
        if completion.logprobs is not None:
            for lp in delta.logprobs:
                completion.logprobs.append(logprob_dict(lp, decode))
                completion.cumulative_logprob += lp.logprobs[0]
        self.num_cached_tokens = max(delta.num_cached_tokens, 0)
        self.num_tier_cached_tokens = delta.num_tier_cached_tokens
        if delta.error:
            self.error = delta.error
            self.error_kind = str(ErrorKind(delta.error_kind or ErrorKind.INTERNAL))
        if delta.finish_reason is not None:
            completion.finish_reason = str(FinishReason(delta.finish_reason))
            completion.stop_reason = delta.stop_reason
            self.finished = bool(delta.error) or all(c.finish_reason is not None
                                                     for c in self.outputs)


class StreamInterval:
    """stream_interval for a stream of one-sample deltas (RequestOutput, one completion
    each): a sample's deltas are held and joined until they carry `interval` new tokens; its
    first delta, its last and an error go at once."""

    __slots__ = ("interval", "_held", "_started")

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self._held: dict[int, RequestOutput] = {}
        self._started: set[int] = set()

    def push(self, delta: RequestOutput) -> RequestOutput | None:
        """The delta to send now (None: held)."""
        index = delta.outputs[0].index
        held = self._held.pop(index, None)
        out = delta if held is None else _joined(held, delta)
        c = out.outputs[0]
        if index in self._started and c.finish_reason is None and not out.error and \
                len(c.token_ids) < self.interval:
            self._held[index] = out
            return None
        self._started.add(index)
        return out


def _joined(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Delta a then delta b of one sample, as one delta."""
    ca, cb = a.outputs[0], b.outputs[0]
    logprobs = None if ca.logprobs is None else ca.logprobs + (cb.logprobs or [])
    completion = dataclasses.replace(cb, text=ca.text + cb.text,
                                     token_ids=ca.token_ids + cb.token_ids, logprobs=logprobs)
    return dataclasses.replace(b, prompt_token_ids=a.prompt_token_ids or b.prompt_token_ids,
                               prompt_logprobs=a.prompt_logprobs or b.prompt_logprobs,
                               outputs=[completion])


def floats_of(raw: bytes) -> list[float]:
    """float32 bytes (a pooled hidden state on the wire) -> floats."""
    return array.array("f", raw).tolist()


def prompt_logprobs_of(lps, decode: Callable[[int], str] | None = None
                       ) -> list[dict[int, Logprob] | None]:
    return [None] + [logprob_dict(lp, decode) for lp in lps]


def logprob_dict(lp, decode: Callable[[int], str] | None = None) -> dict[int, Logprob]:
    """token id -> Logprob, the sampled token first, then the top-n, then any
    logprob_token_ids (with their own ranks); `decode` (a token's text) fills decoded_token."""
    text = decode or (lambda tid: None)
    out = {lp.token_ids[0]: Logprob(lp.logprobs[0], lp.sampled_rank, text(lp.token_ids[0]))}
    top = len(lp.token_ids) - 1 - len(lp.chosen_ranks)
    ranks = list(range(1, top + 1)) + list(lp.chosen_ranks)
    for rank, tid, value in zip(ranks, lp.token_ids[1:], lp.logprobs[1:]):
        if tid not in out:
            out[tid] = Logprob(value, rank, text(tid))
    return out


class Outstanding:
    """The unfinished requests of one stream, by id. A request with n samples finishes when
    each sample has (one finishing output per sample), or at once with an error."""

    __slots__ = ("_left",)

    def __init__(self, requests) -> None:
        self._left = {r.req_id: getattr(r.sampling_params, "n", 1) for r in requests}

    def add(self, request) -> None:
        self._left[request.req_id] = getattr(request.sampling_params, "n", 1)

    def update(self, outputs) -> None:
        left = self._left
        for o in outputs:
            if o.finish_reason is None or o.req_id not in left:
                continue
            if o.error or left[o.req_id] <= 1:
                del left[o.req_id]
            else:
                left[o.req_id] -= 1

    def __bool__(self) -> bool:
        return bool(self._left)

    def __iter__(self):
        return iter(list(self._left))

    def __len__(self) -> int:
        return len(self._left)


class BatchFeed:
    """An offline batch (LLM.generate's) fed to an engine whose queue is bounded
    (max_queued_requests): at most `window` of its requests wait for a first output at a time;
    the rest are held here, in order, and go in as those start. One the engine refused as
    overloaded (other clients filled its queue) is held again, ahead of the rest."""

    __slots__ = ("_held", "_waiting", "_window", "_refused")

    def __init__(self, requests, window: int) -> None:
        assert window >= 1
        self._held = deque(requests)
        self._waiting: dict[str, object] = {}  # released, no output yet: req_id -> request
        self._window = window
        self._refused = False  # the last update had refusals

    def release(self) -> list:
        """The held requests that fit the window now, to be added to the engine."""
        out = []
        while self._held and len(self._waiting) < self._window:
            request = self._held.popleft()
            self._waiting[request.req_id] = request
            out.append(request)
        return out

    def update(self, outputs) -> list:
        """The outputs to deliver: all but the overloaded refusals, whose requests are held
        again."""
        keep, again = [], []
        for o in outputs:
            request = self._waiting.pop(o.req_id, None)
            if request is not None and o.error_kind == ErrorKind.OVERLOADED:
                again.append(request)
            else:
                keep.append(o)
        self._held.extendleft(reversed(again))
        self._refused = bool(again)
        return keep

    @property
    def stalled(self) -> bool:
        """The engine refused requests just now and none released waits: other clients fill
        its queue, so sending again at once would be refused again."""
        return self._refused and not self._waiting


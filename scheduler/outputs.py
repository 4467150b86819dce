"""What a step's reply does to one request: whether it takes its sampled token, appending the
tokens it was given up to a stop, and the EngineCoreOutput it is reported as.
"""
from __future__ import annotations

from tierserve.scheduler.messages import EngineCoreOutput, SampleLogprobs
from tierserve.scheduler.params import RequestStatus, finish_reason_of
from tierserve.scheduler.request import Request

__all__ = ["takes_token", "append_tokens", "engine_output"]


def takes_token(req: Request) -> bool:
    """A running request takes its sampled token; with async scheduling so does one
    preempted after the step was sent (the workers ran the step before the preemption)."""
    return req.status == RequestStatus.RUNNING or (
        req.status == RequestStatus.PREEMPTED and req.num_output_placeholders > 0)


def append_tokens(req: Request, tokens: list[int], max_model_len: int) -> RequestStatus | None:
    """Appends tokens to the request's output up to the first that stops it (an EOS or stop
    token, or a length limit), cutting `tokens` there; returns the finished status it stopped
    with (None: it goes on)."""
    params = req.sampling_params
    for n, token in enumerate(tokens, 1):
        req.append_output_token(token)
        if (token == req.eos_token_id and not params.ignore_eos) or (
                params.stop_token_ids and token in params.stop_token_ids):
            status = RequestStatus.FINISHED_STOPPED
        elif req.num_output_tokens >= req.max_output_tokens or req.num_tokens >= max_model_len:
            status = RequestStatus.FINISHED_LENGTH
        elif params.repetition_detection is not None and \
                req.num_output_tokens >= params.min_tokens and \
                params.repetition_detection.found(req.output_token_ids):
            status = RequestStatus.FINISHED_REPETITION
        else:
            continue
        del tokens[n:]
        return status
    return None


def engine_output(req: Request, tokens: list[int], status: RequestStatus | None,
                  logprobs: SampleLogprobs | None) -> EngineCoreOutput:
    reason = finish_reason_of(status) if status is not None else None
    return EngineCoreOutput(req.family_id, tokens, finish_reason=reason,
                            logprobs=[logprobs] if logprobs else [],
                            num_cached_tokens=req.num_cached_tokens,
                            num_tier_cached_tokens=req.num_tier_cached_tokens,
                            index=req.index, stop_reason=_stop_token(req, tokens, status))


def _stop_token(req: Request, tokens: list[int], status: RequestStatus | None
                ) -> int | str | None:
    """The stop_token_ids entry that stopped the request (append_tokens' order: EOS first);
    vLLM's "repetition_detected" for a repetition."""
    if status == RequestStatus.FINISHED_REPETITION:
        return "repetition_detected"
    if status != RequestStatus.FINISHED_STOPPED or not tokens:
        return None
    token, params = tokens[-1], req.sampling_params
    if token == req.eos_token_id and not params.ignore_eos:
        return None
    return token if token in params.stop_token_ids else None

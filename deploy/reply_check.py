"""What the engine accepts as the answer to a step it sent (invariant 9).

A reply that passes is applied; one that fails is dropped and counted by the caller, never
applied. The checks hold whoever sent the frame: CURVE authentication says which rank sent it,
this says whether it answers the step that is waiting.
"""
from __future__ import annotations

from tierserve.scheduler.messages import (
    ASYNC_KINDS, FlushTiers, FromWorker, ModelRunnerOutput, SchedulerOutput, ToWorker,
    WorkerError, req_ids_digest,
)

__all__ = ["reply_problem"]

# The asynchronous copy kinds a reply may report.
_COPY_KINDS = tuple(int(k) for k in ASYNC_KINDS)


def reply_problem(reply: FromWorker, sender: int, sent: ToWorker, vocab_size: int,
                  num_ranks: int) -> str | None:
    """Why `reply`, from rank `sender`, is not an answer to `sent`; None if it is. Only rank 0
    answers a step; any rank may report its own failure of it."""
    if not 0 <= sender < num_ranks:
        return f"sender rank {sender} is not one of the {num_ranks} ranks"
    step_id = getattr(sent, "step_id", None)
    if reply.step_id != step_id:
        return f"answers step {reply.step_id}, the step waiting is {step_id}"
    if isinstance(reply, WorkerError):
        return None if reply.rank == sender else \
            f"an error of rank {reply.rank} sent by rank {sender}"
    if sender != 0:
        return f"an output from rank {sender}; only rank 0 answers a step"
    if isinstance(sent, FlushTiers):
        return _flush_problem(reply, sent)
    if isinstance(sent, SchedulerOutput):
        return _step_problem(reply, sent, vocab_size)
    return f"a reply to a {type(sent).__name__}, which expects none"


def _step_problem(reply: ModelRunnerOutput, sent: SchedulerOutput,
                  vocab_size: int) -> str | None:
    n = len(sent.num_scheduled_tokens)
    if len(reply.sampled_token_ids) != n:
        return f"{len(reply.sampled_token_ids)} sampled tokens for {n} scheduled requests"
    if reply.req_ids_digest != req_ids_digest(sent.scheduled_req_ids()):
        return "its request ids are not the step's"
    if any(t < -1 or t >= vocab_size for t in reply.sampled_token_ids):
        return f"a sampled token id outside [-1, {vocab_size})"
    if reply.logprobs and len(reply.logprobs) != n:
        return f"{len(reply.logprobs)} logprob entries for {n} scheduled requests"
    for lp in reply.logprobs:
        if lp is not None and (len(lp.token_ids) != len(lp.logprobs) or any(
                t < 0 or t >= vocab_size for t in lp.token_ids)):
            return "a logprob entry with mismatched lengths or a token id outside the vocabulary"
    if reply.flushed_blocks:
        return "flushed SSD blocks in the answer to a step"
    if reply.num_accepted and (len(reply.num_accepted) != n or not sent.num_spec_tokens or any(
            not 0 <= a <= k for a, k in zip(reply.num_accepted, sent.num_spec_tokens))):
        return "accepted draft counts that do not match the step's drafts"
    return _tier_problem(reply)


def _tier_problem(reply: ModelRunnerOutput) -> str | None:
    if len(reply.tier_done) > len(_COPY_KINDS) or any(d < -1 for d in reply.tier_done):
        return f"tier_done {reply.tier_done[:4]} is not one count >= -1 per copy kind"
    failed = reply.tier_failed
    if len(failed) % 2 or any(k not in _COPY_KINDS for k in failed[::2]) \
            or any(seq < 0 for seq in failed[1::2]):
        return "tier_failed is not (copy kind, sequence number) pairs"
    return None


def _flush_problem(reply: ModelRunnerOutput, sent: FlushTiers) -> str | None:
    if reply.sampled_token_ids or reply.logprobs or reply.tier_failed:
        return "sampled tokens or tier copies in the answer to a flush"
    asked = sum(len(batch) for batch in sent.copies)
    if not 0 <= reply.flushed_blocks <= asked:
        return f"{reply.flushed_blocks} blocks flushed of the {asked} the flush asked for"
    return None

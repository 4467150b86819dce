"""One step's plan and the SchedulerOutput it becomes.

StepPlan is what a schedule() call has decided so far (who runs, how many tokens, which
blocks); WorkerUpdates is what the next message owes the workers besides that (sequences
finished since the last one, copy-on-write pairs of forks) and the step ids; build_output turns
a finished plan into the per-step diff: a new request's prompt once, then only new tokens and
block ids.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from tierserve.kvcache import CopyBatch, TierPolicy
from tierserve.scheduler.messages import (
    CachedRequestData, NewRequestData, SchedulerOutput, TierCopyBatch,
)
from tierserve.scheduler.request import Request

__all__ = ["StepPlan", "WorkerUpdates", "build_output", "wire"]


def wire(batch: CopyBatch) -> TierCopyBatch:
    return TierCopyBatch(batch.kind, batch.src, batch.dst, batch.first_seq, batch.hashes,
                         batch.keys)


@dataclass(slots=True)
class StepPlan:
    """What one schedule() call has decided so far."""

    budget: int
    # Prefill tokens the step-time bound leaves this step (None: no bound).
    prefill_left: int | None = None
    # A prefill chunk is cut to this many tokens (0: no cut).
    long_prefill_token_threshold: int = 0
    new_reqs: list[Request] = field(default_factory=list)
    cached_reqs: list[Request] = field(default_factory=list)
    resumed_reqs: list[Request] = field(default_factory=list)
    num_tokens: dict[str, int] = field(default_factory=dict)
    block_ids: dict[str, list[int]] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    drafts: dict[str, list[int]] = field(default_factory=dict)
    prefill: dict[str, int] = field(default_factory=dict)

    def chunk(self, num_new_tokens: int) -> int:
        """The tokens a request with num_new_tokens to compute takes this step: cut to the
        long-prefill threshold and the budget, then by cap_prefill; 0: none fits."""
        threshold = self.long_prefill_token_threshold
        if 0 < threshold < num_new_tokens:
            num_new_tokens = threshold
        if num_new_tokens > self.budget:
            num_new_tokens = self.budget
        return self.cap_prefill(num_new_tokens)

    def cap_prefill(self, n: int) -> int:
        """A prefill chunk (n > 1) cut to what the step-time bound leaves; 0: none fits. Never
        1: a one-token step reads as a decode (drafts, no prefill accounting)."""
        if n <= 1 or self.prefill_left is None:
            return n
        capped = min(n, self.prefill_left)
        return capped if capped > 1 else 0

    def add(self, group: list[Request], req: Request, n: int, blocks: list[int],
            prefill: bool = False) -> None:
        group.append(req)
        self.num_tokens[req.request_id] = n
        self.block_ids[req.request_id] = blocks
        self.budget -= n
        if prefill and self.prefill_left is not None:
            self.prefill_left -= n
            self.prefill[req.request_id] = n

    def drop(self, req: Request) -> None:
        """Undoes a request scheduled earlier this step (it was just preempted)."""
        n = self.num_tokens.pop(req.request_id, None)
        if n is None:
            return
        self.budget += n
        if req.request_id in self.prefill:
            self.prefill_left += self.prefill.pop(req.request_id)
        del self.block_ids[req.request_id]
        self.drafts.pop(req.request_id, None)
        (self.cached_reqs if req in self.cached_reqs else self.new_reqs).remove(req)

    def scheduled(self) -> list[Request]:
        """Every request the step runs, in the SchedulerOutput's order."""
        return list(itertools.chain(self.new_reqs, self.cached_reqs, self.resumed_reqs))

    def commit(self, async_scheduling: bool) -> list[Request]:
        """Applies the plan to its requests once its message is built: their computed counts
        run ahead by the scheduled tokens (drafts included). Returns the scheduled requests."""
        scheduled = self.scheduled()
        for req in scheduled:
            req.num_computed_tokens += self.num_tokens[req.request_id]
            req.spec_token_ids = self.drafts.get(req.request_id, [])
            if async_scheduling and req.num_computed_tokens - len(req.spec_token_ids) \
                    == req.num_tokens + req.num_output_placeholders:
                req.num_output_placeholders += 1  # this step samples its next token
        return scheduled


class WorkerUpdates:
    """What the next SchedulerOutput tells the workers besides the step: the sequences finished
    since the last one that the workers have seen (they drop their rows), and the copy-on-write
    block copies of forks. Also numbers the messages to the workers."""

    __slots__ = ("finished_ids", "copies", "_step_ids")

    def __init__(self) -> None:
        self.finished_ids: list[str] = []
        # (source block id, destination block id): a fork's partial last block.
        self.copies: list[tuple[int, int]] = []
        self._step_ids = itertools.count()

    def next_step_id(self) -> int:
        return next(self._step_ids)

    def pending(self) -> bool:
        return bool(self.finished_ids or self.copies)

    def clear(self) -> None:
        """The workers these were meant for are gone."""
        self.copies, self.finished_ids = [], []

    def take(self) -> tuple[list[str], list[tuple[int, int]]]:
        finished, self.finished_ids = self.finished_ids, []
        copies, self.copies = self.copies, []
        return finished, copies


def _request_data(plan: StepPlan) -> tuple[list[NewRequestData], CachedRequestData]:
    """The scheduled requests' diffs: a request the workers have not seen travels whole, the
    others only as the tokens and block ids they lack."""
    new_data = []
    for req in plan.new_reqs:
        new_data.append(NewRequestData(req.request_id, req.all_token_ids[:],
                                       req.sampling_params, plan.block_ids[req.request_id],
                                       req.num_computed_tokens, req.num_output_tokens,
                                       req.lora))
        req.num_sent_tokens = req.num_tokens
    cached = CachedRequestData()
    for req in plan.cached_reqs:
        cached.add(req.request_id, req.all_token_ids[req.num_sent_tokens:],
                   plan.block_ids[req.request_id])
        req.num_sent_tokens = req.num_tokens
    for req in plan.resumed_reqs:
        cached.add(req.request_id, req.all_token_ids[req.num_sent_tokens:],
                   plan.block_ids[req.request_id], req.num_computed_tokens)
        req.num_sent_tokens = req.num_tokens
    return new_data, cached


def build_output(plan: StepPlan, updates: WorkerUpdates, tiers: TierPolicy) -> SchedulerOutput:
    """The step's message; takes the pending worker updates and the tier policy's copies."""
    new_data, cached = _request_data(plan)
    num_tokens = plan.num_tokens
    scheduled = plan.scheduled()
    spec_ids, num_spec = [], []
    if plan.drafts:
        num_spec = [len(plan.drafts.get(r.request_id, ())) for r in scheduled]
        for r in scheduled:
            spec_ids.extend(plan.drafts.get(r.request_id, ()))
    finished, copies = updates.take()
    step_id = updates.next_step_id()
    tier_copies = [wire(b) for b in tiers.end_step(step_id)]
    return SchedulerOutput(
        step_id=step_id, scheduled_new_reqs=new_data,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=[num_tokens[r.request_id] for r in scheduled],
        finished_req_ids=finished,
        preempted_req_ids=[r.request_id for r in plan.preempted if r.num_sent_tokens],
        tier_copies=tier_copies, copy_src=[c[0] for c in copies],
        copy_dst=[c[1] for c in copies], spec_token_ids=spec_ids, num_spec_tokens=num_spec)

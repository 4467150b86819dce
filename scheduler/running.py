"""The running requests, in admission order, and their side of a step: a decode (with drafts)
or the next prefill chunk for each, in that order, and preemption when the pool is short: from
the tail (FCFS) or the lowest priority, recomputed later or swapped to the CPU tier. Forked
samples start here too, beside the sample they share blocks with, where there is room.
"""
from __future__ import annotations

from typing import Iterator

from tierserve.kvcache import KVCacheBlock, KVCacheManager, TierPolicy
from tierserve.scheduler.drafts import Drafter
from tierserve.scheduler.params import RequestStatus
from tierserve.scheduler.queues import FCFSQueue, PriorityQueue
from tierserve.scheduler.request import Request
from tierserve.scheduler.step_output import StepPlan

__all__ = ["RunningQueue"]


class RunningQueue:
    def __init__(self, kv: KVCacheManager, tiers: TierPolicy,
                 waiting: FCFSQueue | PriorityQueue, drafter: Drafter, *, policy: str,
                 max_num_seqs: int, max_model_len: int) -> None:
        self.kv = kv
        self.tiers = tiers
        # Where a preempted request goes back to, at the front.
        self.waiting = waiting
        self.drafter = drafter
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.requests: list[Request] = []
        self.num_preemptions = 0

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)

    # ---------------------------------------------------------------- membership

    def start(self, req: Request) -> None:
        """The request runs from now on, after every other."""
        req.status = RequestStatus.RUNNING
        self.requests.append(req)

    def remove(self, req: Request) -> None:
        self.requests.remove(req)

    def drop_finished(self) -> None:
        """Drops the requests a reply finished (their status says so already)."""
        self.requests = [r for r in self.requests if r.status == RequestStatus.RUNNING]

    def release_all(self) -> list[Request]:
        """Empties the queue, freeing every block; returns the requests in their order."""
        running, self.requests = self.requests, []
        for req in running:
            self.kv.free(req)
        return running

    def start_forks(self, parent: Request, children: list[Request]) -> list[tuple[int, int]]:
        """Sample 0 has computed the prompt: every other sample shares its KV of all but the
        last prompt token and computes that token itself, for logits of its own to sample
        from. A sample that finds no room queues as a plain request (prefix hits, if cached).
        Returns the copy-on-write block copies for the workers."""
        num_shared = parent.num_prompt_tokens - 1
        copies = []
        for child in children:
            # A parent preempted while its first sample was in flight holds no blocks.
            copy = (self.kv.fork(parent, child, num_shared)
                    if parent.status == RequestStatus.RUNNING
                    and len(self.requests) < self.max_num_seqs else None)
            if copy is None:
                self.waiting.prepend(child)
                continue
            if copy is not True:
                copies.append(copy)
            child.num_computed_tokens = num_shared
            self.start(child)
        return copies

    # ---------------------------------------------------------------- one step

    def num_decoding(self) -> int:
        """Requests whose next step is one token (their last known or placeholder one)."""
        return sum(1 for r in self.requests
                   if r.num_tokens + r.num_output_placeholders - r.num_computed_tokens <= 1)

    def schedule(self, plan: StepPlan) -> None:
        """Each running request's tokens for this step, in order, while the budget lasts."""
        i = 0
        while i < len(self.requests) and plan.budget > 0:
            req = self.requests[i]
            if req.num_output_placeholders and (req.spec_token_ids or self._will_stop(req)
                                                or self.drafter.awaited(req)):
                i += 1  # its step in flight samples its last token, or drafts
                continue
            n = plan.chunk(req.num_tokens + req.num_output_placeholders
                           - req.num_computed_tokens)
            if n == 0:
                i += 1  # the step-time bound leaves no prefill this step
                continue
            prefill = n > 1
            drafts = self.drafter.drafts(req, plan.budget) if n == 1 else []
            n += len(drafts)
            blocks = self.kv.allocate_slots(req, n)
            if blocks is None:
                blocks = self._preempt_until_fits(req, n, plan)
                if blocks is None:
                    break  # it preempted itself: nothing behind it can fit either
            if req.num_sent_tokens:
                plan.add(plan.cached_reqs, req, n, [b.block_id for b in blocks], prefill)
            else:  # a forked sample the workers have not seen: its whole table travels
                plan.add(plan.new_reqs, req, n, self.kv.get_block_ids(req.request_id), prefill)
            if drafts:
                plan.drafts[req.request_id] = drafts
            # A priority preemption may have removed a request ahead of this one.
            i = self.requests.index(req) + 1 if plan.preempted else i + 1

    def _will_stop(self, req: Request) -> bool:
        """The tokens in flight reach the request's length limits."""
        pending = req.num_output_placeholders
        return (req.num_output_tokens + pending >= req.max_output_tokens
                or req.num_tokens + pending >= self.max_model_len)

    # ---------------------------------------------------------------- preemption

    def _preempt_until_fits(self, req: Request, n: int,
                            plan: StepPlan) -> list[KVCacheBlock] | None:
        while True:
            victim = self._pick_victim()
            self._preempt(victim, plan)
            if victim is req:
                return None
            blocks = self.kv.allocate_slots(req, n)
            if blocks is not None:
                return blocks

    def _pick_victim(self) -> Request:
        if self.policy == "priority":
            return max(self.requests, key=lambda r: (r.priority, r.arrival_time))
        return self.requests[-1]

    def _preempt(self, req: Request, plan: StepPlan) -> None:
        """Free every block and go back to the front of the waiting queue: to be recomputed
        (its full blocks stay cached, so resuming is mostly prefix hits), or, with swap
        preemption, with its KV copied to the CPU tier and back on resume."""
        self.requests.remove(req)
        plan.drop(req)
        # Drafts in flight are not computed tokens until verified: their KV stays behind.
        self.tiers.try_swap_out(req.request_id, self.kv.get_block_ids(req.request_id),
                                req.num_computed_tokens - len(req.spec_token_ids))
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(req)
        plan.preempted.append(req)

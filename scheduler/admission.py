"""The waiting side of a step: admits waiting requests, head of the queue first, while sequence
slots, the token budget, the step-time bound, the pool and max_loras allow, each with a
prefix-cache lookup in every tier (a request whose hits are on SSD leaves the queue to wait for
their loads); a swapped-out request resumes from its CPU copy instead.
"""
from __future__ import annotations

import time

from tierserve.kvcache import KVCacheManager, TierAdmission, TierPolicy
from tierserve.scheduler.in_flight import InFlight
from tierserve.scheduler.queues import FCFSQueue, PriorityQueue
from tierserve.scheduler.request import Request
from tierserve.scheduler.running import RunningQueue
from tierserve.scheduler.step_output import StepPlan

__all__ = ["Admission"]


class Admission:
    def __init__(self, kv: KVCacheManager, tiers: TierPolicy,
                 waiting: FCFSQueue | PriorityQueue, running: RunningQueue,
                 in_flight: InFlight, *, max_num_seqs: int, max_loras: int = 1) -> None:
        self.kv = kv
        self.tiers = tiers
        self.waiting = waiting
        self.running = running
        # Its suspects are admitted one at a time.
        self.in_flight = in_flight
        self.max_num_seqs = max_num_seqs
        self.max_loras = max_loras

    def schedule(self, plan: StepPlan) -> None:
        """Admits from the head of the queue until one does not fit (head-of-line)."""
        # A request waiting for SSD loads holds a sequence slot.
        loading = self.tiers.num_loading
        in_flight = self.in_flight
        while self.waiting and plan.budget > 0 \
                and (plan.prefill_left is None or plan.prefill_left > 1) \
                and len(self.running) + loading < self.max_num_seqs:
            if in_flight.suspects and in_flight.quarantined(self.waiting.peek(), self.running):
                break
            admitted = self._admit(self.waiting.peek(), plan)
            if admitted is None:
                break  # head-of-line: later requests wait their turn
            loading += not admitted

    def _admit(self, req: Request, plan: StepPlan) -> bool | None:
        """True: running from this step. False: it left the queue to wait for SSD loads
        (the next may go). None: no room (nobody behind it goes either)."""
        assert not req.num_output_placeholders, "admitted before its step in flight returned"
        if req.lora is not None and not self._lora_fits(req.lora.lora_id):
            return None
        swapped = self.tiers.swapped_tokens(req.request_id)
        if swapped:
            return self._resume_swapped(req, swapped, plan)
        # Prompt logprobs want every prompt position's logits: no hit in any tier; nor for a
        # request that skips reading the cache.
        params = req.sampling_params
        if params.skip_reading_prefix_cache or (params.prompt_logprobs is not None
                                                and not req.output_token_ids):
            hits, num_hit, admission = [], 0, TierAdmission()
        else:
            hits, num_hit = self.kv.get_computed_blocks(req)
            loaded = self.tiers.counters.ssd_hit_blocks
            admission = self.tiers.admit(req, len(hits))
            req.ssd_loaded_blocks += self.tiers.counters.ssd_hit_blocks - loaded
        if admission.wait:
            self.waiting.pop()
            return False
        if admission.defer:
            return None
        num_hit += len(admission.cpu_hits) * self.kv.block_size
        n = plan.chunk(req.num_tokens - num_hit)
        assert n > 0, "admission goes on only while a chunk of 2 tokens fits"
        blocks = self.kv.allocate_slots(req, n, hits, num_hit, apply_watermark=True)
        if blocks is None:
            self.tiers.refused(admission)
            return None
        if req.num_cached_tokens < 0:  # its first admission: the hits it reports
            req.cached_by_tier = self._cached_by_tier(req, len(hits), num_hit)
            req.num_tier_cached_tokens = sum(req.cached_by_tier[1:])
            req.admitted_at = time.monotonic()
        self.tiers.admitted(req.request_id, admission, [b.block_id for b in blocks])
        self._start_running(req, num_hit, n, plan)
        return True

    def _lora_fits(self, lora_id: int) -> bool:
        """Whether a request of this adapter may run beside the running ones: its adapter is
        among theirs, or they run fewer than max_loras adapters."""
        running = {r.lora.lora_id for r in self.running.requests if r.lora is not None}
        return lora_id in running or len(running) < self.max_loras

    def _cached_by_tier(self, req: Request, num_device_blocks: int,
                        num_hit: int) -> tuple[int, int, int]:
        """(device, CPU, SSD) tokens of a first admission's hits; blocks loaded from SSD for
        the request are CPU hits by now."""
        device = num_device_blocks * self.kv.block_size
        below = num_hit - device
        ssd = min(req.ssd_loaded_blocks * self.kv.block_size, below)
        return device, below - ssd, ssd

    def _resume_swapped(self, req: Request, num_swapped: int, plan: StepPlan) -> bool | None:
        n = plan.chunk(req.num_tokens - num_swapped)
        assert n > 0, "admission goes on only while a chunk of 2 tokens fits"
        blocks = self.kv.allocate_slots(req, n, (), num_swapped, apply_watermark=True)
        if blocks is None:
            return None
        self.tiers.swap_in(req.request_id, [b.block_id for b in blocks])
        self._start_running(req, num_swapped, n, plan)
        return True

    def _start_running(self, req: Request, num_computed: int, n: int, plan: StepPlan) -> None:
        """The waiting head runs from this step, its first num_computed tokens in the pool."""
        self.waiting.pop()
        req.num_computed_tokens = num_computed
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_computed
        self.running.start(req)
        group = plan.resumed_reqs if req.num_sent_tokens else plan.new_reqs
        plan.add(group, req, n, self.kv.get_block_ids(req.request_id), prefill=n > 1)

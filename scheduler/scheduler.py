"""The unified scheduler: one token budget shared by prefill chunks and decodes.

Each step serves running requests first (in admission order), preempting from the tail (FCFS)
or the lowest priority when blocks run out, then admits waiting requests with a prefix-cache
lookup, but only in a step that preempted nobody (admitting while evicting would thrash).
A request is a "prefill" or a "decode" only by how far num_computed_tokens trails num_tokens.

With async scheduling, step N+1 is scheduled while step N runs: a request that step N will
sample from holds a placeholder for that token (num_output_placeholders), and step N+1 already
schedules the placeholder's position; the workers feed it their own sampled token. Stops are
learnt a step late, so a finished request's step in flight is wasted and its token dropped.

With speculative decoding (scheduler/spec.py) a decoding request is scheduled with drafts
after its last token; the reply says how many were accepted, and the computed count falls
back by the rejected ones. A request whose drafts are in flight is not scheduled again before
the reply: how many tokens it will have is not known until then; with async scheduling, one
whose known tokens find drafts waits for its step in flight too, so as to draft next.

This module owns the Scheduler: the API the EngineCore drives, its limits, and how a request
enters and finishes. Every other piece of state has one owner among its collaborators: the
live sequences and sample families (sequences.py), the running requests with their decodes,
preemption and forks (running.py), admission from the waiting queue (admission.py,
queues.py), the step's plan and message (step_output.py), the steps in flight and the
suspects of a worker loss (in_flight.py) and the speculative tokens (drafts.py). outputs.py
applies a reply to one request; validation.py checks a request before it is queued.
"""
from __future__ import annotations

import itertools
from typing import Callable

from tierserve.kvcache import BlockHasher, KVCacheManager
from tierserve.scheduler.admission import Admission
from tierserve.scheduler.drafts import Drafter
from tierserve.scheduler.in_flight import InFlight
from tierserve.scheduler.messages import (
    EngineCoreOutput, FlushTiers, ModelRunnerOutput, SchedulerOutput,
)
from tierserve.scheduler.outputs import append_tokens, engine_output, takes_token
from tierserve.scheduler.params import LoRARef, QueueFullError, RequestStatus, SamplingParams
from tierserve.scheduler.queues import make_waiting_queue
from tierserve.scheduler.request import Request
from tierserve.scheduler.running import RunningQueue
from tierserve.scheduler.sequences import Family, Sequences
from tierserve.scheduler.spec import SpeculativeConfig, Speculator
from tierserve.scheduler.step_budget import StepTimeBudget
from tierserve.scheduler.step_output import StepPlan, WorkerUpdates, build_output, wire
from tierserve.scheduler.validation import check_limits, check_request

__all__ = ["Scheduler"]


class Scheduler:
    def __init__(self, kv_cache_manager: KVCacheManager, hasher: BlockHasher | None, *,
                 max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 long_prefill_token_threshold: int = 0, policy: str = "fcfs",
                 vocab_size: int | None = None, max_queued_requests: int | None = None,
                 async_scheduling: bool = False,
                 speculative_config: SpeculativeConfig | None = None,
                 step_time_target_s: float = 0.0, max_loras: int = 1) -> None:
        check_limits(kv_cache_manager, max_num_seqs, max_num_batched_tokens, max_model_len,
                     long_prefill_token_threshold, step_time_target_s)
        self.kv = kv_cache_manager
        self.hasher = hasher if kv_cache_manager.enable_caching else None
        self.max_num_seqs = max_num_seqs
        self.max_queued_requests = max_queued_requests
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.long_prefill_token_threshold = long_prefill_token_threshold
        # While requests decode, a step's prefill fits the measured cost into this time.
        self.step_budget = StepTimeBudget(step_time_target_s, kv_cache_manager.block_size) \
            if step_time_target_s else None
        self.policy = policy
        # Distinct LoRA adapters among the running requests, at most.
        self.max_loras = max_loras
        self.vocab_size = vocab_size
        self.async_scheduling = async_scheduling
        # Called with each sequence that finishes, however it finished (the request log).
        self.on_finish: Callable[[Request], None] | None = None
        # The KV tiers' policy (kvcache/tier_policy.py): asked at admission, preemption and
        # the end of each step; capacity 0 where the engine has no tiers.
        self.tiers = kv_cache_manager.tiers
        self.speculator = Speculator(speculative_config) if speculative_config else None
        self._make_collaborators()

    def _make_collaborators(self) -> None:
        # They share the KV manager, the tier policy and the waiting queue, and own the rest.
        self.waiting = make_waiting_queue(self.policy)
        self._seqs = Sequences()
        self._in_flight = InFlight()
        self._updates = WorkerUpdates()
        self._drafter = Drafter(self.speculator, self.max_model_len)
        self._running = RunningQueue(self.kv, self.tiers, self.waiting, self._drafter,
                                     policy=self.policy, max_num_seqs=self.max_num_seqs,
                                     max_model_len=self.max_model_len)
        self._admission = Admission(self.kv, self.tiers, self.waiting, self._running,
                                    self._in_flight, max_num_seqs=self.max_num_seqs,
                                    max_loras=self.max_loras)

    # ---------------------------------------------------------------- state, by its owner

    @property
    def requests(self) -> dict[str, Request]:
        """Every unfinished sequence by sequence id."""
        return self._seqs.requests

    @property
    def families(self) -> dict[str, Family]:
        return self._seqs.families

    @property
    def running(self) -> list[Request]:
        """The running requests, in admission order."""
        return self._running.requests

    @property
    def num_preemptions(self) -> int:
        return self._running.num_preemptions

    @property
    def suspects(self) -> set[str]:
        """Sequences in a step in flight when the workers were last lost, not yet through a
        step of the new workers (in_flight.py)."""
        return self._in_flight.suspects

    # ---------------------------------------------------------------- requests in and out

    def has_queue_room(self) -> bool:
        """Whether the waiting queue takes another request (max_queued_requests)."""
        return self.max_queued_requests is None or len(self.waiting) < self.max_queued_requests

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    sampling_params: SamplingParams, *, eos_token_id: int | None = None,
                    priority: int = 0, cache_salt: str | None = None,
                    lora: LoRARef | None = None, arrival_time: float | None = None) -> Request:
        """Validates and queues a request; bad input raises ValueError and changes nothing.
        With sampling_params.n > 1 its other samples fork from it once the prompt is computed."""
        if self._seqs.in_use(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        check_request(request_id, prompt_token_ids, sampling_params, self.max_model_len,
                      self.vocab_size)
        if not self.has_queue_room():
            raise QueueFullError(f"the engine's queue is full ({self.max_queued_requests} "
                                 f"requests waiting); try again later")
        req = Request(request_id, prompt_token_ids, sampling_params, eos_token_id=eos_token_id,
                      arrival_time=arrival_time, priority=priority, cache_salt=cache_salt,
                      lora=lora, hasher=self.hasher,
                      keep_keys=self.kv.pool.verify_hits)
        room = self.max_model_len - req.num_prompt_tokens
        limit = sampling_params.max_tokens
        req.max_output_tokens = max(room, 1) if limit is None else limit
        self._seqs.add(req)
        self.waiting.add(req)
        return req

    def finish_requests(self, request_ids, status: RequestStatus) -> list[tuple[str, int]]:
        """Finishes requests, every sample of each, from outside a step (abort, failure);
        returns the (request id, sample index) of each sequence finished."""
        return self.finish_seqs(self._seqs.seq_ids(request_ids), status)

    def abort_requests(self, request_ids) -> list[tuple[str, int]]:
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_seqs(self, seq_ids, status: RequestStatus) -> list[tuple[str, int]]:
        """Finishes single sequences (a stop string, a failed step); a request's first sample
        takes its unforked siblings with it. Returns (request id, sample index) of each."""
        assert status.is_finished()
        done = []
        for sid in list(seq_ids):
            req = self.requests.get(sid)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self._running.remove(req)
            elif not self.tiers.is_loading(req.request_id):
                self.waiting.remove(req)
            done.extend(self._finish(req, status))
        return done

    def _finish(self, req: Request, status: RequestStatus) -> list[tuple[str, int]]:
        """Releases what a sequence holds; its caller has taken it out of its queue."""
        req.status = status
        self._in_flight.forget(req.request_id)
        self.kv.free(req)
        self.tiers.forget(req.request_id)
        self._drafter.forget(req.request_id)
        if self.on_finish is not None:
            self.on_finish(req)
        if req.num_sent_tokens:
            self._updates.finished_ids.append(req.request_id)
        return self._seqs.remove(req)

    # ---------------------------------------------------------------- one step

    def schedule(self) -> SchedulerOutput:
        if not self.async_scheduling:
            self._in_flight.clear()  # a step whose reply never came was dropped by the caller
        plan = StepPlan(budget=self.max_num_batched_tokens, prefill_left=self._prefill_limit(),
                        long_prefill_token_threshold=self.long_prefill_token_threshold)
        self._running.schedule(plan)
        if not plan.preempted:
            self._admission.schedule(plan)
        out = build_output(plan, self._updates, self.tiers)
        scheduled = plan.commit(self.async_scheduling)
        if scheduled:
            self._in_flight.add(out.step_id, scheduled,
                                sum(n - 1 for n in out.num_scheduled_tokens))
        return out

    def _prefill_limit(self) -> int | None:
        if self.step_budget is None:
            return None
        limit = self.step_budget.prefill_limit(self._running.num_decoding())
        if limit is not None and limit >= self.max_num_batched_tokens:
            return None
        return limit

    # ---------------------------------------------------------------- after the forward

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Appends sampled tokens, finishes stopped requests and frees their blocks."""
        self._requeue(self.tiers.complete(scheduler_output.step_id, runner_output.tier_done,
                                          runner_output.tier_failed))
        outputs = []
        any_finished = False
        logprobs = runner_output.logprobs or itertools.repeat(None)
        accepted = runner_output.num_accepted or itertools.repeat(0)
        seqs, in_flight = self._seqs, self._in_flight
        scheduled = in_flight.pop(scheduler_output.step_id)
        for req, token, lp, num_accepted in zip(scheduled, runner_output.sampled_token_ids,
                                                logprobs, accepted):
            drafts, req.spec_token_ids = req.spec_token_ids, []
            if token < 0 or not takes_token(req):
                continue  # a partial prefill chunk, or finished while the step ran
            if seqs.families and seqs.forks_now(req):  # most steps have no family to test
                self._updates.copies += self._running.start_forks(req, seqs.fork(req))
            tokens = self._drafter.accept(req, drafts, num_accepted, token)
            num_sampled = len(tokens)
            status = append_tokens(req, tokens, self.max_model_len)
            if in_flight.suspects:
                in_flight.computed(req)  # by the current workers
            if self.async_scheduling:  # the workers appended them themselves
                req.num_output_placeholders -= 1
                req.num_sent_tokens += num_sampled
            if status is not None:
                if req.status == RequestStatus.PREEMPTED:
                    self.waiting.remove(req)
                self._finish(req, status)
                any_finished = True
            outputs.append(engine_output(req, tokens, status, lp))
        if any_finished:
            self._running.drop_finished()
        return outputs

    def flush_message(self, deadline_s: float) -> FlushTiers | None:
        """A clean shutdown's write of every cached block the SSD folder lacks (no step in
        flight); None when there is nothing to write or no SSD tier."""
        batches = self.tiers.plan_flush(
            (b.block_id, b.block_hash, b.hash_key) for b in self.kv.pool.iter_cached_blocks())
        if not batches:
            return None
        return FlushTiers(self._updates.next_step_id(), [wire(b) for b in batches], deadline_s)

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """A step's measured time: its prefill throughput feeds swap-vs-recompute, its time per
        token the step-time bound."""
        tokens = sum(out.num_scheduled_tokens)
        if seconds > 0 and max(out.num_scheduled_tokens, default=1) > 1:
            self.tiers.costs.observe_prefill(tokens, seconds)
        if self.step_budget is not None and tokens:
            self.step_budget.observe(tokens, seconds)

    def step_failed(self, scheduler_output: SchedulerOutput) -> None:
        """The workers failed the step: its tier copies did not happen."""
        for req in self._in_flight.pop(scheduler_output.step_id):
            req.spec_token_ids = []
        self.tiers.step_failed(scheduler_output.step_id)

    def workers_lost(self) -> list[str]:
        """The workers were lost (a rank died, or a step hung) and replaced by new ones that
        hold nothing: every step in flight is void, the pool's and the CPU tier's contents are
        gone (SSD entries stay), and every unfinished sequence waits again, preempted, to be
        recomputed from its prompt and the tokens it has (prefix hits where SSD has them);
        the running ones first, in their order. Returns the suspects of the last loss found
        in a step in flight again (poison pills), for the caller to fail; the sequences in
        flight now become the suspects."""
        poisoned = self._in_flight.workers_lost(self.requests)
        self._updates.clear()
        # The running ones, then those waiting for SSD loads.
        lost = self._running.release_all() + self.kv.drop_worker_memory()
        for req in reversed(lost):
            self.waiting.prepend(req)
        self._seqs.restart_all()
        return poisoned

    def _requeue(self, ready: list[Request]) -> None:
        """Requests whose SSD loads completed go back to the head of the waiting queue."""
        for req in reversed(ready):
            self.waiting.prepend(req)

    # ---------------------------------------------------------------- introspection

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens still to compute: of a waiting request, those past the prefix its
        admission would find cached on the device now (a chat turn's history mostly is); of a
        running one, those not computed yet (a decode's last token aside); and those of the
        steps in flight, which scheduling counted as computed before they ran (with async
        scheduling a step is in flight whenever the load is read)."""
        queued = self._in_flight.extra_tokens
        queued += sum(r.num_tokens - self.kv.get_computed_blocks(r)[1] for r in self.waiting)
        for r in self.running:
            left = r.num_tokens - r.num_computed_tokens - 1
            if left > 0:
                queued += left
        return queued

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_pending_worker_updates(self) -> bool:
        """Something only a step (even without tokens) tells the workers or learns from them:
        finished requests to drop, tier copies to start or in flight."""
        return self._updates.pending() or self.tiers.has_work()

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def stats(self) -> dict:
        pool, pc = self.kv.pool, self.kv.stats
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "kv_usage": pool.usage(),
            "num_free_blocks": pool.num_free_blocks,
            "num_total_blocks": pool.num_usable_blocks,
            "prefix_cache_requests": pc.requests,
            "prefix_cache_queried_tokens": pc.queried_tokens,
            "prefix_cache_hit_tokens": pc.hit_tokens,
            "prefix_cache_hit_rate": pc.hit_rate,
            "prefix_cache_evictions": pool.num_evictions,
            "prefix_cache_collisions": pool.num_collisions,
            "num_preemptions": self.num_preemptions,
        } | self.tiers.stats() | self._drafter.stats()

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        running_ids = {r.request_id for r in self.running}
        waiting_ids = {r.request_id for r in self.waiting}
        loading_ids = self.tiers.loading_ids()
        assert len(running_ids) + len(loading_ids) <= self.max_num_seqs
        assert len(running_ids) == len(self.running)
        assert not running_ids & waiting_ids and not loading_ids & (running_ids | waiting_ids)
        assert running_ids | waiting_ids | loading_ids == set(self.requests), \
            "requests lost or leaked"
        assert set(self.kv.req_to_blocks) <= running_ids, "a non-running request holds blocks"
        bs = self.kv.block_size
        for req in self.running:
            assert req.status == RequestStatus.RUNNING
            held = len(self.kv.req_to_blocks.get(req.request_id, ()))
            assert held * bs >= req.num_computed_tokens
        for req in self.waiting:
            assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert req.num_computed_tokens == 0
        assert self.suspects <= set(self.requests), "a finished sequence is still suspect"
        self._in_flight.check_integrity()
        in_flight = len(self._in_flight)
        assert in_flight <= (2 if self.async_scheduling else 1), "steps lost in flight"
        for req in self.requests.values():
            assert 0 <= req.num_output_placeholders <= in_flight
            assert req.num_computed_tokens <= (req.num_tokens + req.num_output_placeholders
                                               + len(req.spec_token_ids))

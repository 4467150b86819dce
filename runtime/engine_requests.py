"""Request intake and endings for the EngineCore, over the scheduler that holds the requests.

RequestBook owns what the engine keeps of a request beside the scheduler's state: the caller's
label (list_requests shows it), the prompt logprobs gathered chunk by chunk until the request's
first output carries them, and the outputs of samples finished between steps, which the next
step returns. A request's label and prompt logprobs go when its last sample finishes.
stream_batch drives an engine through a batch of requests by its public methods alone.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Callable, Iterator

import msgspec

from tierserve.runtime.errors import EngineDeadError
from tierserve.runtime.lora import AdapterCatalog
from tierserve.runtime.outputs import Outstanding
from tierserve.runtime.requests import check_request, rejection
from tierserve.scheduler import (
    EngineCoreOutput, EngineCoreRequest, FinishReason, RequestStatus, Scheduler, SchedulerOutput,
)
from tierserve.scheduler.params import ErrorKind
from tierserve.scheduler.request import seq_id

if TYPE_CHECKING:
    from tierserve.runtime.engine_core import EngineCore

__all__ = ["RequestBook", "stream_batch"]

log = logging.getLogger("tierserve.engine")


class RequestBook:
    """Labels, pending prompt logprobs and staged outputs, by request id. The step loop reads
    `labels` and `prompt_logprobs` for emptiness before calling in, so that a step with
    neither pays nothing; `staged` is read, and changed only here."""

    def __init__(self, scheduler: Scheduler, eos_token_id: int | None,
                 loras: AdapterCatalog | None = None, extra_eos_ids: tuple[int, ...] = ()
                 ) -> None:
        self._scheduler = scheduler
        self._eos_token_id = eos_token_id
        # The model's other end-of-sequence ids: a request not ignoring eos stops at them too.
        self._extra_eos_ids = extra_eos_ids
        # The LoRA adapters' door (None: LoRA is not enabled).
        self._loras = loras
        # The caller's label of each unfinished request that has one.
        self.labels: dict[str, str] = {}
        # Prompt logprobs of requests that asked for them and have no output yet.
        self.prompt_logprobs: dict[str, list] = {}
        # Embedding requests' pooled hidden states, until their finishing output.
        self.pooled: dict[str, bytes] = {}
        # Outputs of sequences finished between steps (stop), for the next step.
        self.staged: list[EngineCoreOutput] = []

    # ------------------------------------------------------------------ intake

    def add(self, request: EngineCoreRequest) -> list[int]:
        """Queues a request; bad input raises ValueError and changes nothing."""
        prompt_ids = check_request(request)
        params = request.sampling_params
        if self._extra_eos_ids and not params.ignore_eos:
            params = _stopping_at(params, self._extra_eos_ids)
        lora = request.lora
        if lora is not None:
            if self._loras is None:
                raise ValueError(f"LoRA adapter {lora.name!r}: this engine was started "
                                 f"without enable_lora")
            lora = self._loras.admit(lora)
        self._scheduler.add_request(request.req_id, prompt_ids, params,
                                    eos_token_id=self._eos_token_id, priority=request.priority,
                                    cache_salt=request.cache_salt, lora=lora)
        if request.label:
            self.labels[request.req_id] = request.label
        if params.prompt_logprobs is not None:
            self.prompt_logprobs[request.req_id] = []
        return prompt_ids

    def has_request(self, request_id: str) -> bool:
        """Whether some sample of the request has not finished."""
        sched = self._scheduler
        return request_id in sched.requests or request_id in sched.families

    def named(self, names) -> list[str]:
        """The unfinished requests named by engine id or label."""
        names = set(names)
        ids = dict.fromkeys(r.family_id for r in self._scheduler.requests.values())
        return [rid for rid in ids if rid in names or self.labels.get(rid) in names]

    def describe(self) -> list[dict]:
        """Each unfinished request: id, status, prompt and output tokens, age in seconds."""
        now = time.monotonic()
        return [{"request_id": self.labels.get(r.family_id, r.family_id),
                 "engine_id": r.family_id, "index": r.index, "status": r.status.name.lower(),
                 "prompt_tokens": r.num_prompt_tokens, "output_tokens": r.num_output_tokens,
                 "age_s": round(now - r.arrival_time, 3)}
                for r in sorted(self._scheduler.requests.values(), key=lambda r: r.arrival_time)]

    # ------------------------------------------------------------------ a step's outputs

    def take_staged(self) -> list[EngineCoreOutput]:
        staged, self.staged = self.staged, []
        return staged

    def gather(self, out: SchedulerOutput, chunks: list) -> None:
        """A step's prompt logprobs, one chunk per scheduled request (in scheduled_req_ids'
        order). A chunk from the prompt's start (a preempted request's prefill begun again)
        replaces what was gathered."""
        cached = out.scheduled_cached_reqs
        from_start = {r.req_id for r in out.scheduled_new_reqs if r.num_computed_tokens == 0}
        from_start.update(cached.req_ids[i] for i, n in zip(cached.resumed,
                                                            cached.resumed_num_computed) if n == 0)
        for rid, lps in zip(out.scheduled_req_ids(), chunks):
            if lps and rid in self.prompt_logprobs:  # not a recompute's, after the first
                partial = self.prompt_logprobs[rid]
                if rid in from_start:
                    partial.clear()
                partial.extend(lps)

    def gather_pooled(self, req_ids, pooled: list[bytes]) -> None:
        """A step's pooled hidden states, one per scheduled request (in req_ids' order)."""
        for rid, vec in zip(req_ids, pooled):
            if vec and self.has_request(rid):  # not one aborted while the step ran
                self.pooled[rid] = vec

    def after_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        """A request's first output carries its prompt logprobs (and an embedding request's
        its pooled state); a finished request's label goes."""
        for o in outputs:
            lps = self.prompt_logprobs.pop(o.req_id, None)
            if lps is not None:
                o.prompt_logprobs = lps
            vec = self.pooled.pop(o.req_id, None)
            if vec is not None:
                o.pooled = vec
            if o.finish_reason is not None and not self.has_request(o.req_id):
                self.labels.pop(o.req_id, None)

    def restart_prompt_logprobs(self) -> None:
        """Prompt logprobs not yet delivered are computed again, from the first chunk (the
        workers that computed them are lost)."""
        for partial in self.prompt_logprobs.values():
            partial.clear()

    # ------------------------------------------------------------------ endings

    def abort(self, request_ids) -> list[EngineCoreOutput]:
        done = self._scheduler.abort_requests(request_ids)
        self._forget(done)
        return [EngineCoreOutput(rid, finish_reason=FinishReason.ABORT, index=index)
                for rid, index in done]

    def stop(self, seqs) -> None:
        """Finishes samples, given as (request id, sample index); their finishing outputs are
        staged for the next step."""
        done = self._scheduler.finish_seqs([seq_id(rid, index) for rid, index in seqs],
                                           RequestStatus.FINISHED_STOPPED)
        self._forget(done)
        self.staged += [EngineCoreOutput(rid, finish_reason=FinishReason.STOP, index=index)
                        for rid, index in done]

    def fail(self, seqs: list[str],
             message_of: Callable[[str], str]) -> list[EngineCoreOutput]:
        """Fails the sequences (by seq id) with an internal error, message_of(request id)."""
        done = self._scheduler.finish_seqs(seqs, RequestStatus.FINISHED_ERROR)
        self._forget(done)
        return [EngineCoreOutput(rid, finish_reason=FinishReason.ERROR, error=message_of(rid),
                                 index=index, error_kind=ErrorKind.INTERNAL)
                for rid, index in done]

    def fail_all(self, message: str) -> list[EngineCoreOutput]:
        """Every unfinished request fails with the engine's death; staged outputs go."""
        ids = sorted({r.family_id for r in self._scheduler.requests.values()})
        try:
            self._scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
        except Exception:  # the state that failed the step may be broken: fail them anyway
            log.exception("could not release the requests of a dead engine")
        self._forget((rid, 0) for rid in ids)
        self.staged.clear()
        # An error output finishes every sample of its request.
        return [EngineCoreOutput(rid, finish_reason=FinishReason.ERROR, error=message,
                                 error_kind=ErrorKind.ENGINE_DEAD) for rid in ids]

    def _forget(self, seqs) -> None:
        """Drops the state of requests whose last sequence finished (given as (request id,
        sample index))."""
        if self.labels or self.prompt_logprobs or self.pooled:
            for rid, _ in seqs:
                if not self.has_request(rid):
                    self.labels.pop(rid, None)
                    self.prompt_logprobs.pop(rid, None)
                    self.pooled.pop(rid, None)


def _stopping_at(params, ids: tuple[int, ...]):
    """The parameters with `ids` among their stop_token_ids (vLLM's
    update_from_generation_config)."""
    missing = [i for i in ids if i not in params.stop_token_ids]
    if not missing:
        return params
    return msgspec.structs.replace(params, stop_token_ids=[*params.stop_token_ids, *missing])


def stream_batch(core: EngineCore,
                 requests: list[EngineCoreRequest]) -> Iterator[list[EngineCoreOutput]]:
    """Adds the requests and steps until all have finished, yielding each step's outputs.
    The whole batch is the caller's, as vLLM's offline batches are: requests past the queue's
    bound (max_queued_requests) wait here, in order, and join it as steps drain it. A request
    that fails validation yields one error output; closing the iterator early aborts what is
    left."""
    held = deque(requests)
    pending = Outstanding(())
    try:
        while True:
            failed = _admit(core, held, pending)
            if failed:
                yield failed
            if not pending:
                assert not held, "the engine's queue is full of requests of another batch"
                return
            outputs = core.step()
            pending.update(outputs)
            yield outputs
    finally:
        if pending and core.dead_reason is None:
            core.abort_requests(list(pending))
        if core.dead_reason is None:
            core.drain()  # a finished request's step in flight (none: a no-op)


def _admit(core: EngineCore, held: deque, pending: Outstanding) -> list[EngineCoreOutput]:
    """Moves held requests into the engine while its queue has room; the rejections of those
    that fail validation."""
    failed = []
    while held and core.has_queue_room():
        request = held.popleft()
        try:
            core.add_request(request)
        except EngineDeadError:
            raise
        except Exception as e:  # this request alone fails
            failed.append(rejection(request, e))
        else:
            pending.add(request)
    return failed

"""EngineCore: owns every request; each step schedules, executes on the workers, updates.

It takes token ids and emits token ids: tokenizing, chat templates, detokenizing and stop
strings are the client's (runtime/processor.py), so nothing a client sends makes a step wait
on text work. The transport to the workers is injected: in-process for one device, Ray + ZMQ
in deployment (deploy/); the EngineCore code is the same.

This module owns the step loop (the steps in flight) and the engine's life: its start, where
each failure goes, its death and shutdown. One concern per collaborator: engine_setup.py builds
the engine from its config, engine_requests.py takes requests in and ends them,
engine_heal.py replaces lost workers, engine_report.py reports KV events and load.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable, Iterator

from tierserve.kvcache import KVEventRecorder
from tierserve.runtime.config import EngineConfig
from tierserve.runtime.engine_heal import RESTART_WINDOW_S, WorkerHealer
from tierserve.runtime.engine_report import LoadReporter, engine_info, engine_stats
from tierserve.runtime.engine_requests import RequestBook, stream_batch
from tierserve.runtime.engine_setup import (
    check_model, make_request_log, make_scheduler, make_worker_spec, start_tokenizer,
)
from tierserve.runtime.executor import EngineDeadError, Executor, InProcessExecutor, WorkerInfo
from tierserve.runtime.generation_config import generation_defaults, generation_eos_ids
from tierserve.runtime.lora import adapter_catalog
from tierserve.runtime.request_log import RequestLog
from tierserve.runtime.requests import rejection
from tierserve.runtime.tokenizer import load_model_tokenizer
from tierserve.scheduler import (
    EngineCoreOutput, EngineCoreRequest, ModelRunnerOutput, SchedulerOutput, WorkerError,
)
from tierserve.scheduler.kv_events import KVEventBatch, KVSnapshot, ReplicaLoad
from tierserve.workers.worker import WorkerSpec

__all__ = ["EngineCore", "load_model_tokenizer", "EngineDeadError", "rejection",
           "RESTART_WINDOW_S", "FLUSH_DEADLINE_S"]

log = logging.getLogger("tierserve.engine")
progress = logging.getLogger("tierserve.progress")  # a start's steps, on the CLI's terminal

# A step that only asks the workers how far their asynchronous tier copies got waits this long
# first, so that waiting for an SSD load does not spin the engine.
_POLL_S = 0.002
# How long a clean shutdown may spend writing the KV cache to SSD.
FLUSH_DEADLINE_S = 30.0


class EngineCore:
    def __init__(self, config: EngineConfig,
                 executor_factory: Callable[[WorkerSpec], Executor] = InProcessExecutor) -> None:
        started = time.perf_counter()
        model = check_model(config)
        loras = adapter_catalog(config, model)  # a bad lora_modules fails here, before workers
        spec = make_worker_spec(config)
        self.generation_defaults = generation_defaults(config.generation_config, spec.model,
                                                      config.override_generation_config)
        self._generation_eos = generation_eos_ids(config.generation_config, spec.model)
        self.tokenizer_path = config.tokenizer or spec.model
        spec, tokenizer = start_tokenizer(spec, self.tokenizer_path)
        self.executor = executor_factory(spec)
        # KV events (scheduler/kv_events.py): the hashes entering and leaving each tier.
        self.kv_events = KVEventRecorder() if config.publishes_kv_events else None
        t0 = time.perf_counter()
        try:
            info = self.executor.start()
            self.worker_start_s = time.perf_counter() - t0  # what a restart compares with
            self.tokenizer = tokenizer.result()
            self.scheduler = make_scheduler(config, info, model, spec, self.kv_events)
        except BaseException:
            self.executor.shutdown()  # a failed start leaves no worker, folder or socket
            tokenizer.wait()
            raise
        # Seconds each part of the start took (rank 0's for the workers' parts).
        self.startup = {"tokenizer": tokenizer.seconds, **info.startup,
                        "total": time.perf_counter() - started}
        progress.info("engine ready in %.1f s", self.startup["total"])
        self.config = config
        self.request_log = self._make_request_log(config, spec, info)
        self._describe(info)
        self._reporter = LoadReporter(self.scheduler, self.kv_events)
        self.adapters = loras  # the LoRA door (None: enable_lora is off)
        self._requests = RequestBook(self.scheduler, self.eos_token_id, loras,
                                     self.extra_eos_ids)
        self._healer = WorkerHealer(config, self.executor, self.scheduler)
        self._dead: str | None = None
        # Steps submitted and not yet collected, oldest first, with their submission times:
        # at most one between steps, two while a step is being scheduled (async scheduling).
        self._in_flight: deque[tuple[SchedulerOutput, float]] = deque()
        self._last_collect = 0.0

    def _make_request_log(self, config: EngineConfig, spec: WorkerSpec,
                          info: WorkerInfo) -> RequestLog | None:
        """The request log, where configured: every finished sequence goes to it."""
        try:
            request_log = make_request_log(config, spec, info, self.scheduler.tiers.index)
        except BaseException:
            self.executor.shutdown()
            raise
        if request_log is not None:
            self.scheduler.on_finish = request_log.add
        return request_log

    def _describe(self, info: WorkerInfo) -> None:
        """What the started workers say of the model and themselves."""
        self.max_model_len = self.scheduler.max_model_len
        self.vocab_size = info.vocab_size
        self.backends = info.backends
        self.weight_bytes = info.weight_bytes
        self.decode_weight_bytes = info.decode_weight_bytes
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        self.eos_token_id = eos if eos is not None else (
            info.eos_token_ids[0] if info.eos_token_ids else None)
        # The model's other end-of-sequence ids (generation_config.json's, else config.json's),
        # which requests stop at as stop_token_ids.
        named = self._generation_eos if self._generation_eos is not None else info.eos_token_ids
        self.extra_eos_ids = tuple(i for i in dict.fromkeys(named) if i != self.eos_token_id)

    # ------------------------------------------------------------------ requests

    def add_request(self, request: EngineCoreRequest) -> list[int]:
        """Queues a request; bad input raises ValueError and leaves the engine unchanged."""
        self._check_alive()
        self._reporter.count_request()
        return self._requests.add(request)

    def has_queue_room(self) -> bool:
        """Whether add_request finds room in the waiting queue (max_queued_requests)."""
        return self.scheduler.has_queue_room()

    def stream_batch(self, requests: list[EngineCoreRequest]) -> Iterator[list[EngineCoreOutput]]:
        """Queues the whole batch (past the queue's bound, requests join it as it drains) and
        steps until all have finished, yielding each step's outputs. A request that fails
        validation yields one error output; closing the iterator early aborts what is left."""
        return stream_batch(self, requests)

    def abort_requests(self, request_ids) -> list[EngineCoreOutput]:
        return self._requests.abort(request_ids)

    def stop_sequences(self, seqs) -> None:
        """Finishes samples, given as (request id, sample index), that a client's stop string
        ended; their finishing outputs come out of the next step."""
        self._requests.stop(seqs)

    def request_ids(self, names) -> list[str]:
        """The unfinished requests named by engine id or label (an operator's view)."""
        return self._requests.named(names)

    def has_request(self, request_id: str) -> bool:
        """Whether some sample of the request has not finished."""
        return self._requests.has_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_work(self) -> bool:
        """Whether a step would do anything: requests to serve, steps in flight to collect,
        or news for (or from) the workers."""
        return bool(self._in_flight or self._requests.staged) or \
            self.scheduler.has_unfinished_requests() or self.scheduler.has_pending_worker_updates()

    # ------------------------------------------------------------------ one step

    def step(self) -> list[EngineCoreOutput]:
        """One step's outputs. An unexpected error anywhere in it kills the engine visibly:
        every request fails with the error, and every later call raises EngineDeadError."""
        self._check_alive()
        staged = self._requests.take_staged()
        try:
            return staged + self._step()
        except Exception as e:
            return staged + self._failed(e)

    def _step(self) -> list[EngineCoreOutput]:
        """Schedules and submits a step, then collects the oldest one in flight. Without async
        scheduling that is the step just submitted. With it, the step before: this one runs
        while its outputs are applied, detokenized and returned, and the first call only
        fills the pipeline."""
        submitted = self._submit_next()
        if not self._in_flight:
            return []
        if submitted and self.scheduler.async_scheduling and len(self._in_flight) == 1:
            return []
        return self._collect_oldest()

    def _submit_next(self) -> bool:
        out = self.scheduler.schedule()
        if not (out.num_scheduled_tokens or out.finished_req_ids or out.preempted_req_ids
                or out.tier_copies or out.copy_src):
            if self._in_flight or not self.scheduler.has_pending_worker_updates():
                return False
            # Only asynchronous tier copies to hear about: an empty step asks, without spinning.
            time.sleep(_POLL_S)
        self.executor.submit(out)
        self._in_flight.append((out, time.perf_counter()))
        return True

    def _collect_oldest(self) -> list[EngineCoreOutput]:
        out, submitted_at = self._in_flight[0]
        reply = self.executor.collect(out)
        self._in_flight.popleft()
        if isinstance(reply, WorkerError):  # the transport kept its worker (in-process)
            message = f"worker rank {reply.rank} failed step {out.step_id}: {reply.message}"
            if self._healer.may_restart():
                return self._heal(message)
            return self._fail_step(out, message)
        assert isinstance(reply, ModelRunnerOutput) and reply.step_id == out.step_id
        now = time.perf_counter()
        # Queued behind the step before, it started running when that one was collected.
        self.scheduler.observe_step(out, now - max(submitted_at, self._last_collect))
        self._last_collect = now
        book = self._requests
        if reply.prompt_logprobs:
            book.gather(out, reply.prompt_logprobs)
        if reply.pooled:
            book.gather_pooled(out.scheduled_req_ids(), reply.pooled)
        outputs = self.scheduler.update_from_output(out, reply)
        if book.labels or book.prompt_logprobs or book.pooled:
            book.after_outputs(outputs)
        return outputs

    def drain(self) -> list[EngineCoreOutput]:
        """Collects every step in flight, returning their outputs."""
        self._check_alive()
        outputs = []
        try:
            while self._in_flight:
                outputs += self._collect_oldest()
        except Exception as e:
            return outputs + self._failed(e)
        return outputs

    # ------------------------------------------------------------------ failures

    def _failed(self, error: Exception) -> list[EngineCoreOutput]:
        if isinstance(error, EngineDeadError):  # the workers are lost: heal, or die
            try:
                return self._heal(str(error))
            except Exception as e:
                error = e
        log.exception("engine step failed")
        return self._die(f"the engine failed in a step: {type(error).__name__}: {error}")

    def check_workers(self) -> list[EngineCoreOutput]:
        """Between steps: a worker known to be gone (it died while the engine was idle) is
        replaced now rather than when the next request finds it."""
        self._check_alive()
        try:
            self.executor.check_workers()
        except Exception as e:
            return self._failed(e)
        return []

    def _heal(self, reason: str) -> list[EngineCoreOutput]:
        """New workers replace the lost ones and every unfinished request is re-admitted,
        preempted: its stream goes on where it stopped (engine_heal.py has the budget)."""
        return self._healer.heal(reason, self._workers_lost, self._die)

    def _workers_lost(self, reason: str) -> list[EngineCoreOutput]:
        """Steps in flight are gone with the workers. A suspect of the last loss found in
        flight again fails alone (a poison pill)."""
        self._in_flight.clear()
        self._requests.restart_prompt_logprobs()
        outputs = self._requests.fail(
            self.scheduler.workers_lost(),
            lambda rid: f"request {rid!r} was in flight at two consecutive worker failures, "
                        f"so it is taken for their cause and fails alone (last: {reason})")
        for o in outputs:
            log.error("request %r (sample %d) was in flight at two consecutive worker "
                      "failures: failing it alone", o.req_id, o.index)
        return outputs

    def _fail_step(self, out: SchedulerOutput, message: str) -> list[EngineCoreOutput]:
        """A worker raised: the step's requests fail, the rest keep going."""
        self.scheduler.step_failed(out)
        outputs = self._requests.fail(out.scheduled_req_ids(), lambda rid: message)
        log.error("step %d failed, failing %d sequences: %s", out.step_id, len(outputs), message)
        return outputs

    def _die(self, message: str) -> list[EngineCoreOutput]:
        self._dead = message
        self._in_flight.clear()
        return self._requests.fail_all(message)

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    # ------------------------------------------------------------------ self-healing record

    @property
    def healing(self) -> bool:
        """True while the workers are being rebuilt (read by other threads)."""
        return self._healer.healing

    @property
    def restarts(self) -> int:
        return self._healer.restarts

    @property
    def restart_reason(self) -> str | None:
        return self._healer.restart_reason

    @property
    def restart_s(self) -> float:
        return self._healer.restart_s

    # ------------------------------------------------------------------ KV events

    def take_kv_events(self) -> KVEventBatch | None:
        """The next KV event batch: the tiers' changes since the last one, and the load now
        (None when this engine publishes no events)."""
        return self._reporter.take()

    def kv_snapshot(self) -> tuple[KVEventBatch, KVSnapshot]:
        """The batch of changes not yet taken, then every tier's hashes as of that batch;
        publish the batch first."""
        return self._reporter.snapshot()

    def load(self) -> ReplicaLoad:
        """O(unfinished requests, and the waiting ones' prompt blocks)."""
        return self._reporter.load()

    # ------------------------------------------------------------------ introspection

    def stats(self) -> dict:
        return engine_stats(self)

    def describe_requests(self) -> list[dict]:
        """Each unfinished request: id, status, prompt and output tokens, age in seconds."""
        return self._requests.describe()

    def info(self) -> dict:
        return engine_info(self)

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    # ------------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        """A clean shutdown first writes every cached block not yet on SSD to it (within
        FLUSH_DEADLINE_S), so that an engine started on the same SSD folder serves them."""
        self._healer.stop()  # workers lost now are not replaced
        try:
            if self._dead is None:
                self.drain()
            if self._dead is None:
                self._flush_tiers()
        except Exception:  # the workers are gone or failing: nothing more to save
            log.exception("could not write the KV cache to SSD at shutdown")
        finally:
            if self.request_log is not None:
                self.request_log.close()
            self.executor.shutdown()

    def _flush_tiers(self) -> None:
        msg = self.scheduler.flush_message(FLUSH_DEADLINE_S)
        if msg is None:
            return
        t0 = time.monotonic()
        reply = self.executor.execute(msg)
        written = reply.flushed_blocks if isinstance(reply, ModelRunnerOutput) else 0
        log.info("wrote %d of %d cached blocks to SSD in %.2f s", written,
                 sum(len(b) for b in msg.copies), time.monotonic() - t0)

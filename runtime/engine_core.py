"""EngineCore: owns every request; each step schedules, executes on the workers, updates.

It takes token ids and emits token ids: tokenizing, chat templates, detokenizing and stop
strings are the client's (runtime/processor.py), so nothing a client sends makes a step wait
on text work. The transport to the workers is injected: in-process for one device, Ray + ZMQ
in deployment (deploy/); the EngineCore code is the same.
"""
from __future__ import annotations

import logging
import os
import time
from collections import deque
from typing import Callable, Iterator

from tierserve.kvcache import KVEventRecorder
from tierserve.runtime.config import EngineConfig
from tierserve.runtime.engine_setup import (
    check_model, make_request_log, make_scheduler, make_worker_spec, start_tokenizer,
)
from tierserve.runtime.executor import EngineDeadError, Executor, InProcessExecutor, WorkerInfo
from tierserve.runtime.generation_config import generation_defaults
from tierserve.runtime.outputs import Outstanding
from tierserve.runtime.request_log import RequestLog
from tierserve.runtime.requests import check_request, rejection
from tierserve.runtime.tokenizer import load_model_tokenizer
from tierserve.scheduler import (
    EngineCoreOutput, EngineCoreRequest, FinishReason, ModelRunnerOutput,
    RequestStatus, SchedulerOutput, WorkerError,
)
from tierserve.scheduler.kv_events import (
    KV_EVENTS_VERSION, KVEventBatch, KVSnapshot, ReplicaLoad,
)
from tierserve.scheduler.params import ErrorKind
from tierserve.scheduler.request import seq_id
from tierserve.workers.worker import WorkerSpec

__all__ = ["EngineCore", "load_model_tokenizer", "EngineDeadError", "rejection"]

log = logging.getLogger("tierserve.engine")
progress = logging.getLogger("tierserve.progress")  # a start's steps, on the CLI's terminal

# A step that only asks the workers how far their asynchronous tier copies got waits this long
# first, so that waiting for an SSD load does not spin the engine.
_POLL_S = 0.002
# How long a clean shutdown may spend writing the KV cache to SSD.
FLUSH_DEADLINE_S = 30.0
# Worker failures within this window count against max_restarts.
RESTART_WINDOW_S = 600.0


class EngineCore:
    def __init__(self, config: EngineConfig,
                 executor_factory: Callable[[WorkerSpec], Executor] = InProcessExecutor) -> None:
        started = time.perf_counter()
        model = check_model(config)
        spec = make_worker_spec(config)
        self.generation_defaults = generation_defaults(config.generation_config, spec.model)
        self.tokenizer_path = config.tokenizer or spec.model
        spec, tokenizer = start_tokenizer(spec, self.tokenizer_path)
        self.executor = executor_factory(spec)
        # KV events (scheduler/kv_events.py): the hashes entering and leaving each tier.
        self.kv_events = KVEventRecorder() if config.publishes_kv_events else None
        self._event_epoch = int.from_bytes(os.urandom(8), "little") >> 1
        self._event_seq = -1
        self._requests_added = 0
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
        self.max_model_len = self.scheduler.max_model_len
        self.vocab_size = info.vocab_size
        self.backends = info.backends
        self.weight_bytes = info.weight_bytes
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        self.eos_token_id = eos if eos is not None else (
            info.eos_token_ids[0] if info.eos_token_ids else None)
        # The caller's label of each unfinished request that has one (list_requests shows it).
        self._labels: dict[str, str] = {}
        # Outputs of sequences finished between steps (stop_sequences), for the next step.
        self._staged: list[EngineCoreOutput] = []
        # Prompt logprobs of requests that asked for them and have no output yet, gathered
        # chunk by chunk; the first output carries them.
        self._prompt_logprobs: dict[str, list] = {}
        self._dead: str | None = None
        # Steps submitted and not yet collected, oldest first, with their submission times:
        # at most one between steps, two while a step is being scheduled (async scheduling).
        self._in_flight: deque[tuple[SchedulerOutput, float]] = deque()
        self._last_collect = 0.0
        # Self-healing: when each worker failure of the window was healed (monotonic), and
        # what the restarts did.
        self._failures: deque[float] = deque()
        self.restarts = 0
        # True while the workers are being rebuilt (read by other threads: a router routes
        # nothing to a healing replica).
        self.healing = False
        self.restart_reason: str | None = None
        self.restart_s = 0.0
        self._shutting_down = False

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

    # ------------------------------------------------------------------ requests

    def add_request(self, request: EngineCoreRequest) -> list[int]:
        """Queues a request; bad input raises ValueError and leaves the engine unchanged."""
        self._check_alive()
        self._requests_added += 1
        prompt_ids = check_request(request)
        params = request.sampling_params
        self.scheduler.add_request(request.req_id, prompt_ids, params,
                                   eos_token_id=self.eos_token_id, priority=request.priority,
                                   cache_salt=request.cache_salt)
        if request.label:
            self._labels[request.req_id] = request.label
        if params.prompt_logprobs is not None:
            self._prompt_logprobs[request.req_id] = []
        return prompt_ids

    def stream_batch(self, requests: list[EngineCoreRequest]) -> Iterator[list[EngineCoreOutput]]:
        """Adds the requests and steps until all have finished, yielding each step's outputs.
        A request that fails validation yields one error output; closing the iterator early
        aborts what is left."""
        added, failed = [], []
        pending = Outstanding(())
        try:
            for request in requests:
                try:
                    self.add_request(request)
                    added.append(request)
                except EngineDeadError:
                    raise
                except Exception as e:  # this request alone fails
                    failed.append(rejection(request, e))
                pending = Outstanding(added)
            if failed:
                yield failed
            while pending:
                outputs = self.step()
                pending.update(outputs)
                yield outputs
        finally:
            if pending and self._dead is None:
                self.abort_requests(list(pending))
            if self._in_flight and self._dead is None:
                self.drain()  # a finished request's step in flight

    def abort_requests(self, request_ids) -> list[EngineCoreOutput]:
        done = self.scheduler.abort_requests(request_ids)
        self._forget(done)
        return [EngineCoreOutput(rid, finish_reason=FinishReason.ABORT, index=index)
                for rid, index in done]

    def stop_sequences(self, seqs) -> None:
        """Finishes samples, given as (request id, sample index), that a client's stop string
        ended; their finishing outputs come out of the next step."""
        done = self.scheduler.finish_seqs([seq_id(rid, index) for rid, index in seqs],
                                          RequestStatus.FINISHED_STOPPED)
        self._forget(done)
        self._staged += [EngineCoreOutput(rid, finish_reason=FinishReason.STOP, index=index)
                         for rid, index in done]

    def request_ids(self, names) -> list[str]:
        """The unfinished requests named by engine id or label (an operator's view)."""
        names = set(names)
        return [rid for rid in dict.fromkeys(r.family_id for r in self.scheduler.requests.values())
                if rid in names or self._labels.get(rid) in names]

    def has_request(self, request_id: str) -> bool:
        """Whether some sample of the request has not finished."""
        sched = self.scheduler
        return request_id in sched.requests or request_id in sched.families

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_work(self) -> bool:
        """Whether a step would do anything: requests to serve, steps in flight to collect,
        or news for (or from) the workers."""
        return bool(self._in_flight or self._staged) or \
            self.scheduler.has_unfinished_requests() or self.scheduler.has_pending_worker_updates()

    # ------------------------------------------------------------------ one step

    def step(self) -> list[EngineCoreOutput]:
        """One step's outputs. An unexpected error anywhere in it kills the engine visibly:
        every request fails with the error, and every later call raises EngineDeadError."""
        self._check_alive()
        staged, self._staged = self._staged, []
        try:
            return staged + self._step()
        except Exception as e:
            return staged + self._failed(e)

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

    # ------------------------------------------------------------------ self-healing

    def _heal(self, reason: str) -> list[EngineCoreOutput]:
        """The workers are lost (a rank died, or a step hung). While max_restarts failures in
        RESTART_WINDOW_S are not spent, new workers replace them and every unfinished request
        is re-admitted, preempted: its stream goes on where it stopped. A suspect of the last
        loss found in flight again fails alone (a poison pill). Past the budget, or where the
        transport cannot restart, the engine dies."""
        self.healing = True
        try:
            return self._heal_loop(reason)
        finally:
            self.healing = False

    def _heal_loop(self, reason: str) -> list[EngineCoreOutput]:
        outputs = []
        while True:
            if not self._may_restart():
                return outputs + self._die(self._death_message(reason))
            self._failures.append(time.monotonic())
            self._in_flight.clear()
            # Prompt logprobs not yet delivered are computed again, from the first chunk.
            for partial in self._prompt_logprobs.values():
                partial.clear()
            outputs += self._fail_poisoned(self.scheduler.workers_lost(), reason)
            log.error("the workers are lost (%s); restarting them (%d of %d failures in %.0f "
                      "minutes)", reason, len(self._failures), self.config.max_restarts,
                      RESTART_WINDOW_S / 60)
            t0 = time.perf_counter()
            try:
                info = self.executor.restart()
            except Exception as e:  # another failure, from the budget
                log.exception("restarting the workers failed")
                reason = f"restarting the workers failed: {type(e).__name__}: {e}"
                continue
            assert info.num_blocks == self.scheduler.kv.pool.num_blocks
            self.restarts += 1
            self.restart_reason, self.restart_s = reason, time.perf_counter() - t0
            log.warning("the workers were restarted in %.2f s; %d requests re-admitted",
                        self.restart_s, len(self.scheduler.requests))
            return outputs

    def _may_restart(self) -> bool:
        if not self.executor.restartable or self.config.max_restarts == 0 \
                or self._shutting_down:
            return False
        now = time.monotonic()
        while self._failures and now - self._failures[0] > RESTART_WINDOW_S:
            self._failures.popleft()
        return len(self._failures) < self.config.max_restarts

    def _death_message(self, reason: str) -> str:
        if not self.executor.restartable or self.config.max_restarts == 0:
            return reason
        return (f"{reason} (worker failure {len(self._failures) + 1} within "
                f"{RESTART_WINDOW_S / 60:.0f} minutes; max_restarts={self.config.max_restarts})")

    def _fail_poisoned(self, seqs: list[str], reason: str) -> list[EngineCoreOutput]:
        done = self.scheduler.finish_seqs(seqs, RequestStatus.FINISHED_ERROR)
        self._forget(done)
        for rid, index in done:
            log.error("request %r (sample %d) was in flight at two consecutive worker "
                      "failures: failing it alone", rid, index)
        return [EngineCoreOutput(
                    rid, finish_reason=FinishReason.ERROR, index=index,
                    error_kind=ErrorKind.INTERNAL,
                    error=f"request {rid!r} was in flight at two consecutive worker failures, "
                          f"so it is taken for their cause and fails alone (last: {reason})")
                for rid, index in done]

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
            if self._may_restart():
                return self._heal(message)
            return self._fail_step(out, message)
        assert isinstance(reply, ModelRunnerOutput) and reply.step_id == out.step_id
        now = time.perf_counter()
        # Queued behind the step before, it started running when that one was collected.
        self.scheduler.observe_step(out, now - max(submitted_at, self._last_collect))
        self._last_collect = now
        if reply.prompt_logprobs:
            for rid, lps in zip(out.scheduled_req_ids(), reply.prompt_logprobs):
                if lps and rid in self._prompt_logprobs:  # not a recompute's, after the first
                    self._prompt_logprobs[rid].extend(lps)
        outputs = self.scheduler.update_from_output(out, reply)
        if self._labels or self._prompt_logprobs:
            self._after_outputs(outputs)
        return outputs

    def _after_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        """A request's first output carries its prompt logprobs; a finished request's label
        goes."""
        for o in outputs:
            lps = self._prompt_logprobs.pop(o.req_id, None)
            if lps is not None:
                o.prompt_logprobs = lps
            if o.finish_reason is not None and not self.has_request(o.req_id):
                self._labels.pop(o.req_id, None)

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


    def _fail_step(self, out: SchedulerOutput, message: str) -> list[EngineCoreOutput]:
        """A worker raised: the step's requests fail, the rest keep going."""
        self.scheduler.step_failed(out)
        done = self.scheduler.finish_seqs(out.scheduled_req_ids(), RequestStatus.FINISHED_ERROR)
        log.error("step %d failed, failing %d sequences: %s", out.step_id, len(done), message)
        self._forget(done)
        return [EngineCoreOutput(rid, finish_reason=FinishReason.ERROR, error=message,
                                 index=index, error_kind=ErrorKind.INTERNAL)
                for rid, index in done]

    def _die(self, message: str) -> list[EngineCoreOutput]:
        self._dead = message
        self._in_flight.clear()
        ids = sorted({r.family_id for r in self.scheduler.requests.values()})
        try:
            self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
        except Exception:  # the state that failed the step may be broken: fail them anyway
            log.exception("could not release the requests of a dead engine")
        self._forget((rid, 0) for rid in ids)
        self._staged.clear()
        # An error output finishes every sample of its request.
        return [EngineCoreOutput(rid, finish_reason=FinishReason.ERROR, error=message,
                                 error_kind=ErrorKind.ENGINE_DEAD) for rid in ids]

    def _forget(self, seqs) -> None:
        """Drops the state of requests whose last sequence finished (given as (request id,
        sample index))."""
        if self._labels or self._prompt_logprobs:
            for rid, _ in seqs:
                if not self.has_request(rid):
                    self._labels.pop(rid, None)
                    self._prompt_logprobs.pop(rid, None)

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    # ------------------------------------------------------------------ KV events

    def take_kv_events(self) -> KVEventBatch | None:
        """The next KV event batch: the tiers' changes since the last one, and the load now
        (None when this engine publishes no events)."""
        if self.kv_events is None:
            return None
        stored, removed = self.kv_events.take()
        self._event_seq += 1
        return KVEventBatch(KV_EVENTS_VERSION, self._event_epoch, self._event_seq, stored,
                            removed, self.load())

    def kv_snapshot(self) -> tuple[KVEventBatch, KVSnapshot]:
        """The batch of changes not yet taken, then every tier's hashes as of that batch;
        publish the batch first."""
        if self.kv_events is None:
            raise RuntimeError("this engine publishes no KV events (kv_events is off)")
        batch = self.take_kv_events()
        cpu, ssd = self.scheduler.tiers.index.held_hashes()
        tiers = [self.scheduler.kv.pool.cached_hashes(), cpu, ssd]
        return batch, KVSnapshot(KV_EVENTS_VERSION, self._event_epoch, batch.seq, tiers,
                                 batch.load)

    def load(self) -> ReplicaLoad:
        """O(unfinished requests, and the waiting ones' prompt blocks)."""
        sched = self.scheduler
        queued = sched.queued_prefill_tokens()
        costs = sched.tiers.costs
        cpu_block_s = costs.block_bytes / costs.copy_bytes_per_s if costs.copy_bytes_per_s \
            and sched.tiers.enabled else 0.0
        pool = sched.kv.pool
        return ReplicaLoad(len(sched.running), len(sched.waiting) + sched.tiers.num_loading,
                           queued, pool.num_free_blocks, pool.num_usable_blocks,
                           self._requests_added, costs.prefill_tokens_per_s, cpu_block_s)

    # ------------------------------------------------------------------ introspection

    def stats(self) -> dict:
        stats = self.scheduler.stats()
        stats["max_model_len"] = self.max_model_len
        stats["block_size"] = self.config.block_size
        stats["weight_bytes"] = self.weight_bytes
        if self.backends:
            stats["cpu_backend"] = self.backends[0]["name"]
            stats["backend"] = dict(self.backends[0])
        stats.update(restarts=self.restarts, restart_reason=self.restart_reason,
                     restart_s=round(self.restart_s, 3),
                     worker_start_s=round(self.worker_start_s, 3),
                     worker_phases=dict(self.executor.phases))
        stats.update(self.executor.stats())
        return stats

    def describe_requests(self) -> list[dict]:
        """Each unfinished request: id, status, prompt and output tokens, age in seconds."""
        now = time.monotonic()
        return [{"request_id": self._labels.get(r.family_id, r.family_id),
                 "engine_id": r.family_id, "index": r.index, "status": r.status.name.lower(),
                 "prompt_tokens": r.num_prompt_tokens, "output_tokens": r.num_output_tokens,
                 "age_s": round(now - r.arrival_time, 3)}
                for r in sorted(self.scheduler.requests.values(), key=lambda r: r.arrival_time)]

    def info(self) -> dict:
        return {"model": self.config.model, "max_model_len": self.max_model_len,
                "max_queued_requests": self.config.max_queued_requests,
                "vocab_size": self.vocab_size, "tokenizer_path": self.tokenizer_path,
                "tensor_parallel_size": self.config.tensor_parallel_size,
                "step_timeout_s": self.config.step_timeout_s,
                "block_size": self.config.block_size,
                "hash": {"algorithm": self.config.prefix_caching_hash_algo,
                         "seed": self.config.hash_seed,
                         "enabled": self.config.enable_prefix_caching},
                "backends": [dict(b) for b in self.backends],
                "generation_defaults": dict(self.generation_defaults),
                "startup_s": {k: round(v, 3) for k, v in self.startup.items()}}

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        """A clean shutdown first writes every cached block not yet on SSD to it (within
        FLUSH_DEADLINE_S), so that an engine started on the same SSD folder serves them."""
        self._shutting_down = True  # workers lost now are not replaced
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

"""EngineCore: owns every request; each step schedules, executes on the workers, updates.

It takes token ids and emits token ids: tokenizing, chat templates, detokenizing and stop
strings are the client's (runtime/processor.py), so nothing a client sends makes a step wait
on text work. The transport to the workers is injected: in-process for one device, Ray + ZMQ
in deployment (deploy/); the EngineCore code is the same.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import threading
import time
from collections import deque
from typing import Callable, Iterator

from tierserve.kvcache import BlockHasher, KVCacheManager, KVEventRecorder, TierIndex, TierPolicy
from tierserve.runtime import envs
from tierserve.runtime.config import EngineConfig
from tierserve.runtime.executor import EngineDeadError, Executor, InProcessExecutor, WorkerInfo
from tierserve.runtime.generation_config import generation_defaults
from tierserve.runtime.outputs import Outstanding
from tierserve.runtime.request_log import LOG_VERSION, MAGIC, LogHeader, RequestLog
from tierserve.runtime.requests import check_request, rejection
from tierserve.runtime.tokenizer import load_model_tokenizer, tokenizer_json_file
from tierserve.scheduler import (
    EngineCoreOutput, EngineCoreRequest, FinishReason, ModelRunnerOutput,
    RequestStatus, SamplingParams, Scheduler, SchedulerOutput, WorkerError,
)
from tierserve.scheduler.kv_events import (
    KV_EVENTS_VERSION, KVEventBatch, KVSnapshot, ReplicaLoad,
)
from tierserve.scheduler.params import ErrorKind
from tierserve.scheduler.request import seq_id
from tierserve.workers.kv_fingerprint import kv_fingerprint
from tierserve.workers.model.config import ModelConfig
from tierserve.workers.model.layers import partition_heads
from tierserve.workers.model.loader import default_model_path, load_model_config
from tierserve.workers.tier_ssd import SsdFolder
from tierserve.workers.worker import WorkerSpec, resolve_device

__all__ = ["EngineCore", "make_worker_spec", "load_model_tokenizer", "EngineDeadError",
           "rejection", "check_model"]

log = logging.getLogger("tierserve.engine")
progress = logging.getLogger("tierserve.progress")  # a start's steps, on the CLI's terminal

# Longest context a default config admits, whatever the model's positions allow.
_DEFAULT_MAX_MODEL_LEN = 8192
# A step that only asks the workers how far their asynchronous tier copies got waits this long
# first, so that waiting for an SSD load does not spin the engine.
_POLL_S = 0.002
# How long a clean shutdown may spend writing the KV cache to SSD.
FLUSH_DEADLINE_S = 30.0
# Worker failures within this window count against max_restarts.
RESTART_WINDOW_S = 600.0


def make_worker_spec(config: EngineConfig) -> WorkerSpec:
    device = resolve_device(config.device)
    dtype = config.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    model = config.model or default_model_path()
    return WorkerSpec(
        model=model, dtype=dtype, device=device,
        block_size=config.block_size, tensor_parallel_size=config.tensor_parallel_size,
        max_num_batched_tokens=config.max_num_batched_tokens, seed=config.seed,
        kv_cache_memory_bytes=config.kv_cache_memory_bytes,
        gpu_memory_utilization=config.gpu_memory_utilization,
        num_kv_blocks=config.num_kv_blocks,
        cpu_threads=None if config.cpus_per_worker is None else math.ceil(config.cpus_per_worker),
        collective_timeout_s=config.step_timeout_s, cpu_kernels=envs.cpu_kernels(),
        cpu_isa=config.cpu_isa if config.cpu_isa is not None else envs.cpu_isa(),
        cache_dir=envs.cache_dir(), quantized_linears=config.quantized_linears,
        quantization=config.quantization,
        debug_stall=envs.debug_stall(), debug_crash=envs.debug_crash(),
        debug_late_copies=envs.debug_late_copies(),
        kv_offload_cpu_bytes=config.kv_offload_cpu_bytes,
        kv_offload_ssd_path=config.kv_offload_ssd_path,
        kv_offload_ssd_bytes=config.kv_offload_ssd_bytes,
        kv_fingerprint=_kv_fingerprint(config, model, dtype),
        # The input batch's first capacity (None: the model's length is not known yet; it grows).
        max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
        async_scheduling=config.pipelined)


def _kv_fingerprint(config: EngineConfig, model: str, dtype: str) -> str:
    """The KV fingerprint naming SSD entries ("" without an SSD tier: nothing is hashed)."""
    if not config.kv_offload_ssd_path or not config.kv_offload_cpu_bytes:
        return ""
    t0 = time.perf_counter()
    fp = kv_fingerprint(model, load_model_config(model), dtype=dtype,
                        block_size=config.block_size, cache_dir=envs.cache_dir(),
                        hash_id=f"{config.prefix_caching_hash_algo}:{config.hash_seed}",
                        quantization=config.quantization)
    log.info("KV fingerprint %s in %.3f s", fp[:16], time.perf_counter() - t0)
    return fp


def check_model(config: EngineConfig) -> ModelConfig:
    """The model's config, read before anything starts; a model path that does not exist or
    does not parse, a TP size its heads cannot split over, or a max_model_len beyond its
    positions is a ValueError naming the option."""
    path = config.model or default_model_path()
    if not os.path.exists(path):
        raise ValueError(f"model: {path!r} does not exist")
    try:
        model = load_model_config(path)
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"model: cannot read the model config of {path!r}: "
                         f"{type(e).__name__}: {e}") from e
    except ValueError as e:
        raise ValueError(f"model: {e}") from e
    try:
        partition_heads(model.num_attention_heads, model.num_key_value_heads,
                        config.tensor_parallel_size)
    except ValueError as e:
        raise ValueError(f"tensor_parallel_size: {e}") from None
    if config.max_model_len is not None and not config.allow_long_max_model_len \
            and config.max_model_len > model.max_position_embeddings:
        raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the model's "
                         f"max_position_embeddings ({model.max_position_embeddings}); set "
                         f"allow_long_max_model_len=True to force it")
    generation_defaults(config.generation_config, path)
    return model


def _pool_too_small(config: EngineConfig, info: WorkerInfo, usable_tokens: int) -> str:
    """The error of a max_model_len the KV pool cannot hold, naming settings that fit."""
    blocks = -(-config.max_model_len // config.block_size) + 1
    while True:  # usable blocks (less the null block) beside the admission watermark
        probe = KVCacheManager(blocks, config.block_size, False)
        if (probe.pool.num_usable_blocks - probe.watermark_blocks) * config.block_size \
                >= config.max_model_len:
            break
        blocks += 1
    fix = f"num_kv_blocks={blocks}" if config.num_kv_blocks is not None else \
        f"kv_cache_memory_bytes={blocks * info.kv_block_bytes}"
    return (f"max_model_len {config.max_model_len} does not fit the KV pool ({usable_tokens} "
            f"tokens in {info.num_blocks} blocks); set {fix}, or max_model_len="
            f"{usable_tokens}" if usable_tokens > 0 else
            f"max_model_len {config.max_model_len} does not fit the KV pool ({info.num_blocks} "
            f"blocks); set {fix}")


class _Background:
    """fn(*args) on a thread of its own; result() waits for it and re-raises its error."""

    def __init__(self, fn: Callable, *args) -> None:
        self.seconds = 0.0
        self._result = self._error = None
        self._thread = threading.Thread(target=self._run, args=(fn, args), daemon=True,
                                        name="tierserve-start")
        self._thread.start()

    def _run(self, fn: Callable, args: tuple) -> None:
        t0 = time.perf_counter()
        try:
            self._result = fn(*args)
        except BaseException as e:  # handed to the caller of result()
            self._error = e
        self.seconds = time.perf_counter() - t0

    def wait(self) -> None:
        self._thread.join()

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


class EngineCore:
    def __init__(self, config: EngineConfig,
                 executor_factory: Callable[[WorkerSpec], Executor] = InProcessExecutor) -> None:
        started = time.perf_counter()
        model = check_model(config)
        spec = make_worker_spec(config)
        self.generation_defaults = generation_defaults(config.generation_config, spec.model)
        self.tokenizer_path = config.tokenizer or spec.model
        # The workers read the tokenizer.json a structured-output grammar compiles from. Where
        # it exists (a folder's, or a GGUF's cached conversion), the tokenizer (and
        # transformers, which it imports) loads while the workers load their weights: Python
        # work beside work that runs in torch, mostly without the GIL.
        tokenizer_file = tokenizer_json_file(self.tokenizer_path, envs.cache_dir())
        tokenizer = _Background(load_model_tokenizer, self.tokenizer_path)
        if tokenizer_file is None:  # converted (and cached) first: a GGUF's first start
            tokenizer.wait()
            tokenizer_file = tokenizer_json_file(self.tokenizer_path, envs.cache_dir())
        spec = dataclasses.replace(spec, tokenizer_file=tokenizer_file)
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
            self.scheduler = self._make_scheduler(config, info, model, spec, self.kv_events)
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

    @staticmethod
    def _make_tiers(config: EngineConfig, info: WorkerInfo, model: ModelConfig,
                    spec: WorkerSpec) -> TierPolicy:
        """The tier policy over the CPU slots the ranks allocated and the SSD folder; a tier
        layer of capacity 0 where the engine has no tiers."""
        mode, bs = config.preemption_mode, config.block_size
        if not info.cpu_slots or not config.enable_prefix_caching:
            return TierPolicy(block_size=bs, preemption_mode=mode)
        ssd_blocks, probe = 0, None
        if config.kv_offload_ssd_path:
            folder = SsdFolder(config.kv_offload_ssd_path, spec.kv_fingerprint,
                               model.num_key_value_heads, config.kv_offload_ssd_bytes)
            ranges = sorted(set(info.kv_head_ranges))
            # One block in the folder: every distinct head range's entry.
            ssd_blocks = config.kv_offload_ssd_bytes // (info.kv_block_bytes * len(ranges))
            probe = lambda block_hash: folder.has_block(block_hash, ranges)  # noqa: E731
        index = TierIndex(info.cpu_slots, ssd_blocks, ssd_probe=probe,
                          verify_hits=config.verify_prefix_hits)
        policy = TierPolicy(index, block_size=bs, preemption_mode=mode,
                            block_bytes=info.kv_block_bytes)
        policy.costs.copy_bytes_per_s = info.copy_bytes_per_s
        return policy

    @classmethod
    def _make_scheduler(cls, config: EngineConfig, info: WorkerInfo, model: ModelConfig,
                        spec: WorkerSpec, events: KVEventRecorder | None = None) -> Scheduler:
        kv = KVCacheManager(info.num_blocks, config.block_size, config.enable_prefix_caching,
                            config.verify_prefix_hits,
                            tiers=cls._make_tiers(config, info, model, spec), events=events)
        usable_tokens = (kv.pool.num_usable_blocks - kv.watermark_blocks) * config.block_size
        if config.max_model_len is not None and config.max_model_len > usable_tokens:
            raise ValueError(_pool_too_small(config, info, usable_tokens))
        max_model_len = config.max_model_len or min(
            info.max_position_embeddings, _DEFAULT_MAX_MODEL_LEN, usable_tokens)
        hasher = BlockHasher(config.block_size, config.prefix_caching_hash_algo, config.hash_seed)
        scheduler = Scheduler(kv, hasher, max_num_seqs=config.max_num_seqs,
                              max_num_batched_tokens=config.max_num_batched_tokens,
                              max_model_len=max_model_len,
                              long_prefill_token_threshold=config.long_prefill_token_threshold,
                              policy=config.scheduling_policy, vocab_size=info.vocab_size,
                              max_queued_requests=config.max_queued_requests,
                              async_scheduling=config.pipelined,
                              speculative_config=config.speculative_config,
                              step_time_target_s=config.step_time_target_ms / 1e3)
        return scheduler

    def _make_request_log(self, config: EngineConfig, spec: WorkerSpec,
                          info: WorkerInfo) -> RequestLog | None:
        """The request log, where configured: every finished sequence goes to it."""
        if config.request_log_path is None:
            return None
        index = self.scheduler.tiers.index
        header = LogHeader(
            MAGIC, LOG_VERSION, config.block_size, hash_algo=config.prefix_caching_hash_algo,
            hash_seed=config.hash_seed, model=spec.model, dtype=spec.dtype,
            tensor_parallel_size=config.tensor_parallel_size,
            kv_block_bytes=info.kv_block_bytes, num_blocks=info.num_blocks,
            cpu_slots=index.cpu.num_slots, ssd_entries=index.ssd.capacity,
            kv_head_ranges=len(set(info.kv_head_ranges)) or 1,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            copy_bytes_per_s=info.copy_bytes_per_s)
        try:
            request_log = RequestLog(config.request_log_path, header,
                                     with_tokens=config.request_log_tokens,
                                     max_bytes=config.request_log_max_bytes,
                                     keep=config.request_log_keep)
        except BaseException:
            self.executor.shutdown()
            raise
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
        """O(unfinished requests): prompt tokens not computed yet, by request."""
        sched = self.scheduler
        queued = sum(r.num_tokens for r in sched.waiting)
        for r in sched.running:
            left = r.num_tokens - r.num_computed_tokens - 1  # a decode's last token aside
            if left > 0:
                queued += left
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

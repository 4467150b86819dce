"""EngineCore: owns every request; each step schedules, executes on the workers, updates.

It also tokenizes prompts and detokenizes outputs (stop strings end a request here, at once,
without a round trip to a client). The transport to the workers is injected: in-process for
one device, Ray + ZMQ in deployment (deploy/); the EngineCore code is the same.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections import deque
from typing import Callable, Iterator

from tierserve.kvcache import BlockHash, BlockHasher, KVCacheManager, SlotState, TierManager
from tierserve.runtime import envs
from tierserve.runtime.config import EngineConfig
from tierserve.runtime.detokenizer import IncrementalDetokenizer
from tierserve.runtime.executor import EngineDeadError, Executor, InProcessExecutor, WorkerInfo
from tierserve.runtime.outputs import Outstanding
from tierserve.runtime.requests import check_request, token_ids
from tierserve.runtime.tokenizer import Tokenizer, load_tokenizer, tokenizer_json_file
from tierserve.scheduler import (
    EngineCoreOutput, FlushTiers, EngineCoreRequest, FinishReason, ModelRunnerOutput,
    RequestStatus, SamplingParams, Scheduler, SchedulerOutput, WorkerError,
)
from tierserve.scheduler.params import ErrorKind, QueueFullError
from tierserve.scheduler.request import seq_id
from tierserve.workers.model.layers import partition_heads
from tierserve.workers.model.loader import default_model_path, load_model_config
from tierserve.workers.model.config import ModelConfig
from tierserve.workers.worker import WorkerSpec, resolve_device

__all__ = ["EngineCore", "make_worker_spec", "load_model_tokenizer", "EngineDeadError",
           "rejection", "check_model"]

log = logging.getLogger("tierserve.engine")

# Longest context a default config admits, whatever the model's positions allow.
_DEFAULT_MAX_MODEL_LEN = 8192
# A step that only asks the workers how far their asynchronous tier copies got waits this long
# first, so that waiting for an SSD load does not spin the engine.
_POLL_S = 0.002
# How long a clean shutdown may spend writing the KV cache to SSD.
FLUSH_DEADLINE_S = 30.0
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def make_worker_spec(config: EngineConfig) -> WorkerSpec:
    device = resolve_device(config.device)
    dtype = config.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    return WorkerSpec(
        model=config.model or default_model_path(), dtype=dtype, device=device,
        block_size=config.block_size, tensor_parallel_size=config.tensor_parallel_size,
        max_num_batched_tokens=config.max_num_batched_tokens, seed=config.seed,
        kv_cache_memory_bytes=config.kv_cache_memory_bytes,
        gpu_memory_utilization=config.gpu_memory_utilization,
        num_kv_blocks=config.num_kv_blocks, cpu_threads=config.cpus_per_worker,
        collective_timeout_s=config.step_timeout_s, cpu_kernels=envs.cpu_kernels(),
        cpu_isa=config.cpu_isa if config.cpu_isa is not None else envs.cpu_isa(),
        cache_dir=envs.cache_dir(), quantized_linears=config.quantized_linears,
        quantization=config.quantization,
        debug_stall=envs.debug_stall(),
        kv_offload_cpu_bytes=config.kv_offload_cpu_bytes,
        kv_offload_ssd_path=config.kv_offload_ssd_path,
        kv_offload_ssd_bytes=config.kv_offload_ssd_bytes,
        hash_id=f"{config.prefix_caching_hash_algo}:{config.hash_seed}",
        # The input batch's first capacity (None: the model's length is not known yet; it grows).
        max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
        async_scheduling=config.pipelined)


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
    return model


def load_model_tokenizer(path: str) -> Tokenizer | None:
    """None for a checkpoint folder that ships no tokenizer (prompts must be token ids)."""
    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f))
                                       for f in _TOKENIZER_FILES):
        log.warning("%s has no tokenizer files: prompts must be token ids", path)
        return None
    return load_tokenizer(path, cache_dir=envs.cache_dir())


def rejection(request: EngineCoreRequest, error: Exception) -> EngineCoreOutput:
    """The one output of a request that could not be added: bad input says what was wrong;
    anything else is logged as the engine's bug, and still fails this request alone."""
    kind = (ErrorKind.OVERLOADED if isinstance(error, QueueFullError) else
            ErrorKind.ENGINE_DEAD if isinstance(error, EngineDeadError) else
            ErrorKind.BAD_REQUEST if isinstance(error, ValueError) else ErrorKind.INTERNAL)
    if kind == ErrorKind.INTERNAL:
        log.error("request %r could not be added", request.req_id, exc_info=error)
    message = str(error) if kind != ErrorKind.INTERNAL else (
        f"internal error adding the request: {type(error).__name__}: {error}")
    return EngineCoreOutput(str(request.req_id), finish_reason=FinishReason.ERROR, error=message,
                            error_kind=kind)


class EngineCore:
    def __init__(self, config: EngineConfig,
                 executor_factory: Callable[[WorkerSpec], Executor] = InProcessExecutor) -> None:
        check_model(config)
        spec = make_worker_spec(config)
        self.tokenizer_path = config.tokenizer or spec.model
        self.tokenizer = load_model_tokenizer(self.tokenizer_path)
        if self.tokenizer is not None:
            spec = dataclasses.replace(spec, tokenizer_file=tokenizer_json_file(
                self.tokenizer_path, envs.cache_dir()))
        self.executor = executor_factory(spec)
        try:
            info = self.executor.start()
        except BaseException:
            self.executor.shutdown()  # a failed start leaves no worker, folder or socket
            raise
        self.config = config
        self.scheduler = self._make_scheduler(config, info)
        self.max_model_len = self.scheduler.max_model_len
        self.vocab_size = info.vocab_size
        tiering = self.scheduler.tiering
        self.ssd_restored = 0 if tiering is None or tiering.tiers.ssd is None else \
            len(tiering.tiers.ssd.coldest_ids())
        self.backends = info.backends
        self.weight_bytes = info.weight_bytes
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        self.eos_token_id = eos if eos is not None else (
            info.eos_token_ids[0] if info.eos_token_ids else None)
        self._detok: dict[str, IncrementalDetokenizer] = {}
        # Prompt ids of requests that have produced no output yet (the first output carries them).
        self._unannounced: dict[str, list[int]] = {}
        self._dead: str | None = None
        # Steps submitted and not yet collected, oldest first, with their submission times:
        # at most one between steps, two while a step is being scheduled (async scheduling).
        self._in_flight: deque[tuple[SchedulerOutput, float]] = deque()
        self._last_collect = 0.0

    @staticmethod
    def _make_tiers(config: EngineConfig, info: WorkerInfo) -> TierManager | None:
        """The CPU and SSD tiers the ranks allocated, with the SSD blocks an earlier engine left
        (every rank's entry holding the same block)."""
        if not info.cpu_slots or not config.enable_prefix_caching:
            return None
        tiers = TierManager(info.cpu_slots, info.ssd_entries, block_bytes=info.kv_block_bytes,
                            verify_hits=config.verify_prefix_hits)
        if tiers.ssd is not None:
            for entry, block_hash, key in info.ssd_found:
                tiers.ssd.restore(entry, BlockHash(block_hash), key or None)
        return tiers

    @classmethod
    def _make_scheduler(cls, config: EngineConfig, info: WorkerInfo) -> Scheduler:
        kv = KVCacheManager(info.num_blocks, config.block_size, config.enable_prefix_caching,
                            config.verify_prefix_hits, tiers=cls._make_tiers(config, info))
        usable_tokens = (kv.pool.num_usable_blocks - kv.watermark_blocks) * config.block_size
        max_model_len = config.max_model_len or min(
            info.max_position_embeddings, _DEFAULT_MAX_MODEL_LEN, usable_tokens)
        hasher = BlockHasher(config.block_size, config.prefix_caching_hash_algo, config.hash_seed)
        scheduler = Scheduler(kv, hasher, max_num_seqs=config.max_num_seqs,
                              max_num_batched_tokens=config.max_num_batched_tokens,
                              max_model_len=max_model_len,
                              long_prefill_token_threshold=config.long_prefill_token_threshold,
                              policy=config.scheduling_policy, vocab_size=info.vocab_size,
                              preemption_mode=config.preemption_mode,
                              max_queued_requests=config.max_queued_requests,
                              async_scheduling=config.pipelined,
                              speculative_config=config.speculative_config)
        if scheduler.tiering is not None:
            costs = scheduler.tiering.costs
            costs.block_bytes, costs.copy_bytes_per_s = info.kv_block_bytes, info.copy_bytes_per_s
        return scheduler

    # ------------------------------------------------------------------ requests

    def tokenize(self, request: EngineCoreRequest) -> list[int]:
        """The prompt's token ids; a request check_request passed. A tokenizer or template
        that fails on it is a ValueError for this request."""
        if request.prompt_token_ids is not None:
            return token_ids(request.prompt_token_ids)
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompt token ids")
        try:
            if request.messages is not None:
                return self.tokenizer.apply_chat_template(request.messages)
            return self.tokenizer.encode(request.prompt)
        except ValueError:
            raise
        except Exception as e:
            raise ValueError(f"cannot tokenize the prompt: {type(e).__name__}: {e}") from e

    def add_request(self, request: EngineCoreRequest) -> list[int]:
        """Queues a request; bad input raises ValueError and leaves the engine unchanged."""
        self._check_alive()
        check_request(request)
        params = request.sampling_params
        prompt_ids = self.tokenize(request)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; use stop_token_ids")
        rid = request.req_id
        # Everything that can fail comes before the scheduler takes the request.
        detoks = [] if self.tokenizer is None else [
            IncrementalDetokenizer(self.tokenizer, prompt_ids, stop=params.stop,
                                   include_stop=params.include_stop_str_in_output)
            for _ in range(params.n)]
        self.scheduler.add_request(rid, prompt_ids, params, eos_token_id=self.eos_token_id,
                                   priority=request.priority, cache_salt=request.cache_salt)
        for index, detok in enumerate(detoks):
            self._detok[seq_id(rid, index)] = detok
        self._unannounced[rid] = prompt_ids
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

    def has_request(self, request_id: str) -> bool:
        """Whether some sample of the request has not finished."""
        sched = self.scheduler
        return request_id in sched.requests or request_id in sched.families

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_work(self) -> bool:
        """Whether a step would do anything: requests to serve, steps in flight to collect,
        or news for (or from) the workers."""
        return bool(self._in_flight) or self.scheduler.has_unfinished_requests() or \
            self.scheduler.has_pending_worker_updates()

    # ------------------------------------------------------------------ one step

    def step(self) -> list[EngineCoreOutput]:
        """One step's outputs. An unexpected error anywhere in it kills the engine visibly:
        every request fails with the error, and every later call raises EngineDeadError."""
        self._check_alive()
        try:
            return self._step()
        except Exception as e:
            return self._failed(e)

    def _failed(self, error: Exception) -> list[EngineCoreOutput]:
        if isinstance(error, EngineDeadError):
            return self._die(str(error))
        log.exception("engine step failed")
        return self._die(f"the engine failed in a step: {type(error).__name__}: {error}")

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
                or out.tier_ops or out.copy_src):
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
        if isinstance(reply, WorkerError):
            return self._fail_step(out, f"worker rank {reply.rank}: {reply.message}")
        assert isinstance(reply, ModelRunnerOutput) and reply.step_id == out.step_id
        now = time.perf_counter()
        # Queued behind the step before, it started running when that one was collected.
        self._observe(out, now - max(submitted_at, self._last_collect))
        self._last_collect = now
        outputs = self.scheduler.update_from_output(out, reply)
        if self._detok:
            self._detokenize(outputs)
        if self._unannounced:
            self._announce(outputs)
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

    def _observe(self, out: SchedulerOutput, seconds: float) -> None:
        """Prefill throughput, for the swap-vs-recompute choice (an average over steps)."""
        tiering = self.scheduler.tiering
        if tiering is None or seconds <= 0 or max(out.num_scheduled_tokens, default=1) <= 1:
            return
        rate = sum(out.num_scheduled_tokens) / seconds
        costs = tiering.costs
        costs.prefill_tokens_per_s = rate if not costs.prefill_tokens_per_s else (
            0.8 * costs.prefill_tokens_per_s + 0.2 * rate)

    def _announce(self, outputs: list[EngineCoreOutput]) -> None:
        for o in outputs:
            prompt_ids = self._unannounced.pop(o.req_id, None)
            if prompt_ids is not None:
                o.prompt_token_ids = prompt_ids

    def _detokenize(self, outputs: list[EngineCoreOutput]) -> None:
        stopped = []
        for o in outputs:
            sid = seq_id(o.req_id, o.index)
            detok = self._detok.get(sid)
            if detok is None:
                continue
            text, hit_stop = detok.update(o.new_token_ids)
            if hit_stop and o.finish_reason is None:
                stopped.append(sid)
                o.finish_reason = FinishReason.STOP
            elif o.finish_reason is not None and not hit_stop:
                text += detok.finish()
            o.new_text = text
            if o.finish_reason is not None:
                del self._detok[sid]
        if stopped:
            self.scheduler.finish_seqs(stopped, RequestStatus.FINISHED_STOPPED)

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
        self._detok.clear()
        # An error output finishes every sample of its request.
        return [EngineCoreOutput(rid, finish_reason=FinishReason.ERROR, error=message,
                                 error_kind=ErrorKind.ENGINE_DEAD) for rid in ids]

    def _forget(self, seqs) -> None:
        """Drops the state of finished sequences, given as (request id, sample index)."""
        for rid, index in seqs:
            self._detok.pop(seq_id(rid, index), None)
            self._unannounced.pop(rid, None)

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    # ------------------------------------------------------------------ introspection

    def stats(self) -> dict:
        stats = self.scheduler.stats()
        stats["max_model_len"] = self.max_model_len
        stats["block_size"] = self.config.block_size
        stats["weight_bytes"] = self.weight_bytes
        if self.backends:
            stats["cpu_backend"] = self.backends[0]["name"]
            stats["backend"] = dict(self.backends[0])
        if self.scheduler.tiering is not None and self.scheduler.tiering.tiers.ssd is not None:
            stats["ssd_restored_blocks"] = self.ssd_restored
        stats.update(self.executor.stats())
        return stats

    def describe_requests(self) -> list[dict]:
        """Each unfinished request: id, status, prompt and output tokens, age in seconds."""
        now = time.monotonic()
        return [{"request_id": r.family_id, "index": r.index, "status": r.status.name.lower(),
                 "prompt_tokens": r.num_prompt_tokens, "output_tokens": r.num_output_tokens,
                 "age_s": round(now - r.arrival_time, 3)}
                for r in sorted(self.scheduler.requests.values(), key=lambda r: r.arrival_time)]

    def info(self) -> dict:
        return {"model": self.config.model, "max_model_len": self.max_model_len,
                "max_queued_requests": self.config.max_queued_requests,
                "vocab_size": self.vocab_size, "tokenizer_path": self.tokenizer_path,
                "tensor_parallel_size": self.config.tensor_parallel_size,
                "backends": [dict(b) for b in self.backends]}

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        """A clean shutdown first writes every cached block not yet on SSD to it (within
        FLUSH_DEADLINE_S), so that an engine started on the same SSD folder serves them."""
        try:
            if self._dead is None:
                self.drain()
            if self._dead is None:
                self._flush_tiers()
        except Exception:  # the workers are gone or failing: nothing more to save
            log.exception("could not write the KV cache to SSD at shutdown")
        finally:
            self.executor.shutdown()

    def _flush_tiers(self) -> None:
        tiering = self.scheduler.tiering
        if tiering is None or tiering.tiers.ssd is None:
            return
        tiers, pool = tiering.tiers, self.scheduler.kv.pool
        msg, entries = FlushTiers(step_id=self.scheduler.next_step_id(),
                                  deadline_s=FLUSH_DEADLINE_S), []
        sources = [(b.block_id, b.block_hash, b.hash_key, False)
                   for b in pool.iter_cached_blocks()]
        sources += [(s.slot, s.block_hash, s.hash_key, True) for s in tiers.cpu.cached_slots()
                    if not s.clean]
        for source, block_hash, key, from_cpu in sources:
            if tiers.ssd.contains(block_hash):
                continue
            entry, _ = tiers.ssd.allocate(block_hash, key)
            if entry is None:
                break
            entries.append(entry)
            ids, ents, hashes, keys = (
                (msg.cpu_slots, msg.cpu_entries, msg.cpu_hashes, msg.cpu_keys) if from_cpu else
                (msg.device_blocks, msg.device_entries, msg.device_hashes, msg.device_keys))
            ids.append(source)
            ents.append(entry.slot)
            hashes.append(block_hash)
            keys.append(key or b"")
        if not entries:
            return
        t0 = time.monotonic()
        reply = self.executor.execute(msg)
        written = set(reply.flushed_entries) if isinstance(reply, ModelRunnerOutput) else set()
        for entry in entries:
            if entry.slot in written:
                tiers.ssd.commit(entry)
            else:
                entry.state = SlotState.READY
                tiers.ssd.release(entry)
        log.info("wrote %d of %d cached blocks to SSD in %.2f s", len(written), len(entries),
                 time.monotonic() - t0)


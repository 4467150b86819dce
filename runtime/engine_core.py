"""EngineCore: owns every request; each step schedules, executes on the workers, updates.

It also tokenizes prompts and detokenizes outputs (stop strings end a request here, at once,
without a round trip to a client). The transport to the workers is injected: in-process for
one device, Ray + ZMQ in deployment (deploy/); the EngineCore code is the same.
"""
from __future__ import annotations

import logging
import os
from typing import Callable, Iterator

from tierserve.kvcache import BlockHasher, KVCacheManager
from tierserve.runtime import envs
from tierserve.runtime.config import EngineConfig
from tierserve.runtime.detokenizer import IncrementalDetokenizer
from tierserve.runtime.executor import EngineDeadError, Executor, InProcessExecutor, WorkerInfo
from tierserve.runtime.tokenizer import Tokenizer, load_tokenizer
from tierserve.scheduler import (
    EngineCoreOutput, EngineCoreRequest, FinishReason, ModelRunnerOutput, RequestStatus, SamplingParams, Scheduler,
    SchedulerOutput, WorkerError,
)
from tierserve.workers.loader import default_model_path
from tierserve.workers.worker import WorkerSpec, resolve_device

__all__ = ["EngineCore", "make_worker_spec", "load_model_tokenizer", "EngineDeadError"]

log = logging.getLogger("tierserve.engine")

# Longest context a default config admits, whatever the model's positions allow.
_DEFAULT_MAX_MODEL_LEN = 8192
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
        cache_dir=envs.cache_dir())


def load_model_tokenizer(path: str) -> Tokenizer | None:
    """None for a checkpoint folder that ships no tokenizer (prompts must be token ids)."""
    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f))
                                       for f in _TOKENIZER_FILES):
        log.warning("%s has no tokenizer files: prompts must be token ids", path)
        return None
    return load_tokenizer(path, cache_dir=envs.cache_dir())


class EngineCore:
    def __init__(self, config: EngineConfig,
                 executor_factory: Callable[[WorkerSpec], Executor] = InProcessExecutor) -> None:
        spec = make_worker_spec(config)
        self.tokenizer_path = config.tokenizer or spec.model
        self.tokenizer = load_model_tokenizer(self.tokenizer_path)
        self.executor = executor_factory(spec)
        info = self.executor.start()
        self.config = config
        self.scheduler = self._make_scheduler(config, info)
        self.max_model_len = self.scheduler.max_model_len
        self.vocab_size = info.vocab_size
        self.backends = info.backends
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        self.eos_token_id = eos if eos is not None else (
            info.eos_token_ids[0] if info.eos_token_ids else None)
        self._detok: dict[str, IncrementalDetokenizer] = {}
        # Prompt ids of requests that have produced no output yet (the first output carries them).
        self._unannounced: dict[str, list[int]] = {}
        self._dead: str | None = None

    @staticmethod
    def _make_scheduler(config: EngineConfig, info: WorkerInfo) -> Scheduler:
        kv = KVCacheManager(info.num_blocks, config.block_size, config.enable_prefix_caching,
                            config.verify_prefix_hits)
        usable_tokens = (kv.pool.num_usable_blocks - kv.watermark_blocks) * config.block_size
        max_model_len = config.max_model_len or min(
            info.max_position_embeddings, _DEFAULT_MAX_MODEL_LEN, usable_tokens)
        hasher = BlockHasher(config.block_size, config.prefix_caching_hash_algo, config.hash_seed)
        return Scheduler(kv, hasher, max_num_seqs=config.max_num_seqs,
                         max_num_batched_tokens=config.max_num_batched_tokens,
                         max_model_len=max_model_len,
                         long_prefill_token_threshold=config.long_prefill_token_threshold,
                         policy=config.scheduling_policy, vocab_size=info.vocab_size)

    # ------------------------------------------------------------------ requests

    def tokenize(self, request: EngineCoreRequest) -> list[int]:
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompt token ids")
        if request.messages is not None:
            return self.tokenizer.apply_chat_template(request.messages)
        if request.prompt is None:
            raise ValueError("a request needs a prompt, prompt token ids or chat messages")
        return self.tokenizer.encode(request.prompt)

    def add_request(self, request: EngineCoreRequest) -> list[int]:
        """Queues a request; bad input raises ValueError and leaves the engine unchanged."""
        self._check_alive()
        params = request.sampling_params
        prompt_ids = self.tokenize(request)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; use stop_token_ids")
        rid = request.req_id
        self.scheduler.add_request(rid, prompt_ids, params, eos_token_id=self.eos_token_id,
                                   priority=request.priority, cache_salt=request.cache_salt)
        if self.tokenizer is not None:
            self._detok[rid] = IncrementalDetokenizer(self.tokenizer, prompt_ids,
                                                      stop=params.stop)
        self._unannounced[rid] = prompt_ids
        return prompt_ids

    def stream_batch(self, requests: list[EngineCoreRequest]) -> Iterator[list[EngineCoreOutput]]:
        """Adds the requests and steps until all have finished, yielding each step's outputs.
        A request that fails validation yields one error output; closing the iterator early
        aborts what is left."""
        pending, failed = set(), []
        for request in requests:
            try:
                self.add_request(request)
                pending.add(request.req_id)
            except ValueError as e:
                failed.append(EngineCoreOutput(request.req_id, finish_reason=FinishReason.ERROR,
                                               error=str(e)))
        if failed:
            yield failed
        try:
            while pending:
                outputs = self.step()
                for o in outputs:
                    if o.finish_reason is not None:
                        pending.discard(o.req_id)
                yield outputs
        finally:
            if pending and self._dead is None:
                self.abort_requests(list(pending))

    def abort_requests(self, request_ids) -> list[EngineCoreOutput]:
        done = self.scheduler.abort_requests(request_ids)
        self._forget(done)
        return [EngineCoreOutput(rid, finish_reason=FinishReason.ABORT) for rid in done]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ------------------------------------------------------------------ one step

    def step(self) -> list[EngineCoreOutput]:
        self._check_alive()
        out = self.scheduler.schedule()
        if not (out.num_scheduled_tokens or out.finished_req_ids or out.preempted_req_ids):
            return []
        try:
            reply = self.executor.execute(out)
        except EngineDeadError as e:
            return self._die(str(e))
        if isinstance(reply, WorkerError):
            return self._fail_step(out, f"worker rank {reply.rank}: {reply.message}")
        assert isinstance(reply, ModelRunnerOutput) and reply.step_id == out.step_id
        outputs = self.scheduler.update_from_output(out, reply)
        if self._detok:
            self._detokenize(outputs)
        if self._unannounced:
            self._announce(outputs)
        return outputs

    def _announce(self, outputs: list[EngineCoreOutput]) -> None:
        for o in outputs:
            prompt_ids = self._unannounced.pop(o.req_id, None)
            if prompt_ids is not None:
                o.prompt_token_ids = prompt_ids

    def _detokenize(self, outputs: list[EngineCoreOutput]) -> None:
        stopped = []
        for o in outputs:
            detok = self._detok.get(o.req_id)
            if detok is None:
                continue
            text, hit_stop = detok.update(o.new_token_ids)
            if hit_stop and o.finish_reason is None:
                stopped.append(o.req_id)
                o.finish_reason = FinishReason.STOP
            elif o.finish_reason is not None and not hit_stop:
                text += detok.finish()
            o.new_text = text
            if o.finish_reason is not None:
                del self._detok[o.req_id]
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)

    def _fail_step(self, out: SchedulerOutput, message: str) -> list[EngineCoreOutput]:
        """A worker raised: the step's requests fail, the rest keep going."""
        ids = self.scheduler.finish_requests(out.scheduled_req_ids(),
                                             RequestStatus.FINISHED_ERROR)
        log.error("step %d failed, failing %d requests: %s", out.step_id, len(ids), message)
        self._forget(ids)
        return [EngineCoreOutput(rid, finish_reason=FinishReason.ERROR, error=message)
                for rid in ids]

    def _die(self, message: str) -> list[EngineCoreOutput]:
        self._dead = message
        ids = self.scheduler.finish_requests(list(self.scheduler.requests),
                                             RequestStatus.FINISHED_ERROR)
        self._forget(ids)
        return [EngineCoreOutput(rid, finish_reason=FinishReason.ERROR, error=message)
                for rid in ids]

    def _forget(self, request_ids) -> None:
        for rid in request_ids:
            self._detok.pop(rid, None)
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
        if self.backends:
            stats["cpu_backend"] = self.backends[0]["name"]
            stats["backend"] = dict(self.backends[0])
        return stats

    def info(self) -> dict:
        return {"model": self.config.model, "max_model_len": self.max_model_len,
                "vocab_size": self.vocab_size, "tokenizer_path": self.tokenizer_path,
                "tensor_parallel_size": self.config.tensor_parallel_size,
                "backends": [dict(b) for b in self.backends]}

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        self.executor.shutdown()


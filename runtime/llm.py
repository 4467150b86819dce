"""`tierserve.LLM`: offline batched generation, vLLM's shape.

In-process (one device, no Ray) by default; on the registered remote transport (Ray) when
tensor_parallel_size > 1 or distributed=True, with the same API (client.py). Prompts are
tokenized and outputs detokenized here, by the processors every frontend uses (processor.py).
"""
from __future__ import annotations

import itertools
from typing import Any, Sequence

from tqdm.auto import tqdm

from tierserve.runtime.beam_search import (
    BeamSearch, BeamSearchOutput, BeamSearchParams, round_requests, step_params, take_round,
)
from tierserve.runtime.client import SyncEngineClient, deployments
from tierserve.runtime.config import EngineConfig
from tierserve.runtime.lora import LoRARequest
from tierserve.runtime.metrics import Metric, engine_families, snapshot
from tierserve.runtime.outputs import RequestOutput
from tierserve.runtime.pooling import (
    EmbeddingRequestOutput, PoolingParams, ScoringRequestOutput, as_prompt_list, embed_params,
    embedding_of, score_pairs, scores_of,
)
from tierserve.runtime.processor import InputProcessor, OutputProcessor, Processed
from tierserve.runtime.requests import CHAT_OPTIONS
from tierserve.scheduler.params import SamplingParams

__all__ = ["LLM", "PromptType"]

PromptType = str | list[int] | dict
# Batches at least this long show a progress bar (when use_tqdm is on).
_PROGRESS_MIN = 16


class LLM:
    def __init__(self, model: str | None = None, **options: Any) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **options)
        self.engine: SyncEngineClient
        if self.config.use_ray:
            self.engine = deployments().start(self.config)
        else:
            from tierserve.runtime.engine_core import EngineCore
            self.engine = EngineCore(self.config)
        self._ids = itertools.count()
        self._processors: tuple[InputProcessor, OutputProcessor] | None = None
        self._defaults: dict | None = None
        self._queued: list = []  # enqueue()'s requests (or their failures), in order

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What a prompt without sampling parameters gets: the model's generation config
        (engine option generation_config), else vLLM's defaults."""
        if self._defaults is None:
            self._defaults = self.engine.info()["generation_defaults"]
        return SamplingParams(**self._defaults)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | dict | Sequence[SamplingParams | dict] | None = None,
                 *, use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 cache_salt: str | Sequence[str | None] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in input order. A bad prompt or bad parameters fail
        that request alone (its output has `error` set and finish_reason "error").
        lora_request: the LoRA adapter of every prompt, or one per prompt (enable_lora)."""
        requests = self._requests(prompts, sampling_params, priority, cache_salt, lora_request)
        return self._run(requests, use_tqdm and len(requests) >= _PROGRESS_MIN)

    def enqueue(self, prompts: PromptType | Sequence[PromptType],
                sampling_params: SamplingParams | dict | Sequence | None = None, *,
                use_tqdm: bool = True, priority: Sequence[int] | None = None,
                cache_salt: str | Sequence[str | None] | None = None,
                lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                ) -> list[str]:
        """vLLM's: generate()'s prompts checked and tokenized now, run by the next
        wait_for_completion() with every other prompt enqueued before it; their request ids.
        use_tqdm is vLLM's argument; queueing is too quick here to show a bar for."""
        requests = self._requests(prompts, sampling_params, priority, cache_salt, lora_request)
        self._queued += requests
        return [r.request_id if isinstance(r, RequestOutput) else r.request.req_id
                for r in requests]

    def enqueue_chat(self, messages: list[dict] | Sequence[list[dict]],
                     sampling_params: SamplingParams | dict | Sequence | None = None, *,
                     use_tqdm: bool = True,
                     lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                     **options: Any) -> list[str]:
        """chat()'s conversations (with chat's template options), enqueued (enqueue)."""
        return self.enqueue(_chat_prompts(messages, **options), sampling_params,
                            use_tqdm=use_tqdm, lora_request=lora_request)

    def wait_for_completion(self, *, use_tqdm: bool = True) -> list[RequestOutput]:
        """Runs every prompt enqueued since the last call; their outputs in enqueue order."""
        queued, self._queued = self._queued, []
        return self._run(queued, use_tqdm and len(queued) >= _PROGRESS_MIN)

    def get_world_size(self, include_dp: bool = True) -> int:
        """vLLM's: the ranks of one replica (tensor_parallel_size), times the replicas."""
        config = self.config
        return config.tensor_parallel_size * (config.data_parallel_size if include_dp else 1)

    def _requests(self, prompts, sampling_params, priority, cache_salt, lora_request) -> list:
        batch = _as_batch(prompts)
        params = _per_prompt(sampling_params, len(batch), "sampling_params")
        salts = _per_prompt(cache_salt, len(batch), "cache_salt")
        priorities = _per_prompt(priority, len(batch), "priority")
        loras = _per_prompt(lora_request, len(batch), "lora_request")
        return [self._request(p, sp, salt, prio or 0, lora)
                for p, sp, salt, prio, lora in zip(batch, params, salts, priorities, loras)]

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | dict | Sequence | None = None, *,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template: str | None = None,
             chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        """Applies the model's chat template (or chat_template) to one conversation or a batch
        of them, vLLM's way: a generation prompt after the last message, or that message
        continued; chat_template_kwargs and tools reach the template (e.g. enable_thinking)."""
        prompts = _chat_prompts(messages, add_generation_prompt=add_generation_prompt,
                                continue_final_message=continue_final_message,
                                chat_template=chat_template,
                                chat_template_kwargs=chat_template_kwargs, tools=tools)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | None = None, *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              cache_salt: str | None = None, lora_request: LoRARequest | None = None
              ) -> list[EmbeddingRequestOutput]:
        """vLLM's LLM.embed (runtime/pooling.py): each prompt's vector, in input order. A bad
        prompt raises ValueError naming why."""
        params = embed_params(pooling_params, truncate_prompt_tokens)
        outs = self.generate(prompts, params, use_tqdm=use_tqdm, cache_salt=cache_salt,
                             lora_request=lora_request)
        return [embedding_of(o, pooling_params) for o in outs]

    def score(self, data_1: PromptType | Sequence[PromptType],
              data_2: PromptType | Sequence[PromptType], *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              cache_salt: str | None = None, lora_request: LoRARequest | None = None
              ) -> list[ScoringRequestOutput]:
        """vLLM's LLM.score with an embedding model: each pair's cosine similarity (one
        prompt against each of data_2, or N against N in order). Each prompt is embedded
        once; a bad prompt raises ValueError naming why."""
        first, second = as_prompt_list(data_1), as_prompt_list(data_2)
        pairs = score_pairs(first, second)
        vectors = self.embed(first + second, truncate_prompt_tokens=truncate_prompt_tokens,
                             use_tqdm=use_tqdm, cache_salt=cache_salt,
                             lora_request=lora_request)
        return scores_of(pairs, vectors[:len(first)], vectors[len(first):])

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    *, use_tqdm: bool = False, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None) -> list[BeamSearchOutput]:
        """vLLM's beam search (runtime/beam_search.py): per prompt, the best beam_width
        sequences, best first, each its prompt's tokens then the generated ones, with the
        generated text. A bad prompt raises ValueError naming it."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be BeamSearchParams, got {type(params).__name__}")
        tok = self.tokenizer
        eos = tok.eos_token_id if tok is not None else None
        searches = [BeamSearch(self._prompt_ids(p, cache_salt, lora_request), params, eos)
                    for p in _as_batch(prompts)]
        step = SamplingParams(**step_params(params))
        for _ in tqdm(range(params.max_tokens), desc="beam search", disable=not use_tqdm):
            live, seqs = round_requests(searches, self.engine.max_model_len)
            if not live:
                break
            take_round(live, self.generate([{"prompt_token_ids": q} for q in seqs], step,
                                           use_tqdm=False, cache_salt=cache_salt,
                                           lora_request=lora_request))
        return [BeamSearchOutput(s.result(tok.decode if tok else None)) for s in searches]

    def _prompt_ids(self, prompt: PromptType, cache_salt: str | None,
                    lora_request: LoRARequest | None) -> list[int]:
        processed = self._request(prompt, SamplingParams(max_tokens=1), cache_salt, 0,
                                  lora_request)
        if isinstance(processed, RequestOutput):
            raise ValueError(processed.error)
        return list(processed.request.prompt_token_ids)

    @property
    def processors(self) -> tuple[InputProcessor, OutputProcessor]:
        if self._processors is None:
            tok, engine = self.engine.tokenizer, self.engine
            self._processors = (InputProcessor(tok, engine.vocab_size, engine.max_model_len),
                                OutputProcessor(tok))
        return self._processors

    def _request(self, prompt: PromptType, params, salt, priority,
                 lora_request: LoRARequest | None = None) -> Processed | RequestOutput:
        rid = str(next(self._ids))
        try:
            if isinstance(params, dict):
                params = SamplingParams(**params)
            elif params is None:
                params = self.get_default_sampling_params()
            elif not isinstance(params, SamplingParams):
                raise ValueError(f"sampling_params must be SamplingParams or a dict, got "
                                 f"{type(params).__name__}")
            return self.processors[0].process(rid, prompt, params, priority, salt,
                                              lora_request=lora_request)
        except (ValueError, TypeError) as e:
            return RequestOutput.failed(rid, prompt if isinstance(prompt, str) else None, [],
                                        str(e))

    def _run(self, items: list, progress: bool) -> list[RequestOutput]:
        results = [r if isinstance(r, RequestOutput) else RequestOutput.start(
            r.request.req_id, r.prompt, r.request.sampling_params.logprobs is not None,
            r.request.sampling_params.n, r.request.sampling_params.prompt_logprobs is not None)
            for r in items]
        by_id = {r.request_id: r for r in results if not r.finished}
        requests = [r.request for r in items if isinstance(r, Processed)]
        processor = self.processors[1]
        for request in requests:
            processor.add(request)
        bar = tqdm(total=len(by_id), desc="generating", disable=not progress)
        try:
            for outputs in self.engine.stream_batch(requests):
                outputs, stopped = processor.process(outputs)
                if stopped:
                    self.engine.stop_sequences(stopped)
                for delta in outputs:
                    result = by_id.get(delta.req_id)
                    if result is not None:
                        result.add(delta, processor.decoder(delta.req_id))
                        bar.update(int(result.finished))
        finally:
            bar.close()
            for request in requests:
                processor.remove(request.req_id)
        return results

    def stats(self) -> dict:
        return self.engine.stats()

    def get_metrics(self) -> list[Metric]:
        """The engine's metrics now, as `/metrics` names them (`tierserve:...`), as vLLM's
        records: Counter, Gauge, Histogram, Vector (tierserve.runtime.metrics)."""
        return snapshot(engine_families(self.stats()))

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _chat_prompts(messages, **options) -> list[dict]:
    """One conversation or a batch of them as prompt dicts with chat's template options."""
    unknown = sorted(set(options) - set(CHAT_OPTIONS))
    if unknown:
        raise TypeError(f"unknown chat options: {', '.join(unknown)}")
    conversations = [messages] if messages and isinstance(messages[0], dict) else messages
    return [{"messages": list(c), **options} for c in conversations]


def _as_batch(prompts) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids (bools among them are refused later)
    return prompts


def _per_prompt(value, n: int, name: str) -> list:
    if value is None or isinstance(value, (SamplingParams, dict, str, int, LoRARequest)):
        return [value] * n
    value = list(value)
    if len(value) != n:
        raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
    return value

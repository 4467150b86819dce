"""Embeddings (vLLM's `LLM.embed` and `AsyncLLM.encode` shapes): a prompt's vector is the
final hidden state (after the model's last norm) of its last token, L2-normalized by default,
as Qwen3-Embedding, e5-mistral and gte-Qwen2 pool theirs.

An embedding request is an engine request that samples one token and whose reply carries that
hidden state (SamplingParams.pooling): it is scheduled, chunked, prefix-cached and preempted as
any other, and the workers copy the vector out of the step they already run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from tierserve.runtime.outputs import RequestOutput
from tierserve.scheduler.params import Pooling, SamplingParams

__all__ = ["PoolingParams", "EmbeddingOutput", "EmbeddingRequestOutput", "embed_params",
           "embedding_of"]


@dataclass(frozen=True)
class PoolingParams:
    """normalize: divide the vector by its L2 norm; dimensions: keep its first `dimensions`
    values (a Matryoshka model's shorter embedding), normalized after the cut."""

    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if type(self.normalize) is not bool:
            raise ValueError(f"PoolingParams.normalize must be True or False, got "
                             f"{self.normalize!r}")
        if self.dimensions is not None and (type(self.dimensions) is not int
                                            or self.dimensions < 1):
            raise ValueError(f"PoolingParams.dimensions must be an int >= 1, got "
                             f"{self.dimensions!r}")


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


def embed_params(params: PoolingParams | None,
                 truncate_prompt_tokens: int | None = None) -> SamplingParams:
    """The engine request of an embedding: one greedy token, its hidden state pooled (the
    engine normalizes unless a cut to `dimensions` comes first)."""
    params = params or PoolingParams()
    pooling = Pooling.LAST_NORMALIZED if params.normalize and params.dimensions is None \
        else Pooling.LAST
    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False,
                          truncate_prompt_tokens=truncate_prompt_tokens, pooling=pooling)


def embedding_of(out: RequestOutput, params: PoolingParams | None) -> EmbeddingRequestOutput:
    """A finished embedding request's output; ValueError where it failed, or where
    `dimensions` asks for more values than the model has."""
    if out.error:
        raise ValueError(out.error)
    assert out.embedding is not None, "an embedding request finished without its vector"
    vec, params = out.embedding, params or PoolingParams()
    if params.dimensions is not None:
        if params.dimensions > len(vec):
            raise ValueError(f"dimensions {params.dimensions} is more than the model's "
                             f"{len(vec)}")
        vec = vec[:params.dimensions]
        if params.normalize:
            norm = math.sqrt(sum(v * v for v in vec)) or 1.0
            vec = [v / norm for v in vec]
    return EmbeddingRequestOutput(out.request_id, EmbeddingOutput(vec), out.prompt_token_ids)

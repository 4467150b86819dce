"""Embeddings (vLLM's `LLM.embed` and `AsyncLLM.encode` shapes): a prompt's vector is the
final hidden state (after the model's last norm) of its last token, L2-normalized by default,
as Qwen3-Embedding, e5-mistral and gte-Qwen2 pool theirs. Scores (vLLM's `LLM.score`, the
server's /score and /rerank) are the cosine similarities of two prompts' embeddings, as vLLM
scores with an embedding model.

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
           "embedding_of", "ScoringOutput", "ScoringRequestOutput", "score_pairs",
           "as_prompt_list", "cosine", "scores_of"]


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


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """vLLM's: one pair's score; prompt_token_ids are the two prompts' tokens, one after the
    other."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


def score_pairs(data_1, data_2) -> list[tuple[int, int]]:
    """vLLM's pairing of LLM.score's two sides (each a prompt or a list of them) as index
    pairs into them: one to one, one to each of N, or N to N in order."""
    n1, n2 = len(data_1), len(data_2)
    if n1 == 0 or n2 == 0:
        raise ValueError("score needs at least one prompt on each side")
    if n1 == 1:
        return [(0, j) for j in range(n2)]
    if n1 != n2:
        raise ValueError(f"score pairs one prompt with N, or N with N: got {n1} and {n2}")
    return [(i, i) for i in range(n1)]


def as_prompt_list(data) -> list:
    """One prompt (text, token ids, a prompt dict) or a list of them, as a list."""
    if isinstance(data, (str, dict)) or (isinstance(data, list) and data and
                                         all(isinstance(t, int) for t in data)):
        return [data]
    if not isinstance(data, (list, tuple)):
        raise ValueError(f"score takes a prompt or a list of prompts, got {type(data).__name__}")
    return list(data)


def cosine(a: list[float], b: list[float]) -> float:
    """Cosine similarity of two vectors (0 where one is all zeros)."""
    dot = sum(x * y for x, y in zip(a, b))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


def scores_of(pairs: list[tuple[int, int]], first: list[EmbeddingRequestOutput],
              second: list[EmbeddingRequestOutput]) -> list[ScoringRequestOutput]:
    """Each pair's cosine similarity, from the two sides' embeddings."""
    out = []
    for i, j in pairs:
        a, b = first[i], second[j]
        out.append(ScoringRequestOutput(f"{a.request_id}_{b.request_id}", ScoringOutput(
            cosine(a.outputs.embedding, b.outputs.embedding)),
            a.prompt_token_ids + b.prompt_token_ids))
    return out

"""Batched token sampler: one call per step turns logits float32[n, vocab] into n token ids.

Order of operations for each row (one row per request that receives a token this step):

  grammar mask (constrained rows: tokens their matcher disallows become -inf; structured.py)
  -> penalties (repetition over prompt + output tokens, as HF / vLLM; presence and frequency over
  output tokens only, OpenAI semantics)
  -> greedy rows: argmax of the penalised logits
  -> random rows: temperature -> top-k -> top-p -> min-p -> exponential race with the row's
     generator (argmax(probs / E), E ~ Exp(1) i.i.d., which samples exactly from probs).

Logprobs are log_softmax of the *raw* model logits (vLLM's default "raw_logprobs"): they describe
the model's distribution, before penalties, temperature and truncation.

This module owns the Sampler and its output; the step's inputs are in sampling_batch.py, the
per-request state that builds them (seeded generators, penalty tables) in sampling_state.py,
and the tensor transforms in sampling_ops.py. Their public names are re-exported here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tierserve.workers.backends.base import Backend
from tierserve.workers.backends.portable import torch_backend
from tierserve.workers.sampling_batch import (
    SAMPLING_EPS,
    PenaltyInputs,
    SamplingBatch,
    has_penalties,
    is_greedy,
)
from tierserve.workers.sampling_ops import (
    LogprobsOutput,
    apply_min_p_,
    apply_penalties,
    apply_top_k_,
    apply_top_p_,
    compute_logprobs,
    greedy,
    masked,
)
from tierserve.workers.sampling_state import SamplingStateTable, make_generator, skip_draws

__all__ = [
    "SAMPLING_EPS",
    "apply_min_p_",
    "apply_penalties",
    "apply_top_k_",
    "apply_top_p_",
    "compute_logprobs",
    "LogprobsOutput",
    "PenaltyInputs",
    "Sampler",
    "SamplerOutput",
    "SamplingBatch",
    "SamplingStateTable",
    "has_penalties",
    "is_greedy",
    "make_generator",
    "skip_draws",
]


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # long[n]
    logprobs: LogprobsOutput | None = None


class Sampler:
    """Stateless apart from the shared generator used by unseeded random rows.

    The input logits are never modified.
    """

    def __init__(self, generator: torch.Generator | None = None,
                 backend: Backend | None = None) -> None:
        # None: unseeded rows draw from torch's default generator for the logits' device.
        self.generator = generator
        self.backend = backend or torch_backend()

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != batch.num_rows:
            raise ValueError(f"logits shape {tuple(logits.shape)} does not match "
                             f"{batch.num_rows} batch rows")
        if batch.plain_greedy:
            return SamplerOutput(greedy(logits, self.backend))
        logits = raw = logits.float()
        owned = False
        if batch.masks is not None:
            logits, owned = masked(logits, *batch.masks), True
        if batch.adjust is not None:
            rows, add = batch.adjust
            logits = logits.index_copy(0, rows, logits.index_select(0, rows) + add)
            owned = True
        if batch.penalties is None:
            token_ids = self._choose(logits, batch, owned=owned)
        else:
            token_ids = self._choose(apply_penalties(logits, batch.penalties), batch, owned=True)
        logprobs = None
        if batch.max_num_logprobs is not None:
            logprobs = compute_logprobs(raw, token_ids, batch.max_num_logprobs,
                                        batch.logprob_token_ids)
        return SamplerOutput(token_ids, logprobs)

    def _choose(self, x: torch.Tensor, batch: SamplingBatch, owned: bool) -> torch.Tensor:
        """x: penalised logits float32[n, vocab] -> long[n]; `owned`: x may be modified."""
        if batch.random_rows is None:
            return greedy(x, self.backend)
        if batch.all_random:
            xr = x if owned else x.clone()
        else:
            xr = x.index_select(0, batch.random_rows)
        sampled = self._sample(xr, batch)
        if batch.all_random:
            return sampled
        tokens = torch.empty(batch.num_rows, dtype=torch.long, device=x.device)
        tokens[batch.greedy_rows] = greedy(x.index_select(0, batch.greedy_rows), self.backend)
        tokens[batch.random_rows] = sampled
        return tokens

    def _sample(self, x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """x: float32[r, vocab], a private copy of the random rows, modified in place."""
        if batch.temperature is not None:
            x.div_(batch.temperature)
        if batch.top_k is not None:
            apply_top_k_(x, batch.top_k, batch.top_k_max)
        if batch.top_p is not None:
            apply_top_p_(x, batch.top_p)
        if batch.min_p is not None:
            apply_min_p_(x, batch.min_p)
        probs = x.softmax(dim=-1)
        return probs.div_(self._exponential_noise(probs, batch)).argmax(dim=-1)

    def _exponential_noise(self, like: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Exp(1) noise float32[r, vocab]; a seeded row draws exactly `vocab` uniforms from its own
        generator. -log(u) with u in [0, 1) is in (0, inf]: never 0, so probs / noise is never
        NaN (u == 0 gives inf, i.e. that token cannot win), and it is several times cheaper on CPU
        than Tensor.exponential_."""
        noise = torch.empty_like(like)
        if len(batch.generators) < like.shape[0]:
            noise.uniform_(generator=self.generator)
        for row, generator in batch.generators.items():
            noise[row].uniform_(generator=generator)
        return noise.log_().neg_()

"""Per-step sampler inputs: which rows are greedy, what the random rows truncate by, and the
penalty state of the penalised rows, as device tensors built once per step.

Two ways to build a SamplingBatch, producing identical batches:
  * SamplingBatch.from_token_ids: from full token lists, O(context) work (tests, one-off use).
  * SamplingStateTable (sampling_state.py): the worker's persistent per-request state, O(batch)
    Python work per step, independent of context length.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from tierserve.scheduler.params import SamplingParams

__all__ = [
    "SAMPLING_EPS",
    "PenaltyInputs",
    "SamplingBatch",
    "fill_penalty_row",
    "has_penalties",
    "is_greedy",
]


# Temperatures below this are treated as greedy: logits / T would overflow to inf and softmax
# would return NaN; the limit T -> 0 of sampling is argmax anyway.
SAMPLING_EPS = 1e-5


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < SAMPLING_EPS


def has_penalties(params: SamplingParams) -> bool:
    return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0)


@dataclass
class PenaltyInputs:
    """Penalty state for the m rows of a batch that have any penalty (m <= n)."""

    rows: torch.Tensor           # long[m]: batch row of each penalised request
    output_counts: torch.Tensor  # int32[m, vocab]: occurrences of each token in the output
    prompt_mask: torch.Tensor    # bool[m, vocab]: token occurs in the prompt
    repetition: torch.Tensor     # float32[m, 1]
    presence: torch.Tensor       # float32[m, 1]
    frequency: torch.Tensor      # float32[m, 1]
    any_repetition: bool         # some row has repetition_penalty != 1
    any_additive: bool           # some row has a presence or frequency penalty

    @classmethod
    def create(cls, rows: Sequence[int], params: Sequence[SamplingParams],
               output_counts: torch.Tensor, prompt_mask: torch.Tensor) -> "PenaltyInputs":
        device = output_counts.device

        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

        return cls(
            rows=torch.tensor(list(rows), dtype=torch.long, device=device),
            output_counts=output_counts,
            prompt_mask=prompt_mask,
            repetition=column([p.repetition_penalty for p in params]),
            presence=column([p.presence_penalty for p in params]),
            frequency=column([p.frequency_penalty for p in params]),
            any_repetition=any(p.repetition_penalty != 1.0 for p in params),
            any_additive=any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
                             for p in params),
        )


@dataclass
class SamplingBatch:
    """Everything the sampler needs for one step, as device tensors built once per step.

    Per-row sampling parameters are stored for the random (non-greedy) rows only; `random_rows`
    maps them back to batch rows. A parameter tensor is None when no random row uses it.
    """

    num_rows: int
    vocab_size: int
    greedy_rows: torch.Tensor | None     # long[g]; None when no row is greedy
    random_rows: torch.Tensor | None     # long[r]; None when no row is random
    all_random: bool                     # random_rows covers every row in order
    temperature: torch.Tensor | None     # float32[r, 1]
    top_k: torch.Tensor | None           # long[r], vocab_size where disabled
    top_k_max: int                       # largest enabled top_k (0 when top_k is None)
    top_p: torch.Tensor | None           # float32[r]
    min_p: torch.Tensor | None           # float32[r]
    generators: dict[int, torch.Generator]  # random-row index -> seeded generator
    penalties: PenaltyInputs | None
    max_num_logprobs: int | None         # largest `logprobs` asked for; None when nobody asks
    # Rows with logprob_token_ids -> those ids (their logprobs are gathered besides the top).
    logprob_token_ids: dict[int, list[int]] | None = None
    # Constrained rows (long[c]) and what their grammars add: float32[c, vocab], 0 or -inf.
    masks: tuple[torch.Tensor, torch.Tensor] | None = None
    # Rows with token rules (long[k]) and what each adds to its logits (float32[k, vocab]).
    adjust: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def plain_greedy(self) -> bool:
        """Every row is greedy without penalties, logprobs, masks or token rules: a bare
        argmax suffices."""
        return (self.random_rows is None and self.penalties is None
                and self.max_num_logprobs is None and self.masks is None
                and self.adjust is None)

    @classmethod
    def build(cls, params: Sequence[SamplingParams],
              generators: Sequence[torch.Generator | None], penalties: PenaltyInputs | None,
              vocab_size: int, device: torch.device | str,
              masks: tuple[list[int], torch.Tensor] | None = None,
              adjust: tuple[list[int], torch.Tensor] | None = None) -> "SamplingBatch":
        if len(generators) != len(params):
            raise ValueError("need one generator slot (or None) per row")
        greedy = [i for i, p in enumerate(params) if is_greedy(p)]
        random = [i for i, p in enumerate(params) if not is_greedy(p)]
        rp = [params[i] for i in random]
        top_ks = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in rp]
        asked = [p.logprobs for p in params if p.logprobs is not None]

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            num_rows=len(params),
            vocab_size=vocab_size,
            greedy_rows=tensor(greedy, torch.long) if greedy else None,
            random_rows=tensor(random, torch.long) if random else None,
            all_random=len(random) == len(params),
            temperature=(tensor([[p.temperature] for p in rp], torch.float32)
                         if any(p.temperature != 1.0 for p in rp) else None),
            top_k=tensor(top_ks, torch.long) if any(k < vocab_size for k in top_ks) else None,
            top_k_max=max((k for k in top_ks if k < vocab_size), default=0),
            top_p=(tensor([p.top_p for p in rp], torch.float32)
                   if any(p.top_p < 1.0 for p in rp) else None),
            min_p=(tensor([p.min_p for p in rp], torch.float32)
                   if any(p.min_p > 0.0 for p in rp) else None),
            generators={j: generators[i] for j, i in enumerate(random)
                        if generators[i] is not None},
            penalties=penalties,
            max_num_logprobs=max(asked) if asked else None,
            logprob_token_ids={i: p.logprob_token_ids for i, p in enumerate(params)
                               if p.logprob_token_ids} or None,
            masks=None if masks is None else (tensor(masks[0], torch.long),
                                              masks[1].to(device)),
            adjust=None if adjust is None else (tensor(adjust[0], torch.long), adjust[1]),
        )

    @classmethod
    def from_token_ids(cls, params: Sequence[SamplingParams],
                       prompt_token_ids: Sequence[Sequence[int]],
                       output_token_ids: Sequence[Sequence[int]],
                       generators: Sequence[torch.Generator | None], vocab_size: int,
                       device: torch.device | str = "cpu") -> "SamplingBatch":
        """Build from full token lists (O(context)); the persistent path is SamplingStateTable."""
        rows = [i for i, p in enumerate(params) if has_penalties(p)]
        penalties = None
        if rows:
            counts = torch.zeros(len(rows), vocab_size, dtype=torch.int32, device=device)
            mask = torch.zeros(len(rows), vocab_size, dtype=torch.bool, device=device)
            for j, i in enumerate(rows):
                fill_penalty_row(counts[j], mask[j], prompt_token_ids[i], output_token_ids[i])
            penalties = PenaltyInputs.create(rows, [params[i] for i in rows], counts, mask)
        return cls.build(params, generators, penalties, vocab_size, device)


def fill_penalty_row(counts: torch.Tensor, mask: torch.Tensor, prompt_token_ids: Sequence[int],
                     output_token_ids: Sequence[int]) -> None:
    """counts: int32[vocab] (zeroed), mask: bool[vocab] (zeroed), filled in place."""
    device = counts.device
    if len(prompt_token_ids):
        mask[torch.as_tensor(list(prompt_token_ids), dtype=torch.long, device=device)] = True
    if len(output_token_ids):
        ids = torch.as_tensor(list(output_token_ids), dtype=torch.long, device=device)
        counts.index_put_((ids,), torch.ones_like(ids, dtype=counts.dtype), accumulate=True)

"""Pure tensor transforms of the sampler, each on float32[rows, vocab] logits: argmax, grammar
masks, penalties, top-k / top-p / min-p truncation, and logprobs of the raw distribution."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tierserve.workers.backends.base import Backend
from tierserve.workers.backends.portable import torch_backend
from tierserve.workers.sampling_batch import PenaltyInputs

__all__ = [
    "LogprobsOutput",
    "apply_min_p_",
    "apply_penalties",
    "apply_top_k_",
    "apply_top_p_",
    "compute_logprobs",
    "greedy",
    "masked",
]


@dataclass
class LogprobsOutput:
    """Logprobs of the raw model distribution for every row; k = batch.max_num_logprobs.

    Rows that asked for fewer than k (or none) should take the first `logprobs` columns."""

    sampled_logprobs: torch.Tensor  # float32[n]: logprob of the sampled token
    sampled_ranks: torch.Tensor     # long[n]: 1 + number of tokens with a strictly higher logprob
    top_token_ids: torch.Tensor     # long[n, k], by descending logprob
    top_logprobs: torch.Tensor      # float32[n, k]
    # Rows with logprob_token_ids: row -> (their logprobs, their ranks), in the ids' order.
    chosen: dict[int, tuple[list[float], list[int]]] = field(default_factory=dict)


def greedy(logits: torch.Tensor, backend: Backend | None = None) -> torch.Tensor:
    """Row-wise argmax [n, vocab] -> long[n], the first index on ties (as argmax), by the
    backend's argmax_rows."""
    return (backend or torch_backend()).argmax_rows(logits)


def masked(logits: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """A copy of logits float32[n, vocab] where each constrained row keeps only the tokens its
    grammar allows (bias: float32[c, vocab], -inf on the others)."""
    if len(rows) == logits.shape[0]:  # rows are in batch order: every row is constrained
        return logits + bias
    x = logits.index_select(0, rows)
    x.add_(bias)
    return logits.index_copy(0, rows, x)


def apply_penalties(logits: torch.Tensor, pen: PenaltyInputs) -> torch.Tensor:
    """Returns a penalised copy of logits float32[n, vocab]; only pen.rows change.

    Repetition (HF / CTRL): a logit of a token seen in prompt or output is divided by the penalty
    when positive, multiplied when negative. Then, over output tokens only,
    logit -= frequency * count + presence * (count > 0).
    """
    x = logits.index_select(0, pen.rows)
    counts = pen.output_counts
    if pen.any_repetition:
        seen = pen.prompt_mask | (counts > 0)
        scaled = torch.where(x > 0, x / pen.repetition, x * pen.repetition)
        x = torch.where(seen, scaled, x)
    if pen.any_additive:
        x -= pen.frequency * counts.to(x.dtype) + pen.presence * (counts > 0).to(x.dtype)
    return logits.index_copy(0, pen.rows, x)


def apply_top_k_(x: torch.Tensor, top_k: torch.Tensor, top_k_max: int) -> None:
    """Keep each row's top_k largest logits (ties with the k-th value are all kept); in place.

    x: float32[r, vocab]; top_k: long[r], vocab where disabled."""
    vocab = x.shape[1]
    values = x.topk(min(top_k_max, vocab), dim=-1).values
    kth = values.gather(1, (top_k.clamp(max=top_k_max) - 1).unsqueeze(1))
    kth = torch.where(top_k.unsqueeze(1) >= vocab, torch.full_like(kth, -float("inf")), kth)
    x.masked_fill_(x < kth, -float("inf"))


def apply_top_p_(x: torch.Tensor, top_p: torch.Tensor, max_candidates: int | None = None) -> None:
    """Nucleus truncation on x float32[r, vocab] (already top-k masked), in place.

    Keeps the smallest set of most likely tokens whose probability (under x, i.e. renormalised
    after top-k) reaches top_p: token i, in descending order, is kept iff the mass before it is
    < top_p, so the most likely token always survives. Tokens tied with the last kept logit are
    kept too. A full sort of the vocabulary is slow on CPU, so there only the top
    `max_candidates` (default 1024) are sorted, and rows whose nucleus is wider fall back to a
    full sort. On accelerators the sort is cheap and is always used (no host sync)."""
    vocab = x.shape[1]
    if max_candidates is None:
        max_candidates = 1024 if x.device.type == "cpu" else vocab
    k = min(vocab, max_candidates)
    threshold, resolved = _top_p_threshold(x, top_p, k)
    if k < vocab and not bool(resolved.all()):
        rows = (~resolved).nonzero().squeeze(1)
        threshold[rows] = _top_p_threshold(x[rows], top_p[rows], vocab)[0]
    x.masked_fill_(x < threshold, -float("inf"))


def _top_p_threshold(x: torch.Tensor, top_p: torch.Tensor, k: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """From the k largest logits per row: the smallest kept logit float32[r, 1] (-inf for
    top_p >= 1) and whether the k candidates hold the whole nucleus, bool[r]."""
    values = x.topk(k, dim=-1).values  # descending
    probs = (values - x.logsumexp(dim=-1, keepdim=True)).exp()
    cumulative = probs.cumsum(dim=-1)
    num_kept = ((cumulative - probs) < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True)
    threshold = values.gather(1, num_kept - 1)
    threshold.masked_fill_(top_p.unsqueeze(1) >= 1.0, -float("inf"))
    resolved = (cumulative[:, -1] >= top_p) | (top_p >= 1.0)
    return threshold, resolved


def apply_min_p_(x: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop tokens with prob < min_p * max prob, in place on x float32[r, vocab].

    prob_i / prob_max = exp(x_i - x_max), so the test is done on logits: it is unaffected by
    earlier truncation (the max token always survives top-k / top-p) and needs no softmax."""
    threshold = x.amax(dim=-1, keepdim=True) + torch.log(min_p).unsqueeze(1)
    x.masked_fill_(x < threshold, -float("inf"))


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int,
                     chosen: dict[int, list[int]] | None = None) -> LogprobsOutput:
    """logits: raw float32[n, vocab]; token_ids: long[n] sampled tokens; chosen: row -> the
    token ids whose logprobs and ranks that row also wants (logprob_token_ids)."""
    logprobs = logits.log_softmax(dim=-1)
    sampled = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > sampled).sum(dim=-1) + 1
    if k > 0:
        top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    else:
        top_logprobs = logprobs.new_empty(logprobs.shape[0], 0)
        top_ids = token_ids.new_empty(logprobs.shape[0], 0)
    picked = {}
    for row, ids in (chosen or {}).items():
        values = logprobs[row].index_select(0, torch.tensor(ids, device=logprobs.device))
        above = (logprobs[row].unsqueeze(0) > values.unsqueeze(1)).sum(dim=-1) + 1
        picked[row] = (values.tolist(), above.tolist())
    return LogprobsOutput(sampled.squeeze(1), ranks, top_ids, top_logprobs, picked)

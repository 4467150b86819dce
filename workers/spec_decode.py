"""Speculative decoding, the workers' side: which rows of a step sample, and which drafts they
accept (scheduler/spec.py proposes the drafts and says why this is exact).

A sequence with k drafts samples k + 1 rows: one at its last known token and one at each
draft. Every row is sampled on its own, by the sampler as if it were the only one; the drafts
are accepted while each equals the sample at its position, and the sequence's token is the
sample at the first position that differs (or the one after the last draft). Greedy rows
sample the argmax, so greedy output equals decoding one token at a time; random rows sample
their own distribution, so acceptance is rejection sampling for a one-token draft.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tierserve.workers.input_batch import InputBatch, StepInputs

__all__ = ["SampleRows"]


@dataclass(slots=True)
class SampleRows:
    """The rows a step samples: `keep`, the token of each row in the step ([rows] int64);
    `req_ids`, the request of each row; per sampling sequence its first row and its drafts."""

    keep: np.ndarray
    req_ids: list[str]
    first: np.ndarray  # [num_samples] int64
    drafts: list[np.ndarray] | None  # per sampling sequence; None without drafts

    @classmethod
    def of(cls, inputs: StepInputs, batch: InputBatch) -> "SampleRows":
        ends = np.cumsum(inputs.query_lens)[inputs.sample_rows]  # exclusive
        if inputs.num_drafts is None:
            return cls(ends - 1, inputs.sample_req_ids, np.arange(len(ends)), None)
        k = inputs.num_drafts[inputs.sample_rows]
        counts = k + 1
        first = np.cumsum(counts) - counts
        keep = np.repeat(ends - counts, counts) + (np.arange(int(counts.sum()))
                                                   - np.repeat(first, counts))
        req_ids = [rid for rid, n in zip(inputs.sample_req_ids, counts.tolist())
                   for _ in range(n)]
        drafts = [batch.drafts_of(inputs, int(i)).copy() for i in inputs.sample_rows]
        return cls(keep, req_ids, first, drafts)

    def accept(self, row_tokens: np.ndarray) -> tuple[np.ndarray, list[int], np.ndarray]:
        """From each row's sample ([rows] int64): each sequence's token, how many drafts it
        accepted, and its tokens of the step as a matrix ([num_samples, 1 + most drafts], -1
        after each sequence's own)."""
        if self.drafts is None:
            return row_tokens, [], row_tokens[:, None]
        width = 1 + max(len(d) for d in self.drafts)
        tokens = np.full((len(self.first), width), -1, dtype=np.int64)
        final = np.empty(len(self.first), dtype=np.int64)
        accepted = []
        for i, (start, drafts) in enumerate(zip(self.first.tolist(), self.drafts)):
            samples = row_tokens[start : start + len(drafts) + 1]
            miss = np.flatnonzero(samples[: len(drafts)] != drafts)
            n = int(miss[0]) if len(miss) else len(drafts)
            accepted.append(n)
            final[i] = samples[n]
            tokens[i, :n + 1] = samples[: n + 1]
        return final, accepted, tokens

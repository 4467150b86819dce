"""The worker's persistent view of every request, updated in place from SchedulerOutput diffs.

A request's prompt arrives once (NewRequestData); afterwards each step appends the tokens and
block ids the scheduler sends. A preempted request keeps its tokens and loses its blocks until
it resumes, so the scheduler never has to resend a prompt.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tierserve.scheduler.messages import SchedulerOutput
from tierserve.scheduler.params import SamplingParams
from tierserve.workers.sampler import SamplingStateTable

__all__ = ["RequestState", "InputBatch", "StepInputs"]


@dataclass(slots=True)
class RequestState:
    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    params: SamplingParams


@dataclass(slots=True)
class StepInputs:
    """One forward's inputs, with decodes packed first as the attention kernel expects."""

    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    num_decodes: int
    # order[i] = index in the SchedulerOutput of the i-th packed sequence
    order: list[int]
    # Packed sequence indices that end at the last known token and so sample.
    sample_rows: list[int]
    sample_req_ids: list[str]


class InputBatch:
    def __init__(self, block_size: int, sampling: SamplingStateTable) -> None:
        self.block_size = block_size
        self.sampling = sampling
        self.requests: dict[str, RequestState] = {}

    def apply(self, out: SchedulerOutput) -> None:
        for rid in out.finished_req_ids:
            self._drop(rid)
        for rid in out.preempted_req_ids:
            self.requests[rid].block_ids = []
        for new in out.scheduled_new_reqs:
            if new.req_id in self.requests:
                raise RuntimeError(f"request {new.req_id!r} was sent as new twice")
            self.requests[new.req_id] = RequestState(
                new.req_id, list(new.prompt_token_ids), list(new.block_ids),
                new.num_computed_tokens, new.sampling_params)
            self.sampling.add_request(new.req_id, new.sampling_params, new.prompt_token_ids)
        self._apply_cached(out)

    def _apply_cached(self, out: SchedulerOutput) -> None:
        counted_ids, counted_tokens = [], []
        for rid, new_tokens, new_blocks, resumed_computed in out.scheduled_cached_reqs.unpack():
            state = self.requests[rid]
            if new_tokens:
                state.token_ids.extend(new_tokens)
                counted_ids.extend([rid] * len(new_tokens))
                counted_tokens.extend(new_tokens)
            if resumed_computed is not None:
                state.block_ids = list(new_blocks)
                state.num_computed_tokens = resumed_computed
            elif new_blocks:
                state.block_ids.extend(new_blocks)
        if counted_ids:
            self.sampling.append_tokens(counted_ids, counted_tokens)

    def _drop(self, rid: str) -> None:
        if self.requests.pop(rid, None) is not None:
            self.sampling.remove_request(rid)

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """Inputs for this step (O(scheduled tokens + their block tables)); advances each
        scheduled request's computed-token count past this step's tokens."""
        ids = out.scheduled_req_ids()
        sizes = out.num_scheduled_tokens
        order = [i for i, n in enumerate(sizes) if n == 1] + [
            i for i, n in enumerate(sizes) if n != 1]
        num_decodes = sum(1 for n in sizes if n == 1)
        bs = self.block_size
        tokens, positions, slots, seq_lens, tables = [], [], [], [], []
        sample_rows, sample_ids = [], []
        for row, i in enumerate(order):
            state = self.requests[ids[i]]
            start, n = state.num_computed_tokens, sizes[i]
            end = start + n
            if end > len(state.token_ids):
                raise RuntimeError(f"request {ids[i]!r}: scheduled past its known tokens")
            if n == 1:
                tokens.append(state.token_ids[start])
                positions.append(start)
                slots.append(state.block_ids[start // bs] * bs + start % bs)
            else:
                pos = np.arange(start, end, dtype=np.int64)
                tokens.extend(state.token_ids[start:end])
                positions.append(pos)
                slots.append(np.asarray(state.block_ids, dtype=np.int64)[pos // bs] * bs + pos % bs)
            seq_lens.append(end)
            tables.append(state.block_ids)
            # The scheduler advances its count the same way; it resends it only on resume.
            state.num_computed_tokens = end
            if end == len(state.token_ids):
                sample_rows.append(row)
                sample_ids.append(ids[i])
        return StepInputs(np.asarray(tokens, dtype=np.int64), _concat(positions),
                          _concat(slots), [sizes[i] for i in order], seq_lens, tables,
                          num_decodes, order, sample_rows, sample_ids)


def _concat(parts: list) -> np.ndarray:
    """Concatenates scalars (decodes) and arrays (prefill chunks) into one int64 array."""
    if all(isinstance(p, int) for p in parts):
        return np.asarray(parts, dtype=np.int64)
    return np.concatenate([np.atleast_1d(np.asarray(p, dtype=np.int64)) for p in parts])

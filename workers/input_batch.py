"""The worker's persistent input batch: every live request's tokens, block table and counts in
preallocated arrays, a row per request, updated in place from SchedulerOutput diffs.

A request takes a free row the step its prompt arrives (NewRequestData, the only time it
travels) and keeps it until it finishes; its row is then reused. Each later step writes the
tokens and block ids the scheduler sends at the end of the row. A preempted request keeps its
tokens and loses its blocks until it resumes, when its block row is rewritten.

A step's inputs are gathered from the arrays with vectorised numpy over the scheduled rows, so
its host work is O(scheduled tokens + new blocks), never O(context): the attention reads each
sequence's blocks through the persistent table and the sequence's row, and no per-step table is
built. On CUDA the table is pinned and mirrored on the device, where only new entries are
written; the step's inputs go through pinned buffers with non-blocking copies.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tierserve.scheduler.messages import CachedRequestData, NewRequestData, SchedulerOutput
from tierserve.scheduler.params import SamplingParams
from tierserve.workers.attention import AttentionMetadata
from tierserve.workers.sampler import SamplingStateTable

__all__ = ["BlockTable", "HostToDevice", "InputBatch", "StepInputs"]

# Capacities where the engine gives none; every array grows by doubling past its capacity.
_DEFAULT_ROWS = 16
_DEFAULT_TOKENS = 1024


@dataclass(slots=True)
class StepInputs:
    """One forward's inputs, with decodes packed first as the attention kernel expects; the
    i-th packed sequence is out.scheduled_req_ids()[order[i]]."""

    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    token_rows: np.ndarray  # [num_tokens] int32 batch row of each token's sequence
    query_lens: np.ndarray  # [num_seqs] int64
    seq_lens: np.ndarray  # [num_seqs] int64
    rows: np.ndarray  # [num_seqs] int64 batch row of each sequence
    num_decodes: int
    order: np.ndarray  # [num_seqs] int64
    # Packed sequence indices that end at the last known token (or its drafts) and so
    # sample, and their ids.
    sample_rows: np.ndarray  # [num_samples] int64
    sample_req_ids: list[str]
    # Speculative decoding: each packed sequence's drafts after its last known token (their
    # positions are its last query tokens); None when the step has none.
    num_drafts: np.ndarray | None = None  # [num_seqs] int64


def _grown(size: int, needed: int) -> int:
    while size < needed:
        size *= 2
    return size


def _runs(groups: np.ndarray) -> np.ndarray:
    """How many earlier elements equal each element: [5, 5, 2, 5, 2] -> [0, 1, 0, 2, 1]."""
    n = len(groups)
    order = np.argsort(groups, kind="stable")
    grouped = groups[order]
    starts = np.flatnonzero(np.concatenate(([True], grouped[1:] != grouped[:-1])))
    runs = np.empty(n, dtype=np.int64)
    runs[order] = np.arange(n) - np.repeat(starts, np.diff(np.append(starts, n)))
    return runs


class BlockTable:
    """Block ids of every row, [rows, max_blocks] int32 host memory (pinned on CUDA), and each
    row's count. Off the CPU (or with mirror) a device copy is kept current by writing each
    step's new entries into it; on CPU the attention reads the host table itself."""

    def __init__(self, rows: int, cols: int, device: torch.device,
                 mirror: bool | None = None) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self.mirrored = device.type != "cpu" if mirror is None else mirror
        self.host = torch.zeros(rows, cols, dtype=torch.int32, pin_memory=self.pinned)
        self.array = self.host.numpy()  # shares the host tensor's memory
        self.num_blocks = np.zeros(rows, dtype=np.int64)
        self._device_table = self.host.to(device, copy=True) if self.mirrored else self.host
        self._pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def grow(self, rows: int, cols: int) -> None:
        """Capacity for at least `rows` rows of `cols` blocks (doubling); contents kept."""
        old_rows, old_cols = self.array.shape
        rows, cols = _grown(old_rows, rows), _grown(old_cols, cols)
        if (rows, cols) == (old_rows, old_cols):
            return
        host = torch.zeros(rows, cols, dtype=torch.int32, pin_memory=self.pinned)
        host[:old_rows, :old_cols] = self.host
        self.host, self.array = host, host.numpy()
        self.num_blocks = np.concatenate((self.num_blocks, np.zeros(rows - old_rows, np.int64)))
        if self.mirrored:
            table = torch.zeros(rows, cols, dtype=torch.int32, device=self.device)
            table[:old_rows, :old_cols] = self._device_table
            self._device_table = table
        else:
            self._device_table = self.host

    def clear(self, rows) -> None:
        self.num_blocks[rows] = 0

    def append(self, rows: np.ndarray, runs: np.ndarray, block_ids: list[int]) -> None:
        """block_ids[i] goes at the end of row rows[i], after the earlier ids of that row;
        `runs` numbers each id among them (_runs of the rows)."""
        cols = self.num_blocks[rows] + runs
        self.grow(0, int(cols.max()) + 1)
        ids = np.asarray(block_ids, dtype=np.int32)
        self.array[rows, cols] = ids
        np.maximum.at(self.num_blocks, rows, cols + 1)
        if self.mirrored:
            self._pending.append((rows, cols, ids))

    def device_table(self) -> torch.Tensor:
        """[rows, max_blocks] int32 on the device, with every entry written so far."""
        if self._pending:
            rows, cols, ids = (np.concatenate(parts) for parts in zip(*self._pending))
            self._pending.clear()
            to = lambda a: torch.from_numpy(a).to(self.device)  # noqa: E731
            self._device_table[to(rows), to(cols)] = to(ids)
        return self._device_table


class HostToDevice:
    """A step's host arrays as device tensors: on CPU zero-copy views; on CUDA through pinned
    buffers (one per input, grown on demand) copied with non_blocking. A buffer is written again
    only once the copies of the step before have completed (an event), whether or not that
    step read anything back."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: dict[str, torch.Tensor] = {}
        self._copied = None

    def __call__(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        if self.device.type == "cpu":
            return {name: torch.from_numpy(a) for name, a in arrays.items()}
        if self._copied is not None:
            self._copied.synchronize()
        out = {name: self._stage(name, a).to(self.device, non_blocking=True)
               for name, a in arrays.items()}
        self._copied = torch.cuda.Event()
        self._copied.record()
        return out

    def _stage(self, name: str, array: np.ndarray) -> torch.Tensor:
        source = torch.from_numpy(array)
        buf = self._buffers.get(name)
        if buf is None or buf.dtype != source.dtype or buf.numel() < source.numel():
            size = _grown(buf.numel() if buf is not None else 64, source.numel())
            buf = self._buffers[name] = torch.empty(size, dtype=source.dtype, pin_memory=True)
        staged = buf[: source.numel()]
        staged.copy_(source)
        return staged


class InputBatch:
    def __init__(self, block_size: int, sampling: SamplingStateTable, *,
                 device: torch.device | str = "cpu", max_num_seqs: int | None = None,
                 max_model_len: int | None = None) -> None:
        self.block_size = block_size
        self.sampling = sampling
        self.device = torch.device(device)
        rows = max_num_seqs or _DEFAULT_ROWS
        cols = max_model_len or _DEFAULT_TOKENS
        self.rows: dict[str, int] = {}  # req_id -> row
        self._free_rows = list(range(rows - 1, -1, -1))  # popped lowest first
        self.params: list[SamplingParams | None] = [None] * rows
        self.token_ids = np.zeros((rows, cols), dtype=np.int64)
        self.num_tokens = np.zeros(rows, dtype=np.int64)  # tokens known (prompt + sampled)
        self.num_computed = np.zeros(rows, dtype=np.int64)  # tokens whose K/V is in the pool
        self.num_prompt = np.zeros(rows, dtype=np.int64)  # tokens the request arrived with
        # Rows of requests that want prompt logprobs and have prompt positions left to score.
        self.prompt_logprob_rows: set[int] = set()
        # Rows of embedding requests (SamplingParams.pooling): their sampled row's hidden
        # state goes back with the step's reply.
        self.pooling_rows: set[int] = set()
        # The LoRA adapter digest each row's request runs with (0: the base model).
        self.lora_digests = np.zeros(rows, dtype=np.int64)
        self.blocks = BlockTable(rows, -(-cols // block_size), self.device)
        self.to_device = HostToDevice(self.device)

    def params_of(self, req_id: str) -> SamplingParams:
        return self.params[self.rows[req_id]]

    # ------------------------------------------------------------------ diffs

    def apply(self, out: SchedulerOutput) -> None:
        for rid in out.finished_req_ids:
            self._drop(rid)
        if out.preempted_req_ids:
            self.blocks.clear([self.rows[rid] for rid in out.preempted_req_ids])
        for new in out.scheduled_new_reqs:
            self._add(new)
        if out.scheduled_cached_reqs.req_ids:
            self._apply_cached(out.scheduled_cached_reqs)
        if out.num_spec_tokens:
            self._write_drafts(out)

    def _write_drafts(self, out: SchedulerOutput) -> None:
        """Each request's drafts after its known tokens, where the step's positions read them;
        they are not known tokens (num_tokens stays), and the tokens the step gives the
        request overwrite them."""
        counts = np.asarray(out.num_spec_tokens, dtype=np.int64)
        rows = np.array([self.rows[rid] for rid in out.scheduled_req_ids()], dtype=np.int64)
        token_rows = np.repeat(rows, counts)
        cols = self.num_tokens[token_rows] + _runs(token_rows)
        self._fit_tokens(int(cols.max()) + 1)
        self.token_ids[token_rows, cols] = out.spec_token_ids

    def drafts_of(self, inputs: "StepInputs", i: int) -> np.ndarray:
        """The drafts of packed sequence i (a view of its row)."""
        row = inputs.rows[i]
        start = self.num_tokens[row]
        return self.token_ids[row, start : start + inputs.num_drafts[i]]

    def _add(self, new: NewRequestData) -> None:
        if new.req_id in self.rows:
            raise RuntimeError(f"request {new.req_id!r} was sent as new twice")
        row = self._take_row()
        n = len(new.prompt_token_ids)
        self._fit_tokens(n)
        self.token_ids[row, :n] = new.prompt_token_ids
        self.num_tokens[row] = n
        self.num_computed[row] = new.num_computed_tokens
        prompt_end = n - new.num_output_tokens
        self.num_prompt[row] = prompt_end
        # A request with outputs (re-sent after a restart) had its prompt logprobs already.
        if new.sampling_params.prompt_logprobs is not None and not new.num_output_tokens \
                and new.num_computed_tokens < n - 1:
            self.prompt_logprob_rows.add(row)
        self.blocks.clear(row)
        if new.block_ids:
            rows = np.full(len(new.block_ids), row, dtype=np.int64)
            self.blocks.append(rows, np.arange(len(rows)), new.block_ids)
        self.rows[new.req_id] = row
        self.params[row] = new.sampling_params
        if new.sampling_params.pooling:
            self.pooling_rows.add(row)
        self.lora_digests[row] = 0 if new.lora is None else new.lora.digest
        self.sampling.add_request(new.req_id, new.sampling_params,
                                  new.prompt_token_ids[:prompt_end],
                                  new.prompt_token_ids[prompt_end:])

    def _apply_cached(self, cached: CachedRequestData) -> None:
        ids = cached.req_ids
        rows = np.array([self.rows[rid] for rid in ids], dtype=np.int64)
        self._append_tokens(cached, rows)
        if cached.resumed:
            resumed = rows[cached.resumed]
            self.blocks.clear(resumed)
            self.num_computed[resumed] = cached.resumed_num_computed
        if cached.new_block_ids:
            owners = np.asarray(cached.new_block_owners, dtype=np.int64)
            self.blocks.append(rows[owners], _runs(owners), cached.new_block_ids)

    def _append_tokens(self, cached: CachedRequestData, rows: np.ndarray) -> None:
        """Each request's new tokens (usually one) at the end of its row."""
        if not cached.new_token_ids:
            return
        if cached.num_new_tokens:
            counts = np.asarray(cached.num_new_tokens, dtype=np.int64)
            token_rows = np.repeat(rows, counts)
            cols = self.num_tokens[token_rows] + _runs(token_rows)
            counted_ids = [rid for rid, n in zip(cached.req_ids, cached.num_new_tokens)
                           for _ in range(n)]
        else:
            counts, token_rows, counted_ids = 1, rows, cached.req_ids
            cols = self.num_tokens[rows]
        self._fit_tokens(int(cols.max()) + 1)
        self.token_ids[token_rows, cols] = cached.new_token_ids
        self.num_tokens[rows] += counts
        # A request computes its known tokens but the last; one that decoded drafts computed
        # past it, and the rejected ones are not computed after all.
        self.num_computed[rows] = np.minimum(self.num_computed[rows], self.num_tokens[rows] - 1)
        self.sampling.append_tokens(counted_ids, cached.new_token_ids)

    def append_sampled(self, inputs: "StepInputs", token_ids: torch.Tensor) -> None:
        """Async scheduling: the tokens this step gave each sampling sequence ([num_samples,
        width] int64, in inputs.sample_rows order, each row's tokens first and -1 after them)
        go at the end of their rows, where the next step's placeholder positions read them;
        the scheduler never sends them back."""
        tokens = token_ids.cpu().numpy().reshape(len(inputs.sample_rows), -1)
        counts = (tokens >= 0).sum(axis=1)
        rows = np.repeat(inputs.rows[inputs.sample_rows], counts)
        cols = self.num_tokens[rows] + _runs(rows)
        self._fit_tokens(int(cols.max()) + 1)
        flat = tokens[tokens >= 0]
        self.token_ids[rows, cols] = flat
        sample_rows = inputs.rows[inputs.sample_rows]
        self.num_tokens[sample_rows] += counts
        self.num_computed[sample_rows] = self.num_tokens[sample_rows] - 1
        ids = [rid for rid, n in zip(inputs.sample_req_ids, counts.tolist()) for _ in range(n)]
        self.sampling.append_tokens(ids, torch.from_numpy(flat))

    def _drop(self, rid: str) -> None:
        row = self.rows.pop(rid, None)
        if row is not None:
            self.params[row] = None
            self.prompt_logprob_rows.discard(row)
            self.pooling_rows.discard(row)
            self.lora_digests[row] = 0
            self._free_rows.append(row)
            self.sampling.remove_request(rid)

    def _take_row(self) -> int:
        if not self._free_rows:
            self._grow_rows(2 * len(self.params))
        return self._free_rows.pop()

    def _grow_rows(self, rows: int) -> None:
        old = len(self.params)
        extra = rows - old
        self.params.extend([None] * extra)
        self.token_ids = np.concatenate(
            (self.token_ids, np.zeros((extra, self.token_ids.shape[1]), np.int64)))
        self.num_tokens = np.concatenate((self.num_tokens, np.zeros(extra, np.int64)))
        self.num_computed = np.concatenate((self.num_computed, np.zeros(extra, np.int64)))
        self.num_prompt = np.concatenate((self.num_prompt, np.zeros(extra, np.int64)))
        self.lora_digests = np.concatenate((self.lora_digests, np.zeros(extra, np.int64)))
        self.blocks.grow(rows, 0)
        self._free_rows = list(range(rows - 1, old - 1, -1)) + self._free_rows

    def _fit_tokens(self, n: int) -> None:
        """Room for n tokens in every row (doubling the row length)."""
        cols = self.token_ids.shape[1]
        if n > cols:
            wider = np.zeros((self.token_ids.shape[0], _grown(cols, n)), np.int64)
            wider[:, :cols] = self.token_ids
            self.token_ids = wider

    # ------------------------------------------------------------------ a step's inputs

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """Inputs for this step, O(scheduled tokens); advances each scheduled request's
        computed-token count past this step's tokens."""
        ids = out.scheduled_req_ids()
        sizes = np.asarray(out.num_scheduled_tokens, dtype=np.int64)
        decode = sizes == 1
        order = np.concatenate((np.flatnonzero(decode), np.flatnonzero(~decode)))
        rows = np.array([self.rows[rid] for rid in ids], dtype=np.int64)[order]
        query_lens = sizes[order]
        starts = self.num_computed[rows]
        ends = starts + query_lens
        drafts = np.asarray(out.num_spec_tokens, dtype=np.int64)[order] \
            if out.num_spec_tokens else None
        known = self.num_tokens[rows] + (drafts if drafts is not None else 0)
        self._check(ids, order, rows, ends, known)
        num_decodes = int(np.count_nonzero(decode))
        if num_decodes == len(rows):
            token_rows, positions = rows, starts
        else:
            token_rows = np.repeat(rows, query_lens)
            firsts = np.cumsum(query_lens) - query_lens  # first token of each sequence
            positions = np.repeat(starts - firsts, query_lens) + np.arange(len(token_rows))
        bs = self.block_size
        blocks = self.blocks.array[token_rows, positions // bs].astype(np.int64)
        # The scheduler advances its count the same way; it resends it only on resume.
        self.num_computed[rows] = ends
        sample_rows = np.flatnonzero(ends == known)
        return StepInputs(
            self.token_ids[token_rows, positions], positions, blocks * bs + positions % bs,
            token_rows.astype(np.int32), query_lens, ends, rows, num_decodes, order, sample_rows,
            [ids[i] for i in order[sample_rows].tolist()], drafts)

    def _check(self, ids: list[str], order: np.ndarray, rows: np.ndarray,
               ends: np.ndarray, known: np.ndarray) -> None:
        """Every scheduled token must be known (or a draft) and have a block to go to."""
        bad = np.flatnonzero((ends > known) |
                             (ends > self.blocks.num_blocks[rows] * self.block_size))
        if len(bad):
            i = int(bad[0])
            raise RuntimeError(
                f"request {ids[order[i]]!r}: scheduled up to token {ends[i]}, past its "
                f"{self.num_tokens[rows[i]]} known tokens or its "
                f"{self.blocks.num_blocks[rows[i]]} blocks")

    def forward_inputs(self, inputs: StepInputs
                       ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """input_ids [num_tokens], positions [num_tokens] and the attention metadata, on the
        device; the metadata reads the persistent block table through each sequence's row."""
        dev = self.to_device({
            "input_ids": inputs.input_ids, "positions": inputs.positions,
            "slot_mapping": inputs.slot_mapping, "token_rows": inputs.token_rows,
            "token_lens": (inputs.positions + 1).astype(np.int32),
            "seq_rows": inputs.rows.astype(np.int32)})
        attn = AttentionMetadata(
            slot_mapping=dev["slot_mapping"], query_lens=inputs.query_lens,
            seq_lens=inputs.seq_lens, block_tables=self.blocks.device_table(), rows=inputs.rows,
            seq_rows=dev["seq_rows"], token_rows=dev["token_rows"], token_lens=dev["token_lens"],
            num_decodes=inputs.num_decodes, block_size=self.block_size)
        return dev["input_ids"], dev["positions"], attn

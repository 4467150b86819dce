"""Decode steps replayed from CUDA graphs.

A decode step of a small model is a thousand tiny kernels whose launches, not the GPU, bound it
in eager mode. A decode-only step (every sequence one query token) is instead run by replaying
a graph captured for its shape bucket: the batch padded up to a power of two N, and the decode
block tables cut to a power-of-two width W covering the longest context. The graph reads its
inputs from static buffers that each step fills in place:

  ids, positions, slots   [N_max]             int64
  tables                  [N_max, W_max]      int32 (decode rows only, a copy of the batch's)
  lens                    [N_max]             int32 context length after this step

Padding rows (n <= i < N) decode token 0 at position 0 over a context of one token and write
their K/V to the null block's first slot, which no table reads unmasked (the null block is the
pool's last id and is never allocated). A graph is captured on the first step of its bucket
and kept for the engine's life; all graphs share one memory pool, so a graph's output is valid
only until the next replay (the caller reads it before the next step).

The same code runs on a CPU device without capture (`capture=False`): the padded static
forward then runs eagerly, which is how tests pin the padding and the buffers without a GPU.
"""
from __future__ import annotations

import logging

import torch

from tierserve.workers.attention import AttentionMetadata

__all__ = ["DecodeGraphs"]

log = logging.getLogger(__name__)

# Gathered K and V of one layer in a graph at most: a bucket past it runs eagerly.
_MAX_GATHER_BYTES = 256 << 20


def _bucket(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class DecodeGraphs:
    def __init__(self, model, kv_caches: list, block_size: int, max_batch: int,
                 max_model_len: int, capture: bool = True) -> None:
        k_cache = kv_caches[0][0]
        num_blocks, _, kv_heads, head_dim = k_cache.shape
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.capture = capture
        self.max_batch = _bucket(max_batch)
        self.max_width = _bucket(-(-max_model_len // block_size))
        self.token_bytes = 2 * kv_heads * head_dim * k_cache.element_size()
        self.null_slot = (num_blocks - 1) * block_size
        device = k_cache.device
        n, w = self.max_batch, self.max_width
        self.ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), self.null_slot, dtype=torch.long, device=device)
        self.tables = torch.full((n, w), num_blocks - 1, dtype=torch.int32, device=device)
        self.lens = torch.ones(n, dtype=torch.int32, device=device)
        # (batch, width) -> the graph and its output (None: a bucket run without capture).
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor] | None] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0
        self.failed: str | None = None  # why capture stopped (graphs off from then on)

    def bucket_of(self, attn: AttentionMetadata) -> tuple[int, int] | None:
        """The (batch, width) bucket of a step, or None where the step runs eagerly: not
        decode-only, or larger than the buffers or the gather bound."""
        n = attn.num_decodes
        if self.failed or n == 0 or n != attn.num_tokens or n > self.max_batch:
            return None
        width = _bucket(-(-int(attn.seq_lens.max()) // self.block_size))
        batch = _bucket(n)
        if width > self.max_width or \
                batch * width * self.block_size * self.token_bytes > _MAX_GATHER_BYTES:
            return None
        return batch, width

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
            bucket: tuple[int, int]) -> torch.Tensor:
        """The final hidden states [n, hidden] of a decode-only step (bucket from bucket_of):
        a view of the graph's output, valid until the next replay."""
        n = attn.num_decodes
        self._fill(input_ids, positions, attn)
        if not self.capture:
            self.graphs.setdefault(bucket, None)
            out = self._forward(*bucket)
        else:
            entry = self.graphs.get(bucket) or self._capture(*bucket)
            if entry is None:  # capture failed: this step, and every later one, eagerly
                return self.model(input_ids, positions, attn, self.kv_caches)
            graph, out = entry
            graph.replay()
        self.replays += 1
        return out[:n]

    def _fill(self, input_ids, positions, attn: AttentionMetadata) -> None:
        n = attn.num_decodes
        table, lens = attn.decode_tables()
        self.ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(attn.slot_mapping)
        self.tables[:n, : table.shape[1]].copy_(table)
        self.lens[:n].copy_(lens)
        # Padding rows: rows n.. may hold an earlier, larger step's sequences.
        self.ids[n:].zero_()
        self.positions[n:].zero_()
        self.slots[n:].fill_(self.null_slot)
        self.lens[n:].fill_(1)

    def _forward(self, batch: int, width: int) -> torch.Tensor:
        """The padded step from the static buffers, through fresh metadata (so whatever it
        derives from the buffers, such as the padding mask, is computed inside a capture)."""
        attn = AttentionMetadata.static_decode(self.slots[:batch], self.tables[:batch], width,
                                               self.lens[:batch], self.block_size)
        return self.model(self.ids[:batch], self.positions[:batch], attn, self.kv_caches)

    def _capture(self, batch: int, width: int):
        try:
            # The warm-up runs this step's own inputs (its K/V writes are the replay's too).
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward(batch, width)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread's CUDA work (a tier copy) does not void the capture.
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                out = self._forward(batch, width)
        except RuntimeError as e:  # an op that cannot be captured: eager from now on
            self.failed = f"{type(e).__name__}: {e}"
            log.warning("CUDA graph capture of a %d x %d decode failed, running eagerly: %s",
                        batch, width, self.failed)
            return None
        self.graphs[batch, width] = (graph, out)
        return self.graphs[batch, width]

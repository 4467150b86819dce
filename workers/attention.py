"""Paged attention over a block-structured KV pool.

Pool layout per layer: K and V each [num_blocks, block_size, kv_heads_per_rank, head_dim]; the
flat slot of (block b, offset o) is b * block_size + o. Each step first writes every new token's
K/V into its slot, then every sequence attends over its whole context read back through its block
table, so a sequence may read blocks another sequence of the same batch wrote at this layer.

Token layout of a batch: the first `num_decodes` sequences are decodes (one query token each),
followed by prefill chunks whose positions continue after a possibly cached prefix.

The same torch ops run on CPU and CUDA: decodes are one batched SDPA over K/V gathered block-wise
through the block tables; prefill chunks are one SDPA each. Grouped-query attention needs no K/V
expansion: for decodes the query heads sharing a KV head are laid out as that head's query rows.
This is the torch backend's attention (`torch_attention`); a backend runs its own through the
same metadata (workers/backends/cpu.py: every token reads K/V in place through its block table,
prefill tokens each over their causal context, in one call a layer, with no gather copy and no
padding). The pools themselves are allocated by workers/kv_pool.py.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    """One prefill sequence's slice of the batch, with its context gather precomputed."""

    query_start: int
    query_end: int
    seq_len: int
    # Block ids covering the context [ceil(seq_len / block_size)]; None when the chunk is the
    # whole context, so the fresh K/V are used directly with is_causal.
    block_ids: torch.Tensor | None
    # [query_len, seq_len] bool, True = may attend; None when is_causal suffices.
    mask: torch.Tensor | None
    _window_masks: dict = field(default_factory=dict, repr=False, compare=False)

    def window_mask(self, window: int) -> torch.Tensor:
        """The causal mask cut to a sliding window: query position p sees keys p - W < j <= p
        (Mistral's). [query_len, seq_len] bool, built once per step and window."""
        mask = self._window_masks.get(window)
        if mask is None:
            query_len = self.query_end - self.query_start
            q_pos = torch.arange(self.seq_len - query_len, self.seq_len)[:, None]
            k_pos = torch.arange(self.seq_len)[None, :]
            mask = (k_pos <= q_pos) & (k_pos > q_pos - window)
            self._window_masks[window] = mask
        return mask


@dataclass
class AttentionMetadata:
    """One step's attention inputs. Block tables are rows of a table the caller keeps (the
    worker's persistent one): a sequence reads its context through row seq_rows[i], so a step
    copies no table. Host arrays hold what Python code branches on; tensors are on the device."""

    slot_mapping: torch.Tensor  # [num_tokens] int64 flat slot each new token's K/V goes to
    query_lens: np.ndarray  # [num_seqs] int64
    seq_lens: np.ndarray  # [num_seqs] int64 context length of each sequence after this step
    # [num_rows, max_blocks] int32; entries past a row's own blocks are stale but valid ids.
    block_tables: torch.Tensor
    rows: np.ndarray  # [num_seqs] int64 row of block_tables of each sequence
    seq_rows: torch.Tensor  # rows as int32 [num_seqs]
    token_rows: torch.Tensor  # [num_tokens] int32 row of each token's sequence
    token_lens: torch.Tensor  # [num_tokens] int32 causal context of each token (position + 1)
    num_decodes: int
    block_size: int
    query_start_loc: np.ndarray = field(init=False)  # [num_seqs + 1] int64
    _prefills: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _long_prefills: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _decode_gather: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _decode_tables: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.query_start_loc = np.zeros(len(self.query_lens) + 1, dtype=np.int64)
        np.cumsum(self.query_lens, out=self.query_start_loc[1:])

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @classmethod
    def build(cls, *, slot_mapping: list[int], query_lens: list[int], seq_lens: list[int],
              block_tables: list[list[int]], num_decodes: int, block_size: int,
              device="cpu") -> "AttentionMetadata":
        """From plain lists, one block table per sequence (tests and benches; O(tables)). The
        worker's path is InputBatch.prepare, over its persistent table."""
        _check_batch(slot_mapping, query_lens, seq_lens, block_tables, num_decodes, block_size)
        width = max((len(t) for t in block_tables), default=0)
        table = np.zeros((len(block_tables), width), dtype=np.int32)
        for i, t in enumerate(block_tables):
            table[i, : len(t)] = t
        q = np.asarray(query_lens, dtype=np.int64)
        s = np.asarray(seq_lens, dtype=np.int64)
        rows = np.arange(len(q), dtype=np.int64)
        starts = np.cumsum(q) - q
        # Token j of sequence i sits at position seq_len - query_len + (j - start of i).
        positions = np.repeat(s - q - starts, q) + np.arange(int(q.sum()), dtype=np.int64)
        to = functools.partial(torch.as_tensor, device=device)
        return cls(
            slot_mapping=to(np.asarray(slot_mapping, dtype=np.int64)), query_lens=q, seq_lens=s,
            block_tables=to(table), rows=rows, seq_rows=to(rows.astype(np.int32)),
            token_rows=to(np.repeat(rows, q).astype(np.int32)),
            token_lens=to((positions + 1).astype(np.int32)), num_decodes=num_decodes,
            block_size=block_size)

    @classmethod
    def static_decode(cls, slot_mapping: torch.Tensor, tables: torch.Tensor, width: int,
                      lens: torch.Tensor, block_size: int) -> "AttentionMetadata":
        """A decode-only step read from fixed buffers (workers/cuda_graphs.py): slot_mapping
        [N] int64, the decode rows' block tables [N, max_blocks] int32 (contiguous; the gather
        path reads their first `width` blocks) and context lengths [N] int32, whose values may
        change between uses of this metadata. Nothing derived from their values is built here:
        a CUDA graph captured through it recomputes everything from the buffers, and it
        creates no tensor from host data (no copy a capture would forbid)."""
        n = tables.shape[0]
        rows = torch.arange(n, dtype=torch.int32, device=tables.device)
        attn = cls(slot_mapping=slot_mapping, query_lens=np.ones(n, dtype=np.int64),
                   seq_lens=np.full(n, width * block_size, dtype=np.int64), block_tables=tables,
                   rows=np.arange(n, dtype=np.int64), seq_rows=rows, token_rows=rows,
                   token_lens=lens, num_decodes=n, block_size=block_size)
        attn._decode_tables = (tables[:, :width], lens)
        return attn

    def token_tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every token of the step as a single-query attention of its own: the block tables
        [num_rows, max_blocks] int32, its causal context length [num_tokens] int32 (a prefill
        token at position p sees p + 1 tokens) and its row of the tables [num_tokens] int32."""
        return self.block_tables, self.token_lens, self.token_rows

    def decode_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode sequences' block tables [num_decodes, decode_blocks] int32, decode_blocks
        covering the longest decode context (shorter rows padded with valid ids), and their
        context lengths [num_decodes] int32. A gather of rows, built once per step on first use
        (the gather path; the kernel path reads the tables in place)."""
        if self._decode_tables is None:
            nd = self.num_decodes
            lens = self.seq_lens[:nd]
            nblocks = -(-int(lens.max()) // self.block_size)
            table = self.block_tables[:, :nblocks].index_select(0, self.seq_rows[:nd])
            self._decode_tables = (table, torch.as_tensor(lens.astype(np.int32),
                                                          device=table.device))
        return self._decode_tables

    @property
    def prefills(self) -> list["PrefillChunk"]:
        return [self.prefill(i) for i in range(self.num_decodes, len(self.seq_lens))]

    def prefills_longer_than(self, max_context: int) -> list["PrefillChunk"]:
        """The prefill chunks whose context exceeds max_context (every layer asks the same)."""
        chunks = self._long_prefills.get(max_context)
        if chunks is None:
            nd = self.num_decodes
            long = np.flatnonzero(self.seq_lens[nd:] > max_context) + nd
            chunks = self._long_prefills[max_context] = [self.prefill(i) for i in long.tolist()]
        return chunks

    def prefill(self, i: int) -> "PrefillChunk":
        """Sequence i (a prefill chunk) with its context gather, built once per step."""
        chunk = self._prefills.get(i)
        if chunk is None:
            chunk = self._prefills[i] = self._build_prefill(i)
        return chunk

    def _build_prefill(self, i: int) -> "PrefillChunk":
        start, end = int(self.query_start_loc[i]), int(self.query_start_loc[i + 1])
        seq_len = int(self.seq_lens[i])
        query_len = end - start
        if query_len == seq_len:
            return PrefillChunk(start, end, seq_len, None, None)
        device = self.block_tables.device
        nblocks = -(-seq_len // self.block_size)
        block_ids = self.block_tables[int(self.rows[i]), :nblocks].to(dtype=torch.int64)
        # Query j sits at absolute position seq_len - query_len + j and sees positions <= it.
        q_pos = torch.arange(seq_len - query_len, seq_len)
        mask = torch.arange(seq_len)[None, :] <= q_pos[:, None]
        return PrefillChunk(start, end, seq_len, block_ids, mask.to(device))

    def decode_gather(self, dtype: torch.dtype, window: int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """For the gather path: block ids [num_decodes * decode_blocks] int64 and the additive
        padding mask [num_decodes, 1, 1, decode_blocks * block_size] in `dtype` (0 = real token,
        -inf = padding, or outside a sliding window), built once per step and shared by all
        layers (the CPU SDPA kernel is faster with an additive mask than a boolean one)."""
        cached = self._decode_gather.get((dtype, window))
        if cached is None:
            table, lens = self.decode_tables()
            positions = torch.arange(table.shape[1] * self.block_size, device=table.device)
            padding = positions[None, :] >= lens[:, None]
            if window is not None:
                padding |= positions[None, :] < (lens[:, None] - window)
            bias = torch.zeros(padding.shape, dtype=dtype, device=table.device)
            bias.masked_fill_(padding, float("-inf"))
            cached = (table.reshape(-1).long(), bias.view(self.num_decodes, 1, 1, -1))
            self._decode_gather[(dtype, window)] = cached
        return cached


def _check_batch(slot_mapping, query_lens, seq_lens, block_tables, num_decodes, block_size) -> None:
    if not (len(query_lens) == len(seq_lens) == len(block_tables)):
        raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
    if len(slot_mapping) != sum(query_lens):
        raise ValueError(f"slot_mapping has {len(slot_mapping)} entries for {sum(query_lens)} tokens")
    if not 0 <= num_decodes <= len(query_lens) or any(q != 1 for q in query_lens[:num_decodes]):
        raise ValueError("the first num_decodes sequences must each have query_len == 1")
    for q, s, t in zip(query_lens, seq_lens, block_tables):
        if q < 1 or s < q:
            raise ValueError(f"bad lengths: query_len {q}, seq_len {s}")
        if len(t) * block_size < s:
            raise ValueError(f"block table of {len(t)} blocks cannot hold {s} tokens")


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter k, v [num_tokens, kv_heads, head_dim] into their flat pool slots."""
    kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    kv_cache: tuple[torch.Tensor, torch.Tensor], attn: AttentionMetadata,
                    scale: float, backend, window: int | None = None,
                    kv_written: bool = False) -> torch.Tensor:
    """q [T, heads, D], k/v [T, kv_heads, D] for this step's tokens -> [T, heads * D], through
    `backend.attention`. window: a sliding window (each token sees the last `window` tokens of
    its context), or None. kv_written: k and v are already in their pool slots."""
    if not kv_written:
        write_kv(*kv_cache, k, v, attn.slot_mapping)
    return backend.attention(q, k, v, kv_cache, attn, scale, window)


def torch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    kv_cache: tuple[torch.Tensor, torch.Tensor], attn: AttentionMetadata,
                    scale: float, window: int | None = None) -> torch.Tensor:
    """The torch backend's step, K/V already in the pool -> [T, heads * D]: decodes as one
    batched SDPA over gathered blocks, prefill chunks one SDPA each."""
    k_cache, v_cache = kv_cache
    num_tokens, heads, head_dim = q.shape
    nd = attn.num_decodes
    if nd == num_tokens:
        return _decode(q, k_cache, v_cache, attn, scale, window).view(num_tokens,
                                                                      heads * head_dim)
    out = torch.empty(num_tokens, heads, head_dim, dtype=q.dtype, device=q.device)
    if nd:
        out[:nd] = _decode(q[:nd], k_cache, v_cache, attn, scale, window)
    for chunk in attn.prefills:
        out[chunk.query_start : chunk.query_end] = _prefill(q, k, v, k_cache, v_cache, chunk,
                                                            scale, window)
    return out.view(num_tokens, heads * head_dim)


def chunk_context(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, chunk: "PrefillChunk"
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill chunk's keys and values over its whole context, [seq_len, kv_heads, D]: the
    step's own where the chunk is the whole context, else gathered from its blocks."""
    if chunk.block_ids is None:
        return k[chunk.query_start : chunk.query_end], v[chunk.query_start : chunk.query_end]
    kv_heads, head_dim = k_cache.shape[2:]
    keys = k_cache.index_select(0, chunk.block_ids).view(-1, kv_heads, head_dim)[: chunk.seq_len]
    values = v_cache.index_select(0, chunk.block_ids).view(-1, kv_heads, head_dim)[: chunk.seq_len]
    return keys, values


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            attn: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
    """Batched single-token attention through gathered K/V -> [num_decodes, heads, D]."""
    nd, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    block_ids, bias = attn.decode_gather(q.dtype, window)
    # [nd, kv_heads, L, D]; whole-block gathers are large contiguous copies.
    keys = k_cache.index_select(0, block_ids).view(nd, -1, kv_heads, head_dim).transpose(1, 2)
    values = v_cache.index_select(0, block_ids).view(nd, -1, kv_heads, head_dim).transpose(1, 2)
    # HF GQA maps query head h to KV head h // group, so [nd, kv_heads, group, D] puts each
    # group's queries as the query rows of its KV head.
    q = q.view(nd, kv_heads, heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=scale)
    return out.reshape(nd, heads, head_dim)


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, chunk: PrefillChunk, scale: float,
             window: int | None = None) -> torch.Tensor:
    """Causal attention of one chunk over its context through SDPA -> [query_len, heads, D]."""
    s, e = chunk.query_start, chunk.query_end
    keys, values = chunk_context(k, v, k_cache, v_cache, chunk)
    query = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, heads, query_len, D]
    keys = keys.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, seq_len, D]
    values = values.transpose(0, 1).unsqueeze(0)
    mask = chunk.mask
    if window is not None and chunk.seq_len > window:
        mask = chunk.window_mask(window).to(query.device)
    out = F.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, is_causal=mask is None,
        scale=scale, enable_gqa=True,
    )
    return out[0].transpose(0, 1)

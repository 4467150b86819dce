"""`tierserve analyze`: what prefix caches of each size would save on a request log.

inputs.py opens logs and traces as Traces (traces.py; text_inputs.py and mooncake.py for the
foreign formats), stats.py computes the seed's sharing figures, replay.py replays the traces
through the engine's own KVCacheManager, tier index and tier policy at each capacity, costs.py
turns hits into seconds, analyzer.py runs one pass over everything, report.py prints it. The
replay and the statistics import neither torch nor a tokenizer; a model is read only where
text must be tokenized or a block's bytes computed (model.py, profile.py).
"""
from __future__ import annotations

import itertools
from typing import Iterable, Sequence

from tierserve.runtime.analyze.analyzer import analyze_source, token_traces
from tierserve.runtime.analyze.costs import Costs
from tierserve.runtime.analyze.inputs import DEFAULT_OUTPUT_LEN, open_inputs
from tierserve.runtime.analyze.replay import Capacity
from tierserve.runtime.analyze.traces import TraceSource

__all__ = ["analyze", "Capacity", "Costs"]


def analyze(inputs: str | Sequence[str] | Iterable[Sequence[int]], *,
            model: str | None = None, block_size: int | None = None,
            device_blocks: Sequence[int] | None = None, cpu_bytes: Sequence[int] | None = None,
            ssd_bytes: Sequence[int] | None = None, dtype: str | None = None,
            tensor_parallel_size: int | None = None, costs: Costs | None = None,
            rate: float | None = None, output_len: int = DEFAULT_OUTPUT_LEN,
            hash_algo: str = "xxhash", hash_seed: int = 0, statistics: bool = True) -> dict:
    """The figures `tierserve analyze --json` prints. `inputs`: paths (request logs, OpenAI
    JSONL, ShareGPT, Mooncake traces), or the seed's list of token-id lists (prompts). Every
    combination of device_blocks x cpu_bytes x ssd_bytes (per rank, as the engine options
    kv_offload_cpu_bytes and kv_offload_ssd_bytes count them) is replayed; where the input is
    the engine's log, each defaults to the engine's own."""
    if isinstance(inputs, str):
        inputs = [inputs]
    inputs = list(inputs)
    if inputs and not isinstance(inputs[0], str):
        bs = block_size or 16
        source = TraceSource(token_traces(inputs, bs), bs)
    else:
        tokenizer = _tokenizer(model) if model is not None else None
        source = open_inputs(inputs, block_size=block_size, tokenizer=tokenizer,
                             hash_algo=hash_algo, hash_seed=hash_seed,
                             default_output_len=output_len, rate=rate)
    block_bytes, ranges = _block_bytes(source, model, dtype, tensor_parallel_size)
    capacities = _capacities(source, device_blocks, cpu_bytes, ssd_bytes, block_bytes, ranges)
    return analyze_source(source, capacities, costs=costs, block_bytes=block_bytes,
                          statistics=statistics)


def _capacities(source: TraceSource, device_blocks, cpu_bytes, ssd_bytes, block_bytes: int,
                ranges: int) -> list[Capacity]:
    """Every combination asked for, in blocks; what is not asked is the engine's own (from
    its log's header), else no tier."""
    header = source.header
    if device_blocks is None:
        if header is None or not header.num_blocks:
            raise ValueError("pass device_blocks (--device-blocks): the input does not say "
                             "how large the engine's pool was")
        device_blocks = [header.num_blocks]
    if any(d < 2 for d in device_blocks):
        raise ValueError(f"device blocks must be >= 2 (one is the null block), got "
                         f"{list(device_blocks)}")
    own = header is not None and cpu_bytes is None and ssd_bytes is None
    if own:
        cpu = [(header.cpu_slots, header.cpu_slots * block_bytes)]
        ssd = [(header.ssd_entries, header.ssd_entries * block_bytes * ranges)]
    else:
        if block_bytes == 0 and any(itertools.chain(cpu_bytes or (), ssd_bytes or ())):
            raise ValueError("tier sizes in bytes need a block's size: pass --model (with "
                             "--dtype and --tensor-parallel-size) or analyze the engine's "
                             "own log")
        cpu = [(b // block_bytes if b else 0, b) for b in cpu_bytes or (0,)]
        ssd = [(b // (block_bytes * ranges) if b else 0, b) for b in ssd_bytes or (0,)]
    # An SSD tier without a CPU tier is no configuration (SSD blocks go through the CPU tier).
    out = [Capacity(d, c, s, cb, sb) for d, (c, cb), (s, sb) in
           itertools.product(device_blocks, cpu, ssd) if c or not s]
    if not out:
        raise ValueError("an SSD tier needs a CPU tier (SSD blocks go through it): give "
                         "--cpu-bytes a size beside --ssd-bytes")
    return out


def _tokenizer(model: str):
    from tierserve.runtime import envs
    from tierserve.runtime.tokenizer import load_tokenizer
    try:
        return load_tokenizer(model, cache_dir=envs.cache_dir())
    except (OSError, ValueError) as e:
        raise ValueError(f"model: cannot load the tokenizer of {model!r}: {e}") from None


def _block_bytes(source: TraceSource, model: str | None, dtype: str | None,
                 tp: int | None) -> tuple[int, int]:
    """One block's KV bytes on one rank, and the distinct KV-head ranges over the ranks (an
    SSD block is one entry per range): from the model's config, else the log's header."""
    header = source.header
    if model is None:
        return (header.kv_block_bytes, header.kv_head_ranges) if header is not None else (0, 1)
    from tierserve.runtime.analyze.model import kv_block_bytes
    dtype = dtype or (header.dtype if header is not None and header.dtype else "float32")
    tp = tp or (header.tensor_parallel_size if header is not None else 1)
    return kv_block_bytes(model, dtype, tp, source.block_size)

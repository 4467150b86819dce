"""Mooncake's published traces (FAST'25): JSONL of {timestamp (ms), input_length, output_length,
hash_ids}, one hash id per 512-token block, equal ids meaning equal blocks with equal prefixes.

Each id stands for the same 512 tokens wherever it appears; our blocks cut those tokens at our
block size, and a block's key chains its parent's key with the ids and offset of the tokens it
covers, so two requests share a block exactly when the trace says they share its tokens.
"""
from __future__ import annotations

from typing import Iterator

from tierserve.runtime.analyze.traces import Trace

__all__ = ["MOONCAKE_BLOCK", "mooncake_trace", "is_mooncake"]

MOONCAKE_BLOCK = 512
_ROOT = hash(("tierserve-mooncake", MOONCAKE_BLOCK))


def is_mooncake(obj: dict) -> bool:
    return isinstance(obj, dict) and "hash_ids" in obj and "input_length" in obj


def mooncake_trace(obj: dict, block_size: int, where: str) -> Trace:
    """One line as a Trace; a line that does not fit the format is a ValueError naming it."""
    try:
        ids = obj["hash_ids"]
        prompt_len = int(obj["input_length"])
        output_len = int(obj.get("output_length", 1))
        arrival = float(obj["timestamp"]) / 1000.0 if "timestamp" in obj else None
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: not a Mooncake trace line ({type(e).__name__}: {e})") \
            from None
    if not isinstance(ids, list) or not all(type(i) is int for i in ids) \
            or prompt_len <= 0 or output_len < 0:
        raise ValueError(f"{where}: hash_ids must be a list of ints and input_length > 0")
    if len(ids) * MOONCAKE_BLOCK < prompt_len:
        raise ValueError(f"{where}: {len(ids)} hash ids cannot cover {prompt_len} tokens")
    return Trace(arrival, 0, prompt_len, max(output_len, 1), _chain(ids, prompt_len, block_size))


def _chain(ids: list, prompt_len: int, bs: int) -> list[int]:
    """Keys of the prompt's full blocks. Python's hash of a tuple of ints is deterministic
    (no PYTHONHASHSEED) and cheap, which is all a key needs within one analysis."""
    chain = []
    h = _ROOT
    if MOONCAKE_BLOCK % bs == 0:
        per = MOONCAKE_BLOCK // bs
        for j in range(prompt_len // bs):
            h = hash((h, ids[j // per], j % per))
            chain.append(h)
        return chain
    for j in range(prompt_len // bs):
        start, end = j * bs, (j + 1) * bs - 1
        h = hash((h, start % MOONCAKE_BLOCK,
                  *ids[start // MOONCAKE_BLOCK:end // MOONCAKE_BLOCK + 1]))
        chain.append(h)
    return chain


def iter_mooncake(lines: Iterator[tuple[str, dict]], block_size: int) -> Iterator[Trace]:
    for where, obj in lines:
        yield mooncake_trace(obj, block_size, where)

"""The one shape every input becomes: a Trace per request, in arrival order.

A Trace keys each full block by an int (a block-hash chain: equal ints mean equal KV, salt and
prefix included), so that the statistics and the replay never see text or token ids. Inputs
that know when requests arrived carry times; those that do not arrive back to back (the replay
starts each when the one before has finished), or at --rate.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from tierserve.runtime.request_log import LogHeader, chain_ints, read_log

__all__ = ["Trace", "TraceSource", "log_traces", "in_arrival_order"]


class Trace:
    """One request. `chain` holds the ints of its full blocks, prompt first; blocks past it
    (an output whose tokens the input does not know) are blocks nobody else shares."""

    __slots__ = ("arrival", "tenant", "prompt_len", "output_len", "chain", "duration", "ttft",
                 "served")

    def __init__(self, arrival: float | None, tenant: int, prompt_len: int, output_len: int,
                 chain: list[int], duration: float | None = None, ttft: float | None = None,
                 served: tuple[int, int, int] | None = None) -> None:
        self.arrival = arrival  # seconds; None: when the request before it has finished
        self.tenant = tenant  # 0: no cache salt
        self.prompt_len = prompt_len
        self.output_len = output_len
        self.chain = chain
        self.duration = duration  # arrival to last token, where the input knows it
        self.ttft = ttft
        # Prompt tokens the engine served from (device, CPU, SSD), where the input is our log.
        self.served = served

    def __repr__(self) -> str:
        return (f"Trace(arrival={self.arrival}, tenant={self.tenant}, "
                f"prompt_len={self.prompt_len}, output_len={self.output_len}, "
                f"blocks={len(self.chain)})")


@dataclass
class TraceSource:
    """Traces and what is known about where they came from."""

    traces: Iterable[Trace]
    block_size: int
    # The header of the engine's log, where the input is one (its capacities and costs).
    header: LogHeader | None = None
    # Records read out of arrival order beyond the reorder window (replayed late, counted).
    counters: dict = field(default_factory=lambda: {"late": 0})


def log_traces(paths: list[str]) -> TraceSource:
    """Our request logs: every file (rotations included, oldest first by their headers), one
    block size. Records are written as requests finish; in_arrival_order sorts them back."""
    opened = []
    for path in paths:
        header, records = read_log(path)
        opened.append((header.created, path, header, records))
    opened.sort(key=lambda o: (o[0], o[1]))
    first = opened[0][2]
    for _, path, header, records in opened[1:]:
        if (header.block_size, header.hash_bytes, header.hash_algo, header.hash_seed) != (
                first.block_size, first.hash_bytes, first.hash_algo, first.hash_seed):
            for _, _, _, r in opened:
                r.close()
            raise ValueError(f"{path}: its block size or hash ({header.block_size}, "
                             f"{header.hash_algo}:{header.hash_seed}) differs from "
                             f"{opened[0][1]}'s; analyze them separately")
    source = TraceSource((), first.block_size, first)
    traces = _log_records(first.hash_bytes, (o[3] for o in opened))
    source.traces = in_arrival_order(traces, source.counters)
    return source


def _log_records(width: int, files: Iterator) -> Iterator[Trace]:
    """A record's request as the engine admitted it: it arrives when it was first scheduled
    (the step that admitted it; requests admitted together arrive together), its times from
    then on."""
    for records in files:
        for r in records:
            q = r.queued
            yield Trace(r.arrival + q, r.tenant, r.prompt_len, r.output_len,
                        chain_ints(r.hashes, width), r.e2e - q,
                        r.ttft - q if r.ttft >= 0 else None,
                        (r.cached_device, r.cached_cpu, r.cached_ssd))


def in_arrival_order(traces: Iterable[Trace], counters: dict) -> Iterator[Trace]:
    """Traces written in the order they finished, yielded in the order they arrived. A trace is
    held until no later one can have arrived before it: a later one finishes no earlier, and
    takes no longer than the longest seen so far (one that does is yielded late, at the time
    of the last trace yielded, and counted in counters["late"]). Memory: the traces that finish
    within the longest request's duration, not the log."""
    heap: list = []
    seq = itertools.count()
    longest = 0.0
    last_out = float("-inf")

    def pop() -> Trace:
        nonlocal last_out
        arrival, _, t = heapq.heappop(heap)
        if arrival < last_out:
            counters["late"] += 1
            t.arrival = last_out
        else:
            last_out = arrival
        return t

    for t in traces:
        if t.arrival is None:  # back to back: after every trace before it
            while heap:
                yield pop()
            yield t
            continue
        duration = t.duration or 0.0
        if duration > longest:
            longest = duration
        heapq.heappush(heap, (t.arrival, next(seq), t))
        horizon = t.arrival + duration - longest
        while heap and heap[0][0] <= horizon:
            yield pop()
    while heap:
        yield pop()

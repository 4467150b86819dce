"""Opens what `tierserve analyze` is given: our request logs, or JSON text inputs (OpenAI request
bodies, ShareGPT conversations, Mooncake traces), each file's kind found from its first item.
Every input is streamed; an item that cannot be read is a ValueError naming its file and line.
"""
from __future__ import annotations

import codecs
import itertools
import json
import os
from typing import Iterator

import msgspec

from tierserve.runtime.analyze.mooncake import is_mooncake, iter_mooncake
from tierserve.runtime.analyze.text_inputs import (
    TextHasher, is_openai, is_sharegpt, openai_traces, sharegpt_traces,
)
from tierserve.runtime.analyze.traces import Trace, TraceSource, in_arrival_order, log_traces
from tierserve.runtime.request_log import is_request_log

__all__ = ["open_inputs", "json_items", "DEFAULT_OUTPUT_LEN"]

# Output tokens of a request whose input says nothing of its output.
DEFAULT_OUTPUT_LEN = 128
_CHUNK = 1 << 20


def open_inputs(paths: list[str], *, block_size: int | None = None, tokenizer=None,
                hash_algo: str = "xxhash", hash_seed: int = 0,
                default_output_len: int = DEFAULT_OUTPUT_LEN,
                rate: float | None = None) -> TraceSource:
    """The traces of every path, in arrival order. `tokenizer` (runtime.tokenizer.Tokenizer)
    is needed where an input holds text; block_size defaults to a log's own, else 16."""
    if not paths:
        raise ValueError("no input given")
    for path in paths:
        if not os.path.isfile(path):
            raise ValueError(f"{path}: no such file")
    logs = [is_request_log(p) for p in paths]
    if all(logs):
        source = log_traces(paths)
        if block_size is not None and block_size != source.block_size:
            raise ValueError(f"{paths[0]}: the log's chains are for block size "
                             f"{source.block_size}, not {block_size}")
        return source
    if any(logs):
        raise ValueError("request logs and JSON inputs cannot be analyzed together: "
                         f"{paths[logs.index(True)]} is a log, {paths[logs.index(False)]} is not")
    bs = block_size or 16
    source = TraceSource((), bs)
    text = TextHasher(tokenizer, bs, hash_algo, hash_seed)
    traces = itertools.chain.from_iterable(
        _file_traces(p, bs, text, default_output_len) for p in paths)
    if rate is not None:
        traces = _at_rate(traces, rate)
    source.traces = in_arrival_order(traces, source.counters)
    return source


def _file_traces(path: str, bs: int, text: TextHasher,
                 default_output: int) -> Iterator[Trace]:
    items = json_items(path)
    first = next(items, None)
    if first is None:
        return
    items = itertools.chain([first], items)
    where, obj = first
    if is_mooncake(obj):
        yield from iter_mooncake(items, bs)
        return
    if not (is_sharegpt(obj) or is_openai(obj)):
        raise ValueError(f"{where}: not a request log, an OpenAI request body, a ShareGPT "
                         f"conversation or a Mooncake trace line")
    if is_sharegpt(obj):
        yield from sharegpt_traces(items, text, default_output)
    else:
        yield from openai_traces(items, text, default_output)


def _at_rate(traces: Iterator[Trace], rate: float) -> Iterator[Trace]:
    """Requests with no time of their own arrive every 1/rate seconds."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    for i, t in enumerate(traces):
        if t.arrival is None:
            t.arrival = i / rate
        yield t


def json_items(path: str) -> Iterator[tuple[str, object]]:
    """(where, item) of a JSONL file (one item a line; blank lines skipped) or of a JSON array
    (streamed item by item)."""
    with open(path, "rb") as f:
        head = f.read(1)
        while head and head.isspace():
            head = f.read(1)
        f.seek(0)
        if head == b"[":
            yield from _array_items(f, path)
            return
        decode = msgspec.json.decode
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{path}: line {n}", decode(line)
            except msgspec.DecodeError as e:
                cut = "" if line.endswith(b"\n") else " (the file ends inside it: truncated?)"
                raise ValueError(f"{path}: line {n} is not valid JSON{cut}: {e}") from None


def _array_items(f, path: str) -> Iterator[tuple[str, object]]:
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")()
    buf = utf8.decode(f.read(_CHUNK))
    pos = buf.index("[") + 1
    n = 0
    eof = False
    while True:
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) or eof:
                break
            more = f.read(_CHUNK)
            eof = not more
            buf, pos = buf[pos:] + utf8.decode(more, final=eof), 0
        if pos >= len(buf):
            raise ValueError(f"{path}: the JSON array is truncated after item {n}")
        if buf[pos] == "]":
            return
        try:
            obj, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError as e:
            if eof:
                raise ValueError(f"{path}: item {n + 1} is not valid JSON: {e.msg}") from None
            more = f.read(_CHUNK)
            eof = not more
            buf, pos = buf[pos:] + utf8.decode(more, final=eof), 0
            continue
        n += 1
        yield f"{path}: item {n}", obj
        pos = end

"""A decode step's host work does not grow with context length.

The worker side of one step (InputBatch.apply of the step's diff, prepare, the forward's device
inputs and attention metadata, the kernel's token tables) is run for the same batch of requests
at a short and a long context, and measured without clocks: the Python function calls it makes
(sys.setprofile, C functions included), the bytes it allocates at its peak (tracemalloc, which
sees numpy's buffers) and the bytes of the tensors it hands the model. Each must be the same at
both lengths: the step touches the scheduled rows and their new blocks, never a context."""
from __future__ import annotations

import sys
import tracemalloc

import pytest
import torch

from tierserve.scheduler.messages import NewRequestData, SchedulerOutput
from tierserve.scheduler.params import SamplingParams
from tierserve.workers.input_batch import InputBatch
from tierserve.workers.sampler import SamplingStateTable

BS = 16
NUM_REQUESTS = 8
SHORT, LONG = 64, 4000  # contexts of whole blocks: the first decode token opens a new block
# Allowance for Python's own small-object churn (an int above 256 is an allocation).
SLACK_BYTES = 256


def _prefilled(context: int) -> tuple[InputBatch, int]:
    """A batch whose requests have each prefilled a `context`-token prompt; the next free
    block id."""
    batch = InputBatch(BS, SamplingStateTable(32000), max_num_seqs=16, max_model_len=8192)
    greedy = SamplingParams(temperature=0, max_tokens=16)
    per_request = context // BS
    news = [NewRequestData(f"r{i}", [(7 * i + p) % 30000 + 3 for p in range(context)], greedy,
                           list(range(i * per_request, (i + 1) * per_request)))
            for i in range(NUM_REQUESTS)]
    out = SchedulerOutput(0, news, num_scheduled_tokens=[context] * NUM_REQUESTS)
    batch.apply(out)
    batch.prepare(out)
    return batch, NUM_REQUESTS * per_request


def _decode(step: int, next_block: int | None) -> SchedulerOutput:
    """Every request decodes one token (the one it sampled last step), with a new block each
    where next_block is given, as the scheduler sends it."""
    out = SchedulerOutput(step, num_scheduled_tokens=[1] * NUM_REQUESTS)
    for i in range(NUM_REQUESTS):
        blocks = [] if next_block is None else [next_block + i]
        out.scheduled_cached_reqs.add(f"r{i}", [(step * 13 + i) % 30000 + 3], blocks)
    return out


def _host_step(batch: InputBatch, out: SchedulerOutput):
    batch.apply(out)
    inputs = batch.prepare(out)
    input_ids, positions, attn = batch.forward_inputs(inputs)
    return input_ids, positions, attn, attn.token_tables()


def _count_calls(fn) -> int:
    """Python and C function calls fn makes."""
    events = []
    sys.setprofile(lambda frame, event, arg: events.append(event))
    try:
        fn()
    finally:
        sys.setprofile(None)
    return sum(e in ("call", "c_call") for e in events)


def _peak_allocated(fn) -> int:
    """Bytes fn holds allocated at its peak, numpy's buffers included."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        fn()
        return tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


def _calls(batch: InputBatch, out: SchedulerOutput) -> int:
    return _count_calls(lambda: _host_step(batch, out))


def _peak_bytes(batch: InputBatch, out: SchedulerOutput) -> int:
    return _peak_allocated(lambda: _host_step(batch, out))


def _tensor_bytes(batch: InputBatch, out: SchedulerOutput) -> int:
    """Bytes of the tensors the step hands the model, the persistent table aside (which must
    be handed over in place)."""
    input_ids, positions, attn, (table, lens, rows) = _host_step(batch, out)
    assert table.data_ptr() == batch.blocks.host.data_ptr(), "a per-step copy of the table"
    step = [input_ids, positions, attn.slot_mapping, attn.seq_rows, lens, rows]
    return sum(t.numel() * t.element_size() for t in step) + attn.query_lens.nbytes \
        + attn.seq_lens.nbytes + attn.rows.nbytes


def _measure(measure, context: int) -> list[int]:
    """`measure` of the first decode step (a new block each) and of the second (none)."""
    batch, next_block = _prefilled(context)
    first = measure(batch, _decode(1, next_block))
    return [first, measure(batch, _decode(2, None))]


@pytest.mark.parametrize("measure", [_calls, _peak_bytes, _tensor_bytes],
                         ids=["python_calls", "peak_bytes", "tensor_bytes"])
def test_decode_step_host_work_does_not_grow_with_context(measure):
    _measure(measure, SHORT)  # first use: imports, numpy's and torch's one-time caches
    short, long = _measure(measure, SHORT), _measure(measure, LONG)
    if measure is _peak_bytes:
        assert all(abs(s - l) <= SLACK_BYTES for s, l in zip(short, long)), (short, long)
    else:
        assert short == long


def test_the_measures_see_context_sized_work():
    """The measures are sharp enough to fail: the same step plus a copy of one request's
    tokens (an O(context) list) costs more calls and bytes at the long context."""
    def copying(batch: InputBatch, out: SchedulerOutput) -> None:
        _host_step(batch, out)
        row = batch.rows["r0"]
        [abs(t) for t in batch.token_ids[row, : batch.num_tokens[row]].tolist()]

    calls = lambda batch, out: _count_calls(lambda: copying(batch, out))  # noqa: E731
    peak = lambda batch, out: _peak_allocated(lambda: copying(batch, out))  # noqa: E731
    assert _measure(calls, LONG)[1] > _measure(calls, SHORT)[1] + 1000
    assert _measure(peak, LONG)[1] > _measure(peak, SHORT)[1] + 10 * SLACK_BYTES


def test_device_inputs_are_step_sized():
    """What crosses to the device each decode step: O(requests) elements, whatever the
    context (on CUDA these are the pinned buffers' copies)."""
    batch, next_block = _prefilled(LONG)
    input_ids, positions, attn, _ = _host_step(batch, _decode(1, next_block))
    assert input_ids.shape == positions.shape == attn.slot_mapping.shape == (NUM_REQUESTS,)
    assert positions.tolist() == [LONG] * NUM_REQUESTS
    assert attn.seq_lens.tolist() == [LONG + 1] * NUM_REQUESTS
    assert input_ids.dtype == positions.dtype == torch.int64

"""The worker's persistent input batch against the scheduler: driven by real SchedulerOutput
diffs (chunked prefill, preemption and resume, n > 1 forks, finished requests' rows reused,
arrays grown past their first capacity), its rows hold every live request's tokens and block
table, and each step's inputs are the tokens, positions and slots the scheduler's own view
gives."""
import numpy as np
import pytest
import torch

from tests.sched_driver import EOS, TieredMirror, make_scheduler, tiered_step
from tierserve.scheduler import SamplingParams
from tierserve.scheduler.messages import NewRequestData, SchedulerOutput
from tierserve.workers.input_batch import BlockTable, InputBatch
from tierserve.workers.sampler import SamplingStateTable

BS = 4


class BatchMirror(TieredMirror):
    """A TieredMirror that also feeds each step to an InputBatch and checks it against the
    mirror, which rebuilds every request from the diffs as plain lists."""

    def __init__(self, batch: InputBatch):
        super().__init__(BS)
        self.batch = batch
        self.seen = set()  # what the diffs exercised

    def apply(self, out) -> list[int]:
        self.seen |= {"fork"} if out.copy_src else set()
        self.seen |= {"resume"} if out.scheduled_cached_reqs.resumed else set()
        self.seen |= {"preempt"} if out.preempted_req_ids else set()
        self.batch.apply(out)
        inputs = self.batch.prepare(out) if out.num_scheduled_tokens else None
        sampled = super().apply(out)
        self.check_rows()
        if inputs is not None:
            self.check_inputs(out, inputs, sampled)
        return sampled

    def check_rows(self) -> None:
        batch = self.batch
        assert set(batch.rows) == set(self.tokens)
        assert len(set(batch.rows.values())) == len(batch.rows), "two requests share a row"
        for rid, tokens in self.tokens.items():
            row = batch.rows[rid]
            assert batch.token_ids[row, : batch.num_tokens[row]].tolist() == tokens, rid
            table = batch.blocks.array[row, : batch.blocks.num_blocks[row]]
            assert table.tolist() == self.blocks[rid], rid

    def check_inputs(self, out, inputs, sampled) -> None:
        ids = out.scheduled_req_ids()
        packed = [ids[i] for i in inputs.order.tolist()]
        sizes = [out.num_scheduled_tokens[i] for i in inputs.order.tolist()]
        assert sizes == sorted(sizes, key=lambda n: n != 1), "decodes are packed first"
        assert inputs.num_decodes == sizes.count(1)
        positions, tokens, slots, rows = [], [], [], []
        for rid, n in zip(packed, sizes):
            end = self.computed[rid]  # the mirror advanced it past this step's tokens
            for p in range(end - n, end):
                positions.append(p)
                tokens.append(self.tokens[rid][p])
                slots.append(self.blocks[rid][p // BS] * BS + p % BS)
                rows.append(self.batch.rows[rid])
        assert inputs.positions.tolist() == positions
        assert inputs.input_ids.tolist() == tokens
        assert inputs.slot_mapping.tolist() == slots
        assert inputs.token_rows.tolist() == rows
        assert inputs.query_lens.tolist() == sizes
        assert inputs.seq_lens.tolist() == [self.computed[rid] for rid in packed]
        samplers = [rid for rid, s in zip(ids, sampled) if s != -1]
        assert sorted(inputs.sample_req_ids) == sorted(samplers)


def _params(max_tokens, **kw):
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=1, **kw)


def _batch(**kw) -> InputBatch:
    return InputBatch(BS, SamplingStateTable(1000), **kw)


def run(sched, mirror, max_steps=400):
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return
        tiered_step(sched, mirror)
        sched.check_integrity()
    raise AssertionError("requests did not finish")


@pytest.mark.parametrize("rows,tokens", [(2, 8), (16, 64)], ids=["grown", "preallocated"])
def test_batch_follows_the_scheduler_through_chunks_preemption_forks_and_reuse(rows, tokens):
    sched = make_scheduler(num_blocks=24, block_size=BS, max_num_seqs=4,
                           max_num_batched_tokens=16, max_model_len=64)
    batch = _batch(max_num_seqs=rows, max_model_len=tokens)
    mirror = BatchMirror(batch)
    rng = np.random.default_rng(0)
    sched.add_request("forked", list(range(1, 11)), _params(5, n=3), eos_token_id=EOS)
    for i in range(6):  # prompts of 3-38 tokens, chunked at 16
        prompt = rng.integers(1, 500, size=3 + 7 * i).tolist()
        sched.add_request(f"r{i}", prompt, _params(6 + i), eos_token_id=EOS)
    for _ in range(12):
        tiered_step(sched, mirror)
    for i in range(6, 9):  # arrivals while others run take finished requests' rows
        sched.add_request(f"r{i}", list(range(20 + i, 40 + i)), _params(4), eos_token_id=EOS)
    run(sched, mirror)
    mirror.apply(sched.schedule())  # the last requests' finish reaches the worker
    # The pool is too small for all requests at once.
    assert mirror.seen == {"fork", "preempt", "resume"}
    assert not batch.rows and sorted(batch._free_rows) == list(range(len(batch.params)))
    if rows == 2:  # grown by doubling: more rows, and tokens up to 49 per row
        assert len(batch.params) > 2 and batch.token_ids.shape[1] == 64
    else:
        assert batch.token_ids.shape == (16, 64) and batch.blocks.array.shape == (16, 16)


def test_rows_are_reused_lowest_first():
    batch = _batch(max_num_seqs=2, max_model_len=8)
    greedy = SamplingParams(temperature=0, max_tokens=4)

    def new(rid, blocks):
        return NewRequestData(rid, [1, 2, 3], greedy, blocks)

    batch.apply(SchedulerOutput(0, [new("a", [5]), new("b", [6])], num_scheduled_tokens=[3, 3]))
    assert batch.rows == {"a": 0, "b": 1}
    batch.apply(SchedulerOutput(1, [new("c", [7])], num_scheduled_tokens=[3],
                                finished_req_ids=["a"]))
    assert batch.rows == {"b": 1, "c": 0}
    batch.apply(SchedulerOutput(2, [new("d", [8]), new("e", [9])], num_scheduled_tokens=[3, 3]))
    assert batch.rows == {"b": 1, "c": 0, "d": 2, "e": 3} and len(batch.params) == 4
    assert batch.blocks.array[:4, 0].tolist() == [7, 6, 8, 9]


def _scheduled(step: int, **tokens: int) -> SchedulerOutput:
    """A step scheduling these requests (already in the batch) with no diffs of their own."""
    out = SchedulerOutput(step, num_scheduled_tokens=list(tokens.values()))
    out.scheduled_cached_reqs.req_ids.extend(tokens)
    return out


def test_scheduling_past_known_tokens_or_blocks_is_a_bug():
    batch = _batch()
    greedy = SamplingParams(temperature=0, max_tokens=4)
    batch.apply(SchedulerOutput(0, [NewRequestData("a", [1, 2, 3, 4, 5], greedy, [3])],
                                num_scheduled_tokens=[5]))
    with pytest.raises(RuntimeError, match="'a': scheduled up to token 5, .* its 1 blocks"):
        batch.prepare(_scheduled(0, a=5))
    out = SchedulerOutput(1, num_scheduled_tokens=[1])
    out.scheduled_cached_reqs.add("a", [], [4])
    batch.apply(out)
    with pytest.raises(RuntimeError, match="scheduled up to token 6, past its 5 known tokens"):
        batch.prepare(_scheduled(1, a=6))
    assert batch.prepare(_scheduled(1, a=5)).positions.tolist() == [0, 1, 2, 3, 4]


def test_forward_inputs_read_the_persistent_table_in_place():
    """The attention gets the batch's own table (no per-step copy) and each token's row."""
    batch = _batch(max_num_seqs=4, max_model_len=32)
    greedy = SamplingParams(temperature=0, max_tokens=4)
    batch.apply(SchedulerOutput(0, [NewRequestData("a", list(range(1, 10)), greedy, [4, 2, 9]),
                                    NewRequestData("b", [7], greedy, [5])],
                                num_scheduled_tokens=[9, 1]))
    inputs = batch.prepare(_scheduled(0, a=9, b=1))
    input_ids, positions, attn = batch.forward_inputs(inputs)
    assert attn.block_tables.data_ptr() == batch.blocks.host.data_ptr()
    assert attn.num_decodes == 1 and attn.query_lens.tolist() == [1, 9]
    table, lens, rows = attn.token_tables()
    assert rows.tolist() == [1] + [0] * 9 and lens.tolist() == [1] + list(range(1, 10))
    assert input_ids.tolist() == [7] + list(range(1, 10))
    assert attn.slot_mapping.tolist() == [20] + [16, 17, 18, 19, 8, 9, 10, 11, 36]
    decode_table, decode_lens = attn.decode_tables()
    assert decode_table.tolist() == [[5]] and decode_lens.tolist() == [1]
    assert attn.prefills[0].block_ids is None  # the whole context: no gather
    assert positions.dtype == torch.int64


def test_a_mirrored_table_gets_only_new_entries_and_equals_the_host_one():
    """The device copy CUDA keeps (here mirrored on the CPU): each step's new entries are
    written into it, through growth of rows and columns, and it equals the host table."""
    table = BlockTable(2, 2, torch.device("cpu"), mirror=True)
    rng = np.random.default_rng(1)
    for step in range(30):
        rows = np.sort(rng.choice(6, size=3, replace=False))
        owners = np.repeat(np.arange(3), rng.integers(0, 3, size=3))
        table.grow(int(rows.max()) + 1, 0)
        if step % 7 == 3:
            table.clear(rows[:1])
        if len(owners):
            table.append(rows[owners], np.arange(len(owners)) - np.searchsorted(owners, owners),
                         rng.integers(0, 100, size=len(owners)).tolist())
        device = table.device_table()
        assert device.data_ptr() != table.host.data_ptr()
        assert torch.equal(device, table.host), step
    assert table.array.shape[0] >= 6 and table.num_blocks.max() > 2

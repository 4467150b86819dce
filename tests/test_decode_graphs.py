"""The decode-graph runner's padded static-buffer step (workers/cuda_graphs.py), run eagerly on
the CPU (capture=False): the same hidden states and K/V as the plain step, padding rows writing
to the null block alone, stale rows of a larger earlier step reset, and the buckets a step
falls in. Capture and replay themselves are tests/test_cuda.py's (on a GPU)."""
from __future__ import annotations

import random

import pytest
import torch

from tests.checkpoints import PagedRunner, Work, make_tiny_llama, make_tiny_mistral
from tierserve.workers.attention import AttentionMetadata
from tierserve.workers.cuda_graphs import DecodeGraphs
from tierserve.workers.model.loader import load_model

NUM_BLOCKS, BLOCK = 40, 4
NULL = NUM_BLOCKS - 1


@pytest.fixture(scope="module", params=["llama", "mistral"])
def model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    # Mistral with a window shorter than the contexts: the graph's mask cuts it too.
    path = make_tiny_llama(folder) if request.param == "llama" else \
        make_tiny_mistral(folder, sliding_window=8)
    return load_model(str(path))[1]


def _prefilled(model, lengths: list[int]) -> PagedRunner:
    runner = PagedRunner(model, num_blocks=NUM_BLOCKS, block_size=BLOCK, seed=3)
    runner.free.remove(NULL)  # the engine never hands out the null block
    rng = random.Random(0)
    vocab = model.config.vocab_size
    runner.step([Work(f"s{i}", [rng.randrange(3, vocab) for _ in range(n)], 0)
                 for i, n in enumerate(lengths)])
    return runner


def _decode_inputs(runner: PagedRunner, seqs: dict[str, int], token: int):
    """ids, positions and metadata of one decode step: each sequence in seqs (id -> its
    context before the step) decodes `token`."""
    ids, positions, slots, tables = [], [], [], []
    for seq, start in seqs.items():
        table = runner.reserve(seq, start + 1)
        ids.append(token)
        positions.append(start)
        slots.append(table[start // BLOCK] * BLOCK + start % BLOCK)
        tables.append(table)
    attn = AttentionMetadata.build(slot_mapping=slots, query_lens=[1] * len(seqs),
                                   seq_lens=[s + 1 for s in seqs.values()],
                                   block_tables=tables, num_decodes=len(seqs), block_size=BLOCK)
    return torch.tensor(ids), torch.tensor(positions), attn


def _clone(caches):
    return [(k.clone(), v.clone()) for k, v in caches]


def _assert_pools_close(a, b, skip: int) -> None:
    for (ka, va), (kb, vb) in zip(a, b):
        keep = [i for i in range(ka.shape[0]) if i != skip]
        torch.testing.assert_close(ka[keep], kb[keep], atol=1e-5, rtol=0)
        torch.testing.assert_close(va[keep], vb[keep], atol=1e-5, rtol=0)


def test_padded_static_steps_equal_the_plain_steps(model):
    runner = _prefilled(model, [5, 9, 14])
    graphs = DecodeGraphs(model, _clone(runner.kv_caches), BLOCK, max_batch=8,
                          max_model_len=64, capture=False)
    for null in (runner.kv_caches, graphs.kv_caches):
        for k, v in null:
            k[NULL].fill_(7.0)  # finite stale values, as a pool may hold
            v[NULL].fill_(7.0)
    # Three sequences (padded to 4), then two (rows 2 and 3 reset to padding), then three.
    steps = [{"s0": 5, "s1": 9, "s2": 14}, {"s0": 6, "s2": 15}, {"s0": 7, "s1": 10, "s2": 16}]
    for i, seqs in enumerate(steps):
        ids, positions, attn = _decode_inputs(runner, seqs, token=11 + i)
        want = model(ids, positions, attn, runner.kv_caches)
        ids, positions, attn = _decode_inputs(runner, seqs, token=11 + i)
        bucket = graphs.bucket_of(attn)
        got = graphs.run(ids, positions, attn, bucket)
        assert bucket == (4 if len(seqs) > 2 else 2, 8 if max(seqs.values()) >= 16 else 4)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        _assert_pools_close(graphs.kv_caches, runner.kv_caches, skip=NULL)
    assert graphs.replays == 3 and set(graphs.graphs) == {(4, 4), (2, 4), (4, 8)}
    assert graphs.slots[3].item() == NULL * BLOCK and graphs.lens[3].item() == 1
    # Padding wrote the null block's first slot and nothing else of it.
    k = graphs.kv_caches[0][0][NULL]
    assert not torch.equal(k[0], torch.full_like(k[0], 7.0))
    assert torch.equal(k[1:], torch.full_like(k[1:], 7.0))


def test_steps_outside_the_buckets_run_eagerly(model):
    runner = _prefilled(model, [5, 9, 14])
    graphs = DecodeGraphs(model, runner.kv_caches, BLOCK, max_batch=2, max_model_len=64,
                          capture=False)
    assert graphs.max_batch == 2 and graphs.max_width == 16
    _, _, three = _decode_inputs(runner, {"s0": 5, "s1": 9, "s2": 14}, 3)
    assert graphs.bucket_of(three) is None  # more sequences than the buffers hold
    _, _, two = _decode_inputs(runner, {"s0": 5, "s1": 9}, 3)
    assert graphs.bucket_of(two) == (2, 4)
    mixed = AttentionMetadata.build(slot_mapping=[1, 2, 3], query_lens=[1, 2],
                                    seq_lens=[6, 2], block_tables=[[0, 1], [2]],
                                    num_decodes=1, block_size=BLOCK)
    assert graphs.bucket_of(mixed) is None  # a prefill chunk in the step
    _, _, long = _decode_inputs(runner, {"s0": 70}, 3)
    assert graphs.bucket_of(long) is None  # a context past max_model_len's width
    graphs.failed = "capture refused"
    assert graphs.bucket_of(two) is None


@pytest.mark.parametrize("cpu_isa", ["torch", None])
def test_an_engine_decoding_from_the_static_buffers_keeps_its_tokens(tmp_path, cpu_isa):
    """The model runner's route through the graph runner (eagerly, on the CPU): the same greedy
    tokens as the plain engine, over batches that shrink as requests finish, and every block
    freed."""
    from tierserve import LLM, SamplingParams

    path = str(make_tiny_llama(tmp_path / "llama"))
    prompts = [[(7 * i + 3 * j) % 300 + 3 for j in range(5 + 4 * i)] for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in (3, 9, 17, 30, 6, 12)]
    runs = []
    for static in (False, True):
        with LLM(path, block_size=4, cpu_isa=cpu_isa) as llm:
            runner = llm.engine.executor.worker.runner
            if static:
                runner.graphs = DecodeGraphs(runner.model, runner.kv_caches, 4, max_batch=8,
                                             max_model_len=64, capture=False)
            outs = llm.generate(prompts, params, use_tqdm=False)
            runs.append([o.outputs[0].token_ids for o in outs])
            stats = llm.stats()
            assert stats["num_free_blocks"] == stats["num_total_blocks"]
        if static:
            assert runner.graphs.replays > 20
            assert {batch for batch, _ in runner.graphs.graphs} >= {1, 2, 8}
    assert runs[0] == runs[1]

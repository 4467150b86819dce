"""The seeds' worked examples, step by step, with exact block ids and free-queue orders.

Both use block_size 4 and 10 blocks; our pool reserves its last id as the null block, so the
pools here have 11 blocks and ids 0..9 are the seeds' ids.
"""
from tierserve.kvcache import BlockHasher, KVCacheManager
from tierserve.scheduler import ModelRunnerOutput, SamplingParams, Scheduler
from tierserve.scheduler.request import Request

BS = 4
EOS = 999


def toks(text: str) -> list[int]:
    """One token per character: 'A' -> 65 ...; lowercase differs from uppercase."""
    return [ord(c) for c in text]


def make_request(rid: str, tokens: list[int], hasher: BlockHasher) -> Request:
    return Request(rid, tokens, SamplingParams(temperature=0), hasher=hasher)


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_seed_002_prefix_caching_example():
    """002_14c48aeb7d1ead33.txt, section 示例 (time 1 .. time 7)."""
    hasher = BlockHasher(BS)
    kv = KVCacheManager(11, BS, watermark=0.0)
    queue = kv.pool.free_queue

    # Time 1: 15-token request: 4 blocks, 3 full and cached, the 4th holds 3 tokens.
    req0 = make_request("r0", toks("ABCDEFGHIJKLMNO"), hasher)
    assert kv.get_computed_blocks(req0) == ([], 0)
    assert ids(kv.allocate_slots(req0, 15)) == [0, 1, 2, 3]
    req0.num_computed_tokens = 15
    assert [kv.pool.blocks[i].block_hash is not None for i in range(4)] == [True, True, True, False]

    # Time 2-3: decoding fills block 3 (cached), the next token needs block 4.
    req0.append_output_token(ord("P"))
    assert kv.allocate_slots(req0, 1) == []
    req0.num_computed_tokens = 16
    assert kv.pool.blocks[3].block_hash is not None
    req0.append_output_token(ord("Q"))
    assert ids(kv.allocate_slots(req0, 1)) == [4]
    req0.num_computed_tokens = 17
    assert queue.peek_ids() == [5, 6, 7, 8, 9]

    # Time 4: 14 tokens, the first 10 shared: only 2 full blocks hit.
    req1 = make_request("r1", toks("ABCDEFGHIJklmn"), hasher)
    hits, num_hit = kv.get_computed_blocks(req1)
    assert (ids(hits), num_hit) == ([0, 1], 8)
    assert ids(kv.allocate_slots(req1, 14 - 8, hits, num_hit)) == [5, 6]
    req1.num_computed_tokens = 14
    assert kv.get_block_ids("r1") == [0, 1, 5, 6]
    assert [kv.pool.blocks[i].ref_cnt for i in range(7)] == [2, 2, 1, 1, 1, 1, 1]

    # Time 5: request 0 frees 2, 3, 4 in reverse; 0 and 1 stay with request 1.
    kv.free(req0)
    assert queue.peek_ids() == [7, 8, 9, 4, 3, 2]
    assert kv.pool.blocks[2].block_hash is not None and kv.pool.blocks[3].block_hash is not None

    # Time 6: request 1 frees.
    kv.free(req1)
    assert queue.peek_ids() == [7, 8, 9, 4, 3, 2, 6, 5, 1, 0]
    kv.check_integrity()

    # Time 7: 29 tokens, the first 12 shared: hits 0, 1, 2 leave the queue; 7 8 9 4 3 are
    # allocated and cached block 3 is evicted.
    req2 = make_request("r2", toks("ABCDEFGHIJKL") + list(range(1000, 1017)), hasher)
    hits, num_hit = kv.get_computed_blocks(req2)
    assert (ids(hits), num_hit) == ([0, 1, 2], 12)
    hash3 = kv.pool.blocks[3].block_hash
    evictions = kv.pool.num_evictions
    assert ids(kv.allocate_slots(req2, 29 - 12, hits, num_hit)) == [7, 8, 9, 4, 3]
    assert kv.get_block_ids("r2") == [0, 1, 2, 7, 8, 9, 4, 3]
    assert kv.pool.num_evictions == evictions + 1
    assert kv.pool.get_cached_block(hash3, None) is None
    assert queue.peek_ids() == [6, 5]
    kv.check_integrity()


def _step(sched: Scheduler, sampled: dict[str, int]):
    out = sched.schedule()
    order = out.scheduled_req_ids()
    runner = ModelRunnerOutput(out.step_id, [sampled.get(r, -1) for r in order])
    sched.update_from_output(out, runner)
    sched.check_integrity()
    return out


def test_seed_003_walkthrough_through_the_scheduler():
    """003_9619683c7a45eb2f.txt, section 3.2 (step 0 .. step 6), driven through Scheduler."""
    kv = KVCacheManager(11, BS, watermark=0.0)
    sched = Scheduler(kv, BlockHasher(BS), max_num_seqs=8, max_num_batched_tokens=64,
                      max_model_len=40)
    queue = kv.pool.free_queue
    params = SamplingParams(temperature=0, max_tokens=10)

    # step 0: req0 = ABCD | EFGH | IJKL | MNO, the whole prompt scheduled.
    sched.add_request("req0", toks("ABCDEFGHIJKLMNO"), params, eos_token_id=EOS)
    out = _step(sched, {"req0": ord("P")})
    assert out.scheduled_new_reqs[0].block_ids == [0, 1, 2, 3]
    assert out.num_scheduled_tokens == [15]
    # one decode: P fills block 3.
    out = _step(sched, {"req0": ord("Q")})
    assert out.scheduled_cached_reqs.unpack() == [("req0", [ord("P")], [], None)]
    assert kv.pool.blocks[3].block_hash is not None

    # step 4: req1 = ABCD | EFGH | IJkl | mn hits two blocks; req0's next token takes block 4.
    sched.add_request("req1", toks("ABCDEFGHIJklmn"), params, eos_token_id=EOS)
    out = _step(sched, {"req0": EOS, "req1": ord("o")})
    assert out.scheduled_cached_reqs.unpack() == [("req0", [ord("Q")], [4], None)]
    new = out.scheduled_new_reqs[0]
    assert (new.req_id, new.block_ids, new.num_computed_tokens) == ("req1", [0, 1, 5, 6], 8)
    assert out.num_scheduled_tokens == [6, 1]

    # step 5: req0 finished (EOS above): 4, 3, 2 join the queue in reverse; 0, 1 held by req1.
    assert queue.peek_ids() == [7, 8, 9, 4, 3, 2]
    out = _step(sched, {"req1": EOS})
    assert out.finished_req_ids == ["req0"]
    assert queue.peek_ids() == [7, 8, 9, 4, 3, 2, 6, 5, 1, 0]

    # step 6: req2 = ABCD | EFGH | IJKL | 0-3 | 4-7 | 8-11 | 12-15 | 16: three hits from the
    # queue, five new blocks from its head, and block 3 evicted.
    sched.add_request("req2", toks("ABCDEFGHIJKL") + list(range(100, 117)), params,
                      eos_token_id=EOS)
    out = sched.schedule()
    new = out.scheduled_new_reqs[0]
    assert (new.block_ids, new.num_computed_tokens) == ([0, 1, 2, 7, 8, 9, 4, 3], 12)
    assert out.num_scheduled_tokens == [17]
    assert out.finished_req_ids == ["req1"]
    assert kv.pool.num_evictions == 1
    assert queue.peek_ids() == [6, 5]
    stats = sched.stats()
    assert stats["prefix_cache_hit_tokens"] == 8 + 12
    sched.check_integrity()

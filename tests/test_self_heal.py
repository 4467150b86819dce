"""Self-healing (invariant 8) without Ray: the scheduler's side of losing the workers (every
request re-admitted, the pool's and the CPU tier's contents dropped, SSD kept, suspects and
poison pills), and the in-process engine healing a worker whose steps raise, tiers on. The Ray
deployments (SIGKILL, a hung rank, max_restarts spent) are in tests/test_ray.py and
tests/test_reliability.py."""
from __future__ import annotations

import pytest

from tests.checkpoints import make_tiny_llama
from tests.sched_driver import WorkerMirror, make_scheduler
from tierserve.kvcache import BlockHash, BlockHasher, KVCacheManager
from tierserve.kvcache.tier_index import TierIndex
from tierserve.kvcache.tier_policy import TierPolicy
from tierserve.runtime.config import EngineConfig
from tierserve.runtime.engine_core import EngineCore
from tierserve.scheduler import ModelRunnerOutput, SamplingParams, Scheduler
from tierserve.scheduler.messages import EngineCoreRequest
from tierserve.scheduler.params import RequestStatus

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _step(sched: Scheduler, mirror: WorkerMirror) -> list:
    out = sched.schedule()
    return sched.update_from_output(out, ModelRunnerOutput(out.step_id, mirror.apply(out)))


def _tiered_scheduler() -> Scheduler:
    tiers = TierPolicy(TierIndex(8, 8), block_size=4, block_bytes=1)
    kv = KVCacheManager(24, 4, tiers=tiers, watermark=0.0)
    return Scheduler(kv, BlockHasher(4), max_num_seqs=8, max_num_batched_tokens=32,
                     max_model_len=64, vocab_size=1000)


def test_losing_the_workers_readmits_every_request_and_keeps_only_ssd():
    sched = _tiered_scheduler()
    index = sched.kv.tiers.index
    for h in (b"a" * 16, b"b" * 16):  # SSD entries written before
        index.ssd.commit(index.ssd.start_write(BlockHash(h), None)[0])
    mirror = WorkerMirror()
    for i in range(5):
        sched.add_request(f"r{i}", [10 * i + j for j in range(1, 13)], GREEDY)
    sched.add_request("pair", [7, 8, 9, 10, 11], SamplingParams(n=2, max_tokens=10, seed=3))
    for _ in range(4):
        _step(sched, mirror)
        sched.check_integrity()
    running = [r.request_id for r in sched.running]
    sched.schedule()  # a step in flight when the workers go
    assert sched.workers_lost() == []  # nobody was a suspect yet
    sched.check_integrity()
    assert sched.suspects == set(running)
    assert not sched.running and [r.request_id for r in sched.waiting][:len(running)] == running
    for req in sched.requests.values():
        assert req.num_computed_tokens == req.num_sent_tokens == 0
        assert req.num_output_tokens == 0 or req.status == RequestStatus.PREEMPTED
    pool = sched.kv.pool
    assert pool.num_free_blocks == pool.num_usable_blocks and pool.num_cached_blocks() == 0
    assert index.cpu.num_free == index.cpu.num_slots and not index.has_in_flight()
    assert len(index.ssd) == 2  # SSD entries stay

    # The new workers hold nothing: each request is sent whole again, prompt and outputs,
    # and the suspects re-enter one at a time.
    fresh = WorkerMirror()
    out = sched.schedule()
    sent = [(n.req_id, n.num_output_tokens) for n in out.scheduled_new_reqs]
    assert sent == [(running[0], sched.requests[running[0]].num_output_tokens)]
    sched.update_from_output(out, ModelRunnerOutput(out.step_id, fresh.apply(out)))
    assert running[0] not in sched.suspects  # through a step of the new workers
    finished = []
    while sched.has_unfinished_requests():
        finished += [(o.req_id, o.index) for o in _step(sched, fresh) if o.finish_reason]
        sched.check_integrity()
    assert sorted(finished) == sorted([(f"r{i}", 0) for i in range(5)] + [("pair", 0),
                                                                          ("pair", 1)])


def test_a_suspect_in_flight_at_the_next_loss_is_the_poison_pill():
    sched = make_scheduler()
    mirror = WorkerMirror()
    for i in range(3):
        sched.add_request(f"r{i}", [5 + i, 6, 7, 8, 9], GREEDY)
    _step(sched, mirror)
    sched.schedule()
    assert sched.workers_lost() == [] and sched.suspects == {"r0", "r1", "r2"}
    mirror = WorkerMirror()
    _step(sched, mirror)  # r0 alone: r1, r2 wait their turn
    assert sched.suspects == {"r1", "r2"}
    sched.schedule()  # r0's decode and r1's recompute
    assert sched.workers_lost() == ["r1"]  # r1 was in flight at both
    assert sched.suspects == {"r0"}
    done = sched.finish_seqs(["r1"], RequestStatus.FINISHED_ERROR)
    assert done == [("r1", 0)]
    sched.check_integrity()
    # A loss with nothing in flight blames nobody and keeps the suspects.
    assert sched.workers_lost() == [] and sched.suspects == {"r0"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_llama(tmp_path_factory.mktemp("heal") / "llama"))


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 57)), [3, 1, 4, 1, 5, 9, 2, 6],
           list(range(100, 121))]
SEEDED = SamplingParams(temperature=1.0, top_k=40, max_tokens=10, seed=7, ignore_eos=True,
                        presence_penalty=0.5)


def _run(core: EngineCore, requests: list[EngineCoreRequest], late: list[EngineCoreRequest] = (),
         check: bool = False) -> dict[str, object]:
    """Steps until every request finished (the late ones added after two steps); each
    request's tokens, or its error."""
    got: dict[str, object] = {r.req_id: [] for r in [*requests, *late]}
    for r in requests:
        core.add_request(r)
    steps = 0
    while core.has_work():
        for o in core.step():
            if o.error:
                got[o.req_id] = o.error
            else:
                got[o.req_id].extend(o.new_token_ids)
                # Prompt logprobs arrive once, with the first output.
                got[o.req_id].extend(round(lp.logprobs[0], 4) for lp in o.prompt_logprobs)
        steps += 1
        if steps == 2:
            for r in late:
                core.add_request(r)
        if check:
            core.scheduler.check_integrity()
    return got


def _requests(poison: int | None = None) -> tuple[list, list]:
    first = [EngineCoreRequest(f"g{i}", GREEDY, prompt_token_ids=p) for i, p in enumerate(PROMPTS)]
    first.append(EngineCoreRequest("seeded", SEEDED, prompt_token_ids=PROMPTS[1]))
    with_prompt_logprobs = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                          prompt_logprobs=1)
    first.append(EngineCoreRequest("plp", with_prompt_logprobs, prompt_token_ids=PROMPTS[3]))
    late = [EngineCoreRequest("late", GREEDY, prompt_token_ids=[9, 8, 7, 6])]
    if poison is not None:
        late.append(EngineCoreRequest("poison", GREEDY, prompt_token_ids=[4, poison, 4]))
    return first, late


def test_in_process_a_raising_request_fails_alone_and_the_rest_continue(tiny, tmp_path,
                                                                        monkeypatch):
    """TIERSERVE_DEBUG_CRASH makes the worker raise on the poison's prompt, twice: the first
    failure re-admits every request (seeded and penalised sampling continue exactly), the
    second blames the poison alone. The CPU and SSD tiers stay consistent at every step."""
    options = dict(model=tiny, block_size=4, num_kv_blocks=41, kv_offload_cpu_bytes=16 * 1536,
                   kv_offload_ssd_path=str(tmp_path / "ssd"), kv_offload_ssd_bytes=64 * 1536)
    core = EngineCore(EngineConfig(**options))
    try:
        reference = _run(core, *_requests())
        assert core.stats()["restarts"] == 0
    finally:
        core.shutdown()
    outputs = {t for toks in reference.values() for t in toks}
    poison = next(t for t in range(300, 384) if t not in outputs)
    monkeypatch.setenv("TIERSERVE_DEBUG_CRASH", f"0:{poison}")
    core = EngineCore(EngineConfig(**options))
    try:
        got = _run(core, *_requests(poison), check=True)
        error = got.pop("poison")
        assert "request 'poison'" in error and "two consecutive worker failures" in error
        assert got == reference
        stats = core.stats()
        assert stats["restarts"] == 2 and "injected crash on request 'poison'" in \
            stats["restart_reason"]
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
    finally:
        core.shutdown()


def test_in_process_max_restarts_zero_fails_the_step_as_before(tiny, monkeypatch):
    monkeypatch.setenv("TIERSERVE_DEBUG_CRASH", "0:300")
    core = EngineCore(EngineConfig(model=tiny, block_size=4, max_restarts=0))
    try:
        first, _ = _requests()
        got = _run(core, first[:2], [EngineCoreRequest("poison", GREEDY,
                                                       prompt_token_ids=[4, 300, 4])])
        assert all(isinstance(v, str) and "injected crash" in v for v in got.values()), got
        assert core.stats()["restarts"] == 0 and core.dead_reason is None
    finally:
        core.shutdown()

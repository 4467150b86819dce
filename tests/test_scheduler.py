"""Scheduler behaviour on real KVCacheManager + hashing, checked every step."""
import pytest

from tierserve.scheduler import FinishReason, SamplingParams
from tierserve.scheduler.step_budget import StepTimeBudget
from tests.sched_driver import EOS, WorkerMirror, make_scheduler, next_token, step


def greedy(max_tokens=8, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def run_to_completion(sched, mirror=None, max_steps=500):
    mirror = mirror or WorkerMirror()
    outs, finished = [], {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        out, outputs = step(sched, mirror)
        sched.check_integrity()
        outs.append(out)
        for o in outputs:
            finished.setdefault(o.req_id, []).extend(o.new_token_ids)
    assert not sched.has_unfinished_requests()
    return outs, finished


def expected_tokens(prompt, n):
    toks = list(prompt)
    for _ in range(n):
        toks.append(next_token(toks))
    return toks[len(prompt):]


def test_chunked_prefill_respects_budget_and_samples_only_at_the_end():
    sched = make_scheduler(max_num_batched_tokens=8)
    prompt = list(range(1, 21))
    sched.add_request("a", prompt, greedy(3), eos_token_id=EOS)
    outs, got = run_to_completion(sched)
    assert [o.num_scheduled_tokens for o in outs[:3]] == [[8], [8], [4]]
    assert got["a"] == expected_tokens(prompt, 3)
    assert all(o.total_num_scheduled_tokens <= 8 for o in outs)


def test_long_prefill_threshold_caps_a_chunk_and_decodes_share_the_budget():
    sched = make_scheduler(max_num_batched_tokens=16, threshold=5)
    sched.add_request("a", list(range(1, 4)), greedy(6), eos_token_id=EOS)
    out, _ = step(sched, mirror := WorkerMirror())
    sched.add_request("b", list(range(10, 30)), greedy(2), eos_token_id=EOS)
    out, _ = step(sched, mirror)
    # "a" decodes one token, "b" gets a 5-token chunk though 15 tokens of budget remain.
    assert out.num_scheduled_tokens == [5, 1]
    assert out.scheduled_req_ids() == ["b", "a"]


def test_step_time_budget_fits_a_line_and_leaves_decodes_their_share():
    budget = StepTimeBudget(target_s=0.25, min_chunk=4)
    assert budget.prefill_limit(10) is None  # nothing measured yet
    for tokens in (10, 50, 200, 400, 30, 120):
        budget.observe(tokens, 0.05 + 0.001 * tokens)  # 50 ms a step, 1 ms a token
    a, b = budget.line()
    assert a == pytest.approx(0.05) and b == pytest.approx(0.001)
    assert budget.prefill_limit(10) == 190
    assert budget.prefill_limit(0) is None  # no stream waits on the step
    assert budget.prefill_limit(500) == 0  # the decodes fill the step: prompts wait
    budget.observe(100, 30.0)  # a stalled step counts as 3x the line's prediction, no more
    assert budget.line()[1] < 0.0015
    tight = StepTimeBudget(target_s=0.052, min_chunk=4)  # one decode overruns it: no way to
    for tokens in (10, 50, 200, 400, 30, 120):           # meet it, so prompts still progress
        tight.observe(tokens, 0.05 + 0.001 * tokens)
    assert tight.prefill_limit(3) == 4
    flat = StepTimeBudget(target_s=0.25, min_chunk=4)
    for _ in range(8):
        flat.observe(100, 0.1)
    assert flat.prefill_limit(10) is None  # no slope to read: no limit
    for _ in range(30):  # bigger steps faster (noise): no slope to read, the last fit stays
        budget.observe(100, 0.20)
        budget.observe(200, 0.05)
    a, b = budget.fit
    assert budget.line() is None and b > 0
    assert budget.prefill_limit(10) == max(int((0.25 - a) / b) - 10, 0)
    with pytest.raises(ValueError):
        StepTimeBudget(target_s=0, min_chunk=4)


def test_step_time_target_bounds_prefill_beside_decodes_and_keeps_the_tokens():
    def run(target):
        sched = make_scheduler(max_num_batched_tokens=64, max_model_len=128, num_blocks=128,
                               step_time_target_s=target)
        mirror, got, outs = WorkerMirror(), {}, []
        sched.add_request("a", list(range(1, 6)), greedy(30), eos_token_id=EOS)
        for i in range(40):
            if i == 6:  # once the cost of a few steps is known
                sched.add_request("b", list(range(10, 90)), greedy(4), eos_token_id=EOS)
            if not sched.has_unfinished_requests():
                break
            out, outputs = step(sched, mirror)
            # A made-up cost: 10 ms a step and 1 ms a token, as the engine would measure.
            sched.observe_step(out, 0.010 + 0.001 * out.total_num_scheduled_tokens)
            sched.check_integrity()
            outs.append(out)
            for o in outputs:
                got.setdefault(o.req_id, []).extend(o.new_token_ids)
        return outs, got

    bounded, got = run(0.030)
    free, want = run(0.0)
    assert got == want == {"a": expected_tokens(list(range(1, 6)), 30),
                           "b": expected_tokens(list(range(10, 90)), 4)}
    # Beside "a"'s decode, "b"'s prompt goes in chunks of (30 - 10) / 1 - 1 = 19 tokens.
    chunks = [n for o in bounded for rid, n in zip(o.scheduled_req_ids(), o.num_scheduled_tokens)
              if rid == "b" and n > 1]
    assert chunks[:4] == [19, 19, 19, 19] and sum(chunks) == 80
    assert max(n for o in free for n in o.num_scheduled_tokens) == 63  # unbounded: one chunk
    with pytest.raises(ValueError):
        make_scheduler(step_time_target_s=-1.0)


def test_max_num_seqs_and_token_budget_hold_every_step():
    sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=10)
    for i in range(7):
        sched.add_request(f"r{i}", list(range(1 + i, 9 + i)), greedy(4), eos_token_id=EOS)
    outs, got = run_to_completion(sched)
    for out in outs:
        assert len(out.num_scheduled_tokens) <= 3
        assert out.total_num_scheduled_tokens <= 10
    for i in range(7):
        assert got[f"r{i}"] == expected_tokens(list(range(1 + i, 9 + i)), 4)


def test_fcfs_preemption_recomputes_from_the_tail_and_resumes_without_the_prompt():
    # 8 usable blocks of 4 tokens: two requests of 12 prompt tokens growing to 22 cannot both fit.
    sched = make_scheduler(num_blocks=9, max_num_batched_tokens=64, max_model_len=32)
    prompts = {"a": list(range(1, 13)), "b": list(range(100, 112))}
    for rid, p in prompts.items():
        sched.add_request(rid, p, greedy(10), eos_token_id=EOS)
    mirror = WorkerMirror()
    outs, got = run_to_completion(sched, mirror)
    preempted = [o for o in outs if o.preempted_req_ids]
    assert preempted and preempted[0].preempted_req_ids == ["b"]  # the tail goes first
    resumed = [o for o in outs if o.scheduled_cached_reqs.resumed]
    assert resumed, "b must resume through CachedRequestData"
    assert all(n.req_id != "b" for o in outs[1:] for n in o.scheduled_new_reqs)
    assert sched.num_preemptions >= 1
    for rid, p in prompts.items():
        assert got[rid] == expected_tokens(p, 10)
    assert sched.kv.num_free_blocks == 8


def test_priority_preemption_evicts_the_lowest_priority_even_if_earlier():
    sched = make_scheduler(num_blocks=9, max_num_batched_tokens=64, max_model_len=32,
                           policy="priority")
    sched.add_request("low", list(range(1, 13)), greedy(10), eos_token_id=EOS, priority=5)
    step(sched, mirror := WorkerMirror())
    sched.add_request("high", list(range(100, 112)), greedy(10), eos_token_id=EOS, priority=0)
    outs, got = run_to_completion(sched, mirror)
    first = next(o for o in outs if o.preempted_req_ids)
    assert first.preempted_req_ids == ["low"]
    assert got["high"] == expected_tokens(list(range(100, 112)), 10)


def test_resumed_request_reuses_its_cached_blocks():
    sched = make_scheduler(num_blocks=9, max_num_batched_tokens=64, max_model_len=32)
    sched.add_request("a", list(range(1, 13)), greedy(10), eos_token_id=EOS)
    sched.add_request("b", list(range(100, 112)), greedy(10), eos_token_id=EOS)
    outs, _ = run_to_completion(sched)
    resume = next(o for o in outs if o.scheduled_cached_reqs.resumed)
    # its first full blocks were still cached: it did not recompute from token 0
    assert resume.scheduled_cached_reqs.resumed_num_computed[0] > 0


def test_length_and_stop_finishing():
    sched = make_scheduler(max_model_len=20)
    sched.add_request("len", list(range(1, 17)), greedy(max_tokens=None), eos_token_id=EOS)
    p = list(range(1, 6))
    stop_tok = next_token(p)
    sched.add_request("stop", p, greedy(5, stop_token_ids=[stop_tok]), eos_token_id=EOS)
    sched.add_request("eos", p + [7], greedy(5), eos_token_id=next_token(p + [7]))
    sched.add_request("ign", p + [7], greedy(3, ignore_eos=True),
                      eos_token_id=next_token(p + [7]))
    outs, got = run_to_completion(sched)
    assert len(got["len"]) == 4  # 16 prompt + 4 = max_model_len
    assert got["stop"] == [stop_tok] and len(got["eos"]) == 1 and len(got["ign"]) == 3


def test_repetition_detection_finds_a_repeated_tail_only():
    from tierserve.scheduler.output_rules import RepetitionDetectionParams
    rep = RepetitionDetectionParams(max_pattern_size=3, min_pattern_size=2, min_count=3)
    assert rep.found([9, 1, 2, 1, 2, 1, 2]) and rep.found([4, 5, 6, 4, 5, 6, 4, 5, 6])
    assert not rep.found([1, 2, 1, 2, 1, 2, 9]) and not rep.found([1, 2, 1, 2])
    assert not rep.found([7] * 5) and RepetitionDetectionParams(2, 0, 3).found([7] * 3)
    assert not RepetitionDetectionParams().found([7] * 50)  # max_pattern_size 0: off
    for bad, match in ((dict(max_pattern_size=2, min_count=1), "min_count must be >= 2"),
                       (dict(max_pattern_size=1, min_pattern_size=2, min_count=2),
                        "min_pattern_size must be <= max_pattern_size"),
                       (dict(max_pattern_size=-1), "max_pattern_size must be in"),
                       (dict(max_size=2), "Unexpected keyword argument .max_size.")):
        with pytest.raises(ValueError, match=match):
            SamplingParams(repetition_detection=bad)


def test_finish_reasons_are_reported():
    sched = make_scheduler()
    sched.add_request("a", [1, 2, 3], greedy(2), eos_token_id=EOS)
    mirror = WorkerMirror()
    reasons = []
    while sched.has_unfinished_requests():
        _, outputs = step(sched, mirror)
        reasons += [o.finish_reason for o in outputs]
    assert reasons == [None, FinishReason.LENGTH]


@pytest.mark.parametrize("prompt,match", [([], "empty"), (list(range(65)), "max_model_len"),
                                          ([1, 2, 1000], "out of range"), ([1, -3], "out of range"),
                                          ([1, 2.5], "ints")])
def test_bad_prompts_fail_alone_and_leak_nothing(prompt, match):
    sched = make_scheduler()
    sched.add_request("ok", [1, 2, 3], greedy(2), eos_token_id=EOS)
    with pytest.raises(ValueError, match=match):
        sched.add_request("bad", prompt, greedy(2), eos_token_id=EOS)
    assert "bad" not in sched.requests
    _, got = run_to_completion(sched)
    assert got["ok"] == expected_tokens([1, 2, 3], 2)
    assert sched.kv.num_free_blocks == sched.kv.pool.num_usable_blocks


def test_duplicate_request_id_and_bad_params_type():
    sched = make_scheduler()
    sched.add_request("a", [1, 2], greedy())
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request("a", [1, 2], greedy())
    with pytest.raises(ValueError, match="SamplingParams"):
        sched.add_request("b", [1, 2], {"temperature": 0})


def test_abort_running_and_waiting_frees_everything_and_tells_workers():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request("run", list(range(1, 10)), greedy(20), eos_token_id=EOS)
    sched.add_request("wait", list(range(1, 10)), greedy(20), eos_token_id=EOS)
    mirror = WorkerMirror()
    step(sched, mirror)
    step(sched, mirror)
    assert sched.abort_requests(["run", "wait", "unknown"]) == [("run", 0), ("wait", 0)]
    sched.check_integrity()
    assert sched.kv.num_free_blocks == sched.kv.pool.num_usable_blocks
    out = sched.schedule()
    assert out.finished_req_ids == ["run"]  # "wait" never reached the workers
    assert not sched.has_unfinished_requests()


def test_config_errors():
    with pytest.raises(ValueError, match="does not fit"):
        make_scheduler(num_blocks=5, max_model_len=64)
    with pytest.raises(ValueError, match="policy"):
        make_scheduler(policy="lifo")
    with pytest.raises(ValueError, match="max_num_seqs"):
        make_scheduler(max_num_seqs=0)


def test_queued_prefill_tokens_leave_out_a_waiting_prompts_cached_prefix():
    """What a router reads as a replica's prefill queue: a waiting chat turn whose history is
    cached on the device counts only the tokens past it; a running prefill its uncomputed
    tokens."""
    sched = make_scheduler(max_num_seqs=1, max_num_batched_tokens=8)
    mirror = WorkerMirror()
    history = list(range(10, 30))  # 20 tokens: 5 full blocks of 4
    sched.add_request("turn1", history, greedy(max_tokens=1))
    run_to_completion(sched, mirror)
    assert sched.queued_prefill_tokens() == 0
    sched.add_request("long", list(range(100, 124)), greedy(max_tokens=4))
    step(sched, mirror)  # "long" runs (8 of its 24 tokens); the next request must wait
    sched.add_request("turn2", history + [7, 8, 9], greedy(max_tokens=1))
    # "long": 24 - 8 computed - its last token's 1; "turn2": 23 tokens, the first 20 cached.
    assert sched.queued_prefill_tokens() == 15 + 3
    sched.check_integrity()

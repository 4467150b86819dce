"""Async scheduling: step N+1 is scheduled while step N runs, its decodes on placeholder tokens
the workers fill in themselves. The scheduler is driven with one step always in flight against a
worker mirror that appends its own samples; then the real engine against its synchronous self,
token for token, under chunked prefill, preemption, stops, aborts and n > 1."""
from collections import deque

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.checkpoints import add_tiny_tokenizer, make_tiny_llama
from tests.sched_driver import EOS, WorkerMirror, make_scheduler, next_token
from tierserve import LLM, SamplingParams
from tierserve.kvcache import BlockHasher, KVCacheManager
from tierserve.scheduler import EngineCoreRequest, ModelRunnerOutput, Scheduler
from tierserve.scheduler.params import RequestStatus

BS = 4


class AsyncMirror(WorkerMirror):
    """A worker under async scheduling: the scheduler never sends back a sampled token, so
    the mirror appends its own samples, as the ranks do."""

    token_steps = 0

    def apply(self, out) -> list[int]:
        self.token_steps += bool(out.num_scheduled_tokens)
        sampled = super().apply(out)
        for rid, token in zip(out.scheduled_req_ids(), sampled):
            if token >= 0:
                self.tokens[rid].append(token)
        return sampled


class AsyncDriver:
    """The EngineCore's async loop without a model: schedule and submit a step, then apply the
    reply of the step before. The mirror runs a step when it is submitted, which is when a
    worker would (it runs steps in order, each before the next arrives)."""

    def __init__(self, sched: Scheduler):
        self.sched, self.mirror = sched, AsyncMirror()
        self.in_flight: deque = deque()
        self.outputs: dict[tuple[str, int], list[int]] = {}
        self.reasons: dict[tuple[str, int], int | None] = {}
        self.preempted_takes = 0  # tokens taken by requests preempted while their step ran

    def step(self) -> None:
        out = self.sched.schedule()
        work = out.num_scheduled_tokens or out.finished_req_ids or out.preempted_req_ids \
            or out.copy_src
        if work:
            self.in_flight.append((out, self.mirror.apply(out)))
            self.check_mirror()
        if self.in_flight and (len(self.in_flight) == 2 or not work):
            self.collect()
        self.sched.check_integrity()

    def collect(self) -> None:
        out, sampled = self.in_flight.popleft()
        preempted = {r.request_id for r in self.sched.waiting
                     if r.status == RequestStatus.PREEMPTED and r.num_output_placeholders}
        for o in self.sched.update_from_output(out, ModelRunnerOutput(out.step_id, sampled)):
            self.outputs.setdefault((o.req_id, o.index), []).extend(o.new_token_ids)
            self.reasons[(o.req_id, o.index)] = o.finish_reason
        self.preempted_takes += sum(rid in preempted for rid in out.scheduled_req_ids())

    def check_mirror(self) -> None:
        """The worker holds every known token and one per placeholder; its computed count and
        block table equal the scheduler's."""
        for rid, req in self.sched.requests.items():
            if rid not in self.mirror.tokens:
                continue
            held = self.mirror.tokens[rid]
            assert held[:req.num_tokens] == req.all_token_ids
            if req.status == RequestStatus.RUNNING:
                assert len(held) == req.num_tokens + req.num_output_placeholders
                assert self.mirror.computed[rid] == req.num_computed_tokens
                assert self.mirror.blocks[rid] == self.sched.kv.get_block_ids(rid)

    def run(self, max_steps: int = 3000) -> None:
        for _ in range(max_steps):
            if not (self.sched.has_unfinished_requests() or self.in_flight
                    or self.sched.has_pending_worker_updates()):
                return
            self.step()
        raise AssertionError("requests did not finish")


def reference(prompt: list[int], max_tokens: int, max_model_len: int, seed: int = 0,
              stop: tuple[int, ...] = ()) -> list[int]:
    """The fake model's tokens for a request run alone, synchronously."""
    tokens, out = list(prompt), []
    while len(out) < max_tokens and len(tokens) < max_model_len:
        token = next_token(tokens, seed)
        tokens.append(token)
        out.append(token)
        if token in stop:
            break
    return out


def test_the_next_step_schedules_the_placeholder_before_the_token_is_known():
    sched = make_scheduler(num_blocks=32, block_size=BS, async_scheduling=True)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    sched.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=3), eos_token_id=EOS)
    driver = AsyncDriver(sched)
    first = sched.schedule()
    assert first.num_scheduled_tokens == [8]
    driver.in_flight.append((first, driver.mirror.apply(first)))
    second = sched.schedule()  # before the first step's token is known
    cached = second.scheduled_cached_reqs
    assert second.num_scheduled_tokens == [1] and cached.req_ids == ["a"]
    assert cached.new_token_ids == []  # the workers feed the placeholder themselves
    assert cached.new_block_ids == [sched.kv.get_block_ids("a")[2]]  # room for position 8
    assert sched.requests["a"].num_output_placeholders == 2
    driver.in_flight.append((second, driver.mirror.apply(second)))
    driver.collect()
    assert sched.requests["a"].output_token_ids == reference(prompt, 1, 64)
    driver.run()
    assert driver.outputs[("a", 0)] == reference(prompt, 3, 64)
    # Three tokens, three sampling steps: the length limit is known ahead, so none is wasted.
    assert driver.mirror.token_steps == 3


def test_queued_prefill_tokens_count_the_chunk_in_flight():
    """Scheduling counts a prefill chunk as computed before it runs; with async scheduling a
    step is in flight whenever a router reads the load, so its chunk still counts as queued
    prefill until its reply."""
    sched = make_scheduler(num_blocks=32, block_size=BS, async_scheduling=True)
    prompt = list(range(5, 25))
    sched.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=3), eos_token_id=EOS)
    assert sched.queued_prefill_tokens() == len(prompt)
    driver = AsyncDriver(sched)
    first = sched.schedule()
    assert first.num_scheduled_tokens == [len(prompt)]
    assert sched.queued_prefill_tokens() == len(prompt) - 1  # the last token samples
    sched.check_integrity()
    driver.in_flight.append((first, driver.mirror.apply(first)))
    driver.collect()
    assert sched.queued_prefill_tokens() == 0
    sched.check_integrity()


def test_a_stop_learnt_a_step_late_drops_the_token_in_flight():
    prompt = [3, 1, 4, 1, 5]
    ref = reference(prompt, 8, 64)
    stop = ref[2]
    sched = make_scheduler(num_blocks=32, block_size=BS, async_scheduling=True)
    sched.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=8,
                                                  stop_token_ids=[stop]), eos_token_id=EOS)
    driver = AsyncDriver(sched)
    driver.run()
    assert driver.outputs[("a", 0)] == ref[:3]
    assert sched.kv.num_free_blocks == sched.kv.pool.num_usable_blocks
    # The step scheduled while the stop was in flight computed a fourth token, then dropped it;
    # the workers were told to forget the request.
    assert driver.mirror.token_steps == 4 and "a" not in driver.mirror.tokens


@st.composite
def requests(draw):
    prompt = draw(st.lists(st.integers(1, 40), min_size=1, max_size=14))
    return (prompt, draw(st.integers(1, 10)), draw(st.sampled_from([1, 1, 2, 3])),
            draw(st.sampled_from([None, None, "t"])), draw(st.booleans()))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.lists(requests(), min_size=1, max_size=8), num_blocks=st.integers(10, 40),
       budget=st.integers(4, 40), max_seqs=st.integers(1, 6),
       threshold=st.sampled_from([0, 0, 3]), arrive_every=st.integers(0, 3),
       aborts=st.lists(st.integers(0, 30), max_size=3))
# n=3 whose first sample's step is in flight when the parent is preempted: no blocks to fork.
@example(batch=[([1, 1, 1], 7, 3, None, False), ([1], 5, 1, None, False),
                ([1], 1, 2, None, False)],
         num_blocks=10, budget=5, max_seqs=5, threshold=0, arrive_every=3, aborts=[])
def test_random_batches_under_async_scheduling_give_the_reference_tokens(
        batch, num_blocks, budget, max_seqs, threshold, arrive_every, aborts):
    kv = KVCacheManager(num_blocks, BS, enable_caching=True)
    sched = Scheduler(kv, BlockHasher(BS), max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                      max_model_len=32, long_prefill_token_threshold=threshold,
                      vocab_size=1000, async_scheduling=True)
    driver = AsyncDriver(sched)
    pending, expected, aborted = list(enumerate(batch)), {}, set()
    for step_no in range(3000):
        if pending and (arrive_every == 0 or step_no % arrive_every == 0):
            i, (prompt, max_tokens, n, salt, with_stop) = pending.pop(0)
            seed = 10 * i
            refs = [reference(prompt, max_tokens, 32, (seed + k) % 2**64) for k in range(n)]
            stop = [refs[0][len(refs[0]) // 2]] if with_stop and refs[0] else []
            params = SamplingParams(temperature=1.0, max_tokens=max_tokens, n=n, seed=seed,
                                    stop_token_ids=stop)
            sched.add_request(f"r{i}", prompt, params, eos_token_id=EOS, cache_salt=salt)
            for k in range(n):
                expected[(f"r{i}", k)] = reference(prompt, max_tokens, 32, (seed + k) % 2**64,
                                                   tuple(stop))
        if step_no in aborts and sched.requests:
            victim = sorted({r.family_id for r in sched.requests.values()})[0]
            sched.abort_requests([victim])
            aborted.add(victim)
            sched.check_integrity()
        if not (pending or sched.has_unfinished_requests() or driver.in_flight
                or sched.has_pending_worker_updates()):
            break
        driver.step()
    assert not pending and not sched.requests and not driver.in_flight
    assert sched.kv.num_free_blocks == sched.kv.pool.num_usable_blocks
    assert not sched.kv.req_to_blocks
    for key, tokens in expected.items():
        if key[0] in aborted:
            assert driver.outputs.get(key, []) == tokens[:len(driver.outputs.get(key, []))]
        else:
            assert driver.outputs[key] == tokens, key


def test_a_request_preempted_while_its_step_runs_keeps_that_token():
    """Two growing requests in a pool that cannot hold both: the later one is preempted in the
    step scheduled while its last decode runs, takes that decode's token, and resumes."""
    takes = 0
    for num_blocks in range(11, 18):
        kv = KVCacheManager(num_blocks, BS, enable_caching=True)
        sched = Scheduler(kv, BlockHasher(BS), max_num_seqs=4, max_num_batched_tokens=64,
                          max_model_len=29, vocab_size=1000, async_scheduling=True)
        prompts = {"a": list(range(1, 10)), "b": list(range(20, 29))}
        for rid, prompt in prompts.items():
            sched.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=20),
                              eos_token_id=EOS)
        driver = AsyncDriver(sched)
        driver.run()
        for rid, prompt in prompts.items():
            assert driver.outputs[(rid, 0)] == reference(prompt, 20, 29)
        assert kv.num_free_blocks == kv.pool.num_usable_blocks
        takes += driver.preempted_takes
    assert takes > 0


# ---------------------------------------------------------------- the engine, sync vs async


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(add_tiny_tokenizer(make_tiny_llama(tmp_path_factory.mktemp("async") / "llama")))


def _prompts() -> list[list[int]]:
    shared = [(7 * i + 3) % 300 + 3 for i in range(37)]
    return [shared[:5], shared + [11, 12, 13], [(13 * i + 5) % 300 + 3 for i in range(61)],
            shared[:20] + [44], [9, 8, 7], shared + [50, 51]]


def _params() -> list[SamplingParams]:
    greedy = dict(temperature=0, ignore_eos=True)
    return [SamplingParams(max_tokens=12, **greedy),
            SamplingParams(temperature=1.0, top_k=40, max_tokens=9, seed=7, n=2, ignore_eos=True),
            SamplingParams(max_tokens=1, **greedy),
            SamplingParams(max_tokens=14, stop_token_ids=[100, 200, 300], **greedy),
            SamplingParams(temperature=0.8, top_p=0.9, max_tokens=11, seed=3, ignore_eos=True),
            SamplingParams(max_tokens=10, logprobs=2, **greedy)]


def _drive(llm: LLM, prompts, params) -> dict:
    """Runs the batch through the engine's step loop, checking the scheduler every step."""
    core = llm.engine
    requests = [EngineCoreRequest(f"q{i}", p, prompt_token_ids=prompt)
                for i, (prompt, p) in enumerate(zip(prompts, params))]
    got: dict = {}
    for outputs in core.stream_batch(requests):
        core.scheduler.check_integrity()
        for o in outputs:
            assert not o.error, o.error
            entry = got.setdefault((o.req_id, o.index), {"tokens": [], "text": "",
                                                         "reason": None, "logprobs": []})
            entry["tokens"] += o.new_token_ids
            entry["text"] += o.new_text
            entry["logprobs"] += [(lp.token_ids, [round(x, 4) for x in lp.logprobs])
                                  for lp in o.logprobs]
            if o.finish_reason is not None:
                entry["reason"] = o.finish_reason
    assert not core._in_flight
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_running"] == stats["num_waiting"] == 0
    return got


MODES = {
    "plain": dict(block_size=4),
    "chunked": dict(max_num_batched_tokens=16, long_prefill_token_threshold=8, block_size=4),
    # 29 blocks of 4 tokens cannot hold the batch at once: requests get preempted and resume.
    "preempted": dict(num_kv_blocks=30, block_size=4, max_model_len=80),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_async_engine_gives_the_sync_engines_outputs(tiny, mode):
    prompts, params = _prompts(), _params()
    results, preemptions = {}, {}
    for async_scheduling in (False, True):
        with LLM(tiny, async_scheduling=async_scheduling, **MODES[mode]) as llm:
            results[async_scheduling] = [_drive(llm, prompts, params) for _ in range(2)]
            preemptions[async_scheduling] = llm.stats()["num_preemptions"]
    assert results[True] == results[False]
    stopped = results[True][0][("q3", 0)]
    assert stopped["reason"] is not None
    if mode == "preempted":
        assert preemptions[True] > 0


def test_async_stop_strings_and_aborts_leave_nothing_behind(tiny):
    with LLM(tiny, block_size=4) as llm:
        free = llm.generate(["hello there"], SamplingParams(temperature=0, max_tokens=24,
                                                            ignore_eos=True), use_tqdm=False)
    text = free[0].outputs[0].text
    stop = next(text[i:i + 2] for i in range(4, len(text) - 2) if text[i:i + 2].strip())
    with LLM(tiny, block_size=4, async_scheduling=True) as llm:
        cut = llm.generate(["hello there"], SamplingParams(
            temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]), use_tqdm=False)[0]
        assert cut.outputs[0].finish_reason == "stop"
        assert stop not in cut.outputs[0].text and text.startswith(cut.outputs[0].text)
        core = llm.engine
        stream = core.stream_batch([EngineCoreRequest(f"x{i}", SamplingParams(
            temperature=0, max_tokens=30, ignore_eos=True), prompt_token_ids=list(range(5, 25)))
            for i in range(3)])
        for _ in range(4):
            next(stream)
        assert core._in_flight  # a step is running while its outputs are being read
        stream.close()  # the caller leaves early: everything is aborted and drained
        assert not core._in_flight and not core.has_unfinished_requests()
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        again = llm.generate(["hello there"], SamplingParams(temperature=0, max_tokens=24,
                                                             ignore_eos=True), use_tqdm=False)
        assert again[0].outputs[0].text == text

"""LLM.generate against transformers' generate on the same tiny random weights, token for
token, under prefix caching on/off, chunked prefill and forced preemption."""
import asyncio
import time

import msgspec
import pytest

from tests.checkpoints import (
    TINY_LLAMA3_ROPE, hf_greedy, load_hf, make_tiny_llama, make_tiny_qwen2, make_tiny_qwen3,
)
from tierserve import LLM, AsyncLLM, RequestOutputKind, SamplingParams
from tierserve.scheduler.params import ErrorKind

MAX_NEW = 10


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "llama": make_tiny_llama(root / "llama"),
        "llama3rope": make_tiny_llama(root / "llama3", rope_scaling=TINY_LLAMA3_ROPE,
                                      tie_word_embeddings=True, seed=3),
        "qwen2": make_tiny_qwen2(root / "qwen2"),
        "qwen3": make_tiny_qwen3(root / "qwen3"),
    }


def _prompts(vocab: int) -> list[list[int]]:
    shared = [(7 * i + 3) % (vocab - 3) + 3 for i in range(37)]
    return [
        shared[:5],
        shared + [11, 12, 13],
        [(13 * i + 5) % (vocab - 3) + 3 for i in range(61)],
        shared[:20] + [44],
        [9, 8, 7],
        shared + [50, 51],  # shares 37 tokens with the second prompt
    ]


@pytest.fixture(scope="module")
def references(checkpoints):
    refs = {}
    for name, path in checkpoints.items():
        hf = load_hf(path)
        refs[name] = [hf_greedy(hf, p, MAX_NEW) for p in _prompts(hf.config.vocab_size)]
    return refs


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
MODES = {
    "prefix_caching": dict(enable_prefix_caching=True, block_size=4),
    "no_caching": dict(enable_prefix_caching=False, block_size=8),
    "chunked": dict(max_num_batched_tokens=16, long_prefill_token_threshold=8, block_size=4),
    # 40 blocks of 4 tokens cannot hold the batch at once: requests get preempted and resume.
    "preempted": dict(num_kv_blocks=41, block_size=4, max_model_len=80),
}


@pytest.mark.parity
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", ["llama", "llama3rope", "qwen2", "qwen3"])
def test_greedy_equals_transformers(checkpoints, references, name, mode, backend):
    options = MODES[mode]
    with LLM(str(checkpoints[name]), cpu_isa=backend.name, **options) as llm:
        assert llm.stats()["cpu_backend"] == backend.name
        prompts = _prompts(llm.engine.vocab_size)
        # Run twice: the second pass hits the prefix cache where it is on.
        for _ in range(2):
            outs = llm.generate(prompts, GREEDY, use_tqdm=False)
            for out, ref in zip(outs, references[name]):
                assert out.error is None
                assert out.outputs[0].token_ids == ref
                assert out.outputs[0].finish_reason == "length"
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
    if mode == "prefix_caching":
        assert stats["prefix_cache_hit_tokens"] > 0
        assert outs[5].num_cached_tokens > 0
    if mode == "no_caching":
        assert stats["prefix_cache_hit_tokens"] == 0
    if mode == "preempted":
        assert stats["num_preemptions"] > 0


def test_seeded_sampling_is_reproducible_and_batch_independent(checkpoints):
    with LLM(str(checkpoints["llama"]), block_size=4) as llm:
        prompts = _prompts(llm.engine.vocab_size)
        seeded = SamplingParams(temperature=1.0, top_k=50, max_tokens=12, seed=1234,
                                ignore_eos=True)
        alone = llm.generate([prompts[1]], seeded, use_tqdm=False)[0].outputs[0].token_ids
        in_batch = llm.generate(prompts, [GREEDY, seeded] + [GREEDY] * 4,
                                use_tqdm=False)[1].outputs[0].token_ids
        other = llm.generate([prompts[1]], SamplingParams(temperature=1.0, top_k=50,
                                                          max_tokens=12, seed=4321,
                                                          ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids
    assert alone == in_batch
    assert alone != other


def test_bad_requests_fail_alone_and_leak_nothing(checkpoints, references):
    with LLM(str(checkpoints["llama"]), block_size=4, max_model_len=64) as llm:
        vocab = llm.engine.vocab_size
        good = _prompts(vocab)[0]
        outs = llm.generate(
            [good, [], list(range(3, 70)), [1, 2, vocab + 5], good, "text without tokenizer"],
            [GREEDY, GREEDY, GREEDY, GREEDY, {"temperature": -1.0}, GREEDY], use_tqdm=False)
        errors = [o.error for o in outs]
        assert errors[0] is None and outs[0].outputs[0].token_ids == references["llama"][0]
        assert "empty" in errors[1]
        assert "max_model_len" in errors[2]
        assert "out of range" in errors[3]
        assert "temperature" in errors[4]
        assert "tokenizer" in errors[5]
        assert all(o.outputs[0].finish_reason == "error" for o in outs[1:])
        # A request that skipped the frontend: the engine takes no text.
        from tierserve.scheduler.messages import EngineCoreRequest
        raw = EngineCoreRequest("raw", SamplingParams(bad_words=["x"]), prompt_token_ids=good)
        (out,), = list(llm.engine.stream_batch([raw]))
        assert "bad_words are text" in out.error
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        assert stats["num_running"] == stats["num_waiting"] == 0


def test_a_batch_past_the_queue_bound_is_queued_whole(checkpoints, references):
    """vLLM's offline batches queue whole: past max_queued_requests, LLM's requests wait in
    its stream and join the queue as it drains (a bad one still fails alone); a server's
    stream (AsyncEngine.generate without hold) is refused at the bound instead."""
    from tierserve.runtime.async_engine import AsyncEngine
    from tierserve.runtime.config import EngineConfig
    from tierserve.scheduler.messages import EngineCoreRequest
    with LLM(str(checkpoints["llama"]), block_size=4, max_queued_requests=2) as llm:
        prompts = _prompts(llm.engine.vocab_size)
        outs = llm.generate(prompts * 3 + [[]] + prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs[:18] + outs[19:]] == references["llama"] * 4
        assert "empty" in outs[18].error
        llm.engine.scheduler.check_integrity()
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"] and stats["num_waiting"] == 0
    engine = AsyncEngine(EngineConfig.from_kwargs(model=str(checkpoints["llama"]), block_size=4,
                                                  max_queued_requests=2))

    async def run(hold: bool, tag: str):
        tokens, kinds = {}, {}
        reqs = [EngineCoreRequest(f"{tag}{i}", GREEDY, prompt_token_ids=p)
                for i, p in enumerate(prompts)]
        async for batch in engine.generate(reqs, hold=hold):
            for o in batch:
                tokens.setdefault(o.req_id, []).extend(o.new_token_ids)
                kinds[o.req_id] = o.error_kind
        return [tokens[r.req_id] for r in reqs], [kinds[r.req_id] for r in reqs]
    try:
        held, kinds = asyncio.run(run(True, "h"))
        assert held == references["llama"] and not any(kinds)
        _, kinds = asyncio.run(run(False, "s"))
        assert kinds.count(ErrorKind.OVERLOADED) == len(prompts) - 2
    finally:
        engine.shutdown()


def test_prompt_logprobs_survive_preemption_during_chunked_prefill(checkpoints):
    """A request preempted before its first output computes its prompt again from the start:
    its prompt logprobs are the prompt's, once each, as without preemption."""
    prompts = [[(5 * i + j) % 380 + 3 for i in range(25)] for j in range(6)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=1)

    def run(**options):
        with LLM(str(checkpoints["llama"]), block_size=4, max_model_len=80,
                 max_num_batched_tokens=16, long_prefill_token_threshold=8, **options) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            return outs, llm.stats()["num_preemptions"]
    tight, preemptions = run(num_kv_blocks=30)
    roomy, none = run()
    assert preemptions > 0 and none == 0
    for t, r, p in zip(tight, roomy, prompts):
        assert len(t.prompt_logprobs) == len(p) and t.prompt_logprobs[0] is None
        for a, b, token in zip(t.prompt_logprobs[1:], r.prompt_logprobs[1:], p[1:]):
            assert token in a and abs(a[token].logprob - b[token].logprob) < 1e-4


def test_batch_feed_holds_what_the_engine_refused_ahead_of_the_rest():
    from tierserve.runtime.outputs import BatchFeed
    from tierserve.scheduler.messages import EngineCoreOutput, EngineCoreRequest
    reqs = [EngineCoreRequest(f"r{i}", GREEDY, prompt_token_ids=[3]) for i in range(5)]
    feed = BatchFeed(reqs, window=2)
    assert [r.req_id for r in feed.release()] == ["r0", "r1"] and feed.release() == []
    refused = EngineCoreOutput("r0", finish_reason=1, error="full",
                               error_kind=ErrorKind.OVERLOADED)
    token = EngineCoreOutput("r1", new_token_ids=[4])
    assert feed.update([refused]) == [] and not feed.stalled  # r1 still waits
    assert feed.update([token]) == [token] and not feed.stalled
    assert [r.req_id for r in feed.release()] == ["r0", "r2"]
    feed.update([msgspec.structs.replace(refused, req_id=r) for r in ("r0", "r2")])
    assert feed.stalled and [r.req_id for r in feed.release()] == ["r0", "r2"]


def test_unknown_engine_option_is_an_error(checkpoints):
    with pytest.raises(ValueError, match="max_num_seq.*did you mean 'max_num_seqs'"):
        LLM(str(checkpoints["llama"]), max_num_seq=4)


def test_logprobs_are_returned_for_the_sampled_token(checkpoints):
    with LLM(str(checkpoints["qwen2"]), block_size=4) as llm:
        out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4,
                                                           logprobs=3, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and entry[token].rank == 1  # greedy picks the top token
        assert len(entry) == 3
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in
                                                       zip(out.token_ids, out.logprobs)))


def test_logprob_token_ids_come_with_each_token_as_the_full_distribution_has_them(
        checkpoints):
    """Each step's entries for logprob_token_ids equal that step's full log-softmax (every
    token asked with logprob_token_ids too), ranks included; an id outside the vocabulary is
    that request's error."""
    prompt, asked = [[5, 6, 7, 8]], [3, 9, 40]
    greedy = dict(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(str(checkpoints["qwen2"]), block_size=4) as llm:
        vocab = llm.engine.vocab_size
        out = llm.generate(prompt, SamplingParams(**greedy, logprob_token_ids=asked),
                           use_tqdm=False)[0].outputs[0]
        full = llm.generate(prompt, SamplingParams(**greedy, logprob_token_ids=list(
            range(min(vocab, 128)))), use_tqdm=False)[0].outputs[0]
        bad = llm.generate(prompt, SamplingParams(**greedy, logprob_token_ids=[vocab]),
                           use_tqdm=False)[0]
    assert full.token_ids == out.token_ids and len(out.logprobs) == 4
    for token, entry, every in zip(out.token_ids, out.logprobs, full.logprobs):
        assert list(entry) == [token, *[t for t in asked if t != token]]
        assert entry[token].rank == 1
        for t in asked:
            assert entry[t].logprob == pytest.approx(every[t].logprob, abs=1e-5)
            assert entry[t].rank == every[t].rank
        if vocab <= 128:  # the whole distribution: ranks are its order
            order = sorted(every, key=lambda t: -every[t].logprob)
            assert all(every[t].rank == order.index(t) + 1 for t in asked)
    assert bad.error and "out of range" in bad.error


def test_skip_reading_prefix_cache_recomputes_the_prompt(checkpoints, references):
    """vLLM's skip_reading_prefix_cache: the request hits nothing (its tokens the same), and
    what it computes is still cached for the next request."""
    skip = SamplingParams(temperature=0, max_tokens=GREEDY.max_tokens, ignore_eos=True,
                          skip_reading_prefix_cache=True)
    with LLM(str(checkpoints["llama"]), block_size=4) as llm:
        prompt = _prompts(llm.engine.vocab_size)[5]
        first = llm.generate([prompt], skip, use_tqdm=False)[0]
        again = llm.generate([prompt], skip, use_tqdm=False)[0]
        read = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == again.num_cached_tokens == 0
    assert read.num_cached_tokens > 0
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == \
        read.outputs[0].token_ids == references["llama"][5]
    with pytest.raises(ValueError, match="skip_reading_prefix_cache must be True or False"):
        SamplingParams(skip_reading_prefix_cache=1)


def test_repetition_detection_ends_a_looping_output(checkpoints):
    """An output held to one token loops at once: repetition_detection ends it after
    min_count repeats (not before min_tokens), finish_reason "repetition" and stop_reason
    "repetition_detected", as vLLM reports it; without it the output runs to its length."""
    loop = dict(temperature=0, max_tokens=12, ignore_eos=True, allowed_token_ids=[5])
    from tierserve import RepetitionDetectionParams
    rep = RepetitionDetectionParams(max_pattern_size=2, min_count=4)
    with LLM(str(checkpoints["llama"]), block_size=4) as llm:
        outs = llm.generate([[7, 8, 9]] * 3, [
            SamplingParams(**loop, repetition_detection=rep),
            SamplingParams(**loop, repetition_detection=rep, min_tokens=6),
            SamplingParams(**loop)], use_tqdm=False)
        stats = llm.stats()
    (a,), (b,), (c,) = (o.outputs for o in outs)
    assert a.token_ids == [5] * 4 and b.token_ids == [5] * 6 and c.token_ids == [5] * 12
    assert a.finish_reason == b.finish_reason == "repetition" and c.finish_reason == "length"
    assert a.stop_reason == "repetition_detected" and c.stop_reason is None
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_stream_interval_joins_a_samples_deltas(checkpoints):
    """vLLM's stream_interval: each sample's deltas carry that many tokens, its first and
    last at once; joined they are the same tokens and text; a cumulative stream is yielded as
    often."""
    base = dict(temperature=1.0, seed=3, max_tokens=10, ignore_eos=True, n=2)

    async def deltas(llm, **extra):
        return [d async for d in llm.generate([5, 6, 7, 8], SamplingParams(**base, **extra))]

    with AsyncLLM(str(checkpoints["llama"]), block_size=4) as llm:
        every = asyncio.run(deltas(llm))
        joined = asyncio.run(deltas(llm, stream_interval=4))
        cumulative = asyncio.run(deltas(llm, stream_interval=4,
                                        output_kind=RequestOutputKind.CUMULATIVE))
    for index in (0, 1):
        mine = [d.outputs[0] for d in joined if d.outputs[0].index == index]
        assert [len(c.token_ids) for c in mine] == [1, 4, 4, 1]
        assert mine[-1].finish_reason == "length" and mine[-1].stop_reason is None
        alone = [d.outputs[0] for d in every if d.outputs[0].index == index]
        assert sum((c.token_ids for c in mine), []) == sum((c.token_ids for c in alone), [])
    assert joined[-1].finished and not any(d.finished for d in joined[:-1])
    assert len(cumulative) < len(every) and cumulative[-1].finished
    assert [c.token_ids for c in cumulative[-1].outputs] == [
        sum((d.outputs[0].token_ids for d in every if d.outputs[0].index == i), [])
        for i in (0, 1)]
    with pytest.raises(ValueError, match="stream_interval must be >= 1"):
        SamplingParams(stream_interval=0)


def test_async_llm_in_process_streams_concurrent_requests(checkpoints, references):
    """AsyncLLM without Ray: the same EngineCore on its own step-loop thread; concurrent
    streams get the same tokens as LLM, and leaving a stream early frees its blocks."""
    async def collect(llm, prompt, request_id=None):
        tokens = []
        async for delta in llm.generate(prompt, GREEDY, request_id):  # vLLM's third argument
            assert delta.error is None and delta.request_id == (request_id or delta.request_id)
            tokens.extend(delta.outputs[0].token_ids)
        return tokens

    async def leave_early(llm, prompt):
        async for _ in llm.generate(prompt, SamplingParams(temperature=0, max_tokens=200,
                                                           ignore_eos=True)):
            break

    with AsyncLLM(str(checkpoints["llama"]), block_size=4) as llm:
        prompts = _prompts(llm.engine.vocab_size)

        async def scenario():
            got = await asyncio.gather(*[collect(llm, p, f"r{i}" if i % 2 else None)
                                         for i, p in enumerate(prompts)])
            await leave_early(llm, prompts[2])
            return got

        assert asyncio.run(scenario()) == references["llama"]

        async def kinds(prompt):  # vLLM's output kinds: everything so far, or the end only
            got = {}
            for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
                params = msgspec.structs.replace(GREEDY, output_kind=kind, n=2)
                got[kind] = [o async for o in llm.generate(prompt, params)]
            return got
        got = asyncio.run(kinds(prompts[1]))
        views, (final,) = got[RequestOutputKind.CUMULATIVE], got[RequestOutputKind.FINAL_ONLY]
        assert len(views) > 2 and final.finished and views[-1].finished
        assert views[-1].outputs == final.outputs
        assert [c.token_ids for c in final.outputs] == [references["llama"][1]] * 2
        for before, after in zip(views, views[1:]):
            assert not before.finished and all(
                a.token_ids[:len(b.token_ids)] == b.token_ids and len(a.token_ids) >= len(
                    b.token_ids) for a, b in zip(after.outputs, before.outputs))
        # A second event loop drives the same engine.
        assert asyncio.run(collect(llm, prompts[0])) == references["llama"][0]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            stats = llm.stats()
            if stats["num_running"] == stats["num_waiting"] == 0:
                break
            time.sleep(0.1)
        assert stats["num_free_blocks"] == stats["num_total_blocks"]

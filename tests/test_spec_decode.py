"""N-gram speculative decoding: the drafts (scheduler/spec.py), verification on the workers
(workers/spec_decode.py), greedy output equal to decoding without speculation across prefix
hits, preemption and async scheduling, and sampled output distributed as the target (a
deterministic chi-square test on the sampler itself)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.checkpoints import make_tiny_llama
from tierserve import LLM, SamplingParams
from tierserve.deploy.reply_check import reply_problem
from tierserve.scheduler import ModelRunnerOutput, SchedulerOutput
from tierserve.scheduler.messages import req_ids_digest
from tierserve.scheduler.spec import NgramIndex, SpeculativeConfig
from tierserve.workers.sampler import Sampler, SamplingBatch
from tierserve.workers.spec_decode import SampleRows

SPEC = {"method": "ngram", "num_speculative_tokens": 3}
# Prompts that repeat themselves, so drafts are found, and one that does not.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11] * 5, [3, 4, 5] * 6 + [9], [17, 40, 3, 99, 250, 12, 8, 71]]


def test_ngram_index_drafts_from_the_latest_longest_earlier_match():
    index = NgramIndex(2, 3)
    tokens = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3]
    # [1, 2, 3] occurred twice before; the latest one continued with 5.
    assert index.propose(tokens, 2) == [5, 1]
    tokens += [9, 9]
    assert index.propose(tokens, 4) == []  # [3, 9, 9], [9, 9] never occurred before
    tokens += [1, 2]
    assert index.propose(tokens, 3) == [3, 9, 9]  # [9, 1, 2] no; [1, 2] -> its latest
    assert index.propose([7], 3) == []  # too short for any n-gram
    # Incremental: the same answers as an index built on the final list at once.
    fresh = NgramIndex(2, 3)
    assert fresh.propose(tokens, 3) == [3, 9, 9]


def test_speculative_config_takes_vllm_names_and_refuses_bad_ones():
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 5,
                                      "prompt_lookup_max": 3})
    assert (config.num_speculative_tokens, config.prompt_lookup_max,
            config.prompt_lookup_min) == (5, 3, 2)
    for bad, message in (({"num_speculative_tokens": 0}, "num_speculative_tokens"),
                         ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
                         ({"num_speculative_tokens": 2, "draft_model": "x"}, "unknown"),
                         ({"prompt_lookup_max": 2}, "needs num_speculative_tokens"),
                         ({"num_speculative_tokens": 2, "prompt_lookup_min": 4,
                           "prompt_lookup_max": 3}, "prompt_lookup_min")):
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.parse(bad)
    with pytest.raises(ValueError, match="speculative_config"):
        LLM("unused", speculative_config={"num_speculative_tokens": "4"})


def test_rejection_sampling_follows_the_target_distribution():
    """N requests, each with the draft token 2 before a bonus position; every row sampled by
    the sampler on its own. The first token out (the draft where accepted, else the sample)
    follows p, the draft is accepted with probability p[2], and the token after an accepted
    draft follows q. Seeded: the same draws on every run."""
    p = torch.tensor([0.05, 0.15, 0.40, 0.10, 0.20, 0.10])
    q = torch.tensor([0.30, 0.05, 0.05, 0.30, 0.10, 0.20])
    n = 20000
    logits = torch.stack([p.log(), q.log()]).repeat(n, 1)  # rows: draft position, bonus
    params = [SamplingParams(temperature=1.0)] * (2 * n)
    batch = SamplingBatch.build(params, [None] * (2 * n), None, 6, "cpu")
    sampler = Sampler(torch.Generator().manual_seed(1234))
    samples = sampler(logits, batch).token_ids.numpy()
    rows = SampleRows(np.arange(2 * n), [], np.arange(0, 2 * n, 2),
                      [np.array([2])] * n)
    final, accepted, step_tokens = rows.accept(samples)
    first = step_tokens[:, 0]
    accepted = np.array(accepted, dtype=bool)
    assert np.array_equal(first[accepted], np.full(accepted.sum(), 2))
    assert abs(accepted.mean() - 0.40) < 4 * (0.4 * 0.6 / n) ** 0.5
    for observed, probs, count in ((first, p, n), (final[accepted], q, int(accepted.sum()))):
        freq = np.bincount(observed, minlength=6)
        expected = probs.numpy() * count
        chi2 = float(((freq - expected) ** 2 / expected).sum())
        assert chi2 < 20.5, (freq, expected)  # 5 degrees of freedom: p < 0.001


def test_a_reply_must_accept_no_more_drafts_than_were_sent():
    out = SchedulerOutput(3, num_scheduled_tokens=[4, 1], spec_token_ids=[7, 8, 9],
                          num_spec_tokens=[3, 0])
    out.scheduled_cached_reqs.req_ids.extend(["a", "b"])
    digest = req_ids_digest(["a", "b"])

    def reply(accepted):
        return ModelRunnerOutput(3, [5, 6], num_accepted=accepted, req_ids_digest=digest)

    assert reply_problem(reply([2, 0]), 0, out, 100, 1) is None
    assert reply_problem(reply([]), 0, out, 100, 1) is None
    for bad in ([4, 0], [0, 1], [1], [-1, 0]):
        assert "draft" in reply_problem(reply(bad), 0, out, 100, 1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_llama(tmp_path_factory.mktemp("spec") / "llama"))


def _run(path, prompts, params, **options):
    with LLM(path, block_size=4, **options) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        again = llm.generate(prompts[:1], params, use_tqdm=False)  # a prefix hit
        stats = llm.stats()
    assert all(o.error is None for o in outs + again)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    return [o.outputs[0].token_ids for o in outs + again], stats


@pytest.mark.parametrize("options", [{}, {"async_scheduling": True},
                                     {"num_kv_blocks": 24, "max_model_len": 64}],
                         ids=["sync", "async", "preempting"])
def test_greedy_output_is_the_same_with_speculation(tiny, options):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want, _ = _run(tiny, PROMPTS, greedy, **options)
    got, stats = _run(tiny, PROMPTS, greedy, speculative_config=SPEC, **options)
    assert got == want
    assert stats["spec_num_accepted_tokens"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert stats["spec_num_accepted_tokens"] <= stats["spec_num_draft_tokens"]
    assert set(stats["spec_acceptance_by_request"]) >= {"0", "1"}
    if "num_kv_blocks" in options:
        assert stats["num_preemptions"] > 0


def test_seeded_sampling_with_speculation_is_reproducible(tiny):
    """Drafts depend on the request's own tokens alone, so a seeded request gives the same
    tokens alone or in a batch, and stops where its limits say."""
    seeded = SamplingParams(temperature=0.2, top_k=30, seed=11, max_tokens=20, ignore_eos=True)
    alone, _ = _run(tiny, PROMPTS[:1], seeded, speculative_config=SPEC)
    batch, stats = _run(tiny, PROMPTS, seeded, speculative_config=SPEC)
    assert batch[0] == alone[0] and all(len(t) == 20 for t in batch)
    assert stats["spec_num_drafts"] > 0


def test_seeded_speculation_samples_what_one_token_at_a_time_does(tiny):
    """Draws for rejected drafts are rewound: a seeded stream advances one draw per kept
    token, so its tokens are those of decoding without speculation (the kernels give a row
    the same logits in a verification as alone), and a continuation on other workers, which
    skips one draw per token, resumes the very stream."""
    seeded = SamplingParams(temperature=0.2, seed=5, max_tokens=24, ignore_eos=True)
    want, _ = _run(tiny, PROMPTS, seeded)
    got, stats = _run(tiny, PROMPTS, seeded, speculative_config=SPEC)
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]
    assert got == want


def test_metrics_report_acceptance_per_request():
    """/metrics (deploy/openai/metrics.py) from the scheduler's speculation stats: vLLM's
    counters and a histogram of each finished request's acceptance rate."""
    from prometheus_client import CollectorRegistry, generate_latest

    from tierserve.deploy.openai.metrics import EngineCollector
    from tierserve.scheduler.spec import Speculator
    speculator = Speculator(SpeculativeConfig.parse(SPEC))
    speculator.record("a", 3, 3)
    speculator.record("a", 3, 0)
    speculator.record("b", 2, 1)
    speculator.record("c", 3, 2)  # still running: not in the histogram
    speculator.forget("a")
    speculator.forget("b")
    stats = speculator.stats()
    assert stats["spec_acceptance_by_request"] == {"a": 0.5, "b": 0.5, "c": 2 / 3}
    collector = EngineCollector()
    collector.stats = stats
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    assert "tierserve:spec_decode_num_draft_tokens_total 11.0" in text
    assert "tierserve:spec_decode_num_accepted_tokens_total 6.0" in text
    assert 'tierserve:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 3.0' in text
    assert 'tierserve:spec_decode_request_acceptance_rate_bucket{le="0.5"} 2.0' in text
    assert 'tierserve:spec_decode_request_acceptance_rate_bucket{le="0.4"} 0.0' in text
    assert "tierserve:spec_decode_request_acceptance_rate_count 2.0" in text
    # LLM.get_metrics' records of the same families, as vLLM's reader shapes them.
    from tierserve.runtime.metrics import Histogram, Vector, engine_families, snapshot
    records = {m.name: m for m in snapshot(engine_families(stats))}
    per_pos = records["tierserve:spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(per_pos, Vector) and per_pos.values == stats["spec_accepted_per_position"]
    assert sum(per_pos.values) == records["tierserve:spec_decode_num_accepted_tokens"].value == 6
    rate = records["tierserve:spec_decode_request_acceptance_rate"]
    assert isinstance(rate, Histogram) and (rate.count, rate.sum) == (2, 1.0)
    assert rate.buckets["0.4"] == 0 and rate.buckets["0.5"] == rate.buckets["+Inf"] == 2

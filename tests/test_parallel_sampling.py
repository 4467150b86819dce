"""n > 1: the prompt's KV is computed once; each sample forks with its full blocks shared by
ref count and the partial last block copied (copy-on-write). Scheduler-level checks drive a
KV mirror that holds, for every slot, the token it was computed for; engine-level checks
compare each sample with a separate request of the same seed, and greedy with transformers."""
import pytest

from tests.checkpoints import hf_greedy, load_hf, make_tiny_llama
from tests.sched_driver import EOS, TieredMirror, make_scheduler, next_token, tiered_step
from tierserve import LLM, SamplingParams
from tierserve.scheduler import FinishReason, RequestStatus
from tierserve.scheduler.params import MAX_N

BS = 4


def sampled(n, seed=5, max_tokens=6):
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, n=n, seed=seed)


def expected(prompt, seed, max_tokens):
    toks = list(prompt)
    for _ in range(max_tokens):
        toks.append(next_token(toks, seed))
    return toks[len(prompt):]


def collect(outputs, got, reasons):
    for o in outputs:
        got.setdefault((o.req_id, o.index), []).extend(o.new_token_ids)
        if o.finish_reason is not None:
            reasons[(o.req_id, o.index)] = o.finish_reason


def run(sched, mirror, max_steps=200, got=None):
    outs, got, reasons = [], {} if got is None else got, {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        out, outputs = tiered_step(sched, mirror)
        sched.check_integrity()
        outs.append(out)
        collect(outputs, got, reasons)
    assert not sched.has_unfinished_requests()
    return outs, got, reasons


@pytest.mark.parametrize("prompt_len", [10, 9, 12, 1])
def test_samples_share_full_blocks_and_copy_the_partial_one(prompt_len):
    sched = make_scheduler(num_blocks=64, block_size=BS)
    mirror = TieredMirror(BS)
    prompt = list(range(1, prompt_len + 1))
    sched.add_request("a", prompt, sampled(3), eos_token_id=EOS)
    got = {}
    out, outputs = tiered_step(sched, mirror)
    collect(outputs, got, {})
    assert out.scheduled_req_ids() == ["a"]  # the prompt is computed once
    parent = sched.kv.req_to_blocks["a"]
    num_full, partial = divmod(prompt_len - 1, BS)
    for i in (1, 2):
        child = sched.kv.req_to_blocks[f"a\x1f{i}"]
        assert child[:num_full] == parent[:num_full]
        assert len(child) == num_full + (partial > 0)
    assert all(b.ref_cnt == 3 for b in parent[:num_full])
    out, outputs = tiered_step(sched, mirror)
    collect(outputs, got, {})
    if partial:
        src = parent[num_full].block_id
        assert out.copy_src == [src, src]
        assert out.copy_dst == [sched.kv.req_to_blocks[f"a\x1f{i}"][num_full].block_id
                                for i in (1, 2)]
    else:
        assert out.copy_src == out.copy_dst == []
    # Each sample computes the last prompt token itself (its own logits), nothing more.
    new = {r.req_id: r for r in out.scheduled_new_reqs}
    assert set(new) == {"a\x1f1", "a\x1f2"}
    assert all(r.num_computed_tokens == prompt_len - 1 for r in new.values())
    assert dict(zip(out.scheduled_req_ids(), out.num_scheduled_tokens)) == {
        "a": 1, "a\x1f1": 1, "a\x1f2": 1}
    sched.check_integrity()
    _, got, reasons = run(sched, mirror, got=got)
    for i in range(3):
        assert got[("a", i)] == expected(prompt, 5 + i, 6), i
        assert reasons[("a", i)] == FinishReason.LENGTH
    assert sched.kv.num_free_blocks == sched.kv.pool.num_usable_blocks
    assert not sched.families


def test_greedy_samples_are_identical_and_finish_one_by_one():
    sched = make_scheduler(block_size=BS)
    prompt = list(range(3, 14))
    sched.add_request("g", prompt, SamplingParams(temperature=0, max_tokens=5, n=4),
                      eos_token_id=EOS)
    _, got, reasons = run(sched, TieredMirror(BS))
    assert len(reasons) == 4
    assert len({tuple(t) for k, t in got.items() if k[1] > 0}) == 1


def test_abort_before_the_fork_finishes_every_sample():
    sched = make_scheduler(block_size=BS)
    sched.add_request("a", list(range(1, 11)), sampled(3), eos_token_id=EOS)
    assert sched.abort_requests(["a"]) == [("a", 0), ("a", 1), ("a", 2)]
    assert not sched.requests and not sched.families
    sched.check_integrity()


def test_abort_after_the_fork_frees_every_sample():
    sched = make_scheduler(block_size=BS)
    mirror = TieredMirror(BS)
    sched.add_request("a", list(range(1, 11)), sampled(3, max_tokens=20), eos_token_id=EOS)
    sched.add_request("b", list(range(20, 31)), sampled(1, max_tokens=20), eos_token_id=EOS)
    for _ in range(3):
        tiered_step(sched, mirror)
        sched.check_integrity()
    assert sorted(sched.abort_requests(["a"])) == [("a", 0), ("a", 1), ("a", 2)]
    assert set(sched.requests) == {"b"}
    sched.check_integrity()
    run(sched, mirror)
    assert sched.kv.num_free_blocks == sched.kv.pool.num_usable_blocks


def test_a_stop_on_one_sample_leaves_the_others_running():
    sched = make_scheduler(block_size=BS)
    mirror = TieredMirror(BS)
    sched.add_request("a", list(range(1, 11)), sampled(3, max_tokens=8), eos_token_id=EOS)
    for _ in range(3):
        tiered_step(sched, mirror)
    assert sched.finish_seqs(["a\x1f1"], RequestStatus.FINISHED_STOPPED) == [("a", 1)]
    sched.check_integrity()
    _, got, reasons = run(sched, mirror)
    assert set(reasons) == {("a", 0), ("a", 2)}


@pytest.mark.parametrize("limit", ["blocks", "seqs"])
def test_a_sample_without_room_computes_its_prompt_itself(limit):
    # No free block for the copy (or no sequence slot): the sample queues as a plain request.
    if limit == "blocks":
        sched = make_scheduler(num_blocks=4, block_size=BS, max_model_len=12)
    else:
        sched = make_scheduler(block_size=BS, max_num_seqs=1)
    mirror = TieredMirror(BS)
    prompt = list(range(1, 11))
    sched.add_request("a", prompt, sampled(2, max_tokens=2), eos_token_id=EOS)
    tiered_step(sched, mirror)
    child = sched.requests["a\x1f1"]
    assert child.status == RequestStatus.WAITING and "a\x1f1" not in sched.kv.req_to_blocks
    _, got, _ = run(sched, mirror)
    assert got[("a", 1)] == expected(prompt, 6, 2)


def test_n_is_validated():
    for bad in (0, MAX_N + 1, 1.5, True):
        with pytest.raises(ValueError, match="SamplingParams.n"):
            SamplingParams(n=bad)
    sched = make_scheduler()
    with pytest.raises(ValueError, match="reserved"):
        sched.add_request("x\x1f1", [1, 2], SamplingParams())


# ---------------------------------------------------------------------- the real engine

@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("ckpt") / "llama")


@pytest.mark.parametrize("caching", [True, False])
def test_engine_samples_equal_separate_requests_of_their_seeds(llama, caching):
    prompts = [[(7 * i + 3) % 120 + 3 for i in range(n)] for n in (13, 16, 5)]
    with LLM(str(llama), block_size=4, enable_prefix_caching=caching) as llm:
        params = SamplingParams(temperature=1.0, top_k=40, max_tokens=8, seed=77, n=3,
                                ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        llm.reset_prefix_cache()
        for prompt, out in zip(prompts, outs):
            assert out.finished and [c.index for c in out.outputs] == [0, 1, 2]
            for i, completion in enumerate(out.outputs):
                alone = llm.generate([prompt], SamplingParams(
                    temperature=1.0, top_k=40, max_tokens=8, seed=77 + i, ignore_eos=True),
                    use_tqdm=False)[0].outputs[0]
                assert completion.token_ids == alone.token_ids, (len(prompt), i)
                assert completion.finish_reason == "length"
        assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_engine_greedy_samples_equal_transformers(llama):
    hf = load_hf(llama)
    prompt = [(5 * i + 1) % 120 + 3 for i in range(11)]
    ref = hf_greedy(hf, prompt, 6)
    with LLM(str(llama), block_size=4) as llm:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, n=3,
                                                    ignore_eos=True), use_tqdm=False)[0]
        assert [c.token_ids for c in out.outputs] == [ref] * 3

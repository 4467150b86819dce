"""Beam search (`LLM.beam_search`, vLLM's API): the search's bookkeeping on synthetic
candidates, and the engine's search against transformers' beam search on a tiny checkpoint."""
import math

import pytest

from tests.checkpoints import make_tiny_llama
from tests.http_fixtures import *  # noqa: F403 (checkpoint, engine, server, client)
from tierserve import LLM, BeamSearchParams
from tierserve.runtime.beam_search import BeamSearch, beam_score
from tierserve.runtime.outputs import Logprob

EOS = 0


def _cands(**logprobs) -> dict[int, Logprob]:
    """Candidates by token id (t<N>=logprob), ranked by logprob."""
    order = sorted(logprobs.items(), key=lambda kv: -kv[1])
    return {int(k[1:]): Logprob(v, rank) for rank, (k, v) in enumerate(order, 1)}


def _search(length_penalty: float) -> BeamSearch:
    s = BeamSearch([7, 8], BeamSearchParams(beam_width=2, max_tokens=3,
                                            length_penalty=length_penalty), EOS)
    assert s.pending() == [[7, 8]]
    s.advance([_cands(t1=-0.1, t2=-0.5, t0=-0.7, t3=-3.0)])  # 2 x width = 4 kept
    assert [b.tokens for b in s.beams] == [[7, 8, 1], [7, 8, 2]]
    assert [f.tokens for f in s.finished] == [[7, 8, 0]] and s.finished[0].finish_reason == "stop"
    s.advance([_cands(t4=-1.0, t5=-2.0), _cands(t6=-0.2, t7=-4.0)])
    # -0.1-1.0 = -1.1 and -0.5-0.2 = -0.7: the second beam's extension leads.
    assert [b.tokens[2:] for b in s.beams] == [[2, 6], [1, 4]]
    assert math.isclose(s.beams[0].cum_logprob, -0.7)
    s.advance([_cands(t9=-0.1), _cands(t9=-0.1)])
    assert s.done and s.pending() == []
    return s


def test_extensions_are_ranked_and_eos_finishes_a_hypothesis():
    # Per token (length_penalty 1): -0.8 / 5 and -1.2 / 5 lead the finished -0.7 / 2 (its EOS
    # not counted); by sum alone (0), the finished hypothesis leads.
    best = _search(1.0).result()
    assert [b.tokens for b in best] == [[7, 8, 2, 6, 9], [7, 8, 1, 4, 9]]
    assert all(b.finish_reason == "length" for b in best) and len(best[0].logprobs) == 3
    best = _search(0.0).result()
    assert [b.tokens for b in best] == [[7, 8, 0], [7, 8, 2, 6, 9]]
    assert [b.finish_reason for b in best] == ["stop", "length"]


def test_a_sequences_text_leaves_its_eos_out_unless_asked_as_vllms():
    def decode(ids, skip_special_tokens=True):
        return " ".join(f"<{t}>" if t == EOS else str(t) for t in ids
                        if not (skip_special_tokens and t == EOS))

    def texts(**options):
        s = BeamSearch([7, 8], BeamSearchParams(beam_width=1, max_tokens=2, length_penalty=0,
                                                **options), EOS)
        s.advance([_cands(t0=-0.1, t1=-0.5)])
        s.advance([_cands(t2=-0.1)])
        return [b.text for b in s.result(decode)]
    assert texts() == [""]  # the finished hypothesis [7, 8, EOS] leads by sum
    assert texts(include_stop_str_in_output=True) == [""]  # a special token is skipped
    assert texts(include_stop_str_in_output=True, skip_special_tokens=False) == [f"<{EOS}>"]
    with pytest.raises(ValueError, match="skip_special_tokens must be True or False"):
        BeamSearchParams(beam_width=1, max_tokens=2, skip_special_tokens=None)


def test_length_penalty_and_ignore_eos():
    assert beam_score([1, 2, 3, EOS], -3.0, EOS, 1.0) == -1.0
    assert beam_score([1, 2, 3, EOS], -3.0, EOS, 0.0) == -3.0
    assert beam_score([1, 2, 3, 4], -4.0, EOS, 2.0) == -0.25
    s = BeamSearch([5], BeamSearchParams(beam_width=1, max_tokens=2, ignore_eos=True), EOS)
    s.advance([_cands(t0=-0.1, t1=-0.2)])
    assert s.beams[0].tokens == [5, 0] and not s.finished


def test_a_beam_that_fills_the_context_ends_there():
    s = BeamSearch([1, 2, 3], BeamSearchParams(beam_width=2, max_tokens=5), EOS)
    s.cap(3)
    assert s.done and s.result()[0].finish_reason == "length"


@pytest.mark.parametrize("bad, needle", [
    (dict(beam_width=0, max_tokens=4), "beam_width"),
    (dict(beam_width=11, max_tokens=4), "beam_width"),
    (dict(beam_width=2, max_tokens=0), "max_tokens"),
    (dict(beam_width=2, max_tokens=4, temperature=0.7), "temperature"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty"),
])
def test_bad_params_are_refused_naming_them(bad, needle):
    with pytest.raises(ValueError, match=needle):
        BeamSearchParams(**bad)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("beam") / "llama", seed=3)


def test_the_engines_search_equals_transformers_beam_search(llama):
    """Without EOS every beam has the same length, so the length penalty ranks as the
    logprob sum does in both, and transformers' search (its top 2 x width candidates over
    all beams) keeps the same beams as one of 2 x width a beam."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    prompts = [[5, 17, 42, 9], [100, 3, 250, 77, 61, 8, 8]]
    width, steps = 3, 6
    hf = AutoModelForCausalLM.from_pretrained(str(llama), dtype=torch.float32)
    with LLM(str(llama), block_size=4, max_model_len=128) as llm:
        got = llm.beam_search(prompts, BeamSearchParams(beam_width=width, max_tokens=steps,
                                                        ignore_eos=True))
        assert got[0].sequences[0].text is None  # no tokenizer: token ids alone
        for prompt, out in zip(prompts, got):
            config = GenerationConfig(num_beams=width, num_return_sequences=width,
                                      do_sample=False, max_new_tokens=steps,
                                      min_new_tokens=steps, eos_token_id=None,
                                      pad_token_id=0, early_stopping=False)
            ref = hf.generate(torch.tensor([prompt]), generation_config=config,
                              output_scores=True, return_dict_in_generate=True)
            want = [seq.tolist() for seq in ref.sequences]
            assert [s.tokens for s in out.sequences] == want
            for s, score in zip(out.sequences, ref.sequences_scores.tolist()):
                assert math.isclose(s.cum_logprob, score * steps, rel_tol=1e-4, abs_tol=1e-4)
                assert s.finish_reason == "length" and len(s.logprobs) == steps
        one = llm.beam_search(prompts[0], BeamSearchParams(beam_width=1, max_tokens=steps,
                                                           ignore_eos=True))
        greedy = llm.generate([prompts[0]], dict(max_tokens=steps, temperature=0,
                                                 ignore_eos=True))[0].outputs[0].token_ids
        assert one[0].sequences[0].tokens == prompts[0] + greedy
        with pytest.raises(ValueError, match="out of range|vocab"):
            llm.beam_search([[10 ** 6]], BeamSearchParams(beam_width=2, max_tokens=2))


def test_async_beam_search_equals_the_offline_one(llama):
    import asyncio

    from tierserve import AsyncLLM
    params = BeamSearchParams(beam_width=2, max_tokens=5, length_penalty=0.5)
    prompts = [[5, 17, 42, 9], [100, 3, 250]]
    with LLM(str(llama), block_size=4, max_model_len=128) as llm:
        want = llm.beam_search(prompts, params)
    engine = AsyncLLM(str(llama), block_size=4, max_model_len=128)

    async def run():
        return await asyncio.gather(*(engine.beam_search(p, params) for p in prompts))
    try:
        got = asyncio.run(run())
        with pytest.raises(ValueError):
            asyncio.run(engine.beam_search([10 ** 6], params))
    finally:
        engine.shutdown()
    assert [[(s.tokens, s.finish_reason) for s in o.sequences] for o in got] == \
        [[(s.tokens, s.finish_reason) for s in o.sequences] for o in want]


def test_use_beam_search_over_http_returns_the_searchs_sequences(checkpoint, server, client):
    """vLLM's use_beam_search: n is the beam width; choices are the best n sequences, as
    LLM.beam_search gives them; fields a search cannot honour are 400s naming them."""
    import httpx
    import openai

    from tests.http_thread import MODEL
    prompts = ["hello there", "a b c"]
    out = client.completions.create(model=MODEL, prompt=prompts, n=3, max_tokens=6,
                                    extra_body={"use_beam_search": True, "length_penalty": 0.5})
    with LLM(str(checkpoint), block_size=4, max_model_len=256) as llm:
        want = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=6,
                                                         length_penalty=0.5))
        chat_want = llm.beam_search({"messages": [{"role": "user", "content": "hi"}]},
                                    BeamSearchParams(beam_width=2, max_tokens=4))
    assert [c.text for c in out.choices] == [s.text for o in want for s in o.sequences]
    assert [c.index for c in out.choices] == list(range(6))
    assert out.usage.completion_tokens == sum(len(s.logprobs) for o in want
                                              for s in o.sequences)
    assert out.usage.prompt_tokens == sum(len(o.sequences[0].tokens) -
                                          len(o.sequences[0].logprobs) for o in want)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=4,
        extra_body={"use_beam_search": True})
    assert [c.message.content for c in chat.choices] == [s.text for s in
                                                         chat_want[0].sequences]
    for extra, param in (({"stream": True}, "stream"), ({"logprobs": 2}, "logprobs"),
                         ({"n": 11}, "n"), ({"stop": ["x"]}, "stop"),
                         ({"temperature": 0.8}, "temperature"),
                         ({"max_tokens": 0}, "max_tokens"), ({"prompt": [[]]}, "prompt")):
        body = dict({"model": MODEL, "prompt": "x", "max_tokens": 2, "use_beam_search": True},
                    **extra)
        r = httpx.post(server.base + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                  extra_body={"length_penalty": 2.0})
    assert e.value.body["param"] == "length_penalty"

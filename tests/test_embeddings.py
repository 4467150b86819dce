"""Embeddings (LLM.embed, AsyncLLM.encode, /v1/embeddings): a prompt's vector is the final
hidden state of its last token, as transformers computes it, L2-normalized by default, under
prefix hits, chunked prefill and beside generating requests."""
import asyncio
import math

import pytest
import torch

from tests.checkpoints import load_hf, make_tiny_llama, make_tiny_qwen3
from tierserve import LLM, AsyncLLM, PoolingParams, SamplingParams


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("embed")
    return {"llama": make_tiny_llama(root / "llama"), "qwen3": make_tiny_qwen3(root / "qwen3")}


def _hf_vector(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0, -1]


PROMPTS = [[5, 9, 31, 77, 12, 8, 100, 3, 44, 45, 46], [5, 9, 31, 77], [200, 201], list(
    range(3, 60))]


@pytest.mark.parametrize("name", ["llama", "qwen3"])
@pytest.mark.parametrize("options", [dict(block_size=4),
                                     dict(block_size=4, max_num_batched_tokens=16,
                                          long_prefill_token_threshold=8)])
def test_embed_is_the_last_tokens_final_hidden_state(ckpts, name, options):
    hf = load_hf(ckpts[name])
    want = [_hf_vector(hf, p) for p in PROMPTS]
    with LLM(str(ckpts[name]), **options) as llm:
        for _ in range(2):  # the second pass finds the prompts' blocks cached
            got = llm.embed(PROMPTS, use_tqdm=False)
            for out, ref, prompt in zip(got, want, PROMPTS):
                vec = torch.tensor(out.outputs.embedding)
                assert out.prompt_token_ids == prompt
                torch.testing.assert_close(vec, ref / ref.norm(), atol=1e-5, rtol=0)
        raw = llm.embed(PROMPTS[:1], PoolingParams(normalize=False), use_tqdm=False)[0]
        torch.testing.assert_close(torch.tensor(raw.outputs.embedding), want[0], atol=1e-4,
                                   rtol=1e-5)
        cut = llm.embed(PROMPTS[:1], PoolingParams(dimensions=8), use_tqdm=False)[0]
        short = want[0][:8] / want[0][:8].norm()
        torch.testing.assert_close(torch.tensor(cut.outputs.embedding), short, atol=1e-5,
                                   rtol=0)
        # Beside generating requests: the same vectors, and their tokens unchanged.
        alone = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0),
                             use_tqdm=False)
        mixed = llm.generate(PROMPTS + [{"prompt_token_ids": p} for p in PROMPTS],
                             [SamplingParams(max_tokens=6, temperature=0)] * 4
                             + [SamplingParams(max_tokens=1, temperature=0, pooling=2)] * 4,
                             use_tqdm=False)
        assert [o.outputs[0].token_ids for o in mixed[:4]] == \
            [o.outputs[0].token_ids for o in alone]
        for out, ref in zip(mixed[4:], want):
            torch.testing.assert_close(torch.tensor(out.embedding), ref / ref.norm(),
                                       atol=1e-5, rtol=0)
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        with pytest.raises(ValueError, match="dimensions"):
            llm.embed(PROMPTS[:1], PoolingParams(dimensions=10 ** 6), use_tqdm=False)
        with pytest.raises(ValueError):
            llm.embed([[10 ** 6]], use_tqdm=False)


def test_pooling_refuses_what_it_cannot_serve():
    for bad in (dict(max_tokens=2), dict(n=2), dict(logprobs=1), dict(pooling=7)):
        with pytest.raises(ValueError, match="pooling"):
            SamplingParams(**dict(dict(max_tokens=1, pooling=1), **bad))
    with pytest.raises(ValueError, match="dimensions"):
        PoolingParams(dimensions=0)


def test_async_encode_equals_embed(ckpts):
    with LLM(str(ckpts["llama"]), block_size=4) as llm:
        want = [o.outputs.embedding for o in llm.embed(PROMPTS, use_tqdm=False)]
    engine = AsyncLLM(str(ckpts["llama"]), block_size=4)

    async def one(prompt):
        return [o async for o in engine.encode(prompt)][-1]

    async def run():
        return await asyncio.gather(*(one(p) for p in PROMPTS))
    try:
        got = asyncio.run(run())
    finally:
        engine.shutdown()
    for out, ref in zip(got, want):
        assert all(math.isclose(a, b, abs_tol=1e-6) for a, b in zip(out.outputs.embedding, ref))


def test_the_embeddings_endpoint(tmp_path):
    """OpenAI's client: floats and base64 alike, the vectors LLM.embed gives, token ids or
    texts; bad input is a 400 naming the field, and the server goes on."""
    import base64

    import httpx
    import numpy as np
    import openai

    from tests.checkpoints import add_tiny_tokenizer
    from tests.http_thread import MODEL, Server
    ckpt = add_tiny_tokenizer(make_tiny_llama(tmp_path / "llama"))
    with LLM(str(ckpt), block_size=4) as llm:
        want = [o.outputs.embedding for o in llm.embed(["hello world", PROMPTS[0]],
                                                       use_tqdm=False)]
    engine = AsyncLLM(str(ckpt), block_size=4)
    try:
        with Server(engine) as srv:
            client = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0)
            out = client.embeddings.create(model=MODEL, input="hello world",
                                           encoding_format="float")
            assert np.allclose(out.data[0].embedding, want[0], atol=1e-6)
            assert out.usage.prompt_tokens == out.usage.total_tokens > 0
            raw = httpx.post(srv.base + "/v1/embeddings", timeout=30, json={
                "model": MODEL, "input": [PROMPTS[0], PROMPTS[0]],
                "encoding_format": "base64"}).json()
            for item in raw["data"]:
                vec = np.frombuffer(base64.b64decode(item["embedding"]), "<f4")
                assert np.allclose(vec, want[1], atol=1e-6)
            assert [d["index"] for d in raw["data"]] == [0, 1]
            short = client.embeddings.create(model=MODEL, input="hello world", dimensions=4,
                                             encoding_format="float").data[0].embedding
            assert len(short) == 4 and abs(sum(v * v for v in short) - 1) < 1e-5
            for body, param in (({"input": [[10 ** 6]]}, "input"),
                                ({"input": "x", "dimensions": 10 ** 6}, "dimensions"),
                                ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
                                ({"input": []}, "input"), ({"input": "x", "pooling": 1},
                                                           "pooling"),
                                ({"input": "x" * 10 ** 5}, "input")):
                r = httpx.post(srv.base + "/v1/embeddings", json=dict(body, model=MODEL),
                               timeout=30)
                assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert client.embeddings.create(model=MODEL, input="again").data
    finally:
        engine.shutdown()


def test_pooled_states_never_outlive_their_requests(ckpts):
    """A state arrives with its request's finishing output, or not at all: one whose request
    was aborted while the step ran is dropped, and none is left after the requests end."""
    with LLM(str(ckpts["llama"]), block_size=4) as llm:
        llm.embed(PROMPTS, use_tqdm=False)
        book = llm.engine._requests
        assert book.pooled == {}
        book.gather_pooled(["gone"], [b"\0" * 4])
        assert book.pooled == {}


def _cos(a, b) -> float:
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) *
                                                         sum(y * y for y in b))


def test_score_and_rerank_are_cosines_of_the_embeddings(tmp_path):
    """LLM.score (one to N, N to N) and the server's /score and /rerank: each pair's cosine
    similarity of the two texts' LLM.embed vectors; rerank orders the documents by it, top_n
    first; a bad pairing or field is a 400 and the server goes on."""
    import httpx

    from tests.checkpoints import add_tiny_tokenizer
    from tests.http_thread import MODEL, Server
    ckpt = add_tiny_tokenizer(make_tiny_llama(tmp_path / "llama"))
    query, docs = "the cat sat", ["a dog ran", "the cat sat down", "one two three"]
    with LLM(str(ckpt), block_size=4) as llm:
        vec = {t: o.outputs.embedding for t, o in zip(
            [query, *docs], llm.embed([query, *docs], use_tqdm=False))}
        want = [_cos(vec[query], vec[d]) for d in docs]
        one_to_n = llm.score(query, docs, use_tqdm=False)
        n_to_n = llm.score(docs, [query] * 3, use_tqdm=False)
        ids = llm.score(PROMPTS[0], PROMPTS[1], use_tqdm=False)[0]
        with pytest.raises(ValueError, match="one prompt with N, or N with N"):
            llm.score(docs[:2], docs, use_tqdm=False)
    assert [o.outputs.score for o in one_to_n] == pytest.approx(want, abs=1e-6)
    assert [o.outputs.score for o in n_to_n] == pytest.approx(want, abs=1e-6)
    assert ids.prompt_token_ids == PROMPTS[0] + PROMPTS[1] and -1 <= ids.outputs.score <= 1
    engine = AsyncLLM(str(ckpt), block_size=4)
    try:
        with Server(engine) as srv:
            got = httpx.post(srv.base + "/v1/score", timeout=60, json={
                "model": MODEL, "text_1": query, "text_2": docs}).json()
            assert [d["score"] for d in got["data"]] == pytest.approx(want, abs=1e-6)
            assert [d["index"] for d in got["data"]] == [0, 1, 2] and got["usage"]["total_tokens"]
            ranked = httpx.post(srv.base + "/rerank", timeout=60, json={
                "model": MODEL, "query": query, "top_n": 2,
                "documents": [docs[0], {"text": docs[1]}, docs[2]]}).json()
            order = sorted(range(3), key=lambda k: -want[k])[:2]
            assert [r["index"] for r in ranked["results"]] == order, ranked
            assert [r["relevance_score"] for r in ranked["results"]] == \
                pytest.approx([want[k] for k in order], abs=1e-6)
            assert ranked["results"][0]["document"] == {"text": docs[order[0]]}
            for path, body, param in (
                    ("/v1/score", {"text_1": docs[:2], "text_2": docs}, "text_2"),
                    ("/v1/rerank", {"query": query, "documents": []}, "documents"),
                    ("/v1/rerank", {"query": query, "documents": docs, "top_n": -1}, "top_n"),
                    ("/v1/score", {"text_1": query, "text_2": "x" * 10 ** 5}, "input")):
                r = httpx.post(srv.base + path, json=dict(body, model=MODEL), timeout=30)
                assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert httpx.post(srv.base + "/v2/rerank", timeout=60, json={
                "model": MODEL, "query": query, "documents": docs,
                "return_documents": False}).json()["results"][0].keys() == \
                {"index", "relevance_score"}
    finally:
        engine.shutdown()

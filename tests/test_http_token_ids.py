"""vLLM's `return_token_ids`: the prompt's and each choice's token ids beside the text, whole,
streamed (the prompt's in the first chunk that can carry them, each chunk the ids made since
the choice's last) and for beam search, on both endpoints; and its `logprob_token_ids`."""
import json

import httpx

from tests.http_fixtures import *  # noqa: F403 (checkpoint, engine, server)
from tests.http_thread import MODEL, wait_idle

PROMPT = [7, 8, 9, 10, 11]
GREEDY = {"model": MODEL, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
          "skip_special_tokens": False, "return_token_ids": True}


def _post(server, path: str, body: dict) -> dict:
    r = httpx.post(server.base + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _chunks(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.base + path, json=dict(body, stream=True),
                      timeout=60) as r:
        lines = [line for line in r.read().decode().split("\n\n") if line.strip()]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def _text_of(server, ids: list[int]) -> str:
    return _post(server, "/detokenize", {"model": MODEL, "tokens": ids})["prompt"]


def test_completions_give_each_choices_prompt_and_tokens(server, engine):
    body = dict(GREEDY, prompt=[PROMPT, PROMPT[:3]], n=2, temperature=1.0, seed=5)
    whole = _post(server, "/v1/completions", body)
    assert [c["prompt_token_ids"] for c in whole["choices"]] == [PROMPT] * 2 + [PROMPT[:3]] * 2
    for c in whole["choices"]:
        assert len(c["token_ids"]) == 6 and _text_of(server, c["token_ids"]) == c["text"]
    streamed = {k: {"ids": [], "prompts": []} for k in range(4)}
    for chunk in _chunks(server, "/v1/completions", body):
        for c in chunk["choices"]:
            streamed[c["index"]]["ids"] += c["token_ids"]
            if "prompt_token_ids" in c:
                streamed[c["index"]]["prompts"].append(c["prompt_token_ids"])
    for k, c in enumerate(whole["choices"]):  # seeded: the same samples streamed
        assert streamed[k] == {"ids": c["token_ids"], "prompts": [c["prompt_token_ids"]]}
    plain = _post(server, "/v1/completions", dict(body, return_token_ids=False))
    assert all("token_ids" not in c and "prompt_token_ids" not in c for c in plain["choices"])
    wait_idle(engine)


def test_chat_gives_its_prompt_once_and_each_choices_tokens(server, engine):
    messages = [{"role": "user", "content": "hello there"}]
    body = dict(GREEDY, messages=messages)
    whole = _post(server, "/v1/chat/completions", body)
    rendered = _post(server, "/tokenize", {"model": MODEL, "messages": messages})["tokens"]
    assert whole["prompt_token_ids"] == rendered
    assert len(rendered) == whole["usage"]["prompt_tokens"]
    (choice,) = whole["choices"]
    assert len(choice["token_ids"]) == 6
    assert _text_of(server, choice["token_ids"]) == choice["message"]["content"]
    chunks = _chunks(server, "/v1/chat/completions", body)
    assert chunks[0]["prompt_token_ids"] == rendered
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]] == \
        choice["token_ids"]
    wait_idle(engine)


def test_beam_search_gives_them_too(server, engine):
    out = _post(server, "/v1/completions", dict(GREEDY, prompt=PROMPT, n=2,
                                                use_beam_search=True))
    for c in out["choices"]:
        assert c["prompt_token_ids"] == PROMPT and 0 < len(c["token_ids"]) <= 6
    chat = _post(server, "/v1/chat/completions", dict(
        GREEDY, messages=[{"role": "user", "content": "hi"}], n=2, use_beam_search=True))
    assert len(chat["prompt_token_ids"]) == chat["usage"]["prompt_tokens"]
    assert all(c["token_ids"] for c in chat["choices"])
    wait_idle(engine)


def test_logprob_token_ids_list_after_the_top_logprobs(server, engine):
    """vLLM's logprob_token_ids: each sampled token's top logprobs, then those ids' (their
    values the same whichever else is asked), on both endpoints; an id past the vocabulary
    is a 400."""
    decode = {t: _text_of(server, [t]) for t in (3, 9, 12)}
    base = dict(GREEDY, prompt=PROMPT, logprobs=1, return_token_ids=False)
    one = _post(server, "/v1/completions", dict(base, logprob_token_ids=[3, 9]))
    alone = _post(server, "/v1/completions", dict(base, logprob_token_ids=[9]))
    for top, single in zip(one["choices"][0]["logprobs"]["top_logprobs"],
                           alone["choices"][0]["logprobs"]["top_logprobs"]):
        assert decode[3] in top and decode[9] in top and len(top) <= 3
        assert abs(top[decode[9]] - single[decode[9]]) < 1e-5
    chat = _post(server, "/v1/chat/completions", dict(
        GREEDY, messages=[{"role": "user", "content": "hi"}], logprob_token_ids=[12],
        return_token_ids=False))
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 6
    assert all([e["token"] for e in c["top_logprobs"]] == [decode[12]] for c in content)
    r = httpx.post(server.base + "/v1/completions", timeout=30,
                   json=dict(base, logprob_token_ids=[10**6]))
    assert r.status_code == 400, r.text
    wait_idle(engine)

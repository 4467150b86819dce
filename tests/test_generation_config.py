"""Sampling defaults from the model (vLLM's --generation-config): where they come from, and that
an unset field takes them in the Python API, the CLI (test_cli.py) and the HTTP server alike."""
from __future__ import annotations

import json

import pytest

from tests.checkpoints import make_tiny_llama
from tierserve import LLM, SamplingParams
from tierserve.deploy.openai.protocol import ChatCompletionRequest, CompletionRequest
from tierserve.deploy.openai.protocol import sampling_params as http_sampling_params
from tierserve.runtime.generation_config import generation_defaults, generation_eos_ids
from tierserve.workers.model.loader import default_model_path

HF_CONFIG = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
             "repetition_penalty": 1.1, "max_new_tokens": 5, "bos_token_id": 1,
             "eos_token_id": 2}
EXPECTED = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1,
            "max_tokens": 5}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_llama(tmp_path_factory.mktemp("genconf") / "llama")
    (path / "generation_config.json").write_text(json.dumps(HF_CONFIG))
    return path


def test_sources(tiny, tmp_path):
    assert generation_defaults("auto", str(tiny)) == EXPECTED
    assert generation_defaults("vllm", str(tiny)) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    assert generation_defaults(str(tmp_path), str(tiny)) == {"temperature": 0.0}
    # The default GGUF carries no sampling metadata: its model card's values stand in.
    assert generation_defaults("auto", default_model_path()) == {"temperature": 0.2,
                                                                 "top_p": 0.9}
    with pytest.raises(ValueError, match="holds no generation_config.json"):
        generation_defaults(str(tmp_path / "none"), str(tiny))
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 2.0}))
    with pytest.raises(ValueError, match="not valid sampling parameters: .*top_p"):
        generation_defaults(str(tmp_path), str(tiny))


def test_unset_fields_take_the_defaults_in_the_python_api(tiny):
    with LLM(str(tiny)) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(**EXPECTED)
        out = llm.generate([[5, 6, 7]], use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 5  # max_new_tokens
    with LLM(str(tiny), generation_config="vllm") as llm:
        assert llm.get_default_sampling_params() == SamplingParams()


def test_every_eos_id_the_generation_config_names_stops_a_request(tmp_path):
    """An instruct model's end of turn beside the tokenizer's eos: vLLM adds the generation
    config's eos ids to every request's stop_token_ids (none with ignore_eos); min_tokens
    holds them back as it does eos."""
    path = make_tiny_llama(tmp_path / "llama")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    greedy = dict(temperature=0, max_tokens=5, logit_bias={7: 100.0})
    assert generation_eos_ids("auto", str(path)) == generation_eos_ids("vllm", str(path)) == (2, 7)
    with LLM(str(path)) as llm:
        (out,) = llm.generate([[5, 6, 7]], SamplingParams(**greedy), use_tqdm=False)[0].outputs
        assert (out.token_ids, out.finish_reason, out.stop_reason) == ([7], "stop", 7)
        (out,) = llm.generate([[5, 6, 7]], SamplingParams(**greedy, min_tokens=3),
                              use_tqdm=False)[0].outputs
        assert len(out.token_ids) == 4 and out.token_ids[-1] == 7 and 7 not in out.token_ids[:3]
        (out,) = llm.generate([[5, 6, 7]], SamplingParams(**greedy, ignore_eos=True),
                              use_tqdm=False)[0].outputs
        assert (out.token_ids, out.finish_reason) == ([7] * 5, "length")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": ["x"]}))
    with pytest.raises(ValueError, match="eos_token_id must be a token id"):
        generation_eos_ids("auto", str(path))


def test_unset_body_fields_take_the_defaults_on_the_http_server():
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    params = http_sampling_params(chat, defaults=EXPECTED)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty,
            params.max_tokens) == (0.6, 0.95, 20, 1.1, 5)
    given = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=0,
                                  top_k=0, max_tokens=9)
    params = http_sampling_params(given, defaults=EXPECTED)
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (0, 0, 0.95, 9)
    # A completion's max_tokens defaults to 16 (OpenAI's and vLLM's), as the body says.
    assert http_sampling_params(CompletionRequest(prompt="x"), defaults=EXPECTED).max_tokens == 16
    assert http_sampling_params(chat).temperature == 1.0

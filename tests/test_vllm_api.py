"""vLLM's Python API and server fields as code written for vLLM uses them: structured outputs
with a schema dict, SamplingParams' text options, logprobs' decoded tokens, chat template
options; over an in-process engine on a tiny checkpoint with a tokenizer trained here."""
import json
import re

import httpx
import openai
import pytest

from tests.http_fixtures import *  # noqa: F403 (checkpoint, engine, server, client)
from tests.http_thread import MODEL, Server
from tests.test_http_server import PERSON


def test_the_python_api_takes_a_schema_as_a_dict_as_vllm_does(engine):
    import asyncio

    import jsonschema

    from tierserve import SamplingParams, StructuredOutputsParams
    params = SamplingParams(max_tokens=160, temperature=1.0, seed=4,
                            structured_outputs=StructuredOutputsParams(json=PERSON))
    assert params.structured_outputs.json == json.dumps(PERSON)

    async def text():
        return "".join([d.outputs[0].text async for d in engine.generate("who?", params)])
    jsonschema.validate(json.loads(asyncio.run(text())), PERSON)
    with pytest.raises(ValueError, match="structured_outputs.json is not a JSON schema"):
        StructuredOutputsParams(json={"enum": {1, 2}})


def _stream(engine, prompt, params) -> tuple[str, list[int], list[int]]:
    """(text, token ids, prompt token ids) of one request through the Python API."""
    import asyncio

    async def run():
        text, ids, prompt_ids = "", [], []
        async for d in engine.generate(prompt, params):
            assert d.error is None, d.error
            text, ids = text + d.outputs[0].text, ids + d.outputs[0].token_ids
            prompt_ids = prompt_ids or d.prompt_token_ids
        return text, ids, prompt_ids
    return asyncio.run(run())


def test_vllm_text_options_truncate_ban_words_and_shape_the_text(engine, client):
    from tierserve import SamplingParams
    from tierserve.runtime.processor import bad_word_ids
    tok = engine.tokenizer
    greedy = dict(temperature=0, max_tokens=12, ignore_eos=True)
    ids = tok.encode("one two three four five six seven eight")
    # The prompt's last k tokens, as if they alone were sent.
    alone = _stream(engine, ids[-3:], SamplingParams(**greedy))
    cut = _stream(engine, ids, SamplingParams(**greedy, truncate_prompt_tokens=3))
    assert cut == alone and cut[2] == ids[-3:]
    # A bad word the free output writes (as one token) is never written.
    text, free, _ = _stream(engine, "the cat", SamplingParams(**greedy))
    word = next(w for w in (tok.decode([t]).strip() for t in free)
                if w and any([t] in bad_word_ids([w], tok) for t in free))
    banned = bad_word_ids([word], tok)
    btext, out, _ = _stream(engine, "the cat", SamplingParams(**greedy, bad_words=[word]))
    assert out != free and not any(out[i:i + len(b)] == b for b in banned
                                   for i in range(len(out)))
    # Token ids without text; stop strings then have nothing to match.
    assert _stream(engine, "the cat", SamplingParams(**greedy, detokenize=False))[:2] == \
        ("", free)
    with pytest.raises(ValueError, match="stop strings need detokenize=True"):
        SamplingParams(stop=["x"], detokenize=False)
    # Special tokens' text only when asked for.
    special = tok.hf.all_special_ids[0]
    only = dict(greedy, max_tokens=2, allowed_token_ids=[special])
    assert _stream(engine, "hi", SamplingParams(**only))[0] == ""
    assert _stream(engine, "hi", SamplingParams(**only, skip_special_tokens=False))[0] == \
        tok.decode([special] * 2, skip_special_tokens=False)
    # The same options on the HTTP server.
    body = dict(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True, "truncate_prompt_tokens": 3})
    out = client.completions.create(**body)
    assert out.usage.prompt_tokens == 3 and out.choices[0].text == alone[0]
    out = client.completions.create(model=MODEL, prompt="the cat", max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True, "bad_words": [word]})
    assert out.choices[0].text == btext


def test_logprobs_carry_each_tokens_text_as_vllm_does(checkpoint, engine):
    import asyncio

    from tierserve import LLM, SamplingParams
    tok = engine.tokenizer
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2)

    def texts(entries):
        return [{t: lp.decoded_token for t, lp in e.items()} for e in entries if e is not None]

    def expected(entries):
        return [{t: tok.decode([t], skip_special_tokens=False) for t in e} for e in entries
                if e is not None]

    async def streamed():
        out = []
        async for d in engine.generate("the cat sat", params):
            out += d.outputs[0].logprobs
        return out
    lps = asyncio.run(streamed())
    assert len(lps) == 6 and texts(lps) == expected(lps)
    with LLM(str(checkpoint), block_size=4, max_model_len=256) as llm:
        out = llm.generate("the cat sat", params, use_tqdm=False)[0]
        quiet = llm.generate("the cat sat", SamplingParams(
            temperature=0, max_tokens=2, logprobs=1, detokenize=False), use_tqdm=False)[0]
        one = llm.generate([[5]], params, use_tqdm=False)[0]
    assert texts(out.outputs[0].logprobs) == expected(out.outputs[0].logprobs) == texts(lps)
    assert texts(out.prompt_logprobs) == expected(out.prompt_logprobs)
    assert all(lp.decoded_token is None for e in quiet.outputs[0].logprobs for lp in e.values())
    assert one.prompt_logprobs == [None]  # a one-token prompt's, as vLLM's

    async def first_delta():
        async for d in engine.generate([5], params):
            return d.prompt_logprobs
    assert asyncio.run(first_delta()) == [None]


TEMPLATE = ("{% if tools %}[{{ tools | map(attribute='function.name') | join(',') }}]"
            "{% endif %}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if shout %}!!{% endif %}{% if add_generation_prompt %}<assistant>{% endif %}")
TOOL = {"type": "function", "function": {"name": "look", "parameters": {"type": "object"}}}


def test_chat_template_options_render_as_vllm_renders_them(checkpoint, engine, server, client):
    from tierserve import LLM, SamplingParams
    tok = engine.tokenizer
    messages = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "ok"}]
    cases = [  # options -> the text the template writes
        (dict(), tok.render_chat(messages)),
        (dict(chat_template=TEMPLATE), "<user>hi there<assistant>ok<assistant>"),
        (dict(chat_template=TEMPLATE, chat_template_kwargs={"shout": True}),
         "<user>hi there<assistant>ok!!<assistant>"),
        (dict(chat_template=TEMPLATE, add_generation_prompt=False, continue_final_message=True),
         "<user>hi there<assistant>ok"),
        (dict(chat_template=TEMPLATE, tools=[TOOL]),
         "[look]<user>hi there<assistant>ok<assistant>")]
    one = SamplingParams(temperature=0, max_tokens=1)
    with LLM(str(checkpoint), block_size=4, max_model_len=256) as llm:
        for options, text in cases:
            out = llm.chat(messages, one, use_tqdm=False, **options)[0]
            assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False), options
            body = dict(model=MODEL, messages=messages, **options)
            r = httpx.post(server.base + "/tokenize", json=body).json()
            assert r["tokens"] == out.prompt_token_ids
            chat = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=1, temperature=0,
                extra_body={k: v for k, v in options.items()})
            assert chat.usage.prompt_tokens == len(out.prompt_token_ids)
        bad = llm.chat(messages, one, use_tqdm=False, continue_final_message=True)[0]
        assert "cannot both be true" in bad.error
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs") as e:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                       extra_body={"chat_template_kwargs": ["x"]})
    assert e.value.body["param"] == "chat_template_kwargs"
    # The server's template (api-server --chat-template) where a body sends none.
    ids = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    with Server(engine, chat_template=TEMPLATE) as own:
        body = dict(model=MODEL, messages=messages)
        assert httpx.post(own.base + "/tokenize", json=body).json()["tokens"] == ids(
            "<user>hi there<assistant>ok<assistant>")
        # A request's own template is code the server would run: refused unless trusted
        # (vLLM's --trust-request-chat-template), on every route that renders one.
        body["chat_template"] = "{{ messages[0]['content'] }}"
        for route in ("/tokenize", "/v1/chat/completions"):
            r = httpx.post(own.base + route, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
            assert "--trust-request-chat-template" in r.json()["error"]["message"]
    with Server(engine, chat_template=TEMPLATE, trust_request_chat_template=True) as own:
        assert httpx.post(own.base + "/tokenize", json=body).json()["tokens"] == ids("hi there")
        # A template that fails is the request's 400, naming its messages.
        body["chat_template"] = "{{ foo.bar }}"
        r = httpx.post(own.base + "/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


def test_chat_takes_openai_message_shapes_as_vllm_does(checkpoint):
    """LLM.chat's messages as OpenAI clients write them: text content parts, a tool-call
    turn with no content (its arguments a JSON string, which the template reads as a dict)
    and the tool's reply; anything else is the request's error."""
    from tierserve import LLM, SamplingParams
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                "{% for c in m.tool_calls or [] %}[{{ c.function.name }}:"
                "{{ c.function.arguments.city }}]{% endfor %}"
                "{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}{% endfor %}")
    call = {"id": "c1", "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "weather "},
                                             {"type": "text", "text": "in Oslo?"}]},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    params = SamplingParams(temperature=0, max_tokens=2)
    with LLM(str(checkpoint), block_size=4, max_model_len=256) as llm:
        out = llm.chat(messages, params, chat_template=template, use_tqdm=False)[0]
        want = llm.get_tokenizer().encode("<user>weather in Oslo?<assistant>[weather:Oslo]"
                                          "<tool>sunny#c1", add_special_tokens=False)
        assert out.error is None and out.prompt_token_ids == want
        assert out.prompt == "<user>weather in Oslo?<assistant>[weather:Oslo]<tool>sunny#c1"
        for bad, field in (({"role": "user", "content": [{"type": "image_url"}]},
                            "only text content parts"),
                           ({"role": "assistant", "content": "", "tool_calls": [
                               {"function": {"name": "f", "arguments": "{oops"}}]},
                            r"tool_calls\[0\].function.arguments is not JSON"),
                           ({"role": "user", "content": "x", "audio": {}}, "unknown keys")):
            (failed,) = llm.chat([bad], params, chat_template=template, use_tqdm=False)
            assert re.search(field, failed.error), failed.error


def test_chat_template_flag_reads_a_file_or_a_template(tmp_path):
    from tierserve.deploy.cli_inference import chat_template_of
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert chat_template_of(str(path)) == TEMPLATE == chat_template_of(TEMPLATE)
    assert chat_template_of(None) is None
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        chat_template_of(str(tmp_path / "missing.jinja"))


def test_stop_reason_names_the_stop_string_or_token_as_vllm_does(engine, server, client):
    """CompletionOutput.stop_reason and the server's choices' stop_reason: the stop string,
    the stop_token_ids entry, or None (EOS, length), in streams and whole responses alike."""
    from tierserve import SamplingParams
    greedy = dict(temperature=0, max_tokens=12, ignore_eos=True)

    def last(prompt, params):
        import asyncio

        async def run():
            return [d async for d in engine.generate(prompt, params)][-1].outputs[0]
        return asyncio.run(run())
    free = last("the cat", SamplingParams(**greedy))
    assert free.finish_reason == "length" and free.stop_reason is None
    text, ids, _ = _stream(engine, "the cat", SamplingParams(**greedy))
    stop_id = ids[4]
    by_token = last("the cat", SamplingParams(**greedy, stop_token_ids=[stop_id]))
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", stop_id)
    word = text.strip().split()[1]
    by_text = last("the cat", SamplingParams(**greedy, stop=["zzz", word]))
    assert (by_text.finish_reason, by_text.stop_reason) == ("stop", word)
    body = {"model": MODEL, "prompt": "the cat", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    for extra, reason in (({}, None), ({"stop": [word]}, word),
                          ({"stop_token_ids": [stop_id]}, stop_id)):
        whole = httpx.post(server.base + "/v1/completions", json=body | extra).json()
        assert whole["choices"][0]["stop_reason"] == reason, whole
        chat = {k: v for k, v in body.items() if k != "prompt"} | extra
        chat = httpx.post(server.base + "/v1/chat/completions", json=chat | {
            "messages": [{"role": "user", "content": "the cat"}]})
        assert "stop_reason" in chat.json()["choices"][0], chat.text
        vllm_fields = {k: v for k, v in (body | extra).items() if k in ("ignore_eos",
                                                                      "stop_token_ids")}
        openai_fields = {k: v for k, v in (body | extra).items() if k not in vllm_fields}
        stream = client.completions.create(**openai_fields, extra_body=vllm_fields, stream=True)
        final = [c for c in stream if c.choices and c.choices[0].finish_reason][-1]
        assert final.choices[0].model_extra["stop_reason"] == reason


REPEATS = "The capital of France is Paris. The capital"


def _repeating(engine) -> tuple[dict, str, list[int], list[str]]:
    """Greedy options under which REPEATS' output repeats itself (words of two letters or
    more only), with that output's text, tokens and each token's text."""
    from tierserve import SamplingParams
    tok = engine.tokenizer
    words = [t for t in range(3, 384) if (w := tok.decode([t])).replace(" ", "").isalpha()
             and len(w.strip()) >= 2]
    greedy = dict(temperature=0, max_tokens=30, ignore_eos=True, allowed_token_ids=words)
    text, ids, _ = _stream(engine, REPEATS, SamplingParams(**greedy))
    pieces = [tok.decode([t]) for t in ids]
    assert "".join(pieces) == text
    return greedy, text, ids, pieces


def _final(engine, prompt, params) -> list:
    """Each sample's final output, once checked against the deltas streamed of it."""
    import asyncio

    import msgspec

    from tierserve import RequestOutputKind

    async def run(kind):
        samples: dict[int, list] = {}
        async for d in engine.generate(prompt, msgspec.structs.replace(params, output_kind=kind)):
            for c in d.outputs:
                samples.setdefault(c.index, []).append(c)
        return samples
    deltas = asyncio.run(run(RequestOutputKind.DELTA))
    final = {i: cs[-1] for i, cs in asyncio.run(run(RequestOutputKind.FINAL_ONLY)).items()}
    assert deltas.keys() == final.keys()
    for i, cs in deltas.items():
        assert "".join(c.text for c in cs) == final[i].text
        assert [t for c in cs for t in c.token_ids] == final[i].token_ids
    return [final[i] for i in sorted(final)]


def test_min_tokens_defers_stop_strings_as_vllm_does(engine, client):
    """vLLM's detokenizer: a stop string counts once it ends in the text of the tokens after
    the first min_tokens (it may begin before); a match ending sooner does not stop."""
    from tierserve import SamplingParams
    greedy, text, ids, pieces = _repeating(engine)
    stop = pieces[0][-2:] + pieces[1][:2]  # spans the first two tokens
    assert text.count(stop) >= 2, text
    for min_tokens in (0, 1, 2, 3, len(ids) - 2):
        boundary = len("".join(pieces[:min_tokens]))
        end = text.find(stop, max(0, boundary - len(stop) + 1))
        out, = _final(engine, REPEATS, SamplingParams(**greedy, stop=[stop],
                                                      min_tokens=min_tokens))
        if end == -1:
            assert (out.text, out.finish_reason, out.token_ids) == (text, "length", ids)
            continue
        # The output's last token is the one whose text completes the match.
        n = next(k for k in range(len(ids)) if len("".join(pieces[:k])) >= end + len(stop))
        assert n > min_tokens and out.token_ids == ids[:n]
        assert (out.text, out.finish_reason, out.stop_reason) == (text[:end], "stop", stop)
        chunks = client.completions.create(
            model=MODEL, prompt=REPEATS, max_tokens=30, temperature=0, stop=[stop], stream=True,
            extra_body={"min_tokens": min_tokens, "ignore_eos": True,
                        "allowed_token_ids": greedy["allowed_token_ids"]})
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text[:end]


def test_a_stop_token_or_eos_adds_no_text_unless_included_as_vllm_does(engine, server):
    """vLLM's detokenizer leaves out the text of the stop token or EOS that ended an output
    (its id stays in token_ids) unless include_stop_str_in_output: in streams, for each of n
    samples and in the server's answers."""
    from tierserve import SamplingParams
    tok = engine.tokenizer
    greedy, text, ids, pieces = _repeating(engine)
    stop_id = ids[1]
    n = ids.index(stop_id) + 1
    for include in (False, True):
        outs = _final(engine, REPEATS, SamplingParams(**greedy, stop_token_ids=[stop_id], n=2,
                                                      include_stop_str_in_output=include))
        assert len(outs) == 2
        for out in outs:
            assert out.token_ids == ids[:n] and out.text == "".join(pieces[:n - 1 + include])
            assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    eos, eos_text = tok.eos_token_id, tok.decode([tok.eos_token_id], skip_special_tokens=False)
    raw = dict(temperature=0, max_tokens=8, min_tokens=3, logit_bias={eos: 100},
               skip_special_tokens=False)
    for include in (False, True):
        out, = _final(engine, "the cat", SamplingParams(**raw, include_stop_str_in_output=include))
        assert len(out.token_ids) == 4 and out.token_ids[-1] == eos and out.stop_reason is None
        assert out.text == tok.decode(out.token_ids[:3], skip_special_tokens=False) + (
            eos_text if include else "")
    body = {"model": MODEL, "prompt": "the cat", "max_tokens": 8, "temperature": 0,
            "min_tokens": 3, "logit_bias": {str(eos): 100}, "skip_special_tokens": False}
    for stream in (False, True):
        r = httpx.post(server.base + "/v1/completions", json=body | {"stream": stream})
        assert eos_text in tok.decode(out.token_ids, skip_special_tokens=False)
        assert eos_text not in r.text, r.text


def test_vllm_prompt_dicts_and_sampling_params_helpers(checkpoint):
    """TokensPrompt / TextPrompt with their cache_salt; SamplingParams.clone / from_optional."""
    from tierserve import LLM, SamplingParams, TextPrompt, TokensPrompt
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, stop=["x"])
    copy = params.clone()
    copy.stop.append("y")
    assert params.stop == ["x"] and copy.stop == ["x", "y"]
    assert SamplingParams.from_optional(temperature=None, max_tokens=3) == \
        SamplingParams(max_tokens=3)
    # vLLM's spellings of the defaults, and its from_optional's logit_bias (string keys,
    # clamped); what vLLM refuses is refused.
    assert SamplingParams(stop=None, stop_token_ids=None, seed=-1) == SamplingParams()
    assert (SamplingParams(logprobs=True).logprobs,
            SamplingParams(prompt_logprobs=True).prompt_logprobs) == (1, 1)
    assert SamplingParams.from_optional(logit_bias={"5": 200, 6: -1.5}).logit_bias == \
        {5: 100.0, 6: -1.5}
    for bad, message in ((dict(temperature=2.5), "temperature must be in"),
                         (dict(repetition_penalty=float("inf")), "must be finite")):
        with pytest.raises(ValueError, match=message):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="keys must be token ids"):
        SamplingParams.from_optional(logit_bias={"five": 1.0})
    with LLM(str(checkpoint), block_size=4, max_model_len=256) as llm:
        ids = llm.get_tokenizer().encode("one two three four five six seven eight nine")
        first = llm.generate(TokensPrompt(prompt_token_ids=ids), params, use_tqdm=False)[0]
        again = llm.generate(TokensPrompt(prompt_token_ids=ids), params, use_tqdm=False)[0]
        salted = llm.generate(TokensPrompt(prompt_token_ids=ids, cache_salt="tenant-b"),
                              params, use_tqdm=False)[0]
        text = llm.generate(TextPrompt(prompt="one two"), params, use_tqdm=False)[0]
        clash = llm.generate(TextPrompt(prompt="one", cache_salt="a"), params,
                             cache_salt="b", use_tqdm=False)[0]
        # vLLM's TokensPrompt may carry its ids' text: the ids run, the text is reported.
        both = llm.generate(TokensPrompt(prompt_token_ids=ids, prompt="the text"), params,
                            use_tqdm=False)[0]
        media = llm.generate({"prompt": "x", "multi_modal_data": {"image": None}}, params,
                             use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and salted.num_cached_tokens == 0
    assert salted.outputs[0].token_ids == first.outputs[0].token_ids
    assert text.error is None and len(text.outputs[0].token_ids) == 4
    assert "cache_salt differs" in clash.error
    assert both.prompt == "the text" and both.outputs[0].token_ids == first.outputs[0].token_ids
    assert "multi-modal inputs are not supported" in media.error


def test_vllm_engine_arguments_are_taken_or_refused_with_the_reason(checkpoint):
    """vLLM's engine arguments without a tierserve option: accepted where they ask for what
    tierserve does, refused naming what it does; override_generation_config replaces the
    generation config's defaults."""
    from tierserve import LLM
    from tierserve.deploy.cli_options import engine_options
    from tierserve.deploy.cli_parser import build_parser
    from tierserve.runtime.config import EngineConfig
    same = dict(kv_cache_dtype="auto", enable_chunked_prefill=True, pipeline_parallel_size=1,
                tokenizer_mode="auto", trust_remote_code=True, disable_log_stats=True,
                max_logprobs=20, revision=None, download_dir=None, swap_space=0,
                cpu_offload_gb=0, distributed_executor_backend=None)
    assert EngineConfig.from_kwargs(**same) == EngineConfig()
    assert EngineConfig.from_kwargs(distributed_executor_backend="ray").distributed
    for name, value, reason in (("kv_cache_dtype", "fp8", "model's dtype"),
                                ("pipeline_parallel_size", 2, "tensor parallelism only"),
                                ("pipeline_parallel_size", True, "only 1"),
                                ("enable_chunked_prefill", False, "always prefilled in chunks"),
                                ("revision", "main", "applies to a model named by its Hugging "
                                                     "Face Hub id"),
                                ("swap_space", 4, "kv_offload_cpu_bytes"),
                                ("distributed_executor_backend", "mp", "Ray actors")):
        with pytest.raises(ValueError, match=reason):
            EngineConfig.from_kwargs(**{name: value})
    with pytest.raises(ValueError, match="contradicts"):
        EngineConfig.from_kwargs(distributed_executor_backend="ray", distributed=False)
    args = build_parser().parse_args(["generate", "hi", "--kv-cache-dtype", "auto",
                                      "--trust-remote-code", "--pipeline-parallel-size", "1"])
    assert EngineConfig.from_kwargs(**engine_options(args)) == EngineConfig()
    args = build_parser().parse_args(["generate", "hi", "--kv-cache-dtype", "fp8"])
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' is not supported"):
        EngineConfig.from_kwargs(**engine_options(args))
    with pytest.raises(ValueError, match="unknown field"):
        EngineConfig(override_generation_config={"temp": 0.1})
    with pytest.raises(ValueError, match="top_p"):
        EngineConfig(override_generation_config={"top_p": 3})
    with LLM(str(checkpoint), block_size=4, max_model_len=256, generation_config="vllm",
             override_generation_config={"temperature": 0, "max_new_tokens": 5}) as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.max_tokens) == (0.0, 5)
        out = llm.generate("the cat", use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) <= 5


def _api_server_log(checkpoint, *flags: str) -> str:
    """`tierserve api-server MODEL FLAGS` (vLLM's positional model) serving one completion,
    stopped with Ctrl-C; its output."""
    import signal
    import socket
    import subprocess
    import sys
    import time
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "tierserve", "api-server", str(checkpoint),
                             "--port", str(port), "--block-size", "4", "--max-model-len", "256",
                             *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, json={
            "model": checkpoint.name, "prompt": "the cat", "max_tokens": 2})
        assert r.status_code == 200, r.text
    finally:
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=60)[0]
    return out


def test_api_server_takes_vllms_serve_flags(checkpoint):
    """The model as `vllm serve MODEL` takes it; --uvicorn-log-level; --disable-log-requests
    drops the access log's line per request; --enable-auto-tool-choice is accepted."""
    from tierserve.deploy.cli import main
    logged = _api_server_log(checkpoint, "--uvicorn-log-level", "info",
                             "--enable-auto-tool-choice")
    assert "Application startup complete" in logged and "POST /v1/completions" in logged, logged
    quiet = _api_server_log(checkpoint, "--uvicorn-log-level", "info",
                            "--disable-log-requests")
    assert "Application startup complete" in quiet and "POST /v1/" not in quiet, quiet
    assert main(["api-server", str(checkpoint), "--model", "/elsewhere"]) != 0


def _hub_cache(root, checkpoint, repo_id: str, refs: dict[str, str]):
    """A Hugging Face Hub cache holding `checkpoint` as `repo_id` at each ref -> commit (its
    layout: refs/NAME holds a commit, snapshots/COMMIT its files, linked to blobs)."""
    import os
    import shutil
    repo = root / ("models--" + repo_id.replace("/", "--"))
    for ref, commit in refs.items():
        snap = repo / "snapshots" / commit
        if not snap.exists():
            snap.mkdir(parents=True)
            for f in checkpoint.iterdir():
                blob = repo / "blobs" / f"{commit[:8]}-{f.name}"
                blob.parent.mkdir(exist_ok=True)
                shutil.copy(f, blob)
                os.symlink(os.path.relpath(blob, snap), snap / f.name)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return repo


def test_a_hub_id_is_served_from_the_local_hub_cache(checkpoint, tmp_path, monkeypatch):
    """vLLM's offline behaviour: a model named by its Hub id runs from the Hub cache's
    snapshot (at `revision`, under `download_dir`), and servers name it by that id; an id
    the cache lacks is an error saying how to get it, and nothing is downloaded."""
    from tierserve import LLM, SamplingParams
    from tierserve.deploy.cli_inference import model_name
    from tierserve.deploy.cli_options import engine_options
    from tierserve.deploy.cli_parser import build_parser
    from tierserve.runtime.config import EngineConfig
    main, tag = "1" * 40, "2" * 40
    repo = _hub_cache(tmp_path / "hub", checkpoint, "org/tiny", {"main": main, "v2": tag})
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(str(checkpoint), block_size=4, max_model_len=256) as llm:
        want = llm.generate("the cat", params, use_tqdm=False)[0].outputs[0].text
    with LLM("org/tiny", block_size=4, max_model_len=256) as llm:
        assert llm.generate("the cat", params, use_tqdm=False)[0].outputs[0].text == want
        assert model_name(llm.engine.info()["model"]) == "org/tiny"
    config = EngineConfig.from_kwargs(model="org/tiny", revision="v2")
    assert config.model == str(repo / "snapshots" / tag)
    assert EngineConfig.from_kwargs(model="org/tiny", revision=main, tokenizer="org/tiny"
                                    ).tokenizer == str(repo / "snapshots" / main)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    assert EngineConfig.from_kwargs(model="org/tiny", download_dir=str(tmp_path / "hub")
                                    ).model == str(repo / "snapshots" / main)
    args = build_parser().parse_args(["generate", "hi", "--model", "org/tiny", "--revision",
                                      "v2", "--download-dir", str(tmp_path / "hub")])
    assert EngineConfig.from_kwargs(**engine_options(args)).model == config.model
    with pytest.raises(ValueError, match="huggingface-cli download org/tiny"):
        EngineConfig.from_kwargs(model="org/tiny")
    with pytest.raises(ValueError, match="at revision 'v3'"):
        EngineConfig.from_kwargs(model="org/tiny", revision="v3",
                                 download_dir=str(tmp_path / "hub"))
    with pytest.raises(ValueError, match="model is a path"):
        EngineConfig.from_kwargs(model=str(checkpoint), revision="main")


def test_enqueue_then_wait_for_completion_as_vllm_does(checkpoint):
    """LLM.enqueue / enqueue_chat queue prompts (a bad one fails alone), and
    wait_for_completion runs them all: their outputs in enqueue order, as generate gives."""
    from tierserve import LLM, SamplingParams
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    chat = [{"role": "user", "content": "hi"}]
    with LLM(str(checkpoint), block_size=4, max_model_len=128) as llm:
        assert llm.get_world_size() == llm.get_world_size(include_dp=False) == 1
        ids = llm.enqueue(["one", [5, 6, 7]], greedy) + llm.enqueue_chat(chat, greedy)
        ids += llm.enqueue([[10**9]], greedy)  # out of the vocabulary: fails alone
        assert not llm.engine.has_unfinished_requests()  # nothing runs before the wait
        outs = llm.wait_for_completion(use_tqdm=False)
        assert [o.request_id for o in outs] == ids and llm.wait_for_completion() == []
        expected = llm.generate(["one", [5, 6, 7]], greedy) + llm.chat(chat, greedy)
        assert [o.outputs[0].token_ids for o in outs[:3]] == \
            [o.outputs[0].token_ids for o in expected]
        assert outs[3].error and outs[3].outputs[0].finish_reason == "error"
        with pytest.raises(TypeError, match="unknown chat options: templat"):
            llm.enqueue_chat(chat, greedy, templat="x")


def test_get_metrics_reads_the_engines_counters_as_vllm_records(checkpoint):
    """LLM.get_metrics: /metrics' engine families as vLLM's reader gives them: a Counter per
    counter, a Gauge per gauge sample (the KV usage one per tier), read from the engine now."""
    from tierserve import LLM, SamplingParams
    from tierserve.runtime.metrics import Counter, Gauge
    with LLM(str(checkpoint), block_size=4, max_model_len=128) as llm:
        def by_name():
            return {(m.name, tuple(sorted(m.labels.items()))): m for m in llm.get_metrics()}
        before = by_name()
        prompt = list(range(5, 25))
        for _ in range(2):
            llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        after, stats = by_name(), llm.stats()
    queries = after[("tierserve:prefix_cache_queries", ())]
    assert isinstance(queries, Counter) and queries.value == 40
    assert before[("tierserve:prefix_cache_queries", ())].value == 0
    # The second run's prompt hit its first's full blocks (the last token is always computed).
    assert after[("tierserve:prefix_cache_hits", ())].value == 16
    running = after[("tierserve:num_requests_running", ())]
    assert isinstance(running, Gauge) and running.value == 0
    assert after[("tierserve:kv_cache_total_blocks", ())].value == stats["num_total_blocks"] > 0
    assert {labels for name, labels in after if name == "tierserve:kv_cache_usage_perc"} == \
        {(("tier", t),) for t in ("device", "cpu", "ssd")}


def test_thinking_token_budget_closes_the_reasoning_in_time(checkpoint):
    """vLLM's thinking_token_budget: a prompt that leaves <think> open gets that many tokens
    of reasoning, the same the model writes without a budget, then </think>; 0 closes it at
    once; a prompt that opens none is left alone."""
    from tierserve import LLM, SamplingParams
    greedy = dict(temperature=0, max_tokens=10, ignore_eos=True)
    with LLM(str(checkpoint), block_size=4, max_model_len=128) as llm:
        close = llm.get_tokenizer().encode("</think>", add_special_tokens=False)

        def tokens(prompt: str, **extra) -> list[int]:
            out = llm.generate([prompt], SamplingParams(**greedy, **extra), use_tqdm=False)[0]
            assert out.error is None, out.error
            return out.outputs[0].token_ids

        opened, plain = "Question: why?\n<think>\n", "Question: why?\n"
        free = tokens(opened)
        capped = tokens(opened, thinking_token_budget=3)
        assert capped[:3] == free[:3] and capped[3:3 + len(close)] == close
        assert tokens(opened, thinking_token_budget=0)[:len(close)] == close
        assert tokens(plain, thinking_token_budget=2) == tokens(plain)


def test_repetition_detection_over_http_as_vllm_reports_it(server, client):
    body = dict(model=MODEL, prompt="loop", max_tokens=12, temperature=0,
                extra_body={"allowed_token_ids": [5], "ignore_eos": True,
                            "repetition_detection": {"max_pattern_size": 1, "min_count": 3}})
    out = client.completions.create(**body).choices[0]
    assert out.finish_reason == "repetition"
    assert out.model_extra["stop_reason"] == "repetition_detected"
    streamed = [c.choices[0] for c in client.completions.create(stream=True, **body)]
    assert streamed[-1].finish_reason == "repetition"
    assert "".join(c.text for c in streamed) == out.text
    bad = httpx.post(server.base + "/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": "x", "repetition_detection": {"max_pattern_size": 2}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "repetition_detection"
    metrics = httpx.get(server.base + "/metrics", timeout=30).text
    assert 'finished_reason="repetition"' in metrics


def test_stream_interval_over_http_sends_fewer_larger_chunks(client):
    kwargs = dict(model=MODEL, prompt="tell", max_tokens=9, temperature=0,
                  extra_body={"ignore_eos": True, "return_token_ids": True})
    whole = client.completions.create(**kwargs).choices[0]
    for interval, sizes in ((1, [1] * 9), (4, [1, 4, 4])):
        body = dict(kwargs, extra_body=dict(kwargs["extra_body"], stream_interval=interval))
        chunks = [c.choices[0] for c in client.completions.create(stream=True, **body)
                  if c.choices]
        assert [len(c.model_extra["token_ids"]) for c in chunks] == sizes
        assert "".join(c.text for c in chunks) == whole.text
        assert chunks[-1].finish_reason == "length"


def test_add_special_tokens_as_vllm_encodes_text_and_chat(tmp_path):
    """A tokenizer that puts <s> first: a text prompt gets it unless add_special_tokens is
    false; a chat (whose template writes its own) only when it is true; over HTTP alike."""
    from tests.checkpoints import add_tiny_tokenizer, make_tiny_llama
    from tierserve import LLM, AsyncLLM, SamplingParams
    ckpt = add_tiny_tokenizer(make_tiny_llama(tmp_path / "llama"), bos=True)
    one = SamplingParams(temperature=0, max_tokens=1)
    chat = [{"role": "user", "content": "hi"}]
    with LLM(str(ckpt), block_size=4, max_model_len=128) as llm:
        text, bare, plain, special = (o.prompt_token_ids for o in llm.generate(
            ["hi", {"prompt": "hi", "add_special_tokens": False}, {"messages": chat},
             {"messages": chat, "add_special_tokens": True}], one, use_tqdm=False))
    assert text[0] == 1 and text[1:] == bare and bare[0] != 1
    assert plain[0] != 1 and special == [1] + plain
    engine = AsyncLLM(str(ckpt), block_size=4, max_model_len=128)
    try:
        with Server(engine) as srv:
            def ids(path, **body):
                r = httpx.post(srv.base + path, timeout=30, json=dict(
                    model=MODEL, max_tokens=1, return_token_ids=True, **body)).json()
                return r.get("prompt_token_ids") or r["choices"][0]["prompt_token_ids"]
            assert ids("/v1/completions", prompt="hi") == text
            assert ids("/v1/completions", prompt="hi", add_special_tokens=False) == bare
            assert ids("/v1/chat/completions", messages=chat) == plain
            assert ids("/v1/chat/completions", messages=chat, add_special_tokens=True) == special
    finally:
        engine.shutdown()

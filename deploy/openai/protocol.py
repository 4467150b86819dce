"""OpenAI's request bodies (completions, chat completions) and what they become: engine
prompts and SamplingParams (responses.py shapes what comes back).

Bodies are validated by pydantic with unknown fields refused, so a typo is a 400 naming it,
never silently dropped. Ranges are checked once, by SamplingParams; its ValueError names the
field, which the server turns into the error's `param`.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tierserve.deploy.openai.errors import BadField, param_of
from tierserve.deploy.openai.structured import HERMES, ToolPlan, structured_of, written_call
from tierserve.deploy.openai.tool_parsers import ToolCallFormat
from tierserve.runtime.requests import CHAT_OPTIONS, check_chat_options, message_content
from tierserve.scheduler.params import MAX_N, SamplingParams

__all__ = ["CompletionRequest", "ChatCompletionRequest", "TokenizeCompletionRequest",
           "TokenizeChatRequest", "DetokenizeRequest", "BadField", "sampling_params",
           "completion_prompts", "prompts_of", "chat_messages", "chat_prompt", "param_of"]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(BaseModel):
    """Fields both endpoints take: OpenAI's, then vLLM's extensions."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    cache_salt: str | None = None
    priority: int = 0
    request_id: str | None = None
    # Constrained output (deploy/openai/structured.py): at most one of these.
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    min_tokens: int = 0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    # vLLM's: the prompt's and each choice's token ids beside the text (responses.py).
    return_token_ids: bool = False
    # vLLM's: these tokens' logprobs with every sampled token's, after its top logprobs.
    logprob_token_ids: list[int] | None = None
    # vLLM's: at most this many tokens of reasoning before </think> is forced.
    thinking_token_budget: int | None = None
    # vLLM's: {max_pattern_size, min_pattern_size, min_count}; a looping output ends.
    repetition_detection: dict | None = None
    # vLLM's: a stream's chunks carry this many new tokens each (the first and last at once).
    stream_interval: int | None = None
    # vLLM's: the tokenizer's special tokens (BOS) added; default yes for completions' text,
    # no for chat (its template writes them).
    add_special_tokens: bool | None = None
    # vLLM's beam search (deploy/openai/beam.py): n beams, ranked with this length penalty.
    use_beam_search: bool = False
    length_penalty: float = 1.0


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str
    content: str | list[dict] | None = None
    name: str | None = None
    # An assistant turn's calls, and a tool turn's answer to one (multi-turn tool use).
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    # The rest of an earlier reply as OpenAI's clients send it back (the message's
    # model_dump()): a refusal stands for its text, its reasoning is not re-read, and audio or
    # a deprecated function_call cannot be (chat_messages).
    refusal: str | None = None
    annotations: list | None = None
    audio: dict | None = None
    function_call: dict | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    # How the template renders the conversation (vLLM's fields; runtime/requests.py checks).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None
    # The chat template's reasoning_effort, and enable_thinking unless the kwargs set it.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    # OpenAI's fields that change nothing this server answers, taken so that its clients run
    # unchanged: no completion is stored (store, metadata), there is one tier of service, the
    # prefix cache needs no key, a predicted output could only speed up the same answer, and
    # safety_identifier is another user.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    prediction: dict | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    # Refused unless text alone is asked for (_refuse_unsupported).
    modalities: list[str] | None = None
    audio: dict | None = None
    web_search_options: dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None
    tools: list | None = None
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


def sampling_params(req: CompletionRequest | ChatCompletionRequest,
                    tools: ToolPlan | None = None,
                    defaults: dict | None = None) -> SamplingParams:
    """SamplingParams of a validated body; ValueError (BadField) naming what it cannot serve.
    A field the body leaves out takes the engine's generation defaults (its
    info()["generation_defaults"]), else vLLM's."""
    defaults = defaults or {}
    _refuse_unsupported(req)
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        if req.top_logprobs is not None and not req.logprobs:
            raise BadField("top_logprobs", "top_logprobs needs logprobs: true")
    else:
        max_tokens, logprobs = req.max_tokens, req.logprobs
        if req.echo and max_tokens == 0:  # the prompt scored alone: its one token is dropped
            max_tokens = 1
    if max_tokens is None:
        max_tokens = defaults.get("max_tokens")  # None: the rest of the context
    if not 1 <= req.n <= MAX_N:
        raise BadField("n", f"n must be in [1, {MAX_N}], got {req.n}")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    prompt_logprobs = req.prompt_logprobs
    if getattr(req, "echo", False) and logprobs is not None:  # the echoed prompt's logprobs
        prompt_logprobs = max(prompt_logprobs or 0, logprobs)
    fields = dict(
        temperature=_given(req.temperature, defaults, "temperature", 1.0),
        top_p=_given(req.top_p, defaults, "top_p", 1.0),
        top_k=_given(req.top_k, defaults, "top_k", 0),
        min_p=_given(req.min_p, defaults, "min_p", 0.0), max_tokens=max_tokens, stop=stop,
        stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
        seed=req.seed, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=_given(req.repetition_penalty, defaults, "repetition_penalty", 1.0),
        logprobs=logprobs, n=req.n, structured_outputs=structured_of(req, tools),
        min_tokens=req.min_tokens, logit_bias=_logit_bias(req.logit_bias),
        allowed_token_ids=req.allowed_token_ids,
        bad_words=req.bad_words, skip_special_tokens=req.skip_special_tokens,
        truncate_prompt_tokens=req.truncate_prompt_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        prompt_logprobs=prompt_logprobs, logprob_token_ids=req.logprob_token_ids,
        thinking_token_budget=req.thinking_token_budget,
        repetition_detection=req.repetition_detection, stream_interval=req.stream_interval)
    try:
        return SamplingParams(**fields)
    except ValueError as e:
        name = param_of(str(e)) or "sampling"
        if name == "logprobs" and isinstance(req, ChatCompletionRequest):
            name = "top_logprobs"
        elif name == "max_tokens" and getattr(req, "max_completion_tokens", None) is not None:
            name = "max_completion_tokens"
        raise BadField(name, str(e).replace("SamplingParams.", "")) from None


def _given(value, defaults: dict, name: str, fallback):
    """The body's value; else the generation defaults'; else vLLM's."""
    return value if value is not None else defaults.get(name, fallback)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    try:
        return {int(k): v for k, v in bias.items()}
    except ValueError:
        raise BadField("logit_bias", "logit_bias keys are token ids") from None


def _refuse_unsupported(req) -> None:
    if req.length_penalty != 1.0:
        raise BadField("length_penalty", "length_penalty applies to use_beam_search only")
    if isinstance(req, ChatCompletionRequest):
        _refuse_unsupported_chat(req)
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise BadField("suffix", "suffix is not supported")
        if req.best_of is not None and req.best_of != req.n:
            raise BadField("best_of", "best_of must equal n (beam-style best_of is not supported)")


def _refuse_unsupported_chat(req: ChatCompletionRequest) -> None:
    if req.modalities is not None and set(req.modalities) != {"text"}:
        raise BadField("modalities", f"this model writes text only: modalities is [\"text\"], "
                                     f"got {req.modalities}")
    if req.audio is not None:
        raise BadField("audio", "audio output is not supported")
    if req.web_search_options is not None:
        raise BadField("web_search_options", "web search is not supported")
    if req.functions is not None or req.function_call is not None:
        name = "functions" if req.functions is not None else "function_call"
        raise BadField(name, f"{name} is OpenAI's deprecated form of tools and tool_choice: "
                             f"send those")


def completion_prompts(req: CompletionRequest) -> list[str | list[int] | dict]:
    """A completions body's prompts; a text one as a prompt dict where the body says whether
    its special tokens are added."""
    prompts = prompts_of(req.prompt, "prompt")
    if req.add_special_tokens is None:
        return prompts
    return [{"prompt": p, "add_special_tokens": req.add_special_tokens}
            if isinstance(p, str) else p for p in prompts]


def prompts_of(value, field: str) -> list[str | list[int]]:
    """A body's prompts in `field`: one text, texts, token ids, or lists of token ids."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise BadField(field, f"{field} is empty")
    if all(isinstance(x, int) for x in value):
        return [list(value)]
    return list(value)


def chat_prompt(req: ChatCompletionRequest | TokenizeChatRequest,
                template: str | None = None, fmt: ToolCallFormat = HERMES,
                thinks: bool = False, trust_template: bool = False) -> dict:
    """The body's conversation as a prompt dict: its messages and how to render them (with
    `template`, the server's, where the body sends no chat_template; the body's own only
    where the server trusts request templates). A reasoning_effort needs a model that
    `thinks` (the server parses its reasoning), as OpenAI refuses it for models that answer
    directly."""
    options = {name: getattr(req, name, None) for name in CHAT_OPTIONS}
    if options["chat_template"] is not None and not trust_template:
        raise BadField("chat_template", "a request's chat_template is refused: a template is "
                       "code the server runs (start it with --trust-request-chat-template "
                       "to take them)")
    if options["chat_template"] is None:
        options["chat_template"] = template
    effort = getattr(req, "reasoning_effort", None)
    if effort is not None:
        options["chat_template_kwargs"] = _effort_kwargs(effort, thinks,
                                                         options["chat_template_kwargs"])
    try:
        check_chat_options(options)
    except ValueError as e:  # its message opens with the option's name
        raise BadField(param_of(str(e)) or "messages", str(e)) from None
    special = getattr(req, "add_special_tokens", None)
    return {"messages": chat_messages(req, fmt), **options,
            **({"add_special_tokens": special} if special is not None else {})}


def _effort_kwargs(effort: str, thinks: bool, given):
    """The template variables of a reasoning_effort, as vLLM passes them: reasoning_effort,
    and enable_thinking (off for "none") unless the body's chat_template_kwargs set them."""
    if not thinks:
        raise BadField("reasoning_effort", "reasoning_effort needs a reasoning model (a server "
                                           "started with --reasoning-parser); this one answers "
                                           "directly")
    if given is not None and not isinstance(given, dict):
        return given  # check_chat_options refuses it
    return {"reasoning_effort": effort, "enable_thinking": effort != "none", **(given or {})}


def chat_messages(req: ChatCompletionRequest | TokenizeChatRequest,
                  fmt: ToolCallFormat = HERMES) -> list[dict[str, str]]:
    """Messages as the engine takes them: content parts of type text joined, others refused;
    an assistant's tool calls written out as the model writes them (structured.py)."""
    out = []
    for i, m in enumerate(req.messages):
        if m.audio is not None:
            raise BadField(f"messages[{i}].audio", "a message's audio cannot be read back here")
        if m.function_call is not None:
            raise BadField(f"messages[{i}].function_call", "a message's function_call is "
                           "OpenAI's deprecated form of tool_calls: send those")
        try:
            content = message_content(i, m.refusal if not m.content and m.refusal
                                      else m.content)
        except ValueError as e:
            raise BadField(f"messages[{i}].content", str(e)) from None
        if m.tool_calls:
            content = "\n".join([content] * bool(content) + [
                written_call(call, f"messages[{i}].tool_calls[{j}]", fmt)
                for j, call in enumerate(m.tool_calls)])
        msg = {"role": m.role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out

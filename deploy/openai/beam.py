"""vLLM's `use_beam_search` on completions and chat: `n` is the beam width and the response
holds each prompt's best `n` sequences (runtime/beam_search.py, through AsyncLLM.beam_search),
whole, never streamed. Fields a beam search has no meaning for are refused, naming them."""
from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tierserve.deploy.openai.errors import ApiError, BadField
from tierserve.deploy.openai.responses import usage_json
from tierserve.deploy.openai.streaming import gather_until_disconnect
from tierserve.deploy.openai.tenants import Tenant
from tierserve.runtime.beam_search import BeamSearchParams

__all__ = ["beam_params", "beam_response"]

# Body fields (and their values that mean "not asked for") a beam search cannot honour.
_NOT_WITH_BEAMS = {"logprobs": (None, False), "top_logprobs": (None,), "stop": (None, [], ""),
                   "stop_token_ids": (None, []), "response_format": (None,),
                   "structured_outputs": (None,), "guided_json": (None,),
                   "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
                   "tools": (None, []), "logit_bias": (None, {}), "bad_words": (None, []),
                   "allowed_token_ids": (None,), "prompt_logprobs": (None,),
                   "min_tokens": (0,), "stream": (False,)}


def beam_params(body, defaults: dict) -> BeamSearchParams:
    for name, unset in _NOT_WITH_BEAMS.items():
        if getattr(body, name, None) not in unset:
            raise BadField(name, f"{name} is not supported with use_beam_search")
    max_tokens = next((v for v in (getattr(body, "max_completion_tokens", None),
                                   body.max_tokens, defaults.get("max_tokens"))
                       if v is not None), 16)
    try:
        return BeamSearchParams(beam_width=body.n, max_tokens=max_tokens,
                                ignore_eos=body.ignore_eos, temperature=body.temperature or 0.0,
                                length_penalty=body.length_penalty,
                                include_stop_str_in_output=body.include_stop_str_in_output,
                                skip_special_tokens=body.skip_special_tokens)
    except ValueError as e:
        name = str(e).split(" ", 1)[0]
        raise BadField("n" if name == "beam_width" else name,
                       str(e).replace("beam_width", "n (the beam width)")) from None


async def beam_response(server, kind: str, prompts: list, body, request: Request,
                        tenant: Tenant | None, echo: list[str] | None) -> Response:
    params = beam_params(body, server.generation_defaults)
    server.check_prompts(kind, prompts, tenant)
    salt = body.cache_salt if tenant is None else tenant.cache_salt(body.cache_salt)
    server.admission.admit(len(prompts))
    try:
        outputs = await gather_until_disconnect(request, (
            server.engine.beam_search(p, params, priority=body.priority, cache_salt=salt,
                                      lora_request=server.check_model(body.model))
            for p in prompts))
    except ValueError as e:
        raise ApiError(400, str(e), "prompt" if kind == "completion" else "messages") from None
    finally:
        for _ in prompts:
            server.admission.started()
    if outputs is None:  # the client left: its searches' requests are aborted
        return Response(status_code=499)
    reply = _body(kind, server.model_name(body.model), outputs, echo, body.return_token_ids)
    usage = reply["usage"]
    server.metrics.served_whole(tenant, usage["prompt_tokens"], usage["completion_tokens"],
                                [c["finish_reason"] for c in reply["choices"]])
    return JSONResponse(reply)


def _body(kind: str, model: str, outputs: list, echo: list[str] | None,
          token_ids: bool = False) -> dict:
    """The response; with token_ids (return_token_ids), the ids as responses.py gives them."""
    choices, prompt_tokens, made = [], 0, 0
    for i, out in enumerate(outputs):
        prompt_len = len(out.sequences[0].tokens) - len(out.sequences[0].logprobs)
        prompt_tokens += prompt_len
        for seq in out.sequences:
            made += len(seq.tokens) - prompt_len
            text = (echo[i] if echo else "") + (seq.text or "")
            index = len(choices)
            choices.append({"index": index, "text": text, "logprobs": None,
                            "finish_reason": seq.finish_reason} if kind == "completion" else
                           {"index": index, "message": {"role": "assistant", "content": text},
                            "logprobs": None, "finish_reason": seq.finish_reason})
            if token_ids:
                choices[-1]["token_ids"] = list(seq.tokens[prompt_len:])
                if kind == "completion":
                    choices[-1]["prompt_token_ids"] = list(seq.tokens[:prompt_len])
    prefix = "cmpl" if kind == "completion" else "chatcmpl"
    body = {"id": f"{prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": model,
            "object": "text_completion" if kind == "completion" else "chat.completion",
            "choices": choices, "usage": usage_json(prompt_tokens, made)}
    if token_ids and kind == "chat":  # chat's one prompt
        first = outputs[0].sequences[0]
        body["prompt_token_ids"] = list(first.tokens[:len(first.tokens) - len(first.logprobs)])
    return body

"""vLLM's `POST /tokenize` (a prompt, or chat messages rendered by the engine's template) and
`POST /detokenize`, with the engine's own tokenizer, off the event loop."""
from __future__ import annotations

import asyncio

from tierserve.deploy.openai.errors import ApiError, BadField
from tierserve.deploy.openai.protocol import DetokenizeRequest, TokenizeChatRequest, chat_prompt

__all__ = ["tokenize_response", "detokenize_response", "token_text", "rendered",
           "chat_prompt_tokens"]


def _tokenizer(server):
    if server.tokenizer is None:
        raise ApiError(400, "this model has no tokenizer: send and read token ids")
    return server.tokenizer


def token_text(server, ids: list[int]) -> str:
    """Token ids' text, special tokens included (a 400 for a model without a tokenizer)."""
    return _tokenizer(server).decode(ids, skip_special_tokens=False)


async def tokenize_response(server, body) -> dict:
    server.check_model(body.model)
    tok = _tokenizer(server)
    if isinstance(body, TokenizeChatRequest):
        text = rendered(server, chat_prompt(
            body, server.config.chat_template, server.tool_format,
            trust_template=server.config.trust_request_chat_template))
    else:
        text = body.prompt
    ids = await asyncio.to_thread(tok.encode, text, body.add_special_tokens)
    return {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids,
            "token_strs": tok.convert_ids_to_tokens(ids) if body.return_token_strs else None}


def rendered(server, prompt: dict) -> str:
    """A chat prompt dict (chat_prompt) as the engine's template writes it."""
    options = dict(prompt)
    options.pop("add_special_tokens", None)  # the encoding's, not the template's
    try:
        return _tokenizer(server).render_chat(options.pop("messages"), **options)
    except ValueError:
        raise
    except Exception as e:  # the template itself failed on these options
        raise BadField("messages", f"cannot render the chat template: "
                                   f"{type(e).__name__}: {e}") from None


async def chat_prompt_tokens(server, prompt: dict) -> int:
    """How many tokens the engine prefills for a chat prompt dict: its rendered text encoded
    as the engine's input processor encodes chat (special tokens only where it asks)."""
    text = rendered(server, prompt)
    special = bool(prompt.get("add_special_tokens"))
    return len(await asyncio.to_thread(_tokenizer(server).encode, text, special))


async def detokenize_response(server, body: DetokenizeRequest) -> dict:
    server.check_model(body.model)
    _tokenizer(server)
    vocab = server.vocab_size
    bad = [t for t in body.tokens if t < 0 or (vocab is not None and t >= vocab)]
    if bad:
        raise BadField("tokens", f"token id {bad[0]} is out of range [0, {vocab})")
    return {"prompt": await asyncio.to_thread(token_text, server, body.tokens)}

"""Inputs that hold text: OpenAI request bodies and ShareGPT conversations, tokenized with the
model's tokenizer and hashed into blocks exactly as the engine hashes a prompt (same hasher, the
cache salt in the first block).

OpenAI JSONL: one request body a line (`messages`, rendered with the model's chat template, or
`prompt`: text or token ids), bare or inside a batch-API line's `body`; optional `timestamp`
(seconds), `cache_salt`, and `max_tokens` / `max_completion_tokens` or a response's
`usage.completion_tokens` as the output length. ShareGPT: `conversations` of `from` / `value`
turns; each user turn is a request carrying the history before it, and the assistant's reply
that follows is its output (its tokens and an end-of-turn token, as the model would write them,
so that the next turn's prompt finds them cached).
"""
from __future__ import annotations

import array
import itertools
import re
import sys
from typing import Iterator

from tierserve.kvcache import BlockHasher, encode_extra_keys
from tierserve.runtime.analyze.traces import Trace
from tierserve.runtime.request_log import tenant_id

__all__ = ["TextHasher", "hash_chain", "openai_traces", "sharegpt_traces", "is_sharegpt",
           "is_openai"]

# Requests tokenized together (the Rust tokenizer spreads a batch over the cores).
_BATCH = 256
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
          "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant",
          "system": "system"}


def is_sharegpt(obj: dict) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("conversations"), list)


def is_openai(obj: dict) -> bool:
    body = obj.get("body", obj) if isinstance(obj, dict) else None
    return isinstance(body, dict) and ("messages" in body or "prompt" in body)


class TextHasher:
    """Text -> token ids (the model's tokenizer) -> block-hash chains (the engine's hasher)."""

    def __init__(self, tokenizer, block_size: int, algorithm: str = "xxhash",
                 seed: int = 0) -> None:
        self.tokenizer = tokenizer  # None: token ids only
        self.hasher = BlockHasher(block_size, algorithm, seed)
        self._backend = getattr(tokenizer, "_backend", None)
        self.eos = tokenizer.eos_token_id if tokenizer is not None else None
        self._segments = _Segments.of(self._backend)

    def need_tokenizer(self, where: str) -> None:
        if self.tokenizer is None:
            raise ValueError(f"{where}: the input holds text; pass --model (its tokenizer) to "
                             f"tokenize it")

    def encode_many(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        if self._backend is None:
            return [self.tokenizer.encode(t, add_special_tokens) for t in texts]
        if not add_special_tokens and self._segments is not None:
            return self._segments.encode(texts)
        return [e.ids for e in self._backend.encode_batch(
            texts, add_special_tokens=add_special_tokens)]

    def render(self, messages: list[dict], where: str) -> str:
        self.need_tokenizer(where)
        try:
            return self.tokenizer.render_chat(messages)
        except Exception as e:
            raise ValueError(f"{where}: cannot render the messages with the chat template: "
                             f"{type(e).__name__}: {e}") from None

    def chain(self, token_ids: list[int], salt: str | None) -> list[int]:
        return hash_chain(self.hasher, token_ids, salt)


def hash_chain(hasher: BlockHasher, token_ids: list[int], salt: str | None) -> list[int]:
    """The ints of every full block's hash (its first 8 bytes, as the request log keeps)."""
    hashes, _ = hasher.hash_blocks(token_ids, 0, None, encode_extra_keys(salt), b"")
    out = array.array("Q", b"".join([h[:8] for h in hashes]))
    if sys.byteorder != "little":
        out.byteswap()
    return out.tolist()


class _Segments:
    """Rendered chats, tokenized a piece at a time: the text between two added tokens (the
    template's markers) is tokenized alone by the tokenizer anyway, so each message is
    tokenized once, not once per later turn that carries it. Used for tokenizers whose added
    tokens take no neighbouring whitespace, and only while it agrees with encoding the whole
    text (checked on the first batch)."""

    _MAX = 1 << 18  # pieces remembered (the oldest half goes past it)

    def __init__(self, backend, added: dict[str, int]) -> None:
        self.backend = backend
        self.added = added
        self.split = re.compile("(" + "|".join(
            re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")").split
        self.cache: dict[str, list[int]] = {}
        self.checked = False
        self.exact = True

    @classmethod
    def of(cls, backend) -> "_Segments | None":
        getter = getattr(backend, "get_added_tokens_decoder", None)
        if getter is None:
            return None
        added = getter()
        if not added or any(t.lstrip or t.rstrip or t.single_word or t.normalized
                            for t in added.values()):
            return None
        return cls(backend, {t.content: i for i, t in added.items()})

    def encode(self, texts: list[str]) -> list[list[int]]:
        if not self.exact:
            return self._whole(texts)
        cache = self.cache
        if len(cache) > self._MAX:
            for key in list(itertools.islice(cache, len(cache) // 2)):
                del cache[key]
        pieces = [self.split(t) for t in texts]
        missing = list({p for ps in pieces for p in ps[::2] if p and p not in cache})
        if missing:
            for piece, e in zip(missing, self.backend.encode_batch(
                    missing, add_special_tokens=False)):
                cache[piece] = e.ids
        out = []
        added = self.added
        for ps in pieces:
            ids: list[int] = []
            for i, p in enumerate(ps):
                if i % 2:
                    ids.append(added[p])
                elif p:
                    ids += cache[p]
            out.append(ids)
        if not self.checked:
            self.checked = True
            whole = self._whole(texts)
            if whole != out:  # this tokenizer joins across its markers: whole texts only
                self.exact = False
                return whole
        return out

    def _whole(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]


def openai_traces(lines: Iterator[tuple[str, dict]], text: TextHasher,
                  default_output: int) -> Iterator[Trace]:
    batch: list = []
    for where, obj in lines:
        body = obj.get("body", obj)
        if not isinstance(body, dict) or not is_openai(obj):
            raise ValueError(f"{where}: not an OpenAI request body (no messages or prompt)")
        batch.append((where, obj, body))
        if len(batch) >= _BATCH:
            yield from _openai_batch(batch, text, default_output)
            batch = []
    yield from _openai_batch(batch, text, default_output)


def _openai_batch(batch: list, text: TextHasher, default_output: int) -> Iterator[Trace]:
    chats, prompts, ids = [], [], {}
    for i, (where, _, body) in enumerate(batch):
        if "messages" in body:
            messages = body["messages"]
            if not isinstance(messages, list) or not messages:
                raise ValueError(f"{where}: messages must be a non-empty list")
            chats.append((i, text.render(messages, where)))
        elif isinstance(body["prompt"], str):
            text.need_tokenizer(where)
            prompts.append((i, body["prompt"]))
        elif isinstance(body["prompt"], list) and all(type(t) is int for t in body["prompt"]):
            ids[i] = body["prompt"]
        else:
            raise ValueError(f"{where}: prompt must be text or a list of token ids")
    for group, special in ((chats, False), (prompts, True)):
        if group:
            for (i, _), tokens in zip(group, text.encode_many([t for _, t in group], special)):
                ids[i] = tokens
    for i, (where, obj, body) in enumerate(batch):
        tokens = ids[i]
        if not tokens:
            raise ValueError(f"{where}: the prompt is empty")
        salt = body.get("cache_salt")
        yield Trace(_timestamp(obj, where), tenant_id(salt), len(tokens),
                    _output_len(obj, body, default_output, where), text.chain(tokens, salt))


def _timestamp(obj: dict, where: str) -> float | None:
    value = obj.get("timestamp")
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{where}: timestamp must be a number of seconds")
    return float(value)


def _output_len(obj: dict, body: dict, default: int, where: str) -> int:
    usage = obj.get("usage") or (obj.get("response") or {}).get("usage") or {}
    for value in (usage.get("completion_tokens"), body.get("max_completion_tokens"),
                  body.get("max_tokens")):
        if value is not None:
            if type(value) is not int or value < 0:
                raise ValueError(f"{where}: an output length must be an int >= 0")
            return max(value, 1)
    return default


def sharegpt_traces(convs: Iterator[tuple[str, dict]], text: TextHasher,
                    default_output: int) -> Iterator[Trace]:
    """A request per user turn, in the file's order, the turns of a conversation in a row."""
    for where, obj in convs:
        turns = _turns(obj, where)
        history: list[dict] = []
        requests = []  # (messages, reply or None)
        for i, turn in enumerate(turns):
            if turn["role"] == "user":
                reply = turns[i + 1]["content"] if i + 1 < len(turns) and \
                    turns[i + 1]["role"] == "assistant" else None
                requests.append((history + [turn], reply))
            history = history + [turn]
        if not requests:
            continue
        text.need_tokenizer(where)
        salt = obj.get("cache_salt")
        rendered = [text.render(m, where) for m, _ in requests]
        prompts = text.encode_many(rendered, False)
        replies = text.encode_many([r or "" for _, r in requests], False)
        for tokens, (_, reply), reply_ids in zip(prompts, requests, replies):
            if reply is None:
                yield Trace(None, tenant_id(salt), len(tokens), default_output,
                            text.chain(tokens, salt))
                continue
            output = reply_ids + ([text.eos] if text.eos is not None else [])
            yield Trace(None, tenant_id(salt), len(tokens), max(len(output), 1),
                        text.chain(tokens + output, salt))


def _turns(obj: dict, where: str) -> list[dict]:
    turns = []
    for j, t in enumerate(obj["conversations"]):
        if not isinstance(t, dict) or not isinstance(t.get("value"), str):
            raise ValueError(f"{where}: conversations[{j}] needs a text `value`")
        role = _ROLES.get(str(t.get("from", "")).lower())
        if role is None:
            raise ValueError(f"{where}: conversations[{j}] has an unknown role {t.get('from')!r}")
        turns.append({"role": role, "content": t["value"]})
    return turns

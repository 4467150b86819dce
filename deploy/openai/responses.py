"""What goes back: the one fold of a body's output deltas into choices and usage, and the JSON
of full responses, stream chunks and logprobs, for both endpoints.

A body runs one engine request per prompt (completions take several), each with `n` samples;
choice `i * n + j` is sample j of prompt i. Full responses and streams read the same fold:
a full response once every delta is in, a stream piece by piece as `Fold.add` returns them.
"""
from __future__ import annotations

from dataclasses import dataclass

import msgspec

from tierserve.deploy.openai.reasoning import opens_inside, split_reasoning
from tierserve.deploy.openai.structured import ToolPlan, parse_tool_calls
from tierserve.runtime.outputs import CompletionOutput, Logprob, RequestOutput

__all__ = ["Fold", "Piece", "Responder", "sse", "usage_json", "chat_logprobs",
           "completion_logprobs", "prompt_logprobs_json"]

_encode = msgspec.json.Encoder().encode


@dataclass(slots=True)
class Piece:
    """One sample's new output in one delta, as its choice sends it."""

    index: int            # the choice index, i * n + j
    output: CompletionOutput
    text_offset: int      # the choice's text length before this piece


class Fold:
    """A body's choices (text, tokens, logprobs, finish reason so far) and usage."""

    def __init__(self, num_prompts: int, n: int, want_logprobs: bool,
                 echo: list[str] | None = None, prompt_only: bool = False) -> None:
        self.n = n
        # With echo, each choice's text begins with its prompt's.
        self.echo = echo
        # The prompt scored alone (echo, max_tokens 0): the one token made is not sent.
        self.prompt_only = prompt_only
        self.prompt_ids: list[list[int]] = [[] for _ in range(num_prompts)]
        self.choices = [CompletionOutput(k % n, echo[k // n] if echo else "", [], None,
                                         [] if want_logprobs else None)
                        for k in range(num_prompts * n)]
        self.prompt_tokens = [0] * num_prompts
        self.prompt_logprobs: list[list | None] = [None] * num_prompts
        self.cached_tokens = [0] * num_prompts
        self.completion_tokens = 0

    def note_prompt(self, i: int, delta: RequestOutput) -> None:
        """Prompt i's tokens, from its first delta: before its outputs are folded in, a
        stream's opening chunks can carry them."""
        if delta.prompt_token_ids:
            self.prompt_tokens[i] = len(delta.prompt_token_ids)
            self.prompt_ids[i] = delta.prompt_token_ids

    def add(self, i: int, delta: RequestOutput) -> list[Piece]:
        """Folds prompt i's delta in; returns its pieces with something to send."""
        self.note_prompt(i, delta)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs[i] = delta.prompt_logprobs
        self.cached_tokens[i] = max(self.cached_tokens[i], delta.num_cached_tokens)
        pieces = []
        for c in delta.outputs:
            if self.prompt_only:
                c = CompletionOutput(c.index, "", [], None, None if c.logprobs is None else [],
                                     c.finish_reason and "length")
            self.completion_tokens += len(c.token_ids)
            if not (c.text or c.token_ids or c.finish_reason):
                continue
            index = i * self.n + c.index
            choice = self.choices[index]
            pieces.append(Piece(index, c, len(choice.text)))
            choice.text += c.text
            choice.token_ids += c.token_ids
            if c.logprobs is not None and choice.logprobs is not None:
                choice.logprobs += c.logprobs
            if c.finish_reason is not None:
                choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
        return pieces

    def usage(self) -> dict:
        return usage_json(sum(self.prompt_tokens), self.completion_tokens,
                          sum(self.cached_tokens))


class Responder:
    """The JSON of one body's response and stream chunks: `kind` is "completion" or "chat"."""

    def __init__(self, kind: str, rid: str, created: int, model: str, decode, num_logprobs: int,
                 include_usage: bool, tools: ToolPlan | None = None, echo_logprobs: bool = False,
                 show_prompt_logprobs: bool = True, reasoning: bool = False,
                 continuous_usage: bool = False, token_ids: bool = False,
                 logprob_ids: list[int] | None = None) -> None:
        self.kind, self.decode, self.k = kind, decode, num_logprobs
        self.ids = logprob_ids or ()  # logprob_token_ids: listed after the top k
        # vLLM's return_token_ids: completions' choices carry their prompt's ids, chat's
        # response carries its one prompt's; streamed, the first chunk that can does, and
        # each chunk a choice's ids made since its previous chunk.
        self.token_ids = token_ids
        self._ids_sent: dict[int, int] = {}
        self._prompt_ids_sent: set[int] = set()  # choices (chat: the response, as -1)
        self.include_usage = include_usage
        # vLLM's continuous_usage_stats: every chunk carries the usage so far.
        self.continuous_usage = include_usage and continuous_usage
        self._fold: Fold | None = None
        # Completions' echo with logprobs: the echoed prompt's tokens carry theirs (OpenAI's
        # shape: the first token's None), before the generated ones'.
        self.echo_logprobs = echo_logprobs
        # vLLM's prompt_logprobs field, when the body asked for it (echo's alone do not).
        self.show_prompt_logprobs = show_prompt_logprobs
        self._echoed: set[int] = set()  # streamed choices whose echo was sent
        # Chat with tools the model may call (not "none"): its text may be tool calls.
        self.tools = tools if tools is not None and tools.mode != "none" else None
        obj = "text_completion" if kind == "completion" else "chat.completion"
        self.head = {"id": rid, "object": obj, "created": created, "model": model}
        self.chunk_head = self.head if kind == "completion" else \
            dict(self.head, object="chat.completion.chunk")
        self._announced: set[int] = set()  # choices whose prompt logprobs were streamed
        self._sent: dict[int, int] = {}  # chat: each choice's answer text sent as content
        # Chat: a thinking model's reasoning apart from its answer (reasoning.py).
        self.reasoning = reasoning
        self._sent_reasoning: dict[int, int] = {}
        self._inside: dict[int, bool] = {}  # per prompt: it leaves a <think> open

    def full(self, fold: Fold) -> dict:
        choices = [self._choice(k, c, fold) for k, c in enumerate(fold.choices)]
        for k, choice in enumerate(choices):
            self._prompt_logprobs(choice, fold, k)
            if self.token_ids:
                choice["token_ids"] = list(fold.choices[k].token_ids)
                if self.kind == "completion":
                    choice["prompt_token_ids"] = list(fold.prompt_ids[k // fold.n])
        body = dict(self.head, choices=choices, usage=fold.usage())
        if self.token_ids and self.kind == "chat":
            body["prompt_token_ids"] = list(fold.prompt_ids[0])
        return body

    def _stream_ids(self, chunk: dict, choice: dict) -> None:
        """return_token_ids on a stream chunk (see __init__)."""
        index, fold = choice["index"], self._fold
        ids = fold.choices[index].token_ids
        sent = self._ids_sent.get(index, 0)
        choice["token_ids"] = list(ids[sent:])
        self._ids_sent[index] = len(ids)
        key, holder = (index, choice) if self.kind == "completion" else (-1, chunk)
        prompt = fold.prompt_ids[index // fold.n]
        if prompt and key not in self._prompt_ids_sent:
            self._prompt_ids_sent.add(key)
            holder["prompt_token_ids"] = list(prompt)

    def _prompt_logprobs(self, choice: dict, fold: Fold, index: int) -> dict:
        """vLLM's prompt_logprobs of the choice's prompt, when it was asked for."""
        lps = fold.prompt_logprobs[index // fold.n]
        if lps is not None and self.show_prompt_logprobs:
            choice["prompt_logprobs"] = [None if e is None else {
                str(t): {"logprob": lp.logprob, "rank": lp.rank,
                         "decoded_token": self.decode(t)} for t, lp in e.items()} for e in lps]
        return choice

    def _choice(self, index: int, c: CompletionOutput, fold: Fold) -> dict:
        if self.kind == "completion":
            if not self.echo_logprobs:
                lps = completion_logprobs(c, self.decode, self.k, ids=self.ids)
            else:
                echoed = self._echo_logprobs(index, fold)
                made = completion_logprobs(c, self.decode, self.k, len(fold.echo[index // fold.n]),
                                           self.ids)
                lps = {key: echoed[key] + made[key] for key in echoed}
            return {"index": index, "text": c.text, "logprobs": lps,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        reasoning, text = self._split(index, fold, True)
        message = {"role": "assistant", "content": text}
        if self.reasoning:
            message.update(content=text or None, reasoning=reasoning or None,
                           reasoning_content=reasoning or None)
        reason = c.finish_reason
        if self.tools is not None:
            calls, content = parse_tool_calls(self.tools, text)
            if calls:
                message.update(content=content, tool_calls=calls)
                reason = "tool_calls" if reason == "stop" else reason
        return {"index": index, "message": message,
                "logprobs": chat_logprobs(c, self.decode, self.k, self.ids),
                "finish_reason": reason,
                "stop_reason": c.stop_reason}

    def _echo_logprobs(self, index: int, fold: Fold) -> dict:
        i = index // fold.n
        return prompt_logprobs_json(fold.prompt_ids[i], fold.prompt_logprobs[i], self.decode,
                                    self.k)

    def opening(self, fold: Fold) -> list[bytes]:
        """Chunks before any output: chat announces each choice's role; an echoing completion
        sends each choice's prompt (with logprobs, with its first output: they come with it)."""
        self._fold = fold
        if self.kind == "completion":
            return [self._chunk({"index": k, "text": c.text, "logprobs": None,
                                 "finish_reason": None})
                    for k, c in enumerate(fold.choices) if c.text and not self.echo_logprobs]
        return [self._chunk({"index": k, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None})
                for k in range(len(fold.choices))]

    def piece(self, p: Piece, fold: Fold) -> list[bytes]:
        c = p.output
        self._fold = fold
        if self.kind == "completion":
            out = []
            if self.echo_logprobs and p.index not in self._echoed:
                self._echoed.add(p.index)
                out.append(self._chunk({"index": p.index, "text": fold.echo[p.index // fold.n],
                                        "logprobs": self._echo_logprobs(p.index, fold),
                                        "finish_reason": None}))
            choice = {"index": p.index, "text": c.text,
                      "logprobs": completion_logprobs(c, self.decode, self.k, p.text_offset,
                                                  self.ids),
                      "finish_reason": c.finish_reason}
            if p.index not in self._announced:
                self._announced.add(p.index)
                self._prompt_logprobs(choice, fold, p.index)
            return out + [self._chunk(choice)]
        if self.tools is not None and self.tools.mode in ("named", "required"):
            return self._tool_piece(p, fold)
        reasoning, text = self._split(p.index, fold, c.finish_reason is not None)
        delta = self._reasoning_delta(p.index, reasoning)
        if self.tools is not None:
            return self._auto_piece(p, text, delta)
        sent = self._sent.get(p.index, 0)
        if len(text) > sent:
            delta["content"] = text[sent:]
            self._sent[p.index] = len(text)
        return [self._chunk({"index": p.index, "delta": delta,
                             "logprobs": chat_logprobs(c, self.decode, self.k, self.ids),
                             "finish_reason": c.finish_reason})]

    def _split(self, index: int, fold: Fold, final: bool) -> tuple[str, str]:
        """(reasoning, answer) of a chat choice's text (all answer without a parser)."""
        text = fold.choices[index].text
        if not self.reasoning:
            return "", text
        i = index // fold.n
        if i not in self._inside:
            tail = "".join(self.decode(t) for t in fold.prompt_ids[i][-8:])
            self._inside[i] = opens_inside(tail)
        return split_reasoning(text, self._inside[i], final)

    def _reasoning_delta(self, index: int, reasoning: str) -> dict:
        sent = self._sent_reasoning.get(index, 0)
        if len(reasoning) <= sent:
            return {}
        self._sent_reasoning[index] = len(reasoning)
        return {"reasoning": reasoning[sent:], "reasoning_content": reasoning[sent:]}

    def _auto_piece(self, p: Piece, text: str, delta: dict) -> list[bytes]:
        """`auto`: the answer as content while it may not be a call; then, once it ends, its
        calls as OpenAI streams them whole (with the content around them), or, where none
        parses, the text held back. Content deltas join to the full response's content."""
        c = p.output
        sent = self._sent.get(p.index, 0)
        lp = chat_logprobs(c, self.decode, self.k, self.ids)
        if c.finish_reason is None:
            end = max(sent, self.tools.format.held_from(text))
            self._sent[p.index] = end
            if end > sent:
                delta["content"] = text[sent:end]
            return [self._chunk({"index": p.index, "delta": delta, "logprobs": lp,
                                 "finish_reason": None})]
        calls, content = parse_tool_calls(self.tools, text)
        rest = (content or "")[sent:] if calls else text[sent:]
        if rest:
            delta["content"] = rest
        if calls:
            delta["tool_calls"] = [dict(call, index=i) for i, call in enumerate(calls)]
        reason = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
        return [self._chunk({"index": p.index, "delta": delta, "logprobs": lp,
                             "finish_reason": reason})]

    def _tool_piece(self, p: Piece, fold: Fold) -> list[bytes]:
        """A forced call streams as OpenAI streams calls: a named function's arguments as they
        come (the first chunk names the call); `required` calls whole, once the list closes."""
        c, plan, chunks = p.output, self.tools, []
        lp = chat_logprobs(c, self.decode, self.k, self.ids)
        if plan.mode == "named":
            if p.text_offset == 0:
                call = parse_tool_calls(plan, "")[0][0]
                call["function"]["arguments"] = ""
                chunks.append(self._chunk({"index": p.index, "delta": {"tool_calls": [
                    dict(call, index=0)]}, "logprobs": None, "finish_reason": None}))
            if c.text:
                chunks.append(self._chunk({"index": p.index, "delta": {"tool_calls": [
                    {"index": 0, "function": {"arguments": c.text}}]}, "logprobs": lp,
                    "finish_reason": None}))
        if c.finish_reason is None:
            return chunks
        delta = {}
        if plan.mode == "required":
            calls, content = parse_tool_calls(plan, fold.choices[p.index].text)
            delta = {"tool_calls": [dict(call, index=i) for i, call in enumerate(calls)]} \
                if calls else {"content": content}
        reason = "tool_calls" if c.finish_reason == "stop" else c.finish_reason
        chunks.append(self._chunk({"index": p.index, "delta": delta, "logprobs": None,
                                   "finish_reason": reason}))
        return chunks

    def _chunk(self, choice: dict) -> bytes:
        if choice.get("finish_reason") is not None and self._fold is not None:
            # vLLM's field: the stop string or token that ended the choice (None: EOS).
            choice["stop_reason"] = self._fold.choices[choice["index"]].stop_reason
        chunk = dict(self.chunk_head, choices=[choice])
        if self.token_ids and self._fold is not None:
            self._stream_ids(chunk, choice)
        if self.include_usage:
            chunk["usage"] = self._fold.usage() if self.continuous_usage and self._fold \
                else None
        return sse(chunk)

    def closing(self, fold: Fold) -> list[bytes]:
        """The usage chunk (when asked for), then the end of the stream."""
        tail = [sse(dict(self.chunk_head, choices=[], usage=fold.usage()))] \
            if self.include_usage else []
        return tail + [b"data: [DONE]\n\n"]


def usage_json(prompt: int, completion: int, cached: int = 0) -> dict:
    """OpenAI's usage; cached: prompt tokens served from the prefix cache (any tier)."""
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def sse(obj) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


# ---------------------------------------------------------------------------- logprobs JSON

def _top(entries: dict[int, Logprob], k: int, ids=()) -> list[tuple[int, Logprob]]:
    """The top k (ranks 1..k; the sampled token keeps its true rank), then the request's
    logprob_token_ids `ids` in their order, each once."""
    top = sorted(((t, lp) for t, lp in entries.items() if lp.rank is not None
                  and 1 <= lp.rank <= k), key=lambda e: e[1].rank)
    seen = {t for t, _ in top}
    for t in ids:
        if t in entries and t not in seen:
            seen.add(t)
            top.append((t, entries[t]))
    return top


def _legacy_top(entries: dict[int, Logprob], tid: int, k: int, ids=()) -> dict[int, Logprob]:
    """Completions' top_logprobs (OpenAI's legacy API): the token itself, then the top k, so
    up to k + 1 entries, as vLLM gives them (chat's top_logprobs are the top k alone)."""
    out = {tid: entries[tid]}
    out.update((t, lp) for t, lp in _top(entries, k, ids) if t not in out)
    return out


def _by_text(entries: dict[int, Logprob], decode) -> dict[str, float]:
    """Keyed by each token's text (OpenAI's legacy shape); of tokens that read the same, the
    first (the chosen one) keeps the key."""
    out: dict[str, float] = {}
    for i, lp in entries.items():
        out.setdefault(decode(i), lp.logprob)
    return out


def chat_logprobs(completion: CompletionOutput, decode, k: int, ids=()) -> dict | None:
    if completion.logprobs is None:
        return None
    content = []
    for tid, entries in zip(completion.token_ids, completion.logprobs):
        token = decode(tid)
        content.append({
            "token": token, "logprob": entries[tid].logprob, "bytes": list(token.encode()),
            "top_logprobs": [{"token": (t := decode(i)), "logprob": lp.logprob,
                              "bytes": list(t.encode())} for i, lp in _top(entries, k, ids)]})
    return {"content": content}


def prompt_logprobs_json(ids: list[int], lps: list | None, decode, k: int) -> dict:
    """An echoed prompt's part of completions' logprobs: each token's logprob and top k (None
    for the first, which nothing precedes), offsets from the prompt's start."""
    tokens, token_lps, tops, offsets, offset = [], [], [], [], 0
    for pos, tid in enumerate(ids):
        token = decode(tid)
        entries = lps[pos] if lps is not None else None
        tokens.append(token)
        token_lps.append(None if entries is None else entries[tid].logprob)
        tops.append(None if entries is None else _by_text(_legacy_top(entries, tid, k), decode))
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def completion_logprobs(completion: CompletionOutput, decode, k: int,
                        offset: int = 0, ids=()) -> dict | None:
    if completion.logprobs is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entries in zip(completion.token_ids, completion.logprobs):
        token = decode(tid)
        tokens.append(token)
        token_lps.append(entries[tid].logprob)
        tops.append(_by_text(_legacy_top(entries, tid, k, ids), decode))
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}

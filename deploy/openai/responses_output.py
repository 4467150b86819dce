"""What a Responses API body gets back: the response object (output items, status, usage) and,
streamed, OpenAI's typed events, each `event: <type>` with its `sequence_number`.

Text streams as `response.output_text.delta` events as it comes; with `auto` tools, until a
call may begin (then the calls and any text held back come when it ends); a forced call comes
whole at the end. Each item has its added / delta / done events as OpenAI sends them.
"""
from __future__ import annotations

import time
import uuid

import msgspec

from tierserve.deploy.openai.errors import ApiError
from tierserve.deploy.openai.responses import Fold, Piece, chat_logprobs
from tierserve.deploy.openai.reasoning import opens_inside, split_reasoning
from tierserve.deploy.openai.responses_protocol import ResponsesRequest
from tierserve.deploy.openai.structured import ToolPlan, parse_tool_calls
from tierserve.runtime.outputs import CompletionOutput
from tierserve.scheduler.params import SamplingParams

__all__ = ["ResponseBuilder", "conversation_of"]

_encode = msgspec.json.Encoder().encode


class ResponseBuilder:
    """The response object and events of one body (one prompt, one sample)."""

    def __init__(self, rid: str, model: str, body: ResponsesRequest, params: SamplingParams,
                 tools: ToolPlan | None, decode, num_logprobs: int,
                 reasoning: bool = False) -> None:
        self.rid, self.created = rid, int(time.time())
        self.decode, self.k = decode, num_logprobs
        self.tools = tools if tools is not None and tools.mode != "none" else None
        self.msg_id = f"msg_{uuid.uuid4().hex}"
        self.seq = 0
        self._final: dict | None = None
        self._opened = False       # the message item's opening events sent
        self._sent = 0             # text sent in deltas
        self._pending: list = []   # logprobs of tokens not yet in a delta
        # A thinking model's reasoning as an item of its own (reasoning.py), before the answer.
        self.reasoning, self.rs_id = reasoning, f"rs_{uuid.uuid4().hex}"
        self._inside: bool | None = None   # the prompt leaves a <think> open
        self._sent_r = 0                   # reasoning sent in deltas
        self._r_state = 0                  # the reasoning item: 0 unsent, 1 open, 2 done
        fmt = (body.text or {}).get("format") or {"type": "text"}
        self.fields = {
            "model": model, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "max_tool_calls": None,
            "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id, "reasoning": None,
            "store": body.store, "temperature": params.temperature, "top_p": params.top_p,
            "top_logprobs": body.top_logprobs, "text": {"format": fmt},
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
            "truncation": body.truncation, "user": body.user, "background": False,
            "service_tier": "default"}

    # ------------------------------------------------------------------ the response object

    def response(self, status: str, output: list[dict], fold: Fold | None,
                 error: ApiError | None = None) -> dict:
        reason = fold.choices[0].finish_reason if fold is not None else None
        return {"id": self.rid, "object": "response", "created_at": self.created,
                "status": status, "error": None if error is None else {
                    "code": "server_error" if error.status >= 500 else "invalid_request",
                    "message": error.message},
                "incomplete_details": {"reason": "max_output_tokens"}
                if status == "incomplete" and reason == "length" else None,
                "output": output, **self.fields,
                "usage": None if fold is None else usage_of(fold)}

    def full(self, fold: Fold) -> dict:
        """The finished response (built once: its items' ids are the ones streamed)."""
        if self._final is None:
            status = self._status(fold)
            self._final = self.response(status, self.items(fold), fold)
        return self._final

    def items(self, fold: Fold) -> list[dict]:
        """The output items of a finished sample: its reasoning, if any, then a message, or
        calls (after any text)."""
        c = fold.choices[0]
        reasoning, text = self._split(fold, True)
        head = [self._reasoning_item(reasoning)] if reasoning else []
        if self.tools is not None:
            calls, content = parse_tool_calls(self.tools, text)
            if calls:
                head += [self._message(content, c, "completed")] if content else []
                return head + [_function_call(call) for call in calls]
        return head + [self._message(text, c, "incomplete" if c.finish_reason == "length"
                                     else "completed")]

    def _split(self, fold: Fold, final: bool) -> tuple[str, str]:
        text = fold.choices[0].text
        if not self.reasoning:
            return "", text
        if self._inside is None:
            self._inside = opens_inside("".join(self.decode(t)
                                                for t in fold.prompt_ids[0][-8:]))
        return split_reasoning(text, self._inside, final)

    def _reasoning_item(self, text: str) -> dict:
        return {"id": self.rs_id, "type": "reasoning", "status": "completed", "summary": [],
                "content": [{"type": "reasoning_text", "text": text}]}

    def _message(self, text: str, c: CompletionOutput, status: str) -> dict:
        return {"id": self.msg_id, "type": "message", "status": status, "role": "assistant",
                "content": [self._part(text, c)]}

    def _part(self, text: str, c: CompletionOutput | None) -> dict:
        return {"type": "output_text", "text": text, "annotations": [],
                "logprobs": self._logprobs(c)}

    def _logprobs(self, c: CompletionOutput | None) -> list:
        lps = chat_logprobs(c, self.decode, self.k) if c is not None else None
        return lps["content"] if lps else []

    @staticmethod
    def _status(fold: Fold) -> str:
        return "incomplete" if fold.choices[0].finish_reason == "length" else "completed"

    # ------------------------------------------------------------------ events

    def event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + _encode(data) + b"\n\n"

    def opening(self) -> list[bytes]:
        head = self.response("in_progress", [], None)
        return [self.event("response.created", response=head),
                self.event("response.in_progress", response=head)]

    def _open_message(self) -> list[bytes]:
        """The message item's opening events, once (before its first text)."""
        if self._opened:
            return []
        self._opened = True
        i = self._msg_index
        return [self.event("response.output_item.added", output_index=i, item={
                    "id": self.msg_id, "type": "message", "status": "in_progress",
                    "role": "assistant", "content": []}),
                self.event("response.content_part.added", item_id=self.msg_id, output_index=i,
                           content_index=0, part=self._part("", None))]

    @property
    def _msg_index(self) -> int:
        return 1 if self._r_state else 0

    def _reasoning_events(self, reasoning: str, done: bool) -> list[bytes]:
        """The reasoning item's events for its text so far: opened with its first text, its
        deltas, and (done) its closing ones."""
        out = []
        if reasoning and not self._r_state:
            self._r_state = 1
            out.append(self.event("response.output_item.added", output_index=0, item=dict(
                self._reasoning_item(""), status="in_progress", content=[])))
        if len(reasoning) > self._sent_r:
            out.append(self.event("response.reasoning_text.delta", item_id=self.rs_id,
                                  output_index=0, content_index=0,
                                  delta=reasoning[self._sent_r:]))
            self._sent_r = len(reasoning)
        if done and self._r_state == 1:
            self._r_state = 2
            out += [self.event("response.reasoning_text.done", item_id=self.rs_id,
                               output_index=0, content_index=0, text=reasoning),
                    self.event("response.output_item.done", output_index=0,
                               item=self._reasoning_item(reasoning))]
        return out

    def piece(self, p: Piece, fold: Fold) -> list[bytes]:
        """The sample's text as it comes: all of it without tools; with `auto` tools, while it
        may not be a call (its format's held_from); with forced calls, nothing until the end.
        Each delta carries the logprobs of the tokens since the last one."""
        self._pending += self._logprobs(p.output)
        if self.tools is not None and self.tools.mode != "auto":
            return []
        reasoning, text = self._split(fold, p.output.finish_reason is not None)
        end = len(text) if self.tools is None else max(self._sent, self.tools.format.held_from(text))
        # The answer's first text closes the reasoning: it is whole by then.
        out = self._reasoning_events(reasoning, end > self._sent)
        if end <= self._sent:
            return out
        out += self._open_message() + [self._delta(self._msg_index, text[self._sent:end])]
        self._sent = end
        return out

    def _delta(self, i: int, text: str) -> bytes:
        lps, self._pending = self._pending, []
        return self.event("response.output_text.delta", item_id=self.msg_id, output_index=i,
                          content_index=0, delta=text, logprobs=lps)

    def closing(self, fold: Fold) -> list[bytes]:
        """Each item's events not yet sent, then the response."""
        final = self.full(fold)
        out = []
        for i, item in enumerate(final["output"]):
            if item["type"] == "reasoning":
                out += self._reasoning_events(item["content"][0]["text"], True)
                continue
            if item["type"] == "message":
                out += self._open_message() + self._close_message(i, item)
                continue
            out += [self.event("response.output_item.added", output_index=i,
                               item=dict(item, arguments="", status="in_progress")),
                    self.event("response.function_call_arguments.delta", item_id=item["id"],
                               output_index=i, delta=item["arguments"]),
                    self.event("response.function_call_arguments.done", item_id=item["id"],
                               output_index=i, name=item["name"], arguments=item["arguments"]),
                    self.event("response.output_item.done", output_index=i, item=item)]
        return out + [self.event(f"response.{final['status']}", response=final)]

    def _close_message(self, i: int, item: dict) -> list[bytes]:
        part = item["content"][0]
        rest = part["text"][self._sent:]
        return ([self._delta(i, rest)] if rest else []) + [
            self.event("response.output_text.done", item_id=self.msg_id, output_index=i,
                       content_index=0, text=part["text"], logprobs=part["logprobs"]),
            self.event("response.content_part.done", item_id=self.msg_id, output_index=i,
                       content_index=0, part=part),
            self.event("response.output_item.done", output_index=i, item=item)]

    def failed(self, error: ApiError, fold: Fold) -> list[bytes]:
        return [self.event("error", code=str(error.status), message=error.message,
                           param=error.param),
                self.event("response.failed", response=self.response("failed", [], fold,
                                                                     error))]


def usage_of(fold: Fold) -> dict:
    prompt, out = sum(fold.prompt_tokens), fold.completion_tokens
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": sum(fold.cached_tokens)},
            "output_tokens": out, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + out}


def _function_call(call: dict) -> dict:
    return {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "completed",
            "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"]}


def conversation_of(items: list[dict]) -> list[dict]:
    """A response's output items as the chat messages a later turn continues from."""
    out: list[dict] = []
    for item in items:
        if item["type"] == "reasoning":  # not carried into the next turn's prompt
            continue
        if item["type"] == "message":
            out.append({"role": "assistant", "content": item["content"][0]["text"]})
            continue
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        if out and out[-1]["role"] == "assistant":
            out[-1].setdefault("tool_calls", []).append(call)
        else:
            out.append({"role": "assistant", "content": None, "tool_calls": [call]})
    return out

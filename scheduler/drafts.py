"""Speculative tokens per request (the Speculator of scheduler/spec.py, where one is
configured): the drafts a decoding request is scheduled with, within its length limits; whether
one with a step in flight waits so as to draft next; and the tokens a verified step gives it.
"""
from __future__ import annotations

from tierserve.scheduler.params import RequestStatus
from tierserve.scheduler.request import Request
from tierserve.scheduler.spec import Speculator

__all__ = ["Drafter"]


class Drafter:
    __slots__ = ("speculator", "max_model_len")

    def __init__(self, speculator: Speculator | None, max_model_len: int) -> None:
        self.speculator = speculator
        self.max_model_len = max_model_len

    def drafts(self, req: Request, budget: int) -> list[int]:
        """Drafts for a request about to decode its last token, within the step's budget and
        its length limits (the step yields up to one token more than it has drafts)."""
        if self.speculator is None or req.num_output_placeholders:
            return []
        limit = min(budget - 1, req.max_output_tokens - req.num_output_tokens - 1,
                    self.max_model_len - req.num_tokens - 1)
        return self.speculator.drafts(req.request_id, req.sampling_params, req.all_token_ids,
                                      limit)

    def awaited(self, req: Request) -> bool:
        """With async scheduling, a request whose known tokens already find drafts waits for
        its step in flight rather than run ahead of it: drafts need its every token."""
        return self.speculator is not None and bool(self.speculator.drafts(
            req.request_id, req.sampling_params, req.all_token_ids, 1))

    def accept(self, req: Request, drafts: list[int], num_accepted: int,
               token: int) -> list[int]:
        """The tokens a step gave a request: its accepted drafts, then its sample. The KV of
        the rejected drafts is in the pool but not computed: the count falls back past them."""
        if not drafts:
            return [token]
        num_accepted = min(max(num_accepted, 0), len(drafts))
        if req.status == RequestStatus.RUNNING:
            req.num_computed_tokens -= len(drafts) - num_accepted
        self.speculator.record(req.request_id, len(drafts), num_accepted)
        return drafts[:num_accepted] + [token]

    def forget(self, seq_id: str) -> None:
        if self.speculator is not None:
            self.speculator.forget(seq_id)

    def stats(self) -> dict:
        return self.speculator.stats() if self.speculator is not None else {}

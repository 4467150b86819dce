"""The steps sent to the workers and not answered yet, and the suspects a loss of the workers
leaves: the sequences that were in a step in flight then.

A suspect found in flight at the next loss is a poison pill and fails; until a step of the new
workers has computed it, a suspect is admitted only while no other suspect runs, so that a loss
blames one sequence, never a batch.
"""
from __future__ import annotations

from typing import Iterable

from tierserve.scheduler.request import Request

__all__ = ["InFlight"]


class InFlight:
    __slots__ = ("steps", "suspects", "_extra", "extra_tokens")

    def __init__(self) -> None:
        # The Request objects each step in flight scheduled, in its order (ids may be reused
        # once a request finishes, so its reply is matched to objects, not ids).
        self.steps: dict[int, list[Request]] = {}
        # Sequence ids in a step in flight at the last loss, not yet through a step since.
        self.suspects: set[str] = set()
        # Per step in flight, its tokens beyond one per sequence (prefill chunks and drafts:
        # work a decode step does not have); extra_tokens is their sum, an int that another
        # thread may read while the step loop changes the dict.
        self._extra: dict[int, int] = {}
        self.extra_tokens = 0

    def __len__(self) -> int:
        return len(self.steps)

    def add(self, step_id: int, scheduled: list[Request], extra_tokens: int = 0) -> None:
        self.steps[step_id] = scheduled
        self._extra[step_id] = extra_tokens
        self.extra_tokens += extra_tokens

    def pop(self, step_id: int) -> list[Request] | tuple[()]:
        """The requests of a step whose reply (or failure) came; () for an unknown step."""
        self.extra_tokens -= self._extra.pop(step_id, 0)
        return self.steps.pop(step_id, ())

    def clear(self) -> None:
        self.steps.clear()
        self._extra.clear()
        self.extra_tokens = 0

    def check_integrity(self) -> None:
        assert self._extra.keys() == self.steps.keys()
        assert self.extra_tokens == sum(self._extra.values()) >= 0

    def computed(self, req: Request) -> None:
        """A step of the current workers computed the sequence: it is cleared."""
        self.suspects.discard(req.request_id)

    def forget(self, seq_id: str) -> None:
        self.suspects.discard(seq_id)

    def quarantined(self, req: Request, running: Iterable[Request]) -> bool:
        """A suspect waits while another runs."""
        return req.request_id in self.suspects and any(
            r.request_id in self.suspects for r in running)

    def workers_lost(self, live: dict[str, Request]) -> list[str]:
        """Voids every step in flight. Returns the suspects found in one again (poison pills,
        for the caller to fail); the other live sequences in flight become the suspects."""
        in_flight = [r.request_id for reqs in self.steps.values() for r in reqs
                     if live.get(r.request_id) is r]
        poisoned = [sid for sid in dict.fromkeys(in_flight) if sid in self.suspects]
        if in_flight:  # a loss with nothing in flight (idle, a failed restart) blames nobody
            self.suspects = set(in_flight) - set(poisoned)
        self.clear()
        return poisoned

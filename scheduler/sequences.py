"""The unfinished sequences: every live Request by sequence id, and the families of requests
sampled n > 1 times. Sample i > 0 of request R is a sequence of its own (seq_id(R, i)), forked
from sample 0 once sample 0 has computed the prompt.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import msgspec

from tierserve.scheduler.params import RequestStatus
from tierserve.scheduler.request import Request

__all__ = ["Family", "Sequences"]


@dataclass(slots=True)
class Family:
    """The n samples of one request. Sample 0 runs first; the others fork from it once its
    prompt is computed (`unforked` until then), sharing its blocks."""

    unforked: list[int]
    live: set[str]


class Sequences:
    __slots__ = ("requests", "families")

    def __init__(self) -> None:
        # Keyed by sequence id: a request's sample i > 0 is a sequence of its own.
        self.requests: dict[str, Request] = {}
        # Keyed by request id, for requests with n > 1 while any of their samples is live.
        self.families: dict[str, Family] = {}

    def in_use(self, request_id: str) -> bool:
        return request_id in self.requests or request_id in self.families

    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        n = req.sampling_params.n
        if n > 1:
            self.families[req.request_id] = Family(list(range(1, n)), {req.request_id})

    def seq_ids(self, request_ids: Iterable[str]) -> list[str]:
        """The live sequences of each request: every sample of one with a family."""
        seqs = []
        for rid in request_ids:
            family = self.families.get(rid)
            seqs.extend(family.live if family is not None else (rid,))
        return seqs

    def forks_now(self, req: Request) -> bool:
        """Whether a reply's token is sample 0's first, with siblings still to fork."""
        return req.index == 0 and not req.output_token_ids and req.family_id in self.families

    def fork(self, parent: Request) -> list[Request]:
        """Registers sample 0's unforked siblings, each with its own seed derived from the
        request's (seed + index), and returns them, nothing computed yet."""
        family = self.families[parent.family_id]
        seed = parent.sampling_params.seed
        children = []
        for index in family.unforked:
            params = msgspec.structs.replace(parent.sampling_params, n=1, seed=None if seed is None
                                             else (seed + index) % 2**64)
            child = parent.fork(index, params)
            self.requests[child.request_id] = child
            family.live.add(child.request_id)
            children.append(child)
        family.unforked = []
        return children

    def remove(self, req: Request) -> list[tuple[str, int]]:
        """Drops a finished sequence. Returns (request id, sample index) of it and, for sample
        0, of the siblings it never forked, which finish with it."""
        del self.requests[req.request_id]
        done = [(req.family_id, req.index)]
        family = self.families.get(req.family_id)
        if family is not None:
            family.live.discard(req.request_id)
            if req.index == 0:  # nothing left to fork from
                done += [(req.family_id, i) for i in family.unforked]
                family.unforked = []
            if not family.live:
                del self.families[req.family_id]
        return done

    def restart_all(self) -> None:
        """The workers hold nothing any more: every sequence is to be recomputed from its
        tokens; one that ran or that the workers had seen is PREEMPTED."""
        for req in self.requests.values():
            if req.num_sent_tokens or req.status == RequestStatus.RUNNING:
                req.status = RequestStatus.PREEMPTED
            req.num_computed_tokens = req.num_output_placeholders = req.num_sent_tokens = 0
            req.spec_token_ids = []

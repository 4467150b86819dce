"""Failover of a replicated deployment's streams: what one generate() call has streamed, and
what is left of it to route again when its replica fails.

A request whose replica dies mid-stream (its actor fails, or its engine reports itself dead)
goes on elsewhere as a continuation: the prompt plus every token already streamed, the
remaining max_tokens, the same seed, routed again away from the failed replica; the caller's
stream continues with no token missing or repeated (greedy output equals an undisturbed run).
A request with n samples continues each unfinished sample as a request of its own (sample i
with seed + i, as the engine forks it). What a continuation cannot carry over: a seeded
sampler's random stream restarts from the seed, penalties and bad words count the streamed
tokens as prompt, and a structured output that has begun fails (its grammar's state died with
the replica).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from tierserve.scheduler.messages import EngineCoreOutput, EngineCoreRequest
from tierserve.scheduler.params import ErrorKind, FinishReason

if TYPE_CHECKING:
    from tierserve.deploy.router_client import RouterClient

__all__ = ["CONT_SEP", "MAX_FAILOVERS", "Call", "Tracked"]

# The router client's logger: failover is part of what it reports.
log = logging.getLogger("tierserve.router_client")

# Engine id of sample i's continuation, for a request with several samples: rid + SEP + i
# (the engine reserves \x1f for its own sample ids).
CONT_SEP = "\x1e"
# A request moves to another replica at most this many times before it fails.
MAX_FAILOVERS = 8


@dataclass(slots=True, eq=False)
class Tracked:
    """One caller request across the replicas that serve it."""

    request: EngineCoreRequest
    prompt_ids: list[int]
    tokens: dict[int, list[int]] = field(default_factory=dict)  # per sample, streamed
    finished: set[int] = field(default_factory=set)
    announced: bool = False
    cached: int | None = None
    failovers: int = 0
    failed_on: set[int] = field(default_factory=set)

    @property
    def n(self) -> int:
        return self.request.sampling_params.n

    @property
    def done(self) -> bool:
        return len(self.finished) >= self.n

    @property
    def continuable(self) -> bool:
        """A grammar's state lives on the replica that died: a structured output that has
        begun cannot go on elsewhere."""
        return self.request.sampling_params.structured_outputs is None or \
            not any(self.tokens.values())

    def continuations(self) -> list[EngineCoreRequest]:
        """What is left of it, as requests to route again."""
        req, params = self.request, self.request.sampling_params
        if not any(self.tokens.values()) and not self.finished:  # nothing streamed yet
            return [msgspec.structs.replace(req, prompt_token_ids=self.prompt_ids)]
        out = []
        for index in range(self.n):
            if index in self.finished:
                continue
            streamed = self.tokens.get(index, [])
            seed = params.seed
            if seed is not None and index > 0:
                seed = (seed + index) % 2**64
            left = None if params.max_tokens is None else params.max_tokens - len(streamed)
            # The prompt's logprobs went out with the first output.
            sample = msgspec.structs.replace(
                params, n=1, seed=seed, max_tokens=left, prompt_logprobs=None,
                min_tokens=max(0, params.min_tokens - len(streamed)))
            rid = req.req_id if self.n == 1 else f"{req.req_id}{CONT_SEP}{index}"
            out.append(EngineCoreRequest(rid, sample, prompt_token_ids=self.prompt_ids + streamed,
                                         priority=req.priority, cache_salt=req.cache_salt,
                                         label=req.label, lora=req.lora))
        return out


class Call:
    """One generate() call: its requests, the legs (one replica stream each) serving them,
    and the queue the caller reads."""

    def __init__(self, client: RouterClient, hold: bool = False) -> None:
        self.client = client
        self.hold = hold  # an offline batch: each replica queues its part whole
        self.tracked: dict[str, Tracked] = {}
        self.queue: asyncio.Queue = asyncio.Queue()
        self.legs: set[asyncio.Task] = set()
        self.left = 0  # caller requests whose finishing output is not queued yet
        self.actors: dict[str, object] = {}  # engine id -> the replica actor serving it

    def owner(self, o: EngineCoreOutput) -> tuple[Tracked, int]:
        rid, sep, index = o.req_id.partition(CONT_SEP)
        return self.tracked[rid], int(index) if sep else o.index

    def translate(self, batch: list[EngineCoreOutput], replica: int | None
                  ) -> tuple[list[EngineCoreOutput], list[str]]:
        """The outputs to forward (in caller terms), and the engine ids to continue elsewhere
        (their replica's engine is dead, or full while another replica is not); outputs made
        here (replica None) are forwarded as they are."""
        forward, again = [], []
        for o in batch:
            t, index = self.owner(o)
            if o.error and replica is not None and self._retry(t, o, replica):
                again.append(o.req_id)
                continue
            o.req_id, o.index = t.request.req_id, index
            if o.prompt_token_ids:
                o.prompt_token_ids = [] if t.announced else t.prompt_ids
                t.announced = True
            if t.cached is None:
                t.cached = o.num_cached_tokens
            o.num_cached_tokens = t.cached
            t.tokens.setdefault(index, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                was_done = t.done
                t.finished.update(range(t.n) if o.error else (index,))
                self.left -= t.done and not was_done
            forward.append(o)
        return forward, again

    def _retry(self, t: Tracked, o: EngineCoreOutput, replica: int) -> bool:
        kind = o.error_kind
        if kind == ErrorKind.ENGINE_DEAD:
            return t.failovers < MAX_FAILOVERS
        if kind == ErrorKind.OVERLOADED:  # another replica may have room
            return replica not in t.failed_on and t.failovers < MAX_FAILOVERS
        return False

    def failover(self, replica: int, engine_ids: list[str], reason: str
                 ) -> list[tuple[Tracked, list[EngineCoreRequest]]]:
        """The continuations to route again of the requests behind these engine ids, which
        `replica` failed; a request past MAX_FAILOVERS, or that cannot continue, fails here."""
        work = []
        for t in {id(t): t for t in (self.tracked[e.partition(CONT_SEP)[0]]
                                     for e in engine_ids)}.values():
            if t.done:
                continue
            t.failovers += 1
            t.failed_on.add(replica)
            if t.failovers > MAX_FAILOVERS:
                self.fail(t, f"the request failed on {t.failovers} replicas; last: {reason}")
                continue
            if not t.continuable:
                self.fail(t, f"the replica serving this structured output failed ({reason}); "
                             f"its grammar cannot continue elsewhere")
                continue
            log.info("continuing %r elsewhere: replica %d failed (%s)", t.request.req_id,
                     replica, reason)
            todo = []
            for c in t.continuations():
                if c.sampling_params.max_tokens == 0:  # its last token came, its end did not
                    self.emit([EngineCoreOutput(c.req_id, finish_reason=FinishReason.LENGTH)])
                else:
                    todo.append(c)
            work.append((t, todo))
        return work

    def fail(self, t: Tracked, message: str) -> None:
        self.emit([EngineCoreOutput(t.request.req_id, finish_reason=FinishReason.ERROR,
                                    error=message, error_kind=ErrorKind.ENGINE_DEAD)])

    def emit(self, outputs: list[EngineCoreOutput]) -> None:
        """Outputs made here, not by a replica."""
        forward, _ = self.translate(outputs, None)
        self.queue.put_nowait(forward)

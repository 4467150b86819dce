"""Engine steps and copy completions, in a replay that has no engine loop and no workers.

In the engine every admission and decode allocation happens in a step; a step's device <-> CPU
copies complete when it ends (a slot demoted in a step is FILLING, not a hit, until then; its
fills then its reads settle in the CPU tier's LRU, in order), and the next step begins only
after. SSD loads and spills complete when the workers report them, each kind a queue of its
own, in issue order.

The replay's events happen at times of their own, so the clock groups them: an event within
half a decode interval (the shortest of the step's requests') of the step's first event is in
that step; a later one, or a second event of a request in it, ends it (end_step, then complete)
and begins the next, and so does a request's end (the engine finishes a request as its last
step ends). Between the two
the engine ran decode steps that took no block; the first of them writes cold CPU slots back
(one more end_step). An asynchronous copy ends after the previous copy of its kind and its own
cost; the policy hears of it at the next step's end, or at the time the replay is asked to
`complete` (schedule), as an idle engine's polling step would. Requests whose loads all
completed collect in `ready`.
"""
from __future__ import annotations

import collections
import itertools
from typing import Callable

from tierserve.kvcache import ASYNC_KINDS, CopyKind, TierPolicy

__all__ = ["TierClock"]


class TierClock:
    def __init__(self, policy: TierPolicy, load_block_s: float, spill_block_s: float,
                 schedule: Callable[[float], None]) -> None:
        self.policy = policy
        self.cost = {CopyKind.SSD_TO_CPU: load_block_s, CopyKind.CPU_TO_SSD: spill_block_s}
        self.schedule = schedule  # schedule(time): the replay calls complete(time) then
        self._ids = itertools.count()
        self._free_at = {kind: 0.0 for kind in ASYNC_KINDS}
        self._ends = {kind: collections.deque() for kind in ASYNC_KINDS}  # (seq, end time)
        self._began: float | None = None  # the open step's first event
        self._members: set = set()  # the requests with an event in it
        self._step_s = 0.0  # the open step's length: its requests' shortest decode interval
        self._first_token: float | None = None  # an admitted request's, in the open step
        self.ready: list = []

    def begin(self, now: float, request_id, interval: float,
              first_token: float | None = None) -> None:
        """An event of a request (decoding a token every `interval` seconds) at `now` takes
        part in a step: the open step, or a new one (the open step ended) past its window or
        where the request already took part in it (a request is in a step once). An admission
        (`first_token`: when its prefill step ended) joins a step that admitted requests whose
        first tokens came with its own, however late its admission was stamped (a scheduler
        thread descheduled in the middle of a step)."""
        if request_id in self._members:
            self.end_open_step(now)
        elif self._began is not None and now > self._began + 0.5 * self._step_s and not (
                first_token is not None and self._first_token is not None and
                abs(first_token - self._first_token) <= 0.25 * min(interval, self._step_s)):
            self._end_step(now)
        if self._began is None:
            self._began, self._step_s, self._first_token = now, interval, first_token
        elif interval < self._step_s:
            self._step_s = interval
        self._members.add(request_id)

    def settle(self, now: float) -> None:
        """Ends the open step if `now` is past its window."""
        if self._began is not None and now > self._began + 0.5 * self._step_s:
            self._end_step(now)

    def end_open_step(self, now: float) -> None:
        if self._began is not None:
            self._end_step(now)

    def _end_step(self, now: float) -> None:
        began = self._began
        self._began = None
        self._members.clear()
        step_id = next(self._ids)
        self._issue(self.policy.end_step(step_id), began)
        self.policy.complete(step_id)
        idle = next(self._ids)  # the decode step after it: write-back of the slots it filled
        self._issue(self.policy.end_step(idle), min(began + self._step_s, now))
        self.policy.complete(idle)
        self._apply(now)

    def _issue(self, batches, at: float) -> None:
        for batch in batches:
            if batch.kind not in self.cost:
                continue
            free = max(self._free_at[batch.kind], at)
            ends = self._ends[batch.kind]
            for i in range(len(batch.hashes)):
                free += self.cost[batch.kind]
                ends.append((batch.first_seq + i, free))
            self._free_at[batch.kind] = free
            self.schedule(free)

    def _apply(self, now: float) -> None:
        """The asynchronous copies ended by now complete."""
        done = []
        for kind in ASYNC_KINDS:
            ends, upto = self._ends[kind], -1
            while ends and ends[0][1] <= now:
                upto = ends.popleft()[0] + 1
            done.append(upto)
        if done != [-1] * len(done):
            self.ready += self.policy.complete(-1, done)

    def complete(self, now: float) -> None:
        """A copy is due: the open step ends if past its window, and what is due completes."""
        self.settle(now)
        self._apply(now)

    def finish(self) -> bool:
        """The end of the log: the open step ends. False when none was open."""
        if self._began is None:
            return False
        self._end_step(self._began)
        return True

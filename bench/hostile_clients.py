"""Hostile clients for bench/soak.py's storm (issue 29), beside its load and frame storm:

- duplicate ids: client A streams a request with its own request_id; client B, from the same
  address, sends the same id while A's request runs: B must get 409 (or, if A finished first,
  be served or refused 503), and A must complete untouched;
- 1 MiB prompts: refused 400 on their byte length (the server runs with a 2 MiB body limit,
  so that the byte check, not the body limit, answers them), never a stall of other streams;
- early disconnects: a streaming request whose client leaves before its first token, after a
  random fraction of a second (its request queued, tokenizing or prefilling);
- a stopped engine: the engine actor's process is stopped (SIGSTOP) for a few seconds now and
  then; /health must answer 503 within 2 s meanwhile, and every request in flight completes
  once it resumes (a stop shorter than the step timeout costs nothing).

Every hostile request ends one of the expected ways or counts as lost. `EngineStops` holds a
lock for each stop, which the storm's checks take, so that a check never runs while the
engine is deliberately stopped; streams that overlapped a stop are left out of the chunk-gap
figure (their gap is the stop's).
"""
from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time

import httpx

__all__ = ["HostileClients", "EngineStops", "MIB_BODY_LIMIT"]

# The soak's server takes bodies up to this, so that a 1 MiB prompt reaches the byte check.
MIB_BODY_LIMIT = 2 << 20


class EngineStops:
    """Stops the engine's process for `seconds` every `every` seconds (the first after
    `first`), checking /health each time; windows() are the stops' (start, end) times."""

    def __init__(self, base: str, pid: int, seconds: float, every: float, first: float) -> None:
        self.base, self.pid = base, pid
        self.seconds, self.every, self.first = seconds, every, first
        self.lock = threading.Lock()  # held while the engine is stopped, and until it serves
        self.windows: list[tuple[float, float]] = []
        self.health_ms: list[float] = []  # how long /health took to answer during each stop
        self.problems: list[str] = []

    async def run(self, until: float) -> None:
        await asyncio.sleep(self.first)
        while time.monotonic() + self.seconds < until:
            await asyncio.to_thread(self._stop_once)
            # The next stop, if one still fits before `until`: the load does not wait for a
            # stop interval that ends after it.
            await asyncio.sleep(min(self.every, max(0.0, until - time.monotonic())))

    def _stop_once(self) -> None:
        with self.lock:
            t0 = time.monotonic()
            os.kill(self.pid, signal.SIGSTOP)
            try:
                time.sleep(min(1.0, self.seconds / 2))
                h0 = time.monotonic()
                r = httpx.get(self.base + "/health", timeout=10)
                self.health_ms.append(round((time.monotonic() - h0) * 1000, 1))
                if r.status_code != 503 or "unresponsive" not in r.text:
                    self.problems.append(f"/health of a stopped engine: {r.status_code}")
                time.sleep(max(0.0, self.seconds - (time.monotonic() - t0)))
            finally:
                os.kill(self.pid, signal.SIGCONT)
            self.windows.append((t0, time.monotonic()))
            deadline = time.monotonic() + 30
            while httpx.get(self.base + "/health", timeout=10).status_code != 200:
                if time.monotonic() > deadline:
                    self.problems.append("/health not 200 30 s after the engine resumed")
                    break
                time.sleep(0.1)

    def overlaps(self, start: float, end: float) -> bool:
        return any(s <= end and start <= e for s, e in self.windows)


class HostileClients:
    """Runs the duplicate-id pairs, the 1 MiB prompts and the early disconnects at their
    rates until `until`; outcomes are (kind, outcome) pairs, outcome "lost" when unexpected."""

    def __init__(self, url: str, model: str, output_len: int, seed: int,
                 every_s: float = 5.0) -> None:
        self.url, self.model, self.output_len = url, model, output_len
        self.rng = random.Random(seed)
        self.every_s = every_s
        self.outcomes: list[tuple[str, str]] = []
        self.lost_details: list[str] = []  # what each lost one got, to tell why

    async def run(self, until: float) -> None:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as a, \
                httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as b:
            tasks, k = [], 0
            while time.monotonic() < until:
                tasks += [asyncio.create_task(self._duplicate(a, b, k)),
                          asyncio.create_task(self._megabyte(b)),
                          asyncio.create_task(self._gone_early(a))]
                k += 1
                await asyncio.sleep(self.every_s * (0.5 + self.rng.random()))
            await asyncio.gather(*tasks)

    def _body(self, stream: bool, **extra) -> dict:
        return {"model": self.model, "messages": [{"role": "user", "content": "Tell me a tale"}],
                "max_tokens": self.output_len, "stream": stream, "ignore_eos": True,
                "temperature": 0.7} | extra

    async def _duplicate(self, a: httpx.AsyncClient, b: httpx.AsyncClient, k: int) -> None:
        rid = f"soak-dup-{k}"
        try:
            async with a.stream("POST", self.url, json=self._body(True, request_id=rid)) as r:
                if r.status_code == 503:
                    self.outcomes.append(("duplicate_id", "refused"))
                    return
                lines = r.aiter_lines()
                first = await _first_chunk(lines)
                theirs = await b.post(self.url, json=self._body(False, request_id=rid,
                                                               max_tokens=2))
                self.outcomes.append(("duplicate_id", {409: "conflict", 200: "served",
                                                       503: "refused"}.get(
                    theirs.status_code, "lost")))
                done = first and await _completes(lines)
                self.outcomes.append(("duplicate_id_first", "completed" if done else "lost"))
        except httpx.HTTPError:
            self.outcomes.append(("duplicate_id_first", "lost"))

    async def _megabyte(self, client: httpx.AsyncClient) -> None:
        body = self._body(False)
        body["messages"][0]["content"] = "z" * (1 << 20)
        try:
            r = await client.post(self.url, json=body)
            ok = r.status_code in (400, 413) and "error" in r.json()
            got = f"HTTP {r.status_code}: {r.text[:200]}"
        except (httpx.HTTPError, ValueError) as e:
            ok, got = False, f"{type(e).__name__}: {e}"
        self.outcomes.append(("megabyte_prompt", "rejected" if ok else "lost"))
        if not ok:
            self.lost_details.append(f"megabyte_prompt: {got}")

    async def _gone_early(self, client: httpx.AsyncClient) -> None:
        """A streaming request whose client leaves before reading anything."""
        delay = self.rng.random() * 0.3
        try:
            r = await asyncio.wait_for(client.post(self.url, json=self._body(True)), delay)
            # Answered before it could leave: served, or refused at once.
            self.outcomes.append(("gone_early", {200: "completed", 503: "refused"}.get(
                r.status_code, "lost")))
        except asyncio.TimeoutError:
            self.outcomes.append(("gone_early", "disconnected"))
        except httpx.HTTPError:
            self.outcomes.append(("gone_early", "lost"))


async def _first_chunk(lines) -> bool:
    async for line in lines:
        if line.startswith("data: {"):
            return "error" not in line
    return False


async def _completes(lines) -> bool:
    finished = False
    async for line in lines:
        if line == "data: [DONE]":
            return finished
        if line.startswith("data: {"):
            if '"error"' in line:
                return False
            finished |= '"finish_reason":"' in line.replace(" ", "")
    return False

"""Overload soak: twice the sustainable request rate against the OpenAI server for N minutes,
optionally under a storm of hostile data-plane frames.

It starts a private Ray instance in this process (its own temp folder, auth and usage stats
off) and `tierserve api-server --name ...` in front of a deployment on it: the engine actor and
its worker ranks (tensor parallel --tp, default 1) behind the ZMQ data plane, the engine with
`--step-time-target-ms 100` (--step-time-target-ms: while streams decode, a step takes only the
prefill its measured cost fits in 100 ms, as a latency-bound deployment runs). It measures the
sustainable rate with a short calibration burst, then offers twice that rate with Poisson
arrivals of streaming chat requests, of which a share disconnect mid-stream and a share are bad
(400 expected). Every request must end one way: completed (200 with a finish reason and
`[DONE]`), refused (503 at once: the queue is bounded), rejected (the bad ones, 400),
disconnected (by the client, on purpose); anything else is lost. After the run the engine
drains, and every KV block must be back in the pool. At the end the deployment is stopped, Ray
is shut down and any process of it still alive is killed by pid.

    python bench/soak.py --minutes 10 --frames 10000 [--json] [--check]

--frames N: while the load runs, a child process without the deployment's keys sends N hostile
frames spread over every data-plane socket of the engine (bench/frame_storm.py: the XPUB
broadcast and the reply PULL socket, TCP and IPC; garbage, truncated msgpack, wrong types,
oversized frames, pickles, forged replies and errors for the current step; raw connections,
ZMTP with NULL or a bogus CURVE handshake, pyzmq sockets without CURVE or with a self-made
keypair), in --frame-rounds rounds. After each round (the frames go on meanwhile), and once
more after the drain, a check: a greedy probe request gives the text it gave before the
storm, /health answers 200, the engine's dropped_frames has not moved (a frame without a rank's key never gets past the
handshake, so none reaches the reply check to be dropped there), no pickle was loaded (its
marker file is absent) and the passive subscribers read nothing. `frames_sent` counts the
frames the attacker's sockets took (frame_storm.py defines it); `frames_survived` is the number
of frames sent by the round that the last passing check followed, every earlier check passing
too: frames after which the deployment still served correctly and none of them had been
applied. The final check runs after the last frame, so frames_survived is frames_sent exactly
when every check passed. Requests that fail because of a frame show in lost_requests.

Beside the load, unless --no-hostile, the hostile clients of bench/hostile_clients.py: pairs of
clients sending the same request_id (409 for the second, the first untouched), 1 MiB prompts
(400 on their byte length), streams whose client leaves before the first token, and the engine
actor's process stopped (SIGSTOP) for --stop-seconds every --stop-every seconds (/health must
answer 503 within 2 s meanwhile; nothing in flight may be lost). Their unexpected outcomes
count as lost requests. The storm's checks never run during a deliberate stop.

Reports completed, refused, rejected, disconnected, lost_requests (load_lost from the load,
hostile_lost from the hostile clients, with each kind's outcomes under `hostile`),
leaked_blocks, p99_ttft_admitted_ms, max_chunk_gap_s and p99_chunk_gap_ms (between two chunks
of a normal stream that completed, left out where an engine stop touched it), the engine stops
and how long /health took during each, the engine's RSS at start and end (and the HTTP
server's), and with --frames: frames_sent, frames_survived, frames_read, dropped_frames and the
checks. --check exits 1 unless lost_requests and leaked_blocks are 0, frames_survived equals
frames_sent and every engine stop went as expected.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
from multiprocessing import resource_tracker
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import frame_storm  # noqa: E402
from hostile_clients import MIB_BODY_LIMIT, EngineStops, HostileClients  # noqa: E402
from report import emit  # noqa: E402
from serving import build_prompts, start_tierserve  # noqa: E402

_BAD = [{"temperature": -1}, {"n": 0}, {"top_p": 7}, {"bogus": 1},
        {"messages": [{"role": "wizard", "content": "x"}]}]


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: str, kind: str,
              output_len: int, rng: random.Random) -> tuple[str, float | None, tuple | None]:
    """(outcome, time to first token, (start, end, largest gap between chunks) of a normal
    stream that completed)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": output_len, "temperature": 0.7, "stream": True, "ignore_eos": True}
    if kind == "bad":
        body |= rng.choice(_BAD)
    t0, m0, ttft = time.perf_counter(), time.monotonic(), None
    cut = rng.randint(1, max(output_len // 2, 1)) if kind == "disconnect" else None
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code == 503:
                return "refused", None, None
            if r.status_code == 400:
                return ("rejected" if kind == "bad" else "lost"), None, None
            if r.status_code != 200:
                return "lost", None, None
            chunks, finished, done, last, gap = 0, False, False, None, 0.0
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                    break
                if not line.startswith("data: "):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return "lost", ttft, None
                now = time.perf_counter()
                for choice in chunk.get("choices", ()):
                    if choice["delta"].get("content") and ttft is None:
                        ttft = now - t0
                    finished |= choice.get("finish_reason") is not None
                if ttft is not None:  # gaps between chunks once tokens flow
                    gap = max(gap, now - last) if last is not None else gap
                    last = now
                chunks += 1
                if cut is not None and chunks >= cut:
                    return "disconnected", ttft, None
            if kind == "bad":
                return "lost", ttft, None
            if not (finished and done):
                return "lost", ttft, None
            return "completed", ttft, (m0, time.monotonic(), gap)
    except httpx.HTTPError:
        return "lost", ttft, None


async def offer(url: str, model: str, prompts: list[str], rate: float, seconds: float,
                output_len: int, disconnect_share: float, bad_share: float,
                seed: int) -> list[tuple[str, float | None, tuple | None]]:
    rng, arrivals = random.Random(seed), np.random.default_rng(seed)
    limits = httpx.Limits(max_connections=4096)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        tasks, t_end, i = [], time.monotonic() + seconds, 0
        while time.monotonic() < t_end:
            u = rng.random()
            kind = "bad" if u < bad_share else (
                "disconnect" if u < bad_share + disconnect_share else "normal")
            tasks.append(asyncio.create_task(one(client, url, model, prompts[i % len(prompts)],
                                                 kind, output_len, rng)))
            i += 1
            await asyncio.sleep(arrivals.exponential(1.0 / rate))
        return await asyncio.gather(*tasks)


def metrics(base: str) -> dict:
    out = {}
    text = httpx.get(base + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.labels:
                out[sample.name] = sample.value
    return out


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def drain(base: str, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(base)
        if m["tierserve:num_requests_running"] == m["tierserve:num_requests_waiting"] == 0:
            return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.5)


NAMESPACE = "tierserve-soak"
# A greedy completion whose tokens must not change under the storm.
PROBE = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0,
         "ignore_eos": True}


def probe(base: str, model: str, timeout_s: float = 180.0) -> str:
    """The probe's text; a 503 (the queue is full: the load runs at twice the sustainable
    rate) is retried until timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = httpx.post(base + "/v1/completions", json={"model": model, **PROBE}, timeout=120)
        if r.status_code == 200:
            return r.json()["choices"][0]["text"]
        if r.status_code != 503 or time.monotonic() > deadline:
            raise RuntimeError(f"probe answered {r.status_code}: {r.text[:200]}")
        time.sleep(0.2)


class PrivateRay:
    """A Ray instance this process starts and ends: its own temp folder, auth and usage
    stats off; the api-server it starts joins it through RAY_ADDRESS. `stop` shuts it down
    and kills, by pid, whatever this process started that is still alive."""

    def __init__(self, num_cpus: int) -> None:
        self.tmp = tempfile.mkdtemp(prefix="tierserve-soak-ray-", dir="/tmp")
        os.environ.update(RAY_TMPDIR=self.tmp, RAY_AUTH_MODE="disabled",
                          RAY_USAGE_STATS_ENABLED="0")
        os.environ.pop("RAY_ADDRESS", None)
        import ray
        ray.init(num_cpus=num_cpus, include_dashboard=False, namespace=NAMESPACE,
                 object_store_memory=256 << 20, _temp_dir=self.tmp, log_to_driver=False)
        os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address

    def stop(self, deployment: str | None) -> None:
        import ray
        from tierserve.deploy.ray_engine import stop
        try:
            if deployment is not None:
                stop(deployment, NAMESPACE)
        finally:
            # multiprocessing's resource tracker (the storm's spawned child started it) lives
            # until this process exits: it is not Ray's, and not waited for.
            tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
            ours = {p: t for p, t in _descendants(os.getpid()).items() if p != tracker}
            ray.shutdown()
            _kill_survivors(ours)
            shutil.rmtree(self.tmp, ignore_errors=True)


def _start_time(pid: int) -> str | None:
    """The process's start time; None when it is gone (an exited child not yet reaped, a
    zombie, is gone too)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] == "Z" else fields[19]
    except (OSError, IndexError):
        return None


def _descendants(root: int) -> dict[int, str]:
    """Every process below `root` (pid -> start time, which tells it from a later process
    that reuses its pid)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, grew = {root}, True
    while grew:
        children = {p for p, pp in parents.items() if pp in found} - found
        found |= children
        grew = bool(children)
    found.discard(root)
    return {p: t for p in found if (t := _start_time(p)) is not None}


def _kill_survivors(pids: dict[int, str], grace_s: float = 10.0) -> None:
    deadline = time.monotonic() + grace_s
    for sig in (signal.SIGTERM, signal.SIGKILL):
        while time.monotonic() < deadline and any(_start_time(p) == t for p, t in pids.items()):
            time.sleep(0.2)
        for pid, started in pids.items():
            if _start_time(pid) == started:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 3.0


class Checker:
    """Whether the deployment still serves correctly and applied no hostile frame: the probe's
    text, /health, dropped_frames, the pickle marker, the passive subscribers."""

    def __init__(self, base: str, model: str, actor, marker: str,
                 guard: threading.Lock | None = None) -> None:
        import ray
        self.base, self.model, self.actor, self.marker = base, model, actor, marker
        self.guard = guard or threading.Lock()  # held by a deliberate engine stop
        self.reference = probe(base, model)
        self.dropped_before = ray.get(actor.dataplane.remote(), timeout=60)["dropped_frames"]

    def problem(self, frames_read: int) -> str | None:
        with self.guard:  # never while the engine is stopped on purpose
            return self._problem(frames_read)

    def _problem(self, frames_read: int) -> str | None:
        import ray
        try:
            text = probe(self.base, self.model)
        except (httpx.HTTPError, RuntimeError) as e:
            return f"the probe failed: {e}"
        if text != self.reference:
            return f"the probe gave {text!r}; before the storm {self.reference!r}"
        if httpx.get(self.base + "/health", timeout=30).status_code != 200:
            return "/health is not 200"
        try:
            dropped = ray.get(self.actor.dataplane.remote(), timeout=60)["dropped_frames"]
        except (ray.exceptions.RayError, TimeoutError) as e:
            return f"the engine actor did not answer: {e}"
        if dropped != self.dropped_before:
            return f"dropped_frames went from {self.dropped_before} to {dropped}"
        if os.path.exists(self.marker):
            return "a pickled frame was loaded"
        if frames_read:
            return f"passive subscribers read {frames_read} broadcast frames"
        return None


class Storm:
    """frame_storm.storm in a spawned child process, a thread feeding it the last step id
    broadcast, and a thread running the checker after each of its rounds."""

    def __init__(self, args, plane: dict, actor, checker: Checker, seconds: float) -> None:
        self.ctx = multiprocessing.get_context("spawn")
        self.args, self.endpoints = args, plane["endpoints"]
        self.deadline = time.monotonic() + seconds
        self.actor, self.checker = actor, checker
        self.step = self.ctx.Value("q", plane["last_step_id"])
        self.reports = self.ctx.Queue()
        self.checks: list[tuple[int, str | None]] = []
        self.totals: dict | None = None
        self.attacker_crashes = 0
        self._stop = threading.Event()
        self.proc = self._spawn(args.frames, seconds, args.frame_rounds)
        self._threads = [threading.Thread(target=f, daemon=True)
                         for f in (self._feed_steps, self._check_rounds)]
        for t in self._threads:
            t.start()

    def _spawn(self, frames: int, seconds: float, rounds: int):
        proc = self.ctx.Process(target=frame_storm.storm_child, daemon=True, args=(
            self.endpoints, frames, seconds, rounds, self.step, self.checker.marker,
            self.reports, self.args.seed + self.attacker_crashes))
        proc.start()
        return proc

    def _feed_steps(self) -> None:
        import ray
        while not self._stop.wait(0.2):
            try:
                plane = ray.get(self.actor.dataplane.remote(), timeout=60)
            except (ray.exceptions.RayError, TimeoutError):  # the checks report a dead engine
                continue
            self.step.value = plane["last_step_id"]

    def _check_rounds(self) -> None:
        """Checks after each round. The attacking process is a client of libzmq's, which can
        crash (a segfault in its reaper thread) under what it sends: a new one then sends the
        frames left, and the counts go on from the last round the dead one reported."""
        base = last = (0, 0)  # (sent, read) before this process; its last round's
        while True:
            try:
                report = self.reports.get(timeout=1.0)
            except queue.Empty:
                if self.proc.is_alive():
                    continue
                self.attacker_crashes += 1
                base, last = (base[0] + last[0], base[1] + last[1]), (0, 0)
                left, seconds = self.args.frames - base[0], self.deadline - time.monotonic()
                if left <= 0 or seconds <= 0:
                    self.totals = {"sent": base[0], "read": base[1], "refused": 0}
                    return
                rounds = max(1, self.args.frame_rounds * left // self.args.frames)
                self.proc = self._spawn(left, seconds, rounds)
                continue
            if report[0] == "done":
                if report[1] is not None:
                    self.totals = {k: v + (base[0] if k == "sent" else base[1] if k == "read"
                                           else 0) for k, v in report[1].items()}
                return
            _, sent, read = report
            last = (sent, read)
            self.checks.append((base[0] + sent, self.checker.problem(base[1] + read)))

    def finish(self, timeout_s: float = 600.0) -> dict:
        """Waits for the storm and its round checks, then checks once more."""
        self._threads[1].join(timeout_s)
        self._stop.set()
        self._threads[0].join(5)
        if self.totals is None:
            self.proc.kill()
            raise RuntimeError("the frame storm did not finish")
        sent, read, refused = self.totals["sent"], self.totals["read"], self.totals["refused"]
        self.checks.append((sent, self.checker.problem(read)))
        survived = 0
        for frames, problem in self.checks:
            if problem is not None:
                break
            survived = frames
        failed = [p for _, p in self.checks if p is not None]
        return {"frames_sent": sent, "frames_survived": survived, "frames_read": read,
                "frames_the_transport_refused": refused, "storm_checks": len(self.checks),
                "storm_checks_failed": len(failed), "attacker_crashes": self.attacker_crashes,
                "first_failed_check": failed[0] if failed
                else None}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--frames", type=int, default=0, help="hostile data-plane frames to send")
    ap.add_argument("--frame-rounds", type=int, default=10,
                    help="checks of the deployment during the storm")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel ranks of the deployment")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--disconnect-share", type=float, default=0.1)
    ap.add_argument("--bad-share", type=float, default=0.1)
    ap.add_argument("--max-queued-requests", type=int, default=16)
    ap.add_argument("--no-hostile", dest="hostile", action="store_false",
                    help="leave out the hostile clients (duplicate ids, 1 MiB prompts, early "
                    "disconnects, engine stops)")
    ap.add_argument("--hostile-every", type=float, default=5.0, metavar="SECONDS",
                    help="mean seconds between rounds of hostile clients")
    ap.add_argument("--stop-seconds", type=float, default=3.0,
                    help="how long each SIGSTOP of the engine lasts")
    ap.add_argument("--stop-every", type=float, default=120.0, metavar="SECONDS",
                    help="seconds between engine stops (the first at 40%% of the run, at most "
                    "25 s in)")
    ap.add_argument("--step-time-target-ms", type=float, default=100.0,
                    help="the engine's step_time_target_ms: the bound on a streaming step "
                    "that keeps chunk gaps short under a burst of prompts (0: none)")
    ap.add_argument("--server-arg", action="append", default=[])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--check", action="store_true", help="exit 1 unless nothing was lost or "
                    "leaked and every hostile frame was survived")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    from tierserve.runtime.tokenizer import load_model_tokenizer
    from tierserve.workers.model.loader import default_model_path
    tokenizer = load_model_tokenizer(default_model_path())
    prompts = build_prompts(tokenizer, 64, args.input_len, args.seed)
    private = PrivateRay(max(os.cpu_count() or 1, args.tp))
    name, proc = f"soak-{os.getpid()}", None
    args.server_arg += ["--name", name, "--namespace", NAMESPACE, "--tp", str(args.tp),
                        "--max-body-bytes", str(MIB_BODY_LIMIT),
                        "--max-connections-per-client", "8192",
                        "--step-time-target-ms", str(args.step_time_target_ms)]
    phases, t0 = {}, time.monotonic()
    try:
        proc, base, model = start_tierserve(args)
        phases["start"] = time.monotonic() - t0
        result = soak(args, prompts, proc, base, model, name, phases)
    finally:
        t0 = time.monotonic()
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        private.stop(name)
        phases["stop"] = time.monotonic() - t0
    result["phase_seconds"] = {k: round(v, 1) for k, v in phases.items()}
    emit(result, args.json)
    if args.check and not passed(result):
        sys.exit(1)


def passed(result: dict) -> bool:
    return result["lost_requests"] == 0 and result["leaked_blocks"] == 0 and \
        result.get("frames_survived", 0) == result.get("frames_sent", 0) and \
        not result.get("engine_stop_problems")


def soak(args, prompts: list[str], proc, base: str, model: str, name: str,
         phases: dict) -> dict:
    import ray
    from tierserve.deploy.ray_engine import actor_name
    actor = ray.get_actor(actor_name(name), namespace=NAMESPACE)
    engine_pid = ray.get(actor.info.remote(), timeout=60)["pid"]
    url = base + "/v1/chat/completions"
    t0 = time.monotonic()
    # Calibration: a burst the server admits whole; what it completes per second is the
    # sustainable rate.
    asyncio.run(_burst(url, model, prompts[:1], 4))  # warm-up
    t0 = time.perf_counter()
    calib = asyncio.run(_burst(url, model, prompts[:args.max_queued_requests], args.output_len))
    sustainable = sum(1 for c in calib if c[0] == "completed") / (time.perf_counter() - t0)
    phases["calibration"], t0 = time.monotonic() - t0, time.monotonic()
    seconds = args.minutes * 60
    stops = EngineStops(base, engine_pid, args.stop_seconds, args.stop_every,
                        min(25.0, 0.4 * seconds)) if args.hostile else None
    storm = None
    if args.frames:
        checker = Checker(base, model, actor, frame_storm.marker_path(),
                          stops.lock if stops is not None else None)
        plane = ray.get(actor.dataplane.remote(), timeout=60)
        storm = Storm(args, plane, actor, checker, 0.8 * seconds)
    phases["storm_setup"], t0 = time.monotonic() - t0, time.monotonic()
    rss_start = rss_mb(engine_pid), rss_mb(proc.pid)
    hostile = HostileClients(url, model, args.output_len, args.seed + 2,
                             args.hostile_every) if args.hostile else None
    results = asyncio.run(_load(args, url, model, prompts, 2 * sustainable, hostile, stops))
    phases["load"], t0 = time.monotonic() - t0, time.monotonic()
    after = drain(base)
    phases["drain"], t0 = time.monotonic() - t0, time.monotonic()
    storm_result = storm.finish() if storm is not None else {}
    phases["storm_finish"] = time.monotonic() - t0
    rss_end = rss_mb(engine_pid), rss_mb(proc.pid)
    if storm is not None:
        storm_result["dropped_frames"] = ray.get(actor.dataplane.remote(),
                                                 timeout=60)["dropped_frames"]
    result = summarize(args, sustainable, results, after, rss_start, rss_end) | \
        hostile_summary(hostile, stops, results) | storm_result
    result["lost_requests"] = result["load_lost"] + result.get("hostile_lost", 0)
    return result


async def _load(args, url: str, model: str, prompts: list[str], rate: float,
                hostile: HostileClients | None, stops: EngineStops | None) -> list:
    """The offered load, with the hostile clients and the engine stops beside it."""
    seconds = args.minutes * 60
    jobs = [offer(url, model, prompts, rate, seconds, args.output_len, args.disconnect_share,
                  args.bad_share, args.seed + 1)]
    if hostile is not None:
        until = time.monotonic() + seconds
        jobs += [hostile.run(until), stops.run(until)]
    results, *_ = await asyncio.gather(*jobs)
    return results


def hostile_summary(hostile: HostileClients | None, stops: EngineStops | None,
                    results: list) -> dict:
    """The hostile clients' outcomes (their lost ones count as lost requests), the engine
    stops, and the largest gap between two chunks of a normal stream that no stop touched."""
    gaps = [r[2][2] for r in results if r[2] is not None
            and (stops is None or not stops.overlaps(r[2][0], r[2][1]))]
    out = {"max_chunk_gap_s": round(max(gaps), 3) if gaps else None,
           "p99_chunk_gap_ms": round(float(np.percentile(gaps, 99)) * 1000, 1) if gaps
           else None}
    if hostile is None:
        return out
    counts: dict[str, dict[str, int]] = {}
    for kind, outcome in hostile.outcomes:
        counts.setdefault(kind, {}).setdefault(outcome, 0)
        counts[kind][outcome] += 1
    return out | {"hostile": counts,
                  "hostile_lost": sum(n for c in counts.values() for o, n in c.items()
                                      if o == "lost"),
                  "hostile_lost_details": hostile.lost_details,
                  "engine_stops": len(stops.windows), "stopped_health_ms": stops.health_ms,
                  "engine_stop_problems": stops.problems}


def summarize(args, sustainable: float, results: list, after: dict, rss_start: tuple,
              rss_end: tuple) -> dict:
    counts = {k: sum(1 for r in results if r[0] == k)
              for k in ("completed", "refused", "rejected", "disconnected", "lost")}
    ttfts = [r[1] for r in results if r[0] == "completed" and r[1] is not None]
    return {
        "minutes": args.minutes, "tensor_parallel_size": args.tp,
        "sustainable_req_per_s": round(sustainable, 3),
        "offered_req_per_s": round(2 * sustainable, 3), "requests": len(results),
        **{k: v for k, v in counts.items() if k != "lost"}, "lost_requests": counts["lost"],
        "load_lost": counts["lost"],
        "leaked_blocks": int(after["tierserve:kv_cache_total_blocks"]
                             - after["tierserve:kv_cache_free_blocks"]),
        "p99_ttft_admitted_ms": round(float(np.percentile(ttfts, 99)) * 1000, 1)
        if ttfts else None,
        "rss_start_mb": round(rss_start[0], 1), "rss_end_mb": round(rss_end[0], 1),
        "rss_growth": round(rss_end[0] / rss_start[0] - 1, 4),
        "http_rss_start_mb": round(rss_start[1], 1), "http_rss_end_mb": round(rss_end[1], 1),
    }

async def _burst(url, model, prompts, output_len):
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        rng = random.Random(0)
        return await asyncio.gather(*[one(client, url, model, p, "normal", output_len, rng)
                                      for p in prompts])


if __name__ == "__main__":
    main()

"""Overload soak: twice the sustainable request rate against the OpenAI server for N minutes.

It starts `tierserve api-server` (an engine of its own), measures the sustainable rate with a
short calibration burst, then offers twice that rate with Poisson arrivals of streaming chat
requests, of which a share disconnect mid-stream and a share are bad (400 expected). Every
request must end one way: completed (200 with a finish reason and `[DONE]`), refused (503 at
once: the queue is bounded), rejected (the bad ones, 400), disconnected (by the client, on
purpose); anything else is lost. After the run the engine drains, and every KV block must be
back in the pool.

    python bench/soak.py --minutes 10 [--json]

Reports completed, refused, rejected, disconnected, lost_requests, leaked_blocks,
p99_ttft_admitted_ms, and the server's RSS at start and end.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import emit  # noqa: E402
from serving import build_prompts, start_tierserve  # noqa: E402

_BAD = [{"temperature": -1}, {"n": 0}, {"top_p": 7}, {"bogus": 1},
        {"messages": [{"role": "wizard", "content": "x"}]}]


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: str, kind: str,
              output_len: int, rng: random.Random) -> tuple[str, float | None]:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": output_len, "temperature": 0.7, "stream": True, "ignore_eos": True}
    if kind == "bad":
        body |= rng.choice(_BAD)
    t0, ttft = time.perf_counter(), None
    cut = rng.randint(1, max(output_len // 2, 1)) if kind == "disconnect" else None
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code == 503:
                return "refused", None
            if r.status_code == 400:
                return ("rejected" if kind == "bad" else "lost"), None
            if r.status_code != 200:
                return "lost", None
            chunks, finished, done = 0, False, False
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                    break
                if not line.startswith("data: "):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return "lost", ttft
                for choice in chunk.get("choices", ()):
                    if choice["delta"].get("content") and ttft is None:
                        ttft = time.perf_counter() - t0
                    finished |= choice.get("finish_reason") is not None
                chunks += 1
                if cut is not None and chunks >= cut:
                    return "disconnected", ttft
            if kind == "bad":
                return "lost", ttft
            return ("completed" if finished and done else "lost"), ttft
    except httpx.HTTPError:
        return "lost", ttft


async def offer(url: str, model: str, prompts: list[str], rate: float, seconds: float,
                output_len: int, disconnect_share: float, bad_share: float,
                seed: int) -> list[tuple[str, float | None]]:
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--disconnect-share", type=float, default=0.1)
    ap.add_argument("--bad-share", type=float, default=0.1)
    ap.add_argument("--max-queued-requests", type=int, default=16)
    ap.add_argument("--server-arg", action="append", default=[])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from tierserve.runtime.engine_core import load_model_tokenizer
    from tierserve.workers.loader import default_model_path
    tokenizer = load_model_tokenizer(default_model_path())
    prompts = build_prompts(tokenizer, 64, args.input_len, args.seed)
    proc, base, model = start_tierserve(args)
    url = base + "/v1/chat/completions"
    try:
        # Calibration: a burst the server admits whole; what it completes per second is the
        # sustainable rate.
        burst = args.max_queued_requests
        asyncio.run(_burst(url, model, prompts[:1], 4))  # warm-up
        t0 = time.perf_counter()
        calib = asyncio.run(_burst(url, model, prompts[:burst], args.output_len))
        sustainable = sum(1 for c in calib if c[0] == "completed") / (time.perf_counter() - t0)
        rss_start = rss_mb(proc.pid)
        results = asyncio.run(offer(url, model, prompts, 2 * sustainable, args.minutes * 60,
                                    args.output_len, args.disconnect_share, args.bad_share,
                                    args.seed + 1))
        after = drain(base)
        rss_end = rss_mb(proc.pid)
    finally:
        proc.terminate()
        proc.wait(60)
    counts = {k: sum(1 for r in results if r[0] == k)
              for k in ("completed", "refused", "rejected", "disconnected", "lost")}
    ttfts = [r[1] for r in results if r[0] == "completed" and r[1] is not None]
    result = {
        "minutes": args.minutes, "sustainable_req_per_s": round(sustainable, 3),
        "offered_req_per_s": round(2 * sustainable, 3), "requests": len(results),
        **{k: v for k, v in counts.items() if k != "lost"}, "lost_requests": counts["lost"],
        "leaked_blocks": int(after["tierserve:kv_cache_total_blocks"]
                             - after["tierserve:kv_cache_free_blocks"]),
        "p99_ttft_admitted_ms": round(float(np.percentile(ttfts, 99)) * 1000, 1)
        if ttfts else None,
        "rss_start_mb": round(rss_start, 1), "rss_end_mb": round(rss_end, 1),
        "rss_growth": round(rss_end / rss_start - 1, 4),
    }
    emit(result, args.json)


async def _burst(url, model, prompts, output_len):
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        rng = random.Random(0)
        return await asyncio.gather(*[one(client, url, model, p, "normal", output_len, rng)
                                      for p in prompts])


if __name__ == "__main__":
    main()

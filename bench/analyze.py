"""`tierserve analyze` replay speed on synthetic logs.

1. A request log of --requests (default 1M) requests: multi-turn chats (a geometric number of
   turns, mean 4, at most 10) on 32 shared system prompts of 200-600 tokens, --active
   conversations at a time, each turn a user message of 16-160 tokens and a reply of 32-256
   (prompts average about 1,000 tokens);
   Poisson arrivals at --rate per second, each request lasting as a small engine would serve
   it. Block hashes given (our log format, no tokens). Replayed at one capacity
   (--device-blocks, no tiers, no statistics) in a fresh process, after a warm-up run:
     log_requests_per_s, log_tokens_per_s, log_seconds, log_cpu_seconds, log_peak_rss_mib
   and once more with the statistics (the seed's figures and the unbounded cache):
     log_stats_seconds, log_stats_cpu_seconds, log_stats_peak_rss_mib
2. An OpenAI JSONL text log of --text-requests (default 100k) chat requests of the same shape
   (words the tokenizer reads as one token each), tokenized on the way with --model's
   tokenizer (default: SmolLM2-135M-Instruct):
     text_requests_per_s, text_seconds, text_cpu_seconds, text_peak_rss_mib
Logs are made once under --dir and reused. Each replay runs in its own process, so its peak
RSS is its own; *_cpu_seconds is the process's CPU time (the replay is one thread; the
tokenizer uses more), the figure to read on a loaded machine. Prints the CPU model.

Usage: python bench/analyze.py [--json] [--requests N] [--text-requests N] [--skip-text]
       [--skip-stats] [--skip-warmup]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time

import numpy as np

from report import emit
from tierserve.runtime.request_log import (
    LOG_VERSION, MAGIC, LogHeader, RequestRecord, write_log,
)

BS = 16
SYSTEM_PROMPTS = 32


class Chats:
    """The workload: conversations as (prompt, reply) lengths and their block chains."""

    def __init__(self, seed: int, active: int) -> None:
        self.rng = random.Random(seed)
        self.np = np.random.default_rng(seed)
        self.systems = [self.rng.randrange(200, 600) for _ in range(SYSTEM_PROMPTS)]
        self.system_chains = [self._fresh(n // BS) for n in self.systems]
        self.active = [self._start() for _ in range(active)]

    def _fresh(self, n: int) -> np.ndarray:
        return self.np.integers(1, 2**63, size=n, dtype=np.uint64)

    def _start(self) -> dict:
        s = self.rng.randrange(SYSTEM_PROMPTS)
        return {"system": s, "tokens": self.systems[s], "chain": self.system_chains[s],
                "turns_left": min(int(self.np.geometric(0.25)), 10), "turn": 0, "id": 0}

    def next(self) -> tuple[int, dict, int, int, np.ndarray]:
        """(conversation slot, conversation, prompt length, reply length, chain of every full
        block of prompt + reply)."""
        slot = self.rng.randrange(len(self.active))
        conv = self.active[slot]
        user, reply = self.rng.randrange(16, 161), self.rng.randrange(32, 257)
        prompt = conv["tokens"] + user
        total = prompt + reply
        chain = conv["chain"]
        chain = np.concatenate([chain, self._fresh(total // BS - len(chain))])
        conv.update(tokens=total, chain=chain, turn=conv["turn"] + 1)
        conv["turns_left"] -= 1
        if conv["turns_left"] <= 0:
            self.active[slot] = self._start()
        return slot, conv, prompt, reply, chain


def make_hash_log(path: str, n: int, rate: float, active: int) -> None:
    chats = Chats(0, active)
    header = LogHeader(MAGIC, LOG_VERSION, BS, model="synthetic", created=time.time())

    def records():
        t = 0.0
        for _ in range(n):
            t += chats.np.exponential(1.0 / rate)
            _, _, prompt, reply, chain = chats.next()
            ttft = 0.05 + prompt / 20000
            yield RequestRecord(t, prompt, reply, chain.tobytes(), ttft=ttft,
                                e2e=ttft + reply / 50)

    write_log(path, header, records())


def single_token_words(model: str) -> list[str]:
    """Words the model's tokenizer reads as one token each (after a space)."""
    from tierserve.runtime.tokenizer import load_tokenizer
    vocab = load_tokenizer(model)._backend.get_vocab()
    words = sorted((i, t[1:]) for t, i in vocab.items()
                   if t.startswith("\u0120") and t[1:].isalpha() and len(t) > 3)
    return [w for _, w in words[:4000]]


def make_text_log(path: str, n: int, active: int, words: list[str]) -> None:
    """OpenAI chat bodies: a system prompt and the turns so far, one word per token."""
    chats = Chats(1, active)
    rng = random.Random(1)
    systems = [" ".join(rng.choices(words, k=k)) for k in chats.systems]
    texts: dict[int, list[dict]] = {}
    with open(path, "w") as f:
        for _ in range(n):
            slot, conv, _, reply, _ = chats.next()
            if conv["turn"] == 1:
                texts[slot] = [{"role": "system", "content": systems[conv["system"]]}]
            messages = texts[slot]
            messages.append({"role": "user", "content": " ".join(
                rng.choices(words, k=rng.randrange(16, 161)))})
            f.write(json.dumps({"messages": messages, "max_tokens": reply}) + "\n")
            messages.append({"role": "assistant", "content": " ".join(
                rng.choices(words, k=reply))})


def replay(args) -> None:
    """The child: one analysis, its time and peak RSS as JSON."""
    from tierserve.runtime.analyze import analyze
    t0 = time.perf_counter()
    out = analyze([args.replay], device_blocks=[args.device_blocks], model=args.model,
                  statistics=args.stats)
    seconds = time.perf_counter() - t0
    r = out["replays"][0]
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"seconds": seconds, "cpu_seconds": usage.ru_utime + usage.ru_stime,
                      "requests": r["requests"], "prompt_tokens": r["prompt_tokens"],
                      "hit_rate": r["hit_rate"], "peak_rss_mib": usage.ru_maxrss / 1024}))


def child(path: str, args, *extra: str) -> dict:
    cmd = [sys.executable, __file__, "--replay", path, "--device-blocks",
           str(args.device_blocks), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json", action="store_true")
    p.add_argument("--requests", type=int, default=1_000_000)
    p.add_argument("--text-requests", type=int, default=100_000)
    p.add_argument("--skip-text", action="store_true")
    p.add_argument("--skip-stats", action="store_true")
    p.add_argument("--skip-warmup", action="store_true")
    p.add_argument("--rate", type=float, default=20.0)
    p.add_argument("--active", type=int, default=256)
    p.add_argument("--device-blocks", type=int, default=16384)
    p.add_argument("--model", default=None)
    p.add_argument("--dir", default="/tmp/tierserve-bench-analyze")
    p.add_argument("--replay", default=None, help=argparse.SUPPRESS)
    p.add_argument("--stats", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.replay:
        return replay(args)
    os.makedirs(args.dir, exist_ok=True)
    result = {"cpu": cpu_name()}
    log = os.path.join(args.dir, f"chats-{args.requests}.tslog")
    if not os.path.exists(log):
        make_hash_log(log + ".tmp", args.requests, args.rate, args.active)
        os.replace(log + ".tmp", log)
    if not args.skip_warmup:
        child(log, args)  # warm-up: imports and the page cache
    r = child(log, args)
    result.update(log_requests=r["requests"], log_requests_per_s=r["requests"] / r["seconds"],
                  log_tokens_per_s=r["prompt_tokens"] / r["seconds"], log_seconds=r["seconds"],
                  log_cpu_seconds=r["cpu_seconds"], log_peak_rss_mib=r["peak_rss_mib"],
                  log_hit_rate=r["hit_rate"])
    if not args.skip_stats:
        s = child(log, args, "--stats")
        result.update(log_stats_seconds=s["seconds"], log_stats_cpu_seconds=s["cpu_seconds"],
                      log_stats_peak_rss_mib=s["peak_rss_mib"])
    if not args.skip_text:
        from tierserve.workers.model.loader import default_model_path
        model = args.model or default_model_path()
        text = os.path.join(args.dir, f"chats-{args.text_requests}.jsonl")
        if not os.path.exists(text):
            make_text_log(text + ".tmp", args.text_requests, args.active,
                          single_token_words(model))
            os.replace(text + ".tmp", text)
        t = child(text, args, "--model", model)
        result.update(text_requests=t["requests"],
                      text_requests_per_s=t["requests"] / t["seconds"],
                      text_seconds=t["seconds"], text_cpu_seconds=t["cpu_seconds"],
                      text_peak_rss_mib=t["peak_rss_mib"])
    emit(result, args.json)


if __name__ == "__main__":
    main()

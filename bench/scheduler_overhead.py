"""Scheduler overhead: the EngineCore's CPU work per step, with no model.

256 running decode requests share a 512-token prefix; in the second phase two requests arrive
every step (same prefix, their own suffix, a few output tokens each). Reported:
  step_us                    schedule() + update_from_output(), mean over the arrival phase
  step_us_decode_only        the same with no arrivals
  bytes_per_decode_request   encoded SchedulerOutput bytes / running decode requests
  codec_us                   encode + decode of that SchedulerOutput
  xxhash_ns_per_token, sha256_ns_per_token   block-hash chain cost over a 512-token prompt
  step_us_log_off, step_us_log_on            median step of the arrival phase without and with the
                                             request log (request_log_path), alternated in rounds

Usage: python bench/scheduler_overhead.py [--json] [--steps N]
"""
from __future__ import annotations

import argparse
import itertools
import os
import random
import shutil
import statistics
import tempfile
import time

from report import emit
from tierserve.kvcache import BlockHasher, KVCacheManager
from tierserve.runtime.request_log import LOG_VERSION, MAGIC, LogHeader, RequestLog
from tierserve.scheduler import ModelRunnerOutput, SamplingParams, Scheduler, WorkerChannelCodec

BLOCK_SIZE = 16
PREFIX = [random.Random(0).randrange(1, 49000) for _ in range(512)]
_ARRIVALS = itertools.count(10**6)  # ids of arriving requests, unique across phases


def build(num_running: int) -> Scheduler:
    kv = KVCacheManager(num_blocks=16384, block_size=BLOCK_SIZE)
    sched = Scheduler(kv, BlockHasher(BLOCK_SIZE), max_num_seqs=1024,
                      max_num_batched_tokens=8192, max_model_len=4096, vocab_size=49152)
    params = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    for i in range(num_running):
        sched.add_request(str(i), PREFIX + [i % 49000 + 1] * 16, params)
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.requests.values()) or (
            sched.waiting):
        _step(sched)
    return sched


def _step(sched: Scheduler, codec: WorkerChannelCodec | None = None):
    out = sched.schedule()
    sampled = [7] * len(out.num_scheduled_tokens)
    sched.update_from_output(out, ModelRunnerOutput(out.step_id, sampled))
    return out


def measure_steps(sched: Scheduler, steps: int, arrivals: int) -> list[float]:
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    times = []
    for _ in range(steps):
        for _ in range(arrivals):
            next_id = next(_ARRIVALS)
            sched.add_request(str(next_id), PREFIX + [next_id % 49000 + 1] * 24, params)
        t0 = time.perf_counter()
        _step(sched)
        times.append(time.perf_counter() - t0)
    return times


def measure_request_log(sched: Scheduler, steps: int, rounds: int = 6) -> tuple[float, float]:
    """Median step time of the arrival phase without and with the request log (its writer
    thread appending to a file), alternated in rounds so that drift hits both alike."""
    folder = tempfile.mkdtemp(prefix="tierserve-bench-log-")
    log = RequestLog(os.path.join(folder, "requests.tslog"),
                     LogHeader(MAGIC, LOG_VERSION, BLOCK_SIZE))
    off, on = [], []
    try:
        for _ in range(rounds):
            sched.on_finish = None
            off += measure_steps(sched, steps // (2 * rounds), arrivals=2)
            sched.on_finish = log.add
            on += measure_steps(sched, steps // (2 * rounds), arrivals=2)
    finally:
        sched.on_finish = None
        log.close()
        shutil.rmtree(folder, ignore_errors=True)
    assert log.num_written > 0
    return statistics.median(off) * 1e6, statistics.median(on) * 1e6


def measure_codec(sched: Scheduler, num_running: int) -> tuple[float, float]:
    codec = WorkerChannelCodec()
    out = sched.schedule()
    assert len(out.scheduled_cached_reqs.req_ids) == num_running and not out.scheduled_new_reqs
    frame = codec.encode(out)
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        codec.decode(codec.encode(out))
    codec_us = (time.perf_counter() - t0) / n * 1e6
    sched.update_from_output(out, ModelRunnerOutput(out.step_id, [7] * num_running))
    return len(frame) / num_running, codec_us


def hash_ns_per_token(algorithm: str) -> float:
    hasher = BlockHasher(BLOCK_SIZE, algorithm)
    tokens = PREFIX
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        hasher.hash_blocks(tokens, 0, None)
    return (time.perf_counter() - t0) / n / len(tokens) * 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--running", type=int, default=256)
    args = ap.parse_args()
    sched = build(args.running)
    bytes_per_req, codec_us = measure_codec(sched, args.running)
    decode_only = measure_steps(sched, args.steps, arrivals=0)
    with_arrivals = measure_steps(sched, args.steps, arrivals=2)
    log_off, log_on = measure_request_log(sched, args.steps)
    sched.check_integrity()
    result = {
        "running_requests": args.running,
        "step_us": statistics.mean(with_arrivals) * 1e6,
        "step_us_p50": statistics.median(with_arrivals) * 1e6,
        "step_us_decode_only": statistics.mean(decode_only) * 1e6,
        "bytes_per_decode_request": bytes_per_req,
        "codec_us": codec_us,
        "xxhash_ns_per_token": hash_ns_per_token("xxhash"),
        "sha256_ns_per_token": hash_ns_per_token("sha256"),
        "step_us_log_off": log_off,
        "step_us_log_on": log_on,
        "prefix_cache_hit_rate": sched.stats()["prefix_cache_hit_rate"],
    }
    emit(result, args.json)


if __name__ == "__main__":
    main()

"""Scheduler overhead: the EngineCore's CPU work per step, with no model.

256 running decode requests share a 512-token prefix; in the second phase two requests arrive
every step (same prefix, their own suffix, a few output tokens each). Reported:
  step_us                    schedule() + update_from_output(), mean over the arrival phase
  step_us_decode_only        the same with no arrivals
  bytes_per_decode_request   encoded SchedulerOutput bytes / running decode requests
  codec_us                   encode + decode of that SchedulerOutput
  xxhash_ns_per_token, sha256_ns_per_token   block-hash chain cost over a 512-token prompt

Usage: python bench/scheduler_overhead.py [--json] [--steps N]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from report import emit
from tierserve.kvcache import BlockHasher, KVCacheManager
from tierserve.scheduler import ModelRunnerOutput, SamplingParams, Scheduler, WorkerChannelCodec

BLOCK_SIZE = 16
PREFIX = [random.Random(0).randrange(1, 49000) for _ in range(512)]


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
    next_id = 10**6
    times = []
    for _ in range(steps):
        for _ in range(arrivals):
            sched.add_request(str(next_id), PREFIX + [next_id % 49000 + 1] * 24, params)
            next_id += 1
        t0 = time.perf_counter()
        _step(sched)
        times.append(time.perf_counter() - t0)
    return times


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
        "prefix_cache_hit_rate": sched.stats()["prefix_cache_hit_rate"],
    }
    emit(result, args.json)


if __name__ == "__main__":
    main()

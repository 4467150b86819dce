"""Scheduler overhead: the EngineCore's CPU work per step, with no model.

256 running decode requests share a 512-token prefix; in the second phase two requests arrive
every step (same prefix, their own suffix, a few output tokens each). Reported:
  step_us                    schedule() + update_from_output(), mean over the arrival phase
  step_us_decode_only        the same with no arrivals
  bytes_per_decode_request   encoded SchedulerOutput bytes / running decode requests
  codec_us                   encode + decode of that SchedulerOutput
  xxhash_ns_per_token, sha256_ns_per_token   block-hash chain cost over a 512-token prompt
Tiers on vs off: the same arrival phase on two schedulers, one of them with a CPU tier of 64 GiB
worth of slots for the default model's blocks (SmolLM2-135M, fp32, TP=1: 93,206 slots), steps
alternating between the two so that load on the machine hits both alike; the pool is a quarter
the size, so that cached blocks are evicted (and, with tiers, demoted) every step:
  step_us_tiers_off, step_us_tiers_on   median step, each
  tiers_on_over_off                     their ratio (target: <= 1.1)
  tier_demotions, tier_promotions       what the tiered scheduler copied
Request log on vs off: the arrival phase on a fresh scheduler, steps alternating between the
request log on (request_log_path: finished requests handed to its writer thread, which encodes
and appends them to a file meanwhile) and off:
  step_us_log_off, step_us_log_on       median step, each

Usage: python bench/scheduler_overhead.py [--json] [--steps N] [--tier-steps N]
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
from tierserve.kvcache import BlockHasher, KVCacheManager, TierIndex, TierPolicy
from tierserve.runtime.request_log import LOG_VERSION, MAGIC, LogHeader, RequestLog
from tierserve.scheduler import ModelRunnerOutput, SamplingParams, Scheduler, WorkerChannelCodec

BLOCK_SIZE = 16
PREFIX = [random.Random(0).randrange(1, 49000) for _ in range(512)]
# One block of SmolLM2-135M-Instruct on one rank: K and V, 30 layers, 3 KV heads of 64, fp32.
DEFAULT_MODEL_BLOCK_BYTES = 2 * 30 * BLOCK_SIZE * 3 * 64 * 4
CPU_TIER_BYTES = 64 << 30
# Per scheduler: the id of its next arrival.
_arrival_ids: dict[int, itertools.count] = {}


def build(num_running: int, cpu_slots: int = 0, num_blocks: int = 16384) -> Scheduler:
    tiers = TierPolicy(TierIndex(cpu_slots), block_size=BLOCK_SIZE) if cpu_slots else None
    kv = KVCacheManager(num_blocks=num_blocks, block_size=BLOCK_SIZE, tiers=tiers)
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
            next_id = next(_arrival_ids.setdefault(id(sched), itertools.count(10**6)))
            sched.add_request(str(next_id), PREFIX + [next_id % 49000 + 1] * 24, params)
        t0 = time.perf_counter()
        _step(sched)
        times.append(time.perf_counter() - t0)
    return times


def measure_tiers(num_running: int, steps: int) -> dict:
    """Median step time with and without a 64 GiB CPU tier, steps alternating."""
    slots = CPU_TIER_BYTES // DEFAULT_MODEL_BLOCK_BYTES
    off, on = build(num_running, num_blocks=4096), build(num_running, slots, num_blocks=4096)
    times: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(steps):
        for name, sched in (("off", off), ("on", on)):
            times[name] += measure_steps(sched, 1, arrivals=2)
    on.check_integrity()
    stats = on.stats()
    result = {"cpu_tier_slots": slots,
              "step_us_tiers_off": statistics.median(times["off"]) * 1e6,
              "step_us_tiers_on": statistics.median(times["on"]) * 1e6}
    result["tiers_on_over_off"] = result["step_us_tiers_on"] / result["step_us_tiers_off"]
    result["tier_demotions"] = stats["tier_demotions"]
    result["tier_promotions"] = stats["tier_promotions"]
    return result


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


def measure_request_log(num_running: int, steps: int) -> dict:
    """Median step time with and without the request log, steps alternating."""
    sched = build(num_running)
    folder = tempfile.mkdtemp(prefix="tierserve-bench-log-")
    log = RequestLog(os.path.join(folder, "requests.tslog"),
                     LogHeader(MAGIC, LOG_VERSION, BLOCK_SIZE))
    times: dict[str, list[float]] = {"off": [], "on": []}
    try:
        for _ in range(steps):
            for name, hook in (("off", None), ("on", log.add)):
                sched.on_finish = hook
                times[name] += measure_steps(sched, 1, arrivals=2)
    finally:
        sched.on_finish = None
        log.close()
        shutil.rmtree(folder, ignore_errors=True)
    assert log.num_written > 0
    return {"step_us_log_off": statistics.median(times["off"]) * 1e6,
            "step_us_log_on": statistics.median(times["on"]) * 1e6,
            "requests_logged": log.num_written}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--tier-steps", type=int, default=300)
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
    result.update(measure_tiers(args.running, args.tier_steps))
    result.update(measure_request_log(args.running, args.tier_steps))
    emit(result, args.json)


if __name__ == "__main__":
    main()

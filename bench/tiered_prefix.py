"""KV tiers on the default SmolLM2-135M-Instruct GGUF, fp32: where a cached prefix lives, and
what that does to TTFT; then a multi-turn chat workload bigger than the device pool.

TTFT of a 2,048-token prompt whose first 1,984 tokens are (best of --repeats):
  ttft_recompute_ms  not cached anywhere
  ttft_device_ms     in the device pool
  ttft_cpu_ms        only in the CPU tier (other prompts pushed it out of the pool)
  ttft_ssd_ms        only on SSD (pushed out of the CPU tier too)
  ttft_restart_ms    on SSD, in an engine started after the first one shut down
  ttft_shared_ms     on SSD, written there by another engine (alive, on the same folder)
  ttft_cross_tp_ms   on SSD, written by an engine of TP=3 (on Ray), read by one of TP=1
Each measurement asks for the shared prefix with a suffix not seen before, so only the prefix
can hit. shared_over_recompute and cross_tp_over_recompute: target <= 1/3. fingerprint_cold_s
and fingerprint_cached_s: the KV fingerprint of the default model (its weights' bytes hashed),
first time and from the cache.

Multi-turn chat: --conversations conversations x --turns turns, each sharing a system prompt,
each turn a user message of ~64 tokens and a greedy reply of --reply tokens; --concurrency
conversations at a time, turn-major (every conversation's turn k before any turn k+1), so a
conversation's history is pushed out of the pool between its turns: the KV working set is
several times the pool (`multiturn_working_set_blocks` against `pool_blocks`). Mean TTFT and
output tok/s with the tiers off, with a CPU tier, and with a small CPU tier over SSD:
multiturn_ttft_{off,cpu,ssd}_ms, multiturn_tok_s_{off,cpu,ssd}.

Usage: python bench/tiered_prefix.py [--json] [--pool-blocks 256] [--skip-multiturn]
       [--skip-cross-tp]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import tempfile
import time

os.environ.setdefault("TIERSERVE_CPU_KERNELS", "sync")

from report import emit  # noqa: E402
from tierserve import LLM, AsyncLLM, SamplingParams  # noqa: E402

PROMPT, PREFIX = 2048, 1984
ONE = SamplingParams(temperature=0, max_tokens=1)
BLOCK_BYTES = 2 * 30 * 16 * 3 * 64 * 4  # SmolLM2-135M fp32, block_size 16, TP=1


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def _ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = llm.generate([prompt], ONE, use_tqdm=False)[0]
    return (time.perf_counter() - t0) * 1e3, out.num_cached_tokens


def _push_out(llm: LLM, rng: random.Random, blocks: int) -> None:
    """Prompts of unrelated tokens covering `blocks` blocks: what was cached goes down a tier."""
    prompts = [_tokens(rng, 1024) for _ in range(-(-blocks * 16 // 1024))]
    for i in range(0, len(prompts), 2):
        llm.generate(prompts[i:i + 2], ONE, use_tqdm=False)


def bench_ttft(pool_blocks: int, repeats: int, ssd_dir: str) -> dict:
    rng = random.Random(0)
    prefix = _tokens(rng, PREFIX)
    fresh = lambda: prefix + _tokens(rng, PROMPT - PREFIX)  # noqa: E731
    tiers = dict(num_kv_blocks=pool_blocks + 1, kv_offload_cpu_bytes=pool_blocks * BLOCK_BYTES,
                 kv_offload_ssd_path=ssd_dir, kv_offload_ssd_bytes=8 * pool_blocks * BLOCK_BYTES)
    result: dict[str, float] = {}
    with LLM(**tiers) as llm:
        llm.generate([_tokens(rng, 64)], ONE, use_tqdm=False)  # warm-up
        cold = [_ttft(llm, _tokens(rng, PROMPT)) for _ in range(repeats)]
        result["ttft_recompute_ms"] = min(t for t, _ in cold)
        rows = {"device": [], "cpu": [], "ssd": []}
        for _ in range(repeats):
            llm.reset_prefix_cache()
            _ttft(llm, prefix + _tokens(rng, PROMPT - PREFIX))  # the prefix, computed
            rows["device"].append(_ttft(llm, fresh()))
            _push_out(llm, rng, pool_blocks)  # out of the pool: into the CPU tier
            rows["cpu"].append(_ttft(llm, fresh()))
            _push_out(llm, rng, pool_blocks)
            _push_out(llm, rng, pool_blocks)  # out of the CPU tier: only on SSD
            rows["ssd"].append(_ttft(llm, fresh()))
        for where, runs in rows.items():
            result[f"ttft_{where}_ms"] = min(t for t, _ in runs)
            result[f"cached_tokens_{where}"] = min(c for _, c in runs)
        stats = llm.stats()
        result["tier_checksum_failures"] = stats["tier_checksum_failures"]
    # The engine wrote its cached blocks to SSD as it shut down; a new one starts on them.
    t0 = time.perf_counter()
    with LLM(**tiers) as llm:
        result["restart_start_s"] = time.perf_counter() - t0
        result["ttft_restart_ms"], result["cached_tokens_restart"] = _ttft(llm, fresh())
        result["restart_found_blocks"] = llm.stats()["tier_ssd_found_blocks"]
    result["recompute_over_cpu"] = result["ttft_recompute_ms"] / result["ttft_cpu_ms"]
    result["recompute_over_ssd"] = result["ttft_recompute_ms"] / result["ttft_ssd_ms"]
    result["recompute_over_restart"] = result["ttft_recompute_ms"] / result["ttft_restart_ms"]
    return result


def _tiers(pool_blocks: int, ssd_dir: str) -> dict:
    return dict(num_kv_blocks=pool_blocks + 1, kv_offload_cpu_bytes=pool_blocks * BLOCK_BYTES,
                kv_offload_ssd_path=ssd_dir, kv_offload_ssd_bytes=8 * pool_blocks * BLOCK_BYTES)


def bench_shared(pool_blocks: int, repeats: int, ssd_dir: str) -> dict:
    """TTFT of prefixes one engine computed and wrote to the folder, asked of another engine
    on it while the first one still runs."""
    rng = random.Random(1)
    prefixes = [_tokens(rng, PREFIX) for _ in range(repeats)]
    with LLM(**_tiers(pool_blocks, ssd_dir)) as writer:
        for prefix in prefixes:
            writer.generate([prefix + _tokens(rng, PROMPT - PREFIX)], ONE, use_tqdm=False)
        _push_out(writer, rng, pool_blocks)  # out of the pool, into the CPU tier
        # What an engine's own loop does between requests (AsyncLLM, every engine on Ray):
        # step until the CPU tier is written through to the folder. LLM steps only in generate.
        while writer.engine.has_work():
            writer.engine.step()
        with LLM(**_tiers(pool_blocks, ssd_dir)) as reader:
            reader.generate([_tokens(rng, 64)], ONE, use_tqdm=False)  # warm-up
            runs = [_ttft(reader, p + _tokens(rng, PROMPT - PREFIX)) for p in prefixes]
            found = reader.stats()["tier_ssd_found_blocks"]
    return {"ttft_shared_ms": min(t for t, _ in runs),
            "cached_tokens_shared": min(c for _, c in runs), "shared_found_blocks": found}


def bench_cross_tp(pool_blocks: int, repeats: int, ssd_dir: str) -> dict:
    """TTFT of prefixes an engine of TP=3 (on Ray) computed and wrote, asked of one of TP=1."""
    import ray
    if not ray.is_initialized():
        ray.init(num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False,
                 log_to_driver=False)
    rng = random.Random(2)
    prefixes = [_tokens(rng, PREFIX) for _ in range(repeats)]
    tp3 = dict(_tiers(pool_blocks, ssd_dir), tensor_parallel_size=3, cpus_per_worker=1)
    with LLM(**tp3) as writer:
        for prefix in prefixes:
            writer.generate([prefix + _tokens(rng, PROMPT - PREFIX)], ONE, use_tqdm=False)
    # Its shutdown wrote every cached block to the folder, one entry per rank (head range).
    with LLM(**_tiers(pool_blocks, ssd_dir)) as reader:
        reader.generate([_tokens(rng, 64)], ONE, use_tqdm=False)  # warm-up
        runs = [_ttft(reader, p + _tokens(rng, PROMPT - PREFIX)) for p in prefixes]
        stats = reader.stats()
    return {"ttft_cross_tp_ms": min(t for t, _ in runs),
            "cached_tokens_cross_tp": min(c for _, c in runs),
            "cross_tp_found_blocks": stats["tier_ssd_found_blocks"],
            "cross_tp_checksum_failures": stats["tier_checksum_failures"]}


def bench_fingerprint() -> dict:
    from tierserve.workers.kv_fingerprint import kv_fingerprint
    from tierserve.workers.model.loader import default_model_path, load_model_config
    path = default_model_path()
    config = load_model_config(path)
    with tempfile.TemporaryDirectory() as cache:
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            kv_fingerprint(path, config, dtype="float32", block_size=16, hash_id="xxhash:0",
                           cache_dir=cache)
            times.append(time.perf_counter() - t0)
    return {"fingerprint_cold_s": times[0], "fingerprint_cached_s": times[1],
            "model_bytes": os.path.getsize(path)}


def _conversations(n: int, seed: int = 1) -> tuple[str, list[list[str]]]:
    rng = random.Random(seed)
    words = ("the model serves requests with a paged cache of keys and values so that many "
             "sequences share memory while the scheduler keeps one token budget").split()
    system = "You are a careful assistant. " + " ".join(rng.choice(words) for _ in range(200))
    turns = [[" ".join(rng.choice(words) for _ in range(48)) for _ in range(8)]
             for _ in range(n)]
    return system, turns


async def _multiturn(llm: AsyncLLM, system: str, users: list[list[str]], turns: int,
                     reply: int, concurrency: int) -> tuple[list[float], int, float, list]:
    histories = [[{"role": "system", "content": system}] for _ in users]
    params = SamplingParams(temperature=0, max_tokens=reply, ignore_eos=True)
    ttfts: list[float] = []
    produced = 0
    gate = asyncio.Semaphore(concurrency)

    async def one(c: int, k: int) -> None:
        nonlocal produced
        async with gate:
            histories[c].append({"role": "user", "content": users[c][k]})
            t0, first, text = time.perf_counter(), None, ""
            async for delta in llm.generate(histories[c], params):
                if first is None and delta.outputs[0].token_ids:
                    first = time.perf_counter() - t0
                text += delta.outputs[0].text
                produced += len(delta.outputs[0].token_ids)
            ttfts.append(first * 1e3)
            histories[c].append({"role": "assistant", "content": text})

    t0 = time.perf_counter()
    for k in range(turns):  # turn-major: every conversation's turn k, then turn k + 1
        await asyncio.gather(*[one(c, k) for c in range(len(users))])
    return ttfts, produced, time.perf_counter() - t0, histories


def bench_multiturn(pool_blocks: int, conversations: int, turns: int, reply: int,
                    concurrency: int, ssd_dir: str) -> dict:
    configs = {
        "off": {},
        "cpu": dict(kv_offload_cpu_bytes=8 * pool_blocks * BLOCK_BYTES),
        "ssd": dict(kv_offload_cpu_bytes=pool_blocks * BLOCK_BYTES, kv_offload_ssd_path=ssd_dir,
                    kv_offload_ssd_bytes=16 * pool_blocks * BLOCK_BYTES),
    }
    result: dict[str, float] = {}
    for name, tiers in configs.items():
        shutil.rmtree(ssd_dir, ignore_errors=True)
        llm = AsyncLLM(num_kv_blocks=pool_blocks + 1, max_num_seqs=concurrency, **tiers)
        try:
            system, users = _conversations(conversations)
            ttfts, produced, seconds, histories = asyncio.run(
                _multiturn(llm, system, users, turns, reply, concurrency))
            stats = llm.stats()
            lengths = [len(llm.tokenizer.apply_chat_template(h)) for h in histories]
            shared = len(llm.tokenizer.apply_chat_template(histories[0][:1]))
        finally:
            llm.shutdown()
        result[f"multiturn_ttft_{name}_ms"] = sum(ttfts) / len(ttfts)
        result[f"multiturn_tok_s_{name}"] = produced / seconds
        result[f"multiturn_hit_rate_{name}"] = stats["prefix_cache_hit_rate"]
        if name == "ssd":
            result["multiturn_ssd_loads"] = stats["tier_loads"]
            result["multiturn_ssd_spills"] = stats["tier_spills"]
    # Every conversation's final context, the shared system prompt counted once.
    result["multiturn_working_set_blocks"] = (sum(lengths) - (len(lengths) - 1) * shared) // 16
    result["multiturn_off_over_ssd"] = (result["multiturn_ttft_off_ms"]
                                        / result["multiturn_ttft_ssd_ms"])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--pool-blocks", type=int, default=256,
                    help="device pool blocks (16 tokens each)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--reply", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--skip-multiturn", action="store_true")
    ap.add_argument("--skip-ttft", action="store_true")
    ap.add_argument("--skip-cross-tp", action="store_true", help="no TP=3 engine (Ray)")
    ap.add_argument("--ssd-dir", default=None, help="default: a temporary folder")
    args = ap.parse_args()
    ssd_dir = args.ssd_dir or tempfile.mkdtemp(prefix="tierserve-ssd-")
    result: dict = {"pool_blocks": args.pool_blocks}
    try:
        if not args.skip_ttft:
            result.update(bench_fingerprint())
            result.update(bench_ttft(args.pool_blocks, args.repeats,
                                     os.path.join(ssd_dir, "ttft")))
            result.update(bench_shared(args.pool_blocks, args.repeats,
                                       os.path.join(ssd_dir, "shared")))
            if not args.skip_cross_tp:
                result.update(bench_cross_tp(args.pool_blocks, args.repeats,
                                             os.path.join(ssd_dir, "cross_tp")))
            recompute = result["ttft_recompute_ms"]
            for key in ("shared", "cross_tp"):
                if f"ttft_{key}_ms" in result:
                    result[f"{key}_over_recompute"] = result[f"ttft_{key}_ms"] / recompute
        if not args.skip_multiturn:
            result.update(bench_multiturn(args.pool_blocks, args.conversations, args.turns,
                                          args.reply, args.concurrency,
                                          os.path.join(ssd_dir, "multiturn")))
    finally:
        if args.ssd_dir is None:
            shutil.rmtree(ssd_dir, ignore_errors=True)
    emit(result, args.json)


if __name__ == "__main__":
    main()

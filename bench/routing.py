"""Routing policies of a replicated deployment against one big engine, on the default model.

Two replicas (TP=1, --cpus-per-replica CPUs each) of SmolLM2-135M-Instruct behind one router,
fp32, a device pool (--pool-blocks) and a CPU tier (--cpu-blocks) per replica. Every
policy runs the same workloads on the same replicas, caches emptied between runs:

  chat      --sessions multi-turn conversations sharing a --system-tokens system prompt; each
            turn adds a --user-tokens user message to the history and waits for a greedy
            reply of --reply-tokens (EOS ignored; 64 and 192 by default: a chat reply is
            usually several times the message that asked for it), after an exponential
            think time (--think-s). The KV working set (every conversation's history)
            exceeds one replica's pool and fits the cluster's tiers (`working_set_blocks`
            in the JSON).
  mooncake  a trace in Mooncake's FAST'25 JSONL format (timestamp ms, input_length,
            output_length, hash_ids: one id per 512 tokens), replayed at its arrival times
            (x --time-scale): each hash id stands for the same synthetic tokens wherever it
            appears, a block of --mooncake-block tokens (512 scaled down to the model's
            context). --mooncake-trace reads a file; without one, a synthetic trace in that
            format is generated, shaped like the published conversation trace: every request
            opens with the same id (a system prompt), new sessions' lengths are heavy-tailed,
            and later turns extend their session's ids.

Per policy (round_robin, least_loaded, prefix_tree: the approximate tree of past prompts that
SGLang's and Ray Serve's routers keep, kv: the exact KV-event index): prefix hit rate (cached
prompt tokens / prompt tokens), mean and p90 TTFT, output tok/s, requests shed (refused
overloaded), and the router's time per request: wall (`route_us`) and its thread's CPU time
(`route_cpu_us`, what routing costs whatever else shares the cores). `bound`: one engine with
the cluster's total cache (twice the pool and tier) and all its CPUs, the same workload.

`route_us_at_100k_blocks` times the kv policy alone on the chat workload's prompts with the
index holding 100,000 blocks over two replicas (the router's code, in this process).
`router`: requests one router actor routes per second with 64 route calls in flight, and one
call's round trip (no token passes through the router: this bounds the deployment's request
rate, not its token rate).

Usage: python bench/routing.py [--json] [--quick] [--policies kv,round_robin]
       [--workloads chat,mooncake]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import tempfile
import time

os.environ.setdefault("TIERSERVE_CPU_KERNELS", "sync")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from report import print_table  # noqa: E402

POLICIES = ("round_robin", "least_loaded", "prefix_tree", "kv")
BLOCK_SIZE = 16
# SmolLM2-135M fp32, block_size 16, TP=1: 30 layers x K and V x 3 KV heads x 64 x 4 bytes.
BLOCK_BYTES = 2 * 30 * 16 * 3 * 64 * 4


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


# ---------------------------------------------------------------------------- workloads

def chat_workload(args) -> list[dict]:
    """Sessions: each a start time and its turns' user messages (token ids)."""
    rng = random.Random(1)
    system = _tokens(rng, args.system_tokens)
    sessions, start = [], 0.0
    for _ in range(args.sessions):
        start += rng.expovariate(1.0 / args.session_gap_s)
        sessions.append({"start": start, "system": system,
                         "turns": [_tokens(rng, args.user_tokens) for _ in range(args.turns)]})
    return sessions


def synthetic_mooncake(args) -> list[dict]:
    """A trace in Mooncake's JSONL format, shaped like its published conversation trace: every
    request opens with hash id 0 (the service's system prompt); a session's first request adds
    a heavy-tailed number of new ids (lognormal: most a few, some near the context), each later
    one repeats the session's ids so far and adds 1-2 (the last reply and a new message)."""
    rng = random.Random(2)
    room = args.max_model_len - 2 * args.mooncake_output_tokens
    max_ids = room // args.mooncake_block - 1 - 2 * args.mooncake_turns
    rows, next_id, t = [], 1, 0.0
    for _ in range(args.mooncake_sessions):
        first = min(max_ids, max(1, round(rng.lognormvariate(math.log(4), 0.9))))
        ids, at = [0], t
        for turn in range(args.mooncake_turns):
            new = first if turn == 0 else rng.randrange(1, 3)
            ids = ids + list(range(next_id, next_id + new))
            next_id += new
            rows.append({"timestamp": int(at * 1000), "input_length": len(ids) * 512 - 100,
                         "output_length": args.mooncake_output_tokens * 512
                         // args.mooncake_block,
                         "hash_ids": list(ids)})
            at += rng.expovariate(1.0 / (4 * args.mooncake_gap_s))
        t += rng.expovariate(1.0 / args.mooncake_gap_s)
    return sorted(rows, key=lambda r: r["timestamp"])


def mooncake_requests(rows: list[dict], args) -> list[dict]:
    """Trace rows as requests: prompt tokens from the hash ids (each id the same synthetic
    block wherever it appears, 512 tokens scaled to --mooncake-block), output length scaled
    alike; arrival times x time_scale."""
    scale = args.mooncake_block / 512
    blocks: dict[int, list[int]] = {}
    out = []
    for r in rows[:args.mooncake_requests or None]:
        tokens = []
        for h in r["hash_ids"]:
            if h not in blocks:
                blocks[h] = _tokens(random.Random(h * 7919 + 1), args.mooncake_block)
            tokens += blocks[h]
        length = max(1, min(len(tokens), round(r["input_length"] * scale)))
        out.append({"at": r["timestamp"] / 1000 * args.time_scale, "prompt": tokens[:length],
                    "max_tokens": max(1, round(r["output_length"] * scale))})
    return out


# ---------------------------------------------------------------------------- running

class Recorder:
    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.prompt_tokens = self.cached_tokens = self.output_tokens = self.shed = 0

    async def request(self, llm, prompt: list[int], max_tokens: int):
        from tierserve import SamplingParams
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        t0, first, out, cached = time.perf_counter(), None, [], 0
        async for delta in llm.generate(prompt, params):
            if delta.error:
                if delta.error_kind == "overloaded":
                    self.shed += 1
                    return None
                raise RuntimeError(delta.error)
            if first is None and delta.outputs[0].token_ids:
                first = time.perf_counter() - t0
            out += delta.outputs[0].token_ids
            cached = delta.num_cached_tokens
        self.ttft.append(first)
        self.prompt_tokens += len(prompt)
        self.cached_tokens += cached
        self.output_tokens += len(out)
        return out

    def result(self, seconds: float) -> dict:
        ttft = sorted(self.ttft)
        return {"hit_rate": round(self.cached_tokens / max(1, self.prompt_tokens), 4),
                "ttft_mean_ms": round(1e3 * sum(ttft) / max(1, len(ttft)), 1),
                "ttft_p90_ms": round(1e3 * ttft[int(0.9 * (len(ttft) - 1))], 1) if ttft else 0,
                "out_tok_s": round(self.output_tokens / seconds, 2), "shed": self.shed,
                "requests": len(ttft)}


async def run_chat(llm, sessions: list[dict], args) -> dict:
    rec, rng = Recorder(), random.Random(3)
    t0 = time.perf_counter()

    async def session(s):
        await asyncio.sleep(s["start"] - (time.perf_counter() - t0))
        history = list(s["system"])
        for user in s["turns"]:
            history += user
            reply = await rec.request(llm, history, args.reply_tokens)
            if reply is None:
                return
            history += reply
            await asyncio.sleep(rng.expovariate(1.0 / args.think_s))
    await asyncio.gather(*(session(s) for s in sessions))
    return rec.result(time.perf_counter() - t0)


async def run_trace(llm, requests: list[dict]) -> dict:
    rec = Recorder()
    t0 = time.perf_counter()

    async def one(r):
        await asyncio.sleep(r["at"] - (time.perf_counter() - t0))
        await rec.request(llm, r["prompt"], r["max_tokens"])
    await asyncio.gather(*(one(r) for r in requests))
    return rec.result(time.perf_counter() - t0)


def _warm(llm) -> None:
    rng = random.Random(9)
    asyncio.run(Recorder().request(llm, _tokens(rng, 64), 2))


def _reset(llm) -> None:
    assert llm.reset_prefix_cache(), "a cache could not be reset (requests still running?)"


def router_capacity(router, prompts: list[list[int]], n: int = 2000,
                    in_flight: int = 64) -> dict:
    """How many requests one router actor routes per second when many clients ask at once
    (each a route call of one request, `in_flight` calls outstanding), and one call's round
    trip alone: the bound the router puts on a deployment's request rate, since no token
    passes through it."""
    from tierserve.deploy.routing import RouteQuery
    queries = [RouteQuery(p) for p in prompts]

    async def burst():
        t0 = time.perf_counter()
        for start in range(0, n, in_flight):
            await asyncio.gather(*(router.route.remote([queries[i % len(queries)]])
                                   for i in range(start, min(n, start + in_flight))))
        return time.perf_counter() - t0

    async def one_by_one(k=50):
        t0 = time.perf_counter()
        for i in range(k):
            await router.route.remote([queries[i % len(queries)]])
        return (time.perf_counter() - t0) / k
    seconds = asyncio.run(burst())
    return {"routes_per_s": round(n / seconds), "route_call_ms": round(
        1e3 * asyncio.run(one_by_one()), 2)}


def run_policies(args, workloads: dict) -> dict:
    import tierserve
    results = {name: {} for name in workloads}
    llm = tierserve.serve("bench-routing", model=args.model, data_parallel_size=2,
                          cpus_per_worker=args.cpus_per_replica, num_kv_blocks=args.pool_blocks + 1,
                          kv_offload_cpu_bytes=args.cpu_blocks * BLOCK_BYTES,
                          max_model_len=args.max_model_len)
    try:
        _warm(llm)
        router = llm.engine.router
        for policy in args.policies:
            import ray
            ray.get(router.set_policy.remote(policy))
            for name, (kind, work) in workloads.items():
                _reset(llm)
                time.sleep(0.5)  # the replicas' reset events reach the router
                ray.get(router.reset_route_times.remote())
                before = llm.engine.describe()
                res = asyncio.run(run_chat(llm, work, args) if kind == "chat"
                                  else run_trace(llm, work))
                after = llm.engine.describe()
                routed = after["routed"] - before["routed"]
                res["route_us"] = round(after["route_us_mean"], 1)
                res["route_cpu_us"] = round(after["route_cpu_us_mean"], 1)
                res["routed"] = routed
                results[name][policy] = res
                print(f"  {name:<9} {policy:<13} {res}", file=sys.stderr, flush=True)
        # Last: the routes it makes count as load on their way to the replicas.
        results["router"] = router_capacity(router, args.router_prompts)
    finally:
        tierserve.stop("bench-routing")
    return results


def run_bound(args, workloads: dict) -> dict:
    """One engine with the cluster's total cache and CPUs."""
    from tierserve import AsyncLLM
    llm = AsyncLLM(args.model, distributed=True, cpus_per_worker=2 * args.cpus_per_replica,
                   num_kv_blocks=2 * args.pool_blocks + 1,
                   kv_offload_cpu_bytes=2 * args.cpu_blocks * BLOCK_BYTES,
                   max_model_len=args.max_model_len)
    out = {}
    try:
        _warm(llm)
        for name, (kind, work) in workloads.items():
            _reset(llm)
            out[name] = asyncio.run(run_chat(llm, work, args) if kind == "chat"
                                    else run_trace(llm, work))
            print(f"  {name:<9} bound         {out[name]}", file=sys.stderr, flush=True)
    finally:
        llm.shutdown()
    return out


def route_us_at(num_blocks: int, prompts: list[list[int]]) -> float:
    """The kv policy's time per request with the index holding num_blocks blocks over two
    replicas, the prompts' chains among them (mean over the prompts, after a warm-up)."""
    from tierserve.deploy.kv_index import KVIndex
    from tierserve.deploy.routing import Candidate, KVAware, LoadTracker, RouteQuery
    from tierserve.kvcache import BlockHasher
    from tierserve.scheduler.kv_events import KV_EVENTS_VERSION, KVSnapshot
    hasher = BlockHasher(BLOCK_SIZE)
    chains = [h for p in prompts for h in hasher.hash_blocks(p, 0, None)[0]]
    rng = random.Random(5)
    filler = [rng.randbytes(16) for _ in range(max(0, num_blocks - len(chains)))]
    every = chains + filler
    index = KVIndex()
    for r in range(2):
        index.add_replica(r)
        index.receive(r, KVSnapshot(KV_EVENTS_VERSION, 1, 0, [every[r::2], [], []]))
    policy = KVAware(index, hasher, 2048)
    cands = [Candidate(r, LoadTracker()) for r in range(2)]
    queries = [RouteQuery(p) for p in prompts]
    for q in queries[:20]:
        policy.pick(q, cands)
    t0 = time.perf_counter()
    for q in queries:
        policy.pick(q, cands)
    return round((time.perf_counter() - t0) / len(queries) * 1e6, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--quick", action="store_true", help="a few sessions, to check it runs")
    p.add_argument("--model", default=None)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--workloads", default="chat,mooncake")
    p.add_argument("--skip-bound", action="store_true")
    p.add_argument("--cpus-per-replica", type=int, default=1)
    p.add_argument("--pool-blocks", type=int, default=1024)
    p.add_argument("--cpu-blocks", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=256)
    p.add_argument("--user-tokens", type=int, default=64)
    p.add_argument("--reply-tokens", type=int, default=192)
    p.add_argument("--session-gap-s", type=float, default=1.0)
    p.add_argument("--think-s", type=float, default=3.0)
    p.add_argument("--mooncake-trace", default=None, help="a Mooncake JSONL trace to replay")
    p.add_argument("--mooncake-requests", type=int, default=0, help="its first N rows (0: all)")
    p.add_argument("--mooncake-block", type=int, default=64,
                   help="tokens per hash id (Mooncake's 512, scaled to the model)")
    p.add_argument("--mooncake-sessions", type=int, default=16)
    p.add_argument("--mooncake-turns", type=int, default=5)
    p.add_argument("--mooncake-gap-s", type=float, default=2.0,
                   help="the synthetic trace's mean gap between sessions (4x between turns)")
    p.add_argument("--mooncake-output-tokens", type=int, default=32,
                   help="the synthetic trace's output length, scaled as its blocks are")
    p.add_argument("--time-scale", type=float, default=1.0)
    args = p.parse_args()
    args.policies = [x for x in args.policies.split(",") if x]
    if args.quick:
        args.sessions, args.turns, args.mooncake_sessions, args.mooncake_turns = 3, 2, 3, 2
        args.pool_blocks, args.cpu_blocks, args.max_model_len = 96, 256, 1024

    if args.mooncake_trace:
        with open(args.mooncake_trace) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        rows = synthetic_mooncake(args)
    chat = chat_workload(args)
    workloads = {"chat": ("chat", chat), "mooncake": ("trace", mooncake_requests(rows, args))}
    unknown = set(args.workloads.split(",")) - set(workloads)
    if unknown:
        p.error(f"unknown workloads {sorted(unknown)}; choose from {sorted(workloads)}")
    workloads = {k: v for k, v in workloads.items() if k in args.workloads.split(",")}
    args.router_prompts = [s["system"] + [t for u in s["turns"] for t in u] for s in chat]
    longest = max(len(s["system"]) + len(s["turns"]) * (args.user_tokens + args.reply_tokens)
                  for s in chat) - args.reply_tokens
    working_set = sum(len(s["system"]) + len(s["turns"]) * (args.user_tokens + args.reply_tokens)
                      for s in chat) // BLOCK_SIZE

    import ray
    from tierserve.workers.backends.cpu_features import detect_cpu_features
    ray.init(num_cpus=2 * args.cpus_per_replica, include_dashboard=False,
             object_store_memory=256 << 20, log_to_driver=False,
             _temp_dir=tempfile.mkdtemp(prefix="ts-bench-routing-", dir="/tmp"))
    result = {"cpu": detect_cpu_features().model_name, "model": args.model or "SmolLM2-135M",
              "pool_blocks": args.pool_blocks, "cpu_tier_blocks": args.cpu_blocks,
              "working_set_blocks": working_set, "longest_prompt": longest,
              "workloads": {}}
    try:
        per_policy = run_policies(args, workloads)
        bound = {} if args.skip_bound else run_bound(args, workloads)
    finally:
        ray.shutdown()
    for name in workloads:
        result["workloads"][name] = {"bound": bound.get(name, {}), **per_policy[name]}
    result["router"] = per_policy.get("router", {})
    result["route_us_at_100k_blocks"] = route_us_at(100_000, args.router_prompts * 4)
    if args.json:
        print(json.dumps(result))
        return
    print(f"# {result['cpu']}; pool {args.pool_blocks} blocks + CPU tier {args.cpu_blocks} "
          f"per replica; chat working set {working_set} blocks")
    for name, per in result["workloads"].items():
        print(f"\n## {name}")
        print_table([{"policy": k, **v} for k, v in per.items() if v])
    print(f"\nkv routing at 100k indexed blocks: {result['route_us_at_100k_blocks']} us/request")
    r = result["router"]
    if r:
        print(f"router actor: {r['routes_per_s']} requests routed/s with 64 calls in flight; "
              f"one call's round trip {r['route_call_ms']} ms")


if __name__ == "__main__":
    main()

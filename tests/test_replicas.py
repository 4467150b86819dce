"""Replicated deployments on a 2-node Ray cluster (ray.cluster_utils.Cluster, one CPU per node,
one TP=1 replica per node), in a child process with a cluster of its own: one deployment
serves every check, in order (the cluster and the replicas' start dominate the time)."""
import json
import os
import subprocess
import sys
import tempfile

from tests.checkpoints import make_tiny_llama
from tierserve import LLM, SamplingParams
from tierserve.runtime.request_log import read_log

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 47)), [3, 1, 4, 1, 5, 9, 2, 6], list(range(100, 121))]
GREEDY = dict(temperature=0, max_tokens=40, ignore_eos=True)

SCRIPT = """
import asyncio, json, sys, time
import ray
from ray.cluster_utils import Cluster
import tierserve
from tierserve import SamplingParams
from tierserve.deploy.cli import main as cli
from tierserve.deploy.routing import RouteQuery

path, prompts, greedy, ssd, request_log = (sys.argv[1], json.loads(sys.argv[2]),
                                           json.loads(sys.argv[3]), sys.argv[4], sys.argv[5])
cluster = Cluster(initialize_head=True, head_node_args={
    "num_cpus": 1, "include_dashboard": False, "object_store_memory": 96 * 1024 * 1024})
cluster.add_node(num_cpus=1, object_store_memory=96 * 1024 * 1024)
ray.init(address=cluster.address, namespace="replicas", log_to_driver=False)
out = {}
try:
    # Small tiers (block: 3 layers x K, V x 2 heads x 16 x 4 bytes x 4 tokens = 1536 bytes):
    # a 48-block pool, 32 CPU slots, SSD below.
    h = tierserve.serve("rep", model=path, block_size=4, data_parallel_size=2,
                        max_num_batched_tokens=64, num_kv_blocks=48,
                        kv_offload_cpu_bytes=32 * 1536, kv_offload_ssd_path=ssd,
                        request_log_path=request_log)
    router = h.engine.router
    view = h.engine.describe()["replicas"]
    out["nodes"] = [r["node"] for r in view.values()]

    finishes = []  # (tokens, finish reason) of each stream, for a failure's message

    async def collect(prompt, params, salt=None):
        toks, cached, reason = [], None, None
        async for d in h.generate(prompt, params, cache_salt=salt):
            assert d.error is None, d.error
            toks += d.outputs[0].token_ids
            cached = d.num_cached_tokens
            reason = d.outputs[0].finish_reason or reason
        finishes.append((len(toks), reason))
        return toks, cached

    async def many(prompts, params):
        return await asyncio.gather(*[collect(p, params) for p in prompts])

    async def many_of(fn, prompts):
        return await asyncio.gather(*[fn(p) for p in prompts])

    greedy_params = SamplingParams(**greedy)
    out["tokens"] = [t for t, _ in asyncio.run(many(prompts, greedy_params))]
    out["finishes"] = list(finishes)
    # The synchronous path (LLM's): one batch over both replicas.
    from tierserve.scheduler.messages import EngineCoreRequest
    batch = [EngineCoreRequest(f"sync-{i}", greedy_params, prompt_token_ids=p)
             for i, p in enumerate(prompts)]
    sync = {}
    for outputs in h.engine.stream_batch(batch):
        for o in outputs:
            sync.setdefault(o.req_id, []).extend(o.new_token_ids)
    out["sync_tokens"] = [sync[f"sync-{i}"] for i in range(len(prompts))]

    # A caller that awaits between outputs (as an HTTP stream's writes do) gets every one.
    async def slow(prompt):
        toks, reason = [], None
        async for d in h.generate(prompt, greedy_params):
            toks += d.outputs[0].token_ids
            reason = d.outputs[0].finish_reason or reason
            await asyncio.sleep(0.01)
        return toks, reason
    out["slow"] = asyncio.run(many_of(slow, prompts))

    # A prefix served once: its follow-up goes where it is cached, whichever replica that is.
    short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    prefixes = [[(7 * i + j) % 300 + 1 for j in range(33)] for i in range(6)]
    asyncio.run(many(prefixes, short))
    time.sleep(0.5)  # the replicas' last events reach the router
    holders = [ray.get(router.explain.remote(RouteQuery(p + [380 - i])))
               for i, p in enumerate(prefixes)]
    out["holders"] = [sorted(r for r, m in x.items() if m[0]) for x in holders]
    out["follow_cached"] = [asyncio.run(collect(p + [380 - i], short))[1]
                            for i, p in enumerate(prefixes)]

    # Pushed out of the pool, then out of the CPU tier: still routed to its holder, by tier.
    target = prefixes[0]
    holder = out["holders"][0][0]
    rng = __import__("random").Random(0)
    out["tiers_seen"] = []
    # The states asserted below: in the CPU tier and off the device; then on SSD alone.
    wanted = (lambda m: m[0] == 0 and m[1] == 8, lambda m: list(m) == [0, 0, 8])
    for tier in (1, 2):  # CPU, then SSD only
        for _ in range(200):
            found = ray.get(router.explain.remote(RouteQuery(target + [380])))
            if wanted[tier - 1](found[holder]):
                break
            # Off the device, a push of one block demotes one: the target then stays in the
            # CPU tier (32 slots) for many polls, where 8-block pushes left it a few. To
            # reach SSD alone it takes the 8-block pushes that fill the CPU tier.
            length = 5 if tier == 1 and not found[holder][0] else 33
            asyncio.run(many([[rng.randrange(1, 380) for _ in range(length)]], short))
            time.sleep(0.1)
        others = [m for r, m in found.items() if r != holder]
        out["tiers_seen"].append([found[holder], others])
        toks, cached = asyncio.run(collect(target + [370 + tier], short))
        out.setdefault("tier_follow_cached", []).append(cached)
        # Served: the prefix is back on the holder's device; make it tiered again for the
        # next round by pushing.

    # Tenants: an identical prompt under another salt matches nothing of the first's.
    tenant_prompt = list(range(200, 241))
    asyncio.run(collect(tenant_prompt, short, "tenant-a"))
    time.sleep(0.5)
    out["tenant_a"] = ray.get(router.explain.remote(RouteQuery(tenant_prompt, "tenant-a")))
    out["tenant_b"] = ray.get(router.explain.remote(RouteQuery(tenant_prompt, "tenant-b")))
    out["tenant_b_cached"] = asyncio.run(collect(tenant_prompt, short, "tenant-b"))[1]

    # The index equals what each replica holds, kept by the event batches alone.
    time.sleep(0.5)
    actors = ray.get(router.replica_actors.remote())
    from tierserve.scheduler.kv_events import KVEventCodec
    actual = {r: [sorted(t) for t in KVEventCodec().decode(ray.get(a.kv_snapshot.remote())).tiers]
              for r, (_, a) in actors.items()}
    time.sleep(0.5)
    indexed = ray.get(router.index_state.remote())
    out["index_equal"] = {str(r): indexed.get(r) == actual[r] for r in actual}
    out["resyncs"] = [r["event_resyncs"] for r in h.engine.describe()["replicas"].values()]
    ray.get(router.check_integrity.remote())

    # Kill a replica's engine mid-stream under load: every stream completes, token for token.
    load = [prompts[i % len(prompts)] for i in range(8)]

    async def under_load():
        started = asyncio.Event()

        async def one(p):
            toks = []
            async for d in h.generate(p, greedy_params):
                assert d.error is None, d.error
                toks += d.outputs[0].token_ids
                if len(toks) >= 4:
                    started.set()
            return toks
        tasks = [asyncio.create_task(one(p)) for p in load]
        await started.wait()
        view = h.engine.describe()["replicas"]
        victim = max(view, key=lambda r: view[r]["outstanding"])
        _, actor = (await router.replica_actors.remote())[victim]
        ray.kill(actor, no_restart=True)
        return victim, await asyncio.gather(*tasks)
    victim, streams = asyncio.run(under_load())
    out["killed"] = victim
    out["after_kill"] = streams
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        view = h.engine.describe()["replicas"]
        if all(r["state"] == "live" for r in view.values()):
            break
        time.sleep(0.5)
    out["rejoined"] = {str(k): [v["state"], v["replica_restarts"]] for k, v in view.items()}
    out["after_rejoin"] = [t for t, _ in asyncio.run(many(prompts, greedy_params))]

    print("STATUS-BEGIN")
    out["status_rc"] = cli(["status", "rep"])
    print("STATUS-END")
    # Scale down: the drained replica goes, the deployment keeps serving.
    out["scaled"] = h.engine.scale(1)
    out["after_scale"] = [t for t, _ in asyncio.run(many(prompts[:2], greedy_params))]
    out["scaled_up"] = h.engine.scale(2)
    out["after_scale_up"] = [t for t, _ in asyncio.run(many(prompts, greedy_params))]
    out["live_after_scale_up"] = sorted(
        r["state"] for r in h.engine.describe()["replicas"].values())

    # The router dies mid-stream: Ray restarts it, it adopts the running replicas, the
    # streams (straight from the replicas) never notice, and it routes again.
    async def router_dies():
        tasks = [asyncio.create_task(collect(p, greedy_params)) for p in prompts]
        await asyncio.sleep(0.2)
        ray.kill(router, no_restart=False)
        return [t for t, _ in await asyncio.gather(*tasks)]
    out["router_killed"] = asyncio.run(router_dies())
    out["after_router_restart"] = [t for t, _ in asyncio.run(many(prompts, greedy_params))]
    out["adopted"] = sorted((r["state"], r["replica_restarts"])
                            for r in h.engine.describe()["replicas"].values())
finally:
    out["stopped"] = tierserve.stop("rep")
    time.sleep(1)
    out["left"] = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)] + [
        p["name"] for p in ray.util.placement_group_table().values() if p["state"] != "REMOVED"]
    print(json.dumps(out))
    ray.shutdown()
    cluster.shutdown()
"""


def _env(tmp: str) -> dict:
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0",
               RAY_TMPDIR=tmp, PYTHONPATH=REPO)
    env.pop("RAY_ADDRESS", None)
    return env


def test_replicas_on_two_nodes_route_by_kv_events_and_survive_a_dead_replica(tmp_path):
    path = str(make_tiny_llama(tmp_path / "llama"))
    with LLM(path, block_size=4) as llm:
        ref = [o.outputs[0].token_ids for o in llm.generate(
            PROMPTS, SamplingParams(**GREEDY), use_tqdm=False)]
    ray_tmp = tempfile.mkdtemp(prefix="ts-rep-", dir="/tmp")
    run = subprocess.run([sys.executable, "-c", SCRIPT, path, json.dumps(PROMPTS),
                          json.dumps(GREEDY), str(tmp_path / "ssd"),
                          str(tmp_path / "requests.tslog")], env=_env(ray_tmp),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    out = json.loads(next(line for line in reversed(run.stdout.splitlines())
                          if line.startswith("{")))
    # One replica per node.
    assert len(set(out["nodes"])) == 2
    # Greedy tokens equal a single engine's, streamed or in one synchronous batch.
    assert out["tokens"] == ref and out["sync_tokens"] == ref, out["finishes"]
    assert out["slow"] == [[t, "length"] for t in ref]
    # Each prefix is on exactly one replica's device, and its follow-up was routed there.
    assert all(len(h) == 1 for h in out["holders"]), out["holders"]
    assert out["follow_cached"] == [32] * 6, out["follow_cached"]
    # Later, only in the holder's CPU tier, then only on its SSD: still routed there.
    cpu, ssd = out["tiers_seen"]
    assert cpu[0][1] == 8 and cpu[0][0] == 0 and ssd[0] == [0, 0, 8], out["tiers_seen"]
    assert all(m == [0, 0, 0] for m in cpu[1] + ssd[1]), out["tiers_seen"]
    assert out["tier_follow_cached"] == [32, 32], out["tier_follow_cached"]
    # Tenants: B's identical prompt matches none of A's blocks.
    assert max(m[0] for m in out["tenant_a"].values()) == 10
    assert all(m == [0, 0, 0] for m in out["tenant_b"].values())
    assert out["tenant_b_cached"] == 0
    # The index equals the replicas' contents, kept by the event batches alone.
    assert all(out["index_equal"].values()) and out["resyncs"] == [0, 0], out
    # The dead replica's streams went on elsewhere: every token, none twice; it rejoined.
    assert out["after_kill"] == [ref[i % len(ref)] for i in range(8)]
    assert out["rejoined"][str(out["killed"])] == ["live", 1]
    assert out["after_rejoin"] == ref
    status = run.stdout.split("STATUS-BEGIN")[1].split("STATUS-END")[0]
    assert out["status_rc"] == 0 and "replicas (2)" in status and "live" in status, \
        (status, run.stderr[-3000:])
    assert out["scaled"] == {"replicas": 1, "errors": []}
    assert out["after_scale"] == ref[:2]
    assert out["scaled_up"] == {"replicas": 2, "errors": []}
    assert out["after_scale_up"] == ref and out["live_after_scale_up"] == ["live", "live"]
    assert out["router_killed"] == ref and out["after_router_restart"] == ref
    assert out["adopted"] == [["live", 0], ["live", 0]], out["adopted"]
    assert out["stopped"] and out["left"] == [], out["left"]
    # Each replica wrote a request log of its own. A replica's engine that starts again (the
    # killed one, the one scaled up) rotates the file its predecessor wrote to PATH.1, ...,
    # and may have served nothing since (kv routing sends the prompts where they are cached).
    for r in range(2):
        files = sorted(tmp_path.glob(f"requests.replica{r}.tslog*"))
        assert tmp_path / f"requests.replica{r}.tslog" in files, r
        served = 0
        for log_file in files:
            header, records = read_log(str(log_file))
            assert header.block_size == 4, log_file
            served += len(list(records))
        assert served > 0, r
    assert not list(tmp_path.glob("requests.tslog*"))

"""`tierserve analyze`: the request log the engine writes, the replay of it through the engine's
own KVCacheManager (predicting the hit tokens the engine served, per tier), the seed's sharing
statistics, tenant isolation, the foreign input formats, and bad inputs named by file and
record."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import msgspec
import pytest

from tests.checkpoints import add_tiny_tokenizer, make_tiny_llama
from tierserve import LLM, SamplingParams
from tierserve.deploy.cli import main as cli_main
from tierserve.kvcache import BlockHasher
from tierserve.runtime.analyze import analyze
from tierserve.runtime.analyze.costs import Costs
from tierserve.runtime.analyze.replay import Capacity, Replay
from tierserve.runtime.analyze.stats import PrefixStats, TenantStats, add_to_dict
from tierserve.runtime.analyze.traces import Trace
from tierserve.runtime.analyze.text_inputs import hash_chain
from tierserve.runtime.request_log import (
    LOG_VERSION, MAGIC, LogHeader, RequestRecord, read_log, tenant_id, write_log,
)

BS = 4
REPLY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# 48 conversations, 8 at a time: a turn of the 8 fits the pool, the histories of all 48 do not.
CHATS, TURNS, BATCH = 48, 5, 8
ENGINE = dict(block_size=BS, num_kv_blocks=401, max_model_len=256, cpus_per_worker=1)
BLOCK_BYTES = 2 * 3 * BS * 2 * 16 * 4  # tiny llama: 3 layers, 2 KV heads of 16, fp32
CPU_TIER = dict(kv_offload_cpu_bytes=300 * BLOCK_BYTES)  # below the pool: 300 blocks


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(add_tiny_tokenizer(make_tiny_llama(tmp_path_factory.mktemp("analyze") / "llama")))


def _chats(seed: int = 0):
    """Conversations on three shared system prompts: each turn's prompt is the history (every
    prompt and reply before it) and a user message of its own. Turn-major: a conversation's
    history is pushed out of the pool between its turns."""
    rng = random.Random(seed)
    systems = [[rng.randrange(5, 380) for _ in range(rng.randrange(18, 30))] for _ in range(3)]
    history = [list(rng.choice(systems)) for _ in range(CHATS)]
    for _ in range(TURNS):
        prompts = [h + [rng.randrange(5, 380) for _ in range(rng.randrange(6, 14))]
                   for h in history]
        replies = yield prompts
        history = [p + r for p, r in zip(prompts, replies)]


def _run(llm: LLM, concurrent: bool) -> None:
    """Every turn of every conversation, one request at a time or BATCH at a time."""
    chats = _chats()
    prompts = next(chats)
    step = BATCH if concurrent else 1
    try:
        while True:
            replies = []
            for i in range(0, len(prompts), step):
                outs = llm.generate(prompts[i:i + step], REPLY, use_tqdm=False)
                assert all(o.error is None for o in outs)
                replies += [o.outputs[0].token_ids for o in outs]
            llm.engine.scheduler.check_integrity()
            prompts = chats.send(replies)
    except StopIteration:
        pass


def _served(path: str) -> list[int]:
    _, records = read_log(path)
    served = [0, 0, 0]
    for r in records:
        for i, n in enumerate((r.cached_device, r.cached_cpu, r.cached_ssd)):
            served[i] += n
    return served


def _engine_log(tiny: str, folder, concurrent: bool) -> str:
    log = str(folder / "requests.tslog")
    with LLM(tiny, request_log_path=log, **CPU_TIER, **ENGINE) as llm:
        _run(llm, concurrent)
        hits = llm.stats()["prefix_cache_hit_tokens"]
    assert sum(_served(log)) == hits  # the log is whole once the engine has shut down
    return log


@pytest.fixture(scope="module")
def serial_log(tiny, tmp_path_factory):
    return _engine_log(tiny, tmp_path_factory.mktemp("serial"), concurrent=False)


@pytest.mark.parametrize("concurrent", [False, True], ids=["serial", "concurrent"])
def test_replay_predicts_the_hits_the_engine_served(tiny, serial_log, tmp_path, concurrent):
    """At the engine's own capacities (from the log's header), the replay's hit tokens per
    tier are the engine's: exactly for one request at a time; within 2% for 8 at a time,
    where the replay places the engine's steps from the log's times."""
    log = _engine_log(tiny, tmp_path, concurrent=True) if concurrent else serial_log
    served = _served(log)
    assert all(served[:2])  # device and CPU hits both
    replay = analyze(log)["replays"][0]
    assert (replay["device_blocks"], replay["cpu_blocks"]) == (401, 300)
    assert replay["requests"] == CHATS * TURNS and replay["evictions"] > 0
    assert replay["served_tokens"] == dict(zip(("device", "cpu", "ssd"), served))
    predicted = [replay["hit_tokens"][t] for t in ("device", "cpu", "ssd")]
    if concurrent:
        assert predicted == pytest.approx(served, rel=0.02, abs=BS)
    else:
        assert predicted == served


def test_a_grid_of_tier_sizes_and_the_recommendation(serial_log):
    """The engine's log replayed at other sizes: hit rates grow with each tier, an SSD tier
    serves what the CPU tier drops, and the recommendation is the smallest size within 2% of
    the unbounded cache."""
    out = analyze(serial_log, cpu_bytes=[0, 100 * BLOCK_BYTES, 2000 * BLOCK_BYTES],
                  ssd_bytes=[0, 4000 * BLOCK_BYTES])
    rate = {(r["cpu_blocks"], r["ssd_blocks"]): r for r in out["replays"]}
    assert (0, 4000) not in rate  # no SSD tier without a CPU tier
    assert rate[0, 0]["hit_rate"] < rate[100, 0]["hit_rate"] < rate[2000, 0]["hit_rate"]
    assert rate[100, 4000]["hit_tokens"]["ssd"] > 0
    assert rate[100, 4000]["hit_rate"] > rate[100, 0]["hit_rate"]
    unbounded = out["statistics"]["unbounded_hit_rate"]
    assert all(r["hit_rate"] <= unbounded + 1e-9 for r in out["replays"])
    best = out["recommendation"]["by_device_blocks"][401]
    assert best["found"] and best["hit_rate"] >= 0.98 * unbounded
    smaller = [r for r in out["replays"] if (r["cpu_bytes"], r["ssd_bytes"]) <
               (best["cpu_bytes"], best["ssd_bytes"])]
    assert all(r["hit_rate"] < 0.98 * unbounded for r in smaller)


def test_the_log_keeps_no_text_and_no_salt(tiny, tmp_path):
    log = str(tmp_path / "requests.tslog")
    prompt = [7] * 30
    with LLM(tiny, request_log_path=log, **ENGINE) as llm:
        llm.generate([prompt], REPLY, use_tqdm=False, cache_salt="secret-salt")
    raw = open(log, "rb").read()
    assert b"secret-salt" not in raw
    header, records = read_log(log)
    (record,) = list(records)
    assert (header.block_size, header.num_blocks, record.prompt_len, record.output_len) == (
        BS, 401, 30, 6)
    assert record.tenant == tenant_id("secret-salt") != 0 and record.tokens == b""
    assert record.finish == 1 and 0 < record.ttft <= record.e2e  # FinishReason.LENGTH
    # The chain covers prompt and output, 8 bytes a block, as the engine hashed them.
    assert len(record.hashes) == (30 + 6) // BS * 8


def test_chat_requests_as_openai_jsonl_hash_like_the_engine(tiny, tmp_path):
    """The same conversation, analyzed from its request bodies, has the chains the engine
    logged: tokenized with the model's template and hashed with the salt in the first block."""
    log, bodies = str(tmp_path / "requests.tslog"), tmp_path / "bodies.jsonl"
    messages = [[{"role": "system", "content": "hello server, hello client"},
                 {"role": "user", "content": "The capital of France is Paris."}],
                [{"role": "user", "content": "A tiny model writes tiny words."}]]
    with LLM(tiny, request_log_path=log, **ENGINE) as llm:
        for m in messages:
            llm.generate([{"messages": m}], REPLY, use_tqdm=False, cache_salt="t1")
    bodies.write_text("".join(json.dumps({"messages": m, "cache_salt": "t1", "max_tokens": 6})
                              + "\n" for m in messages))
    from tierserve.runtime.analyze.inputs import open_inputs
    from tierserve.runtime.tokenizer import load_tokenizer
    _, records = read_log(log)
    logged = sorted((r.prompt_len, r.hashes[:r.prompt_len // BS * 8]) for r in records)
    traces = open_inputs([str(bodies)], block_size=BS, tokenizer=load_tokenizer(tiny)).traces
    ours = sorted((t.prompt_len, b"".join(h.to_bytes(8, "little") for h in t.chain))
                  for t in traces)
    assert ours == logged


def test_the_log_rotates_by_size_and_keeps_its_newest_files(tmp_path):
    from types import SimpleNamespace
    from tierserve.runtime.request_log import RequestLog
    from tierserve.scheduler import RequestStatus
    path = str(tmp_path / "r.tslog")
    log = RequestLog(path, _header(num_blocks=64), max_bytes=4096, keep=2)
    for n in range(200):  # about 100 bytes each: several rotations
        log.add(SimpleNamespace(
            block_hashes=[bytes([n % 256]) * 16] * 8, first_token_time=n + 0.5,
            admitted_at=n + 0.1, cached_by_tier=(4, 0, 0), arrival_time=float(n),
            num_prompt_tokens=30, num_output_tokens=3, cache_salt=None, index=0,
            status=RequestStatus.FINISHED_LENGTH, all_token_ids=[]), finished_at=n + 1.0)
        if n % 50 == 49:
            log._wake.set()
            while log._pending:  # the writer thread takes them
                log._wake.wait(0.01)
    log.close()
    assert sorted(os.listdir(tmp_path)) == ["r.tslog", "r.tslog.1", "r.tslog.2"]
    header, records = read_log(path + ".2")
    first = next(records)
    assert header.num_blocks == 64 and first.prompt_len == 30
    assert first.queued == pytest.approx(0.1)
    assert first.ttft == pytest.approx(0.5) and first.e2e == pytest.approx(1.0)
    assert first.finish == 1 and len(first.hashes) == 8 * 8
    assert max(os.path.getsize(tmp_path / f) for f in os.listdir(tmp_path)) <= 4096


def _header(**kw) -> LogHeader:
    return LogHeader(MAGIC, LOG_VERSION, BS, **kw)


def _record(tokens: list[int], salt: str | None = None, arrival: float = 0.0,
            output_len: int = 1) -> RequestRecord:
    chain = hash_chain(BlockHasher(BS), tokens, salt)
    return RequestRecord(arrival, len(tokens), output_len,
                         b"".join(h.to_bytes(8, "little") for h in chain),
                         tenant=tenant_id(salt), e2e=0.5)


def test_the_seeds_statistics_on_a_hand_made_log(tmp_path):
    """Four prompts of 4 full blocks (block size 4): A B C D, A B C E, A B F G, H I J K.
    Blocks: total 16; distinct A B C D E F G H I J K (+ the chained C under A B is one) = 11;
    shared: A B (3 prompts), C (2) = 3; reusable instances 16 - 11 = 5."""
    a, b, c, d, e, f, g, h, i, j, k = ([n] * BS for n in range(10, 21))
    prompts = [a + b + c + d, a + b + c + e, a + b + f + g, h + i + j + k]
    path = str(tmp_path / "hand.tslog")
    write_log(path, _header(num_blocks=64),
              [_record(p + [1], arrival=float(n)) for n, p in enumerate(prompts)])
    stats = analyze(path)["statistics"]
    assert {k: stats[k] for k in ("total_requests", "total_blocks", "unique_blocks",
                                  "shared_blocks", "reusable_block_instances",
                                  "potential_prefill_savings", "avg_shared_prefix_length")} == {
        "total_requests": 4, "total_blocks": 16, "unique_blocks": 11, "shared_blocks": 3,
        "reusable_block_instances": 5, "potential_prefill_savings": 5 / 16,
        "avg_shared_prefix_length": 5 * BS / 4}
    # The seed's API: a list of token-id lists gives the same figures.
    seed = analyze([p + [1] for p in prompts], block_size=BS, device_blocks=[64])
    assert seed["statistics"]["reusable_block_instances"] == 5
    # Reuse distances in requests: A B at 1 and 1, C at 1; A B again at 1 from prompt 2.
    assert stats["reuse_distance"] == {1: 5}
    # An unbounded cache hits A B C, A B, nothing: 5 blocks of 68 prompt tokens.
    assert stats["unbounded_hit_rate"] == pytest.approx(5 * BS / 68)


def _stats_by_dict(traces, bs: int) -> dict:
    """The statistics block by block in a dict (stats.add_to_dict), one trace at a time."""
    blocks, hist, total, tenants = {}, [0] * 64, TenantStats(), {}
    for idx, t in enumerate(traces):
        num_prompt = min(t.prompt_len // bs, len(t.chain))
        computed = min(max(t.prompt_len + t.output_len - 1, 0) // bs, len(t.chain))
        unique, shared, hit = add_to_dict(blocks, hist, t.chain, idx, num_prompt,
                                          min((t.prompt_len - 1) // bs, num_prompt), computed)
        for s in (total, tenants.setdefault(t.tenant, TenantStats())):
            s.requests += 1
            s.prompt_tokens += t.prompt_len
            s.total_blocks += num_prompt
            s.unique_blocks += unique
            s.shared_blocks += shared
            s.unbounded_hit_tokens += hit * bs
    return {"total": total, "tenants": tenants, "hist": hist, "distinct": len(blocks)}


@pytest.mark.parametrize("huge_key_at", [None, 150])
def test_chunked_statistics_equal_the_block_by_block_ones(huge_key_at):
    """Random traces (shared prefixes, repeated and output-only blocks, empty prompts, three
    tenants), folded a few requests at a time, give the dict's figures exactly; a key past 64
    bits moves the rest to the dict."""
    rng = random.Random(7)
    bs, traces = 4, []
    for n in range(400):
        chain = [rng.randrange(40) for _ in range(rng.randrange(0, 6))]
        chain += [rng.randrange(1 << 64) for _ in range(rng.randrange(0, 4))]
        chain += [rng.choice(chain)] if chain and rng.random() < 0.2 else []
        if n == huge_key_at:
            chain.append(1 << 70)
        prompt = rng.randrange(0, len(chain) * bs + 3)
        traces.append(Trace(None, rng.randrange(3), prompt, rng.randrange(1, 12), chain))
    want = _stats_by_dict(traces, bs)
    stats = PrefixStats(bs, chunk=37)
    for t in traces:
        stats.add(t)
    assert stats.figures()["total_blocks"] == want["total"].total_blocks
    assert stats.total == want["total"]
    assert stats.tenants == want["tenants"]
    assert stats.reuse_distance == want["hist"]
    assert stats.distinct_blocks == want["distinct"]


def test_a_blocks_bytes_are_read_without_torch(tiny):
    """Sizing tiers from --model reads the model's config only: no torch in the process."""
    code = ("import sys; from tierserve.runtime.analyze.model import kv_block_bytes; "
            f"assert kv_block_bytes({tiny!r}, 'float32', 1, {BS}) == ({BLOCK_BYTES}, 1); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_two_tenants_never_share_a_hit_in_the_replay(tmp_path):
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 380) for _ in range(40)] for _ in range(6)]
    records = [_record(p, salt, arrival=float(n))
               for n, (salt, p) in enumerate([(s, p) for s in ("a", "b", "a")
                                               for p in prompts])]
    path = str(tmp_path / "tenants.tslog")
    write_log(path, _header(num_blocks=200), records)
    out = analyze(path, device_blocks=[200, 12])
    big, small = sorted(out["replays"], key=lambda r: -r["device_blocks"])
    tenants = big["tenants"]
    assert tenants[tenant_id("b")]["hit_tokens"] == 0  # b's prompts are a's, salted apart
    assert tenants[tenant_id("a")]["hit_tokens"] == 6 * 36  # a's second round, whole blocks
    assert small["tenants"][tenant_id("b")]["hit_tokens"] == 0
    stats = out["statistics"]["tenants"]
    assert stats[tenant_id("a")]["shared_blocks"] == 6 * 10
    assert stats[tenant_id("b")]["shared_blocks"] == 0


def test_requests_waiting_on_blocks_in_flight_are_admitted_when_the_copies_complete():
    """A 10-block pool with CPU and SSD tiers: requests end while their evicted blocks are
    still being demoted, so the blocks the waiting requests need free only when those copies
    complete. A completed copy step retries the waiting requests, as the engine's scheduler
    does every step; otherwise they wait on an empty pool to the end of the replay (finish()
    asserts). Found by a search over random traces; the block ids keep its sharing."""
    traces = [(0.2, 9, 9, [1, 2]), (0.2, 14, 4, [1, 2, 3]), (0.4, 12, 12, [4, 5, 6]),
              (0.41, 19, 5, [7, 8, 9, 10]), (0.66, 13, 11, [4, 11, 12]),
              (0.86, 23, 1, [1, 2, 13, 14, 15]), (0.88, 18, 3, [7, 8, 16, 17])]
    costs = Costs(prefill_tokens_per_s=2000, decode_tokens_per_s=50, cpu_block_s=0.002,
                  ssd_block_s=0.01)
    replay = Replay(Capacity(10, 4, 16), 4, costs, block_bytes=1024)
    for arrival, prompt_len, output_len, chain in traces:
        replay.add(Trace(arrival, 0, prompt_len, output_len, chain))
    result = replay.finish()
    assert (result.requests, result.skipped) == (7, 0) and result.queued >= 1
    assert result.hit_tokens[2] > 0 and result.tier_counters["demotions"] > 0


def test_mooncake_hash_ids_become_shared_blocks(tmp_path):
    """512-token blocks cut at 16: two requests sharing their first id share 32 blocks."""
    path = tmp_path / "mooncake.jsonl"
    lines = [{"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]},
             {"timestamp": 5000, "input_length": 700, "output_length": 10, "hash_ids": [1, 3]}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = analyze(str(path), block_size=16, device_blocks=[1024])
    assert out["statistics"]["total_blocks"] == 64 + 43
    assert out["statistics"]["shared_blocks"] == 32
    assert out["replays"][0]["hit_tokens"]["device"] == 512


def test_bad_inputs_name_the_file_and_the_record(tmp_path):
    good = [_record([n] * 12, arrival=float(n)) for n in range(3)]
    path = tmp_path / "cut.tslog"
    write_log(str(path), _header(num_blocks=64), good)
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(ValueError, match=r"cut\.tslog: record 3 is truncated"):
        analyze(str(path))
    future = tmp_path / "future.tslog"
    header = msgspec.msgpack.encode([MAGIC, 99, BS, "a field of version 99"])
    future.write_bytes(len(header).to_bytes(4, "little") + header)
    with pytest.raises(ValueError, match=r"future\.tslog: header: request log version 99 is "
                                         r"not supported"):
        analyze(str(future))
    text = tmp_path / "bodies.jsonl"
    text.write_text(json.dumps({"prompt": "hello"}) + "\n")
    with pytest.raises(ValueError, match=r"bodies\.jsonl: line 1: .*text.*pass --model"):
        analyze(str(text), device_blocks=[64])
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({"prompt": [1, 2, 3]}) + "\n{\"prompt\": [1,")
    with pytest.raises(ValueError, match=r"broken\.jsonl: line 2 is not valid JSON \(the file "
                                         r"ends inside it"):
        analyze(str(broken), device_blocks=[64])


def test_cli_prints_the_table_and_the_json(tmp_path, capsys):
    path = str(tmp_path / "cli.tslog")
    write_log(path, _header(num_blocks=64, kv_block_bytes=1024),
              [_record([n % 3] * 40, arrival=float(n)) for n in range(12)])
    assert cli_main(["analyze", path, "--device-blocks", "8,64", "--cpu-bytes", "0"]) == 0
    text = capsys.readouterr().out
    assert "unique_blocks" in text and "Recommended with 64 device blocks" in text
    assert cli_main(["analyze", path, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["replays"][0]["device_blocks"] == 64 and out["input"]["requests"] == 12
    assert cli_main(["analyze", os.path.join(str(tmp_path), "missing.tslog")]) != 0

"""KV tiers end to end, with real workers and real files: greedy tokens identical with tiers on
and off under eviction ping-pong with copies that complete late (TP=1 in process, TP=3 on Ray,
whose SSD entries an engine of TP=1 then serves), cache salts kept apart in every tier, corrupted
and truncated SSD entries detected and recomputed, a second engine process serving the first
one's blocks, only an engine of the same weights and KV config finding them, aborts during
copies leaking nothing, and swap preemption giving recompute preemption's tokens."""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkpoints import make_tiny_llama
from tierserve import LLM, SamplingParams

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# The pool holds 40 blocks; the prompts below take ~150: four times the pool.
POOL = dict(block_size=BS, num_kv_blocks=41, max_model_len=120)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_llama(tmp_path_factory.mktemp("tiers") / "llama"))


@pytest.fixture(scope="module")
def tiny3(tmp_path_factory):
    """3 KV heads (of 16), so that TP=3 holds one head per rank."""
    return str(make_tiny_llama(tmp_path_factory.mktemp("tiers3") / "llama", hidden_size=96,
                               num_heads=6, num_kv_heads=3))


@pytest.fixture
def late_copies(monkeypatch):
    """Tier copies complete late, their destinations NaN until waited for
    (workers/tier_streams.py LateCopies): a read the protocol does not order fails."""
    monkeypatch.setenv("TIERSERVE_DEBUG_LATE_COPIES", "1")


def _working_set(n=10, seed=0) -> list[list[int]]:
    """Prompts sharing a system prefix, each with a long tail of its own."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 380) for _ in range(20)]
    return [system + [rng.randrange(3, 380) for _ in range(rng.randrange(40, 60))]
            for _ in range(n)]


def _rounds(llm, prompts, rounds=3, batch=4):
    """The prompts again and again, `batch` at a time (concurrent requests)."""
    tokens, cached = [], 0
    for _ in range(rounds):
        for i in range(0, len(prompts), batch):
            for out in llm.generate(prompts[i:i + batch], GREEDY, use_tqdm=False):
                assert out.error is None, out.error
                tokens.append(out.outputs[0].token_ids)
                cached += out.num_cached_tokens
            _check(llm)
    return tokens, cached


def _check(llm) -> None:
    engine = getattr(llm.engine, "scheduler", None)
    if engine is not None:  # in process: every invariant, tiers included
        engine.check_integrity()


def _cpu_bytes(blocks: int, kv_heads: int = 2) -> int:
    return blocks * 2 * 3 * BS * kv_heads * 16 * 4  # tiny llama: 3 layers, KV heads of 16, fp32


@pytest.mark.usefixtures("late_copies")
def test_cpu_and_ssd_tiers_keep_greedy_tokens_under_ping_pong(tiny, tmp_path):
    prompts = _working_set()
    with LLM(tiny, **POOL) as llm:
        off, cached_off = _rounds(llm, prompts)
    with LLM(tiny, kv_offload_cpu_bytes=_cpu_bytes(400), **POOL) as llm:
        cpu, cached_cpu = _rounds(llm, prompts)
        stats = llm.stats()
    assert cpu == off
    assert cached_cpu > cached_off
    assert stats["tier_promotions"] > 0 and stats["tier_demotions"] > 0
    with LLM(tiny, kv_offload_cpu_bytes=_cpu_bytes(40), kv_offload_ssd_path=str(tmp_path),
             kv_offload_ssd_bytes=_cpu_bytes(2000), **POOL) as llm:
        ssd, cached_ssd = _rounds(llm, prompts)
        stats = llm.stats()
    assert ssd == off
    assert cached_ssd > cached_off
    assert stats["tier_spills"] > 0 and stats["tier_loads"] > 0


@pytest.mark.usefixtures("ray_session", "late_copies")
def test_tp3_on_ray_keeps_greedy_tokens_and_tp1_serves_its_ssd_entries(tiny3, tmp_path):
    prompts = _working_set(n=8, seed=1)
    with LLM(tiny3, **POOL) as llm:
        off, _ = _rounds(llm, prompts, rounds=2)
    tiers = dict(kv_offload_ssd_path=str(tmp_path), kv_offload_ssd_bytes=_cpu_bytes(1000, 3))
    with LLM(tiny3, tensor_parallel_size=3, kv_offload_cpu_bytes=_cpu_bytes(30, 1), **tiers,
             **POOL) as llm:
        tiered, cached = _rounds(llm, prompts, rounds=2)
        stats = llm.stats()
    assert tiered == off
    assert cached > 0 and stats["tier_promotions"] > 0 and stats["tier_spills"] > 0
    # The TP=3 engine wrote one head per rank (and its cached blocks as it shut down); an
    # engine of TP=1 reads each block from the three entries.
    # One prompt at a time: a batch's SSD loads beyond the 40-slot CPU tier would recompute.
    with LLM(tiny3, kv_offload_cpu_bytes=_cpu_bytes(40, 3), **tiers, **POOL) as llm:
        outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
        stats = llm.stats()
    assert [o.outputs[0].token_ids for o in outs] == off[:len(prompts)]
    assert stats["tier_ssd_found_blocks"] > 0 and stats["tier_loads"] > 0
    assert all(o.num_cached_tokens > 20 for o in outs)  # more than the shared system prefix
    assert stats["tier_checksum_failures"] == 0


def test_cache_salts_never_share_a_block_in_any_tier(tiny, tmp_path):
    rng = random.Random(2)  # no prefix shared between prompts: only across tenants
    prompts = [[rng.randrange(3, 380) for _ in range(60)] for _ in range(8)]
    with LLM(tiny, kv_offload_cpu_bytes=_cpu_bytes(40), kv_offload_ssd_path=str(tmp_path),
             kv_offload_ssd_bytes=_cpu_bytes(2000), **POOL) as llm:
        for _ in range(2):
            llm.generate(prompts, GREEDY, use_tqdm=False, cache_salt="tenant-a")
        assert llm.stats()["tier_demotions"] > 0
        other = llm.generate(prompts, GREEDY, use_tqdm=False, cache_salt="tenant-b")
        assert all(o.num_cached_tokens == 0 for o in other)
        again = llm.generate(prompts, GREEDY, use_tqdm=False, cache_salt="tenant-a")
        assert any(o.num_cached_tokens > 0 for o in again)
        _check(llm)


def _fill_ssd(tiny, folder, prompts) -> list[list[int]]:
    """One engine's tokens; its shutdown writes its cached blocks to `folder`."""
    with LLM(tiny, kv_offload_cpu_bytes=_cpu_bytes(40), kv_offload_ssd_path=str(folder),
             kv_offload_ssd_bytes=_cpu_bytes(2000), **POOL) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _entries(folder) -> list[str]:
    return sorted(os.path.join(root, f) for root, _, files in os.walk(folder)
                  for f in files if f.endswith(".kv"))


def test_corrupted_and_truncated_ssd_entries_are_recomputed_and_counted(tiny, tmp_path):
    prompts = _working_set(n=6, seed=3)
    want = _fill_ssd(tiny, tmp_path, prompts)
    files = _entries(tmp_path)
    assert len(files) > 10
    for path in files[::2]:  # half the entries: a flipped payload byte
        with open(path, "r+b") as f:
            f.seek(-7, os.SEEK_END)
            byte = f.read(1)
            f.seek(-7, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0xFF]))
    for path in files[1::4]:  # others: cut short
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 100)
    with LLM(tiny, kv_offload_cpu_bytes=_cpu_bytes(40), kv_offload_ssd_path=str(tmp_path),
             kv_offload_ssd_bytes=_cpu_bytes(2000), **POOL) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        stats = llm.stats()
        _check(llm)
    assert got == want
    # Corrupted and truncated entries are found (their names are right) and caught when
    # loaded: a miss, recomputed.
    assert stats["tier_checksum_failures"] > 0
    assert stats["tier_loads"] > 0


RESTART = """
import json, sys
from tierserve import LLM, SamplingParams
prompts, folder, model, pool = json.loads(sys.argv[1])
with LLM(model, kv_offload_cpu_bytes=pool.pop("cpu"), kv_offload_ssd_path=folder,
         kv_offload_ssd_bytes=pool.pop("ssd"), **pool) as llm:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs],
                      "cached": [o.num_cached_tokens for o in outs],
                      "found": llm.stats()["tier_ssd_found_blocks"]}))
"""


def test_a_second_engine_process_serves_the_first_ones_blocks_from_ssd(tiny, tmp_path):
    prompts = _working_set(n=6, seed=4)
    pool = dict(POOL, cpu=_cpu_bytes(40), ssd=_cpu_bytes(2000))
    runs = []
    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", RESTART,
                              json.dumps([prompts, str(tmp_path), tiny, pool])],
                             env=dict(os.environ, PYTHONPATH=REPO), capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        runs.append(json.loads(run.stdout.strip().splitlines()[-1]))
    first, second = runs
    # The first engine hits only the system prefix its batch shares; the second, the rest too.
    assert first["found"] == 0 and second["found"] > 0
    assert sum(second["cached"]) > sum(first["cached"])
    assert second["cached"][0] > 20  # the first request finds more than the shared prefix
    assert second["tokens"] == first["tokens"]


def _variant(src: str, dst, change=None) -> str:
    """A copy of checkpoint `src` at `dst`, changed by change(folder), its files keeping the
    sizes and modification times of the original's."""
    shutil.copytree(src, dst)
    if change is not None:
        change(dst)
    for name in os.listdir(src):
        st = os.stat(os.path.join(src, name))
        os.utime(os.path.join(dst, name), ns=(st.st_atime_ns, st.st_mtime_ns))
    return str(dst)


def _flip_a_weight_byte(folder) -> None:
    path = os.path.join(folder, "model.safetensors")
    with open(path, "r+b") as f:
        f.seek(-1000, os.SEEK_END)  # inside the last tensor's data
        byte = f.read(1)
        f.seek(-1000, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x40]))


def _set_rope_theta(folder) -> None:
    path = os.path.join(folder, "config.json")
    config = json.loads(open(path).read())
    if "rope_parameters" in config:
        config["rope_parameters"]["rope_theta"] = 500.0
    else:
        config["rope_theta"] = 500.0
    with open(path, "w") as f:  # the same length: the size check alone would not tell
        f.write(json.dumps(config).ljust(os.path.getsize(path)))


def _other_model(folder) -> None:
    other = make_tiny_llama(Path(str(folder) + "-other"), seed=1)
    shutil.copy(other / "model.safetensors", Path(folder) / "model.safetensors")


def _generate(model, prompts, **tiers):
    with LLM(model, **tiers, **POOL) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert all(o.error is None for o in outs)
        return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs], \
            llm.stats()


def test_only_the_same_weights_and_kv_config_find_the_ssd_entries(tiny, tmp_path):
    prompts = _working_set(n=4, seed=7)
    folder = tmp_path / "ssd"
    tiers = dict(kv_offload_cpu_bytes=_cpu_bytes(40), kv_offload_ssd_path=str(folder),
                 kv_offload_ssd_bytes=_cpu_bytes(2000))
    want = _fill_ssd(tiny, folder, prompts)
    moved = _variant(tiny, tmp_path / "moved")
    tokens, cached, stats = _generate(moved, prompts, **tiers)
    assert tokens == want and cached[0] > 20 and stats["tier_ssd_found_blocks"] > 0
    for name, change in [("weight", _flip_a_weight_byte), ("rope", _set_rope_theta),
                         ("other", _other_model)]:
        model = _variant(tiny, tmp_path / name, change)
        off, _, _ = _generate(model, prompts)
        tokens, cached, stats = _generate(model, prompts, **tiers)
        assert tokens == off, name
        assert stats["tier_ssd_found_blocks"] == 0 and stats["tier_ssd_hit_blocks"] == 0, name
        assert stats["tier_checksum_failures"] == 0, name
    assert off != want  # the changed models do compute other tokens


def test_aborts_while_loads_are_in_flight_leak_nothing(tiny, tmp_path):
    prompts = _working_set(n=6, seed=5)
    _fill_ssd(tiny, tmp_path, prompts)
    with LLM(tiny, kv_offload_cpu_bytes=_cpu_bytes(40), kv_offload_ssd_path=str(tmp_path),
             kv_offload_ssd_bytes=_cpu_bytes(2000), **POOL) as llm:
        core = llm.engine
        stream = core.stream_batch([llm._request(p, GREEDY, None, 0).request for p in prompts])
        next(stream)  # one step: SSD hits start loading
        assert core.scheduler.tiers.num_loading
        stream.close()  # the caller leaves: every request is aborted, loads in flight
        for _ in range(200):
            if not core.scheduler.has_pending_worker_updates():
                break
            core.step()
            core.scheduler.check_integrity()
        tiers = core.scheduler.tiers
        assert not tiers.index.has_in_flight() and not tiers.num_loading
        assert all(not s.busy for s in tiers.cpu.slots)
        assert all(not e.busy for e in tiers.ssd._entries.values())
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        assert not core.scheduler.requests


@pytest.mark.usefixtures("late_copies")
def test_swap_preemption_gives_the_tokens_of_recompute(tiny):
    prompts = _working_set(n=6, seed=6)
    long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    outs, stats = {}, {}
    for mode in ("recompute", "swap"):
        with LLM(tiny, block_size=BS, num_kv_blocks=61, max_model_len=100,
                 kv_offload_cpu_bytes=_cpu_bytes(200), preemption_mode=mode) as llm:
            outs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, long,
                                                                         use_tqdm=False)]
            stats[mode] = llm.stats()
            _check(llm)
    assert stats["recompute"]["num_preemptions"] > 0 and stats["swap"]["tier_swap_outs"] > 0
    assert stats["swap"]["tier_swap_ins"] == stats["swap"]["tier_swap_outs"]
    assert outs["swap"] == outs["recompute"]

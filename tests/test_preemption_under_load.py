"""Swap preemption under load, and SSD hits at TP=3 on Ray (issue 29): greedy tokens identical
to recompute preemption and to an engine without tiers.

A pool far smaller than the batch's working set makes requests preempt each other again and
again; `swap` sends every victim's computed KV to the CPU tier and back, `auto` chooses by the
measured costs, `recompute` prefills them again. The tokens may not change, with async
scheduling too (a step in flight while its requests are swapped out), and every slot and
block comes back (check_integrity after each batch)."""
from __future__ import annotations

import random

import pytest

from tests.checkpoints import make_tiny_llama
from tierserve import LLM, SamplingParams

BS = 4
LONG = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def _cpu_bytes(model_blocks: int, layers: int, kv_heads: int) -> int:
    return model_blocks * 2 * layers * BS * kv_heads * 16 * 4  # K and V, head_dim 16, fp32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_llama(tmp_path_factory.mktemp("preempt") / "llama"))


def _prompts(n: int, seed: int, tail: tuple[int, int] = (8, 20)) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, 380) for _ in range(12)]
    return [system + [rng.randrange(3, 380) for _ in range(rng.randrange(*tail))]
            for _ in range(n)]


MODES = {"recompute": dict(preemption_mode="recompute"),
         "swap": dict(preemption_mode="swap"),
         "auto": dict(preemption_mode="auto"),
         "swap, async": dict(preemption_mode="swap", async_scheduling=True)}


def test_swap_and_auto_preempt_many_times_and_give_recomputes_tokens(tiny):
    """16 requests of ~45 tokens in a pool of 15 blocks (60 tokens): they preempt each other
    over and over."""
    prompts = _prompts(16, seed=9)
    tokens, stats = {}, {}
    for name, options in MODES.items():
        with LLM(tiny, block_size=BS, num_kv_blocks=16, max_model_len=60,
                 kv_offload_cpu_bytes=_cpu_bytes(200, 3, 2), **options) as llm:
            outs = llm.generate(prompts, LONG, use_tqdm=False)
            assert all(o.error is None for o in outs)
            tokens[name] = [o.outputs[0].token_ids for o in outs]
            llm.engine.scheduler.check_integrity()
            stats[name] = s = llm.stats()
            assert s["num_free_blocks"] == s["num_total_blocks"]
            assert s["num_running"] == s["num_waiting"] == 0
    assert stats["recompute"]["num_preemptions"] >= 12, stats["recompute"]
    for name in ("swap", "swap, async"):
        assert stats[name]["tier_swap_outs"] >= 10, stats[name]
        assert stats[name]["tier_swap_ins"] == stats[name]["tier_swap_outs"]
    assert stats["auto"]["num_preemptions"] >= 10
    assert stats["auto"]["tier_swap_ins"] == stats["auto"]["tier_swap_outs"]
    for name in MODES:
        assert tokens[name] == tokens["recompute"], name


@pytest.mark.usefixtures("ray_session")
def test_ssd_hits_at_tp3_on_ray_give_the_tokens_without_tiers(tmp_path):
    """An SSD folder filled by a TP=1 engine in this process serves a TP=3 deployment on Ray
    (three ranks, one KV head each): its prompts hit blocks in the folder, and its greedy
    tokens are those of TP=1 without any tier."""
    model = str(make_tiny_llama(tmp_path / "three", num_heads=6, num_kv_heads=3,
                                hidden_size=96, num_layers=2))
    prompts = _prompts(6, seed=3, tail=(40, 60))
    pool = dict(block_size=BS, num_kv_blocks=41, max_model_len=120)
    tiers = dict(kv_offload_cpu_bytes=_cpu_bytes(60, 2, 3), kv_offload_ssd_path=str(tmp_path),
                 kv_offload_ssd_bytes=_cpu_bytes(2000, 2, 3))
    short = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(model, **pool) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, short, use_tqdm=False)]
    with LLM(model, **pool, **tiers) as llm:  # its shutdown writes its blocks to the folder
        llm.generate(prompts, short, use_tqdm=False)
    with LLM(model, tensor_parallel_size=3, **pool, **tiers) as llm:
        outs = llm.generate(prompts, short, use_tqdm=False)
        stats = llm.stats()
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert stats["tier_ssd_found_blocks"] > 0 and stats["tier_loads"] > 0, stats
    assert sum(o.num_cached_tokens for o in outs) > 0

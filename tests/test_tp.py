"""Tensor parallelism over gloo in spawned processes: sharded logits, gathered on rank 0, equal
the TP=1 model's."""
from __future__ import annotations

import random
import socket
import traceback
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.checkpoints import (
    TINY_LLAMA3_ROPE, PagedRunner, Work, make_tiny_llama, make_tiny_qwen2, make_tiny_qwen3,
)
from tierserve.workers.model.layers import partition_heads
from tierserve.workers.model.loader import load_model, load_model_config
from tierserve.workers.model.llama import LlamaForCausalLM
from tierserve.workers.parallel import destroy_distributed, get_tp_size, init_distributed

# Sharding changes the order of float reductions (row-parallel all-reduce), nothing else.
ATOL = 1e-4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_scenario(model) -> dict[str, torch.Tensor]:
    """Prefill of mixed lengths, decode steps, a prefix-cached chunk, then greedy decoding."""
    rng = random.Random(0)
    vocab = model.config.vocab_size
    seqs = [[rng.randrange(3, vocab) for _ in range(n)] for n in (13, 6, 1)]
    runner = PagedRunner(model, num_blocks=80, block_size=4, seed=3)
    out = {"prefill": _cat(runner.step([Work(f"s{i}", s, 0) for i, s in enumerate(seqs)]))}
    decode = []
    for _ in range(3):
        for s in seqs:
            s.append(rng.randrange(3, vocab))
        decode += runner.step([Work(f"s{i}", s[-1:], len(s) - 1) for i, s in enumerate(seqs)])
    runner.share_prefix("s0", "c", 2)
    chunk = runner.step([Work("s1", [5], len(seqs[1])), Work("c", [7, 8, 9], 8)])
    out["decode"] = _cat(decode + chunk)
    out["greedy"] = torch.tensor(runner.greedy([seqs[0][:7], seqs[2][:1]], 8))
    return out


def _cat(logits: list) -> torch.Tensor | None:
    """The step's logits; None on a rank that got none (every rank but 0 under TP)."""
    if any(x is None for x in logits):
        assert all(x is None for x in logits)
        return None
    return torch.cat(logits)


def _backend(name: str):
    """The named CPU backend in a spawned rank (the test process built its kernels)."""
    from tierserve.runtime import envs
    from tierserve.workers.backends.cpu import kernel_backend

    return kernel_backend(name, envs.cache_dir())


def _tp_worker(rank: int, world_size: int, port: int, ckpts: list[str], out_dir: str,
               backend: str) -> None:
    torch.set_num_threads(1)  # several ranks share two cores
    init_distributed(rank, world_size, f"tcp://127.0.0.1:{port}", "gloo", timeout_s=120)
    try:
        results = {}
        for path in ckpts:
            _, model = load_model(path, backend=_backend(backend))
            results[path] = run_scenario(model)
            results[path]["kv_heads_per_rank"] = model.kv_heads_per_rank
        results["errors"] = _construction_errors(load_model_config(ckpts[0]))
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    except Exception:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        destroy_distributed()


def _construction_errors(config) -> dict[str, str]:
    """Messages raised when head counts cannot be split at this TP size."""
    import dataclasses

    errors = {}
    tp = get_tp_size()
    for label, heads, kv_heads in (("heads", 4 * tp + 2, 1), ("kv_heads", 4 * tp, 4)):
        try:
            LlamaForCausalLM(dataclasses.replace(
                config, num_attention_heads=heads, num_key_value_heads=kv_heads,
                hidden_size=heads * config.head_dim,
            ))
            errors[label] = ""
        except ValueError as exc:
            errors[label] = str(exc)
    return errors


def _run_tp(world_size: int, ckpts: list[Path], tmp_path: Path,
            backend: str = "torch") -> list[dict]:
    paths = [str(p) for p in ckpts]
    mp.spawn(_tp_worker, args=(world_size, _free_port(), paths, str(tmp_path), backend),
             nprocs=world_size, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]


def _assert_matches_tp1(ranks: list[dict], ckpt: Path, backend: str = "torch") -> None:
    _, model = load_model(str(ckpt), backend=_backend(backend))
    ref = run_scenario(model)
    got = ranks[0][str(ckpt)]
    for key in ("prefill", "decode"):
        torch.testing.assert_close(got[key], ref[key], atol=ATOL, rtol=0,
                                   msg=f"rank 0 {key} logits of {ckpt.name}")
    assert torch.equal(got["greedy"], ref["greedy"]), f"greedy tokens of {ckpt.name}"
    # The full vocabulary's logits are gathered on rank 0 alone, the rank that samples.
    for r, res in enumerate(ranks[1:], start=1):
        assert res[str(ckpt)]["prefill"] is None and res[str(ckpt)]["decode"] is None, r


@pytest.mark.parity
def test_tp2_llama_and_qwen2(tmp_path, backend):
    ckpts = [
        make_tiny_llama(tmp_path / "llama"),
        make_tiny_llama(tmp_path / "llama3", rope_scaling=TINY_LLAMA3_ROPE, seed=2),
        make_tiny_qwen2(tmp_path / "qwen2"),  # tied embeddings, q/k/v bias
        make_tiny_qwen3(tmp_path / "qwen3"),  # per-head q/k norms, replicated on the ranks
    ]
    ranks = _run_tp(2, ckpts, tmp_path, backend.name)
    for ckpt in ckpts:
        _assert_matches_tp1(ranks, ckpt, backend.name)
        assert ranks[0][str(ckpt)]["kv_heads_per_rank"] == 1


def test_tp3_nine_heads_three_kv_heads_odd_vocab(tmp_path):
    # vocab 301 leaves the last vocab shard padded; hidden 144 = 9 heads x 16.
    ckpt = make_tiny_llama(tmp_path / "llama9", vocab_size=301, hidden_size=144, num_heads=9,
                           num_kv_heads=3, num_layers=2, seed=5)
    ranks = _run_tp(3, [ckpt], tmp_path)
    _assert_matches_tp1(ranks, ckpt)
    assert ranks[0][str(ckpt)]["kv_heads_per_rank"] == 1
    errors = ranks[0]["errors"]
    assert "num_attention_heads (14) must be divisible by the TP size (3)" in errors["heads"]
    assert "num_key_value_heads (4) must divide, or be divisible by, the TP size (3)" in errors["kv_heads"]


def test_tp4_replicates_kv_heads(tmp_path):
    # 2 KV heads over 4 ranks: ranks 0,1 hold KV head 0 and ranks 2,3 hold KV head 1.
    ckpt = make_tiny_llama(tmp_path / "llama_rep", hidden_size=128, num_heads=8, num_kv_heads=2,
                           num_layers=2, tie_word_embeddings=True, seed=6)
    ranks = _run_tp(4, [ckpt], tmp_path)
    _assert_matches_tp1(ranks, ckpt)
    assert ranks[0][str(ckpt)]["kv_heads_per_rank"] == 1


@pytest.mark.parametrize(
    "heads, kv_heads, tp, expected",
    [(9, 3, 3, (3, 1)), (8, 2, 4, (2, 1)), (8, 8, 2, (4, 4)), (4, 1, 2, (2, 1)), (32, 8, 1, (32, 8))],
)
def test_partition_heads(heads, kv_heads, tp, expected):
    assert partition_heads(heads, kv_heads, tp) == expected


@pytest.mark.parametrize("heads, kv_heads, tp", [(4, 2, 3), (12, 4, 6), (6, 2, 3)])
def test_partition_heads_rejects_indivisible(heads, kv_heads, tp):
    with pytest.raises(ValueError, match="TP size"):
        partition_heads(heads, kv_heads, tp)


def test_tp1_collectives_are_noops():
    from tierserve.workers.parallel import get_tp_rank, tp_all_reduce, tp_gather

    init_distributed(0, 1, "tcp://127.0.0.1:1")  # world of one: no process group is created
    try:
        x = torch.arange(6.0).view(2, 3)
        assert (get_tp_rank(), get_tp_size()) == (0, 1)
        assert tp_all_reduce(x) is x and tp_gather(x) is x
    finally:
        destroy_distributed()

"""Our paged Llama/Qwen2 model against Hugging Face transformers on the same weights."""
from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch

from tests.checkpoints import (
    TINY_LLAMA3_ROPE,
    PagedRunner,
    Work,
    hf_greedy,
    hf_logits,
    load_hf,
    make_tiny_llama,
    make_tiny_mistral,
    make_tiny_qwen2,
    make_tiny_qwen2_sliding,
    make_tiny_qwen3,
    write_llama_gguf,
)
from tierserve.workers.attention import AttentionMetadata
from tierserve.workers.kv_pool import _Prefaulter, allocate_kv_cache, kv_cache_bytes_per_block
from tierserve.workers.model.loader import (
    default_model_path,
    iter_weights,
    load_model,
    load_model_config,
)
from tierserve.workers.model.llama import LlamaForCausalLM
from tierserve.workers.model.config import ModelConfig

ATOL = 1e-4


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


@pytest.fixture(scope="module")
def tiny_ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {
        "llama": make_tiny_llama(root / "llama"),
        "llama3_rope": make_tiny_llama(root / "llama3", rope_scaling=TINY_LLAMA3_ROPE, seed=2),
        "qwen2": make_tiny_qwen2(root / "qwen2"),
        "qwen3": make_tiny_qwen3(root / "qwen3"),
        "mistral": make_tiny_mistral(root / "mistral"),
    }


@pytest.fixture(scope="module")
def hf_models(tiny_ckpts):
    return {name: load_hf(path) for name, path in tiny_ckpts.items()}


@pytest.fixture(scope="module", params=["llama", "llama3_rope", "qwen2", "qwen3", "mistral"])
def pair(request, tiny_ckpts, hf_models, backend):
    """(HF reference model, our model on the pinned CPU backend) on one tiny checkpoint."""
    path = tiny_ckpts[request.param]
    return hf_models[request.param], load_model(str(path), backend=backend)[1]


@pytest.mark.parity
def test_prefill_batch_matches_hf(pair):
    hf, ours = pair
    rng = random.Random(0)
    prompts = [_tokens(rng, n, ours.config.vocab_size) for n in (5, 1, 13, 30, 8)]
    runner = PagedRunner(ours)
    logits = runner.step([Work(f"s{i}", p, 0) for i, p in enumerate(prompts)])
    for prompt, got in zip(prompts, logits):
        torch.testing.assert_close(got, hf_logits(hf, prompt), atol=ATOL, rtol=0)


@pytest.mark.parity
def test_decode_steps_on_scattered_blocks_match_hf(pair):
    hf, ours = pair
    rng = random.Random(1)
    vocab = ours.config.vocab_size
    seqs = [_tokens(rng, n, vocab) for n in (3, 9, 16, 22)]
    runner = PagedRunner(ours, seed=5)
    runner.step([Work(f"s{i}", s, 0) for i, s in enumerate(seqs)])
    step_logits = []
    for _ in range(7):
        works = []
        for i, s in enumerate(seqs):
            s.append(rng.randrange(3, vocab))
            works.append(Work(f"s{i}", [s[-1]], len(s) - 1))
        step_logits.append(runner.step(works))
    # Block ids were drawn from a shuffled free list, so tables are scattered.
    assert any(t != sorted(t) for t in runner.tables.values())
    for i, s in enumerate(seqs):
        ref = hf_logits(hf, s)
        for k, logits in enumerate(step_logits):
            pos = len(s) - 7 + k
            torch.testing.assert_close(logits[i][0], ref[pos], atol=ATOL, rtol=0)


@pytest.mark.parity
def test_mixed_batch_with_cached_prefixes_matches_hf(pair):
    """Decodes first, then prefill chunks after a prefix cached earlier, after a prefix shared
    with another sequence, and after a prefix another sequence writes in this same step."""
    hf, ours = pair
    rng = random.Random(2)
    vocab = ours.config.vocab_size
    bs = 4
    a = _tokens(rng, 14, vocab)
    b = _tokens(rng, 6, vocab)
    d = _tokens(rng, 19, vocab)
    runner = PagedRunner(ours, block_size=bs, seed=9)
    runner.step([Work("a", a, 0), Work("b", b, 0), Work("d", d[:8], 0)])

    c = a[:12] + _tokens(rng, 5, vocab)  # hits a's 3 full blocks
    runner.share_prefix("a", "c", 3)
    e = _tokens(rng, 8, vocab)
    f = e[:8] + _tokens(rng, 3, vocab)  # its prefix is written by e in this very step
    runner.reserve("e", len(e))
    runner.share_prefix("e", "f", 2)
    a.append(rng.randrange(3, vocab))
    b.append(rng.randrange(3, vocab))
    works = [
        Work("a", a[-1:], len(a) - 1), Work("b", b[-1:], len(b) - 1),
        Work("c", c[12:], 12), Work("d", d[8:], 8), Work("e", e, 0), Work("f", f[8:], 8),
    ]
    full = [a, b, c, d, e, f]
    for work, seq, got in zip(works, full, runner.step(works)):
        ref = hf_logits(hf, seq)[work.start : work.start + len(work.tokens)]
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0, msg=f"sequence {work.seq_id}")


@pytest.mark.parity
def test_greedy_generation_matches_hf_generate(pair):
    hf, ours = pair
    rng = random.Random(3)
    prompts = [_tokens(rng, n, ours.config.vocab_size) for n in (4, 11, 1)]
    got = PagedRunner(ours, num_blocks=64, seed=4).greedy(prompts, 12)
    assert got == [hf_greedy(hf, p, 12) for p in prompts]


@pytest.fixture(scope="module")
def sliding(tmp_path_factory):
    root = tmp_path_factory.mktemp("sliding")
    return {"mistral_w8": make_tiny_mistral(root / "mistral", sliding_window=8, seed=7),
            "qwen2_w6": make_tiny_qwen2_sliding(root / "qwen2", window=6)}


@pytest.mark.parity
@pytest.mark.parametrize("name", ["mistral_w8", "qwen2_w6"])
def test_sliding_window_matches_hf_past_the_window(sliding, name, backend):
    """Mistral's sliding window (every layer) and Qwen2's (layers past max_window_layers):
    prefill logits of prompts 3-4x the window, in one chunk and as a chunk after a cached
    prefix, then decode steps and greedy tokens, against transformers."""
    path = sliding[name]
    hf, ours = load_hf(path), load_model(str(path), backend=backend)[1]
    window = ours.config.sliding_window
    assert window is not None and any(ours.config.window_of(i) for i in range(3))
    rng = random.Random(11)
    vocab = ours.config.vocab_size
    seqs = [_tokens(rng, n, vocab) for n in (3 * window + 1, 4 * window, window - 1)]
    runner = PagedRunner(ours, block_size=4, seed=2)
    logits = runner.step([Work("a", seqs[0], 0), Work("b", seqs[1][:10], 0),
                          Work("c", seqs[2], 0)])
    torch.testing.assert_close(logits[0], hf_logits(hf, seqs[0]), atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[2], hf_logits(hf, seqs[2]), atol=ATOL, rtol=0)
    got = runner.step([Work("b", seqs[1][10:], 10)])[0]  # a chunk after a cached prefix
    torch.testing.assert_close(got, hf_logits(hf, seqs[1])[10:], atol=ATOL, rtol=0)
    for _ in range(3):  # decodes, each past the window
        for s in seqs:
            s.append(rng.randrange(3, vocab))
        steps = runner.step([Work(k, s[-1:], len(s) - 1) for k, s in zip("abc", seqs)])
        for s, got in zip(seqs, steps):
            torch.testing.assert_close(got[0], hf_logits(hf, s)[-1], atol=ATOL, rtol=0)
    prompts = [seqs[0][:2 * window + 3], seqs[2]]
    assert PagedRunner(ours, seed=5).greedy(prompts, 12) == [hf_greedy(hf, p, 12)
                                                             for p in prompts]


@pytest.mark.parity
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_tracks_fp32(tiny_ckpts, dtype, backend):
    path = str(tiny_ckpts["llama"])
    _, ref_model = load_model(path)
    _, half = load_model(path, dtype=dtype, backend=backend)
    qkv = half.model.layers[0].self_attn.qkv_proj
    assert qkv.method.weight().dtype == dtype
    rng = random.Random(4)
    prompts = [_tokens(rng, n, ref_model.config.vocab_size) for n in (7, 12)]
    works = [Work(f"s{i}", p, 0) for i, p in enumerate(prompts)]
    ref = torch.cat(PagedRunner(ref_model).step(works))
    got = torch.cat(PagedRunner(half).step(works))
    assert got.dtype == torch.float32
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()


def test_load_weights_rejects_missing_and_unknown_tensors(tiny_ckpts):
    path = str(tiny_ckpts["llama"])
    config = load_model_config(path)
    weights = dict(iter_weights(path))
    model = LlamaForCausalLM(config)
    partial = {k: v for k, v in weights.items() if k != "model.layers.1.self_attn.k_proj.weight"}
    with pytest.raises(ValueError, match=r"qkv_proj\.weight\[k\]"):
        model.load_weights(partial.items())
    with pytest.raises(ValueError, match="unexpected checkpoint tensor"):
        model.load_weights([*weights.items(), ("model.layers.0.mlp.extra.weight", torch.zeros(1))])
    bad = dict(weights, **{"model.norm.weight": torch.ones(3)})
    with pytest.raises(ValueError, match="model.norm.weight"):
        model.load_weights(bad.items())


def test_model_config_from_hf_dicts(tiny_ckpts):
    llama3 = load_model_config(str(tiny_ckpts["llama3_rope"]))
    assert llama3.rope_scaling_dict["rope_type"] == "llama3"
    assert llama3.rope_scaling_dict["original_max_position_embeddings"] == 64
    hash(llama3)  # frozen and hashable, so it can key caches
    qwen = load_model_config(str(tiny_ckpts["qwen2"]))
    assert (qwen.architecture, qwen.attention_bias, qwen.tie_word_embeddings) == ("qwen2", True, True)
    assert qwen.eos_token_ids == (2,) and qwen.rope_theta == 1e6
    qwen3 = load_model_config(str(tiny_ckpts["qwen3"]))
    assert (qwen3.architecture, qwen3.qk_norm, qwen3.attention_bias, qwen3.head_dim) == \
        ("qwen3", True, False, 32)
    # transformers 4.x layout: rope_theta at top level, rope_scaling with "type".
    old = ModelConfig.from_hf_config({
        "model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 500000.0,
        "rope_scaling": {"type": "linear", "factor": 2.0}, "eos_token_id": [5, 6],
    })
    assert old.rope_theta == 5e5 and old.rope_scaling_dict == {"rope_type": "linear", "factor": 2.0}
    assert (old.num_key_value_heads, old.head_dim, old.eos_token_ids) == (2, 4, (5, 6))
    with pytest.raises(ValueError, match="unsupported model_type"):
        ModelConfig.from_hf_config({"model_type": "gpt2"})


def test_kv_cache_size_and_metadata_validation(tiny_ckpts):
    config = load_model_config(str(tiny_ckpts["llama"]))
    # 3 layers x K+V x 4 slots x 2 KV heads x 16 dims x 4 bytes; TP=2 halves the heads.
    assert kv_cache_bytes_per_block(config, 1, 4, torch.float32) == 3 * 2 * 4 * 2 * 16 * 4
    assert kv_cache_bytes_per_block(config, 2, 4, torch.bfloat16) == 3 * 2 * 4 * 1 * 16 * 2
    with pytest.raises(ValueError, match="query_len == 1"):
        AttentionMetadata.build(slot_mapping=[0, 1], query_lens=[2], seq_lens=[2],
                                block_tables=[[0]], num_decodes=1, block_size=4)
    with pytest.raises(ValueError, match="cannot hold"):
        AttentionMetadata.build(slot_mapping=[0], query_lens=[1], seq_lens=[5],
                                block_tables=[[0]], num_decodes=1, block_size=4)


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_cpu_pools_are_zero_and_faulted_in_at_allocation():
    """The kernel maps the pools' pages in up front (where it can), so the decode path takes
    no page faults on fresh KV; pools read zero and keep what is written."""
    before = _rss_bytes()
    pools = allocate_kv_cache(4, 1024, 16, 4, 64, torch.float32, "cpu")  # 4 x 2 x 16 MiB
    pool_bytes = 4 * 2 * 1024 * 16 * 4 * 64 * 4
    if _Prefaulter.supported:
        assert _rss_bytes() - before >= pool_bytes * 9 // 10
    assert all(k.eq(0).all() and v.eq(0).all() for k, v in pools)
    pools[3][1][1023, 15].fill_(-2.0)
    assert pools[3][1][1023, 15].eq(-2.0).all() and pools[3][1][1023, :15].eq(0).all()


# ---------------------------------------------------------------------------- GGUF


def test_gguf_loader_undoes_llama_cpp_permutation(tiny_ckpts, tmp_path):
    folder = tiny_ckpts["llama"]
    gguf_file = write_llama_gguf(folder, tmp_path / "tiny.gguf")
    from_gguf, from_hf = load_model_config(str(gguf_file)), load_model_config(str(folder))
    # GGUF stores the epsilon as float32; everything else must agree exactly.
    assert from_gguf.rms_norm_eps == pytest.approx(from_hf.rms_norm_eps, rel=1e-6)
    assert from_gguf == dataclasses.replace(from_hf, rms_norm_eps=from_gguf.rms_norm_eps)
    expected = dict(iter_weights(str(folder)))
    got = dict(iter_weights(str(gguf_file)))
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.parity
def test_a_qwen3_gguf_runs_as_its_hf_folder(tiny_ckpts, hf_models, tmp_path, backend):
    folder = tiny_ckpts["qwen3"]
    gguf_file = write_llama_gguf(folder, tmp_path / "qwen3.gguf")
    config = load_model_config(str(gguf_file))
    assert (config.architecture, config.qk_norm, config.head_dim) == ("qwen3", True, 32)
    ours = load_model(str(gguf_file), backend=backend)[1]
    rng = random.Random(6)
    prompts = [_tokens(rng, n, config.vocab_size) for n in (3, 9)]
    got = PagedRunner(ours, num_blocks=64, seed=2).greedy(prompts, 8)
    assert got == [hf_greedy(hf_models["qwen3"], p, 8) for p in prompts]


@pytest.fixture(scope="session")
def smollm2_hf():
    """SmolLM2's config and transformers' own GGUF conversion of the same file. Session-wide:
    the suite runs its tests grouped by backend, so a module's fixture would be rebuilt (about
    ten seconds) once per backend.

    transformers' `from_pretrained(gguf_file=...)` needs `accelerate`, which tierserve does not
    depend on; its underlying `load_gguf_checkpoint` (dequantize, reverse permute, rename) and
    GGUF config parsing are what it would run, so the reference is built from those directly.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = default_model_path()
    config = load_model_config(path)
    with torch.device("meta"):
        # Only names matter to the tensor-name map; the real config comes from transformers.
        mapping_model = AutoModelForCausalLM.from_config(_hf_llama_config(config))
    parsed = load_gguf_checkpoint(path, return_tensors=True, model_to_load=mapping_model)
    hf_config = AutoConfig.for_model(**parsed["config"])
    hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    missing, unexpected = hf.load_state_dict(parsed["tensors"], strict=False)
    assert (missing, unexpected) == (["lm_head.weight"], [])  # tied to the embedding
    return config, hf.eval()


@pytest.fixture
def smollm2(smollm2_hf, backend):
    """(config, our SmolLM2 on the pinned CPU backend, transformers' SmolLM2)."""
    config, hf = smollm2_hf
    return config, load_model(default_model_path(), backend=backend)[1], hf


def _hf_llama_config(config: ModelConfig):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, tie_word_embeddings=True,
    )


SMOL_PROMPT = [1, 504, 3458, 282, 4649, 314, 2114, 30, 378, 3622, 314, 253]


def test_default_gguf_config():
    config = load_model_config(default_model_path())
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert (config.vocab_size, config.hidden_size, config.head_dim) == (49152, 576, 64)
    assert config.tie_word_embeddings and config.eos_token_ids == (2,)
    assert os.path.basename(default_model_path()) == "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.parity
def test_smollm2_gguf_logits_match_transformers(smollm2):
    config, ours, hf = smollm2
    hf_cfg = hf.config
    assert (hf_cfg.rms_norm_eps, hf_cfg.rope_parameters["rope_theta"]) == (config.rms_norm_eps, config.rope_theta)
    runner = PagedRunner(ours, num_blocks=32, block_size=16)
    got = runner.step([Work("p", SMOL_PROMPT, 0)])[0]
    torch.testing.assert_close(got, hf_logits(hf, SMOL_PROMPT), atol=1e-3, rtol=0)


@pytest.mark.parity
def test_smollm2_gguf_greedy_matches_transformers(smollm2):
    _, ours, hf = smollm2
    prompts = [SMOL_PROMPT, SMOL_PROMPT[:5]]
    got = PagedRunner(ours, num_blocks=32, block_size=16).greedy(prompts, 10)
    assert got == [hf_greedy(hf, p, 10) for p in prompts]


@pytest.mark.parametrize("name,dtype,quant", [
    ("llama", torch.float32, None), ("qwen2", torch.bfloat16, None),  # qwen2: biases
    ("mistral", torch.float32, None), ("qwen2", torch.float32, "q4_1"),  # mistral: windows
    ("qwen3", torch.float32, None), ("qwen3", torch.bfloat16, None),  # per-head q/k norms
    ("qwen2", torch.float32, "q8_0"),  # int8 activations (int8_linear.py), biases
    ("qwen2", torch.bfloat16, "q8_0"), ("llama", torch.bfloat16, "q4_1")])  # codes, bf16 rows
def test_layer_stack_is_bitwise_the_layer_by_layer_path(tiny_ckpts, kernels, name, dtype, quant,
                                                        monkeypatch):
    """A kernel backend runs a step's layers in one call (backends/stack.py) where every piece
    takes a kernel: prefills, single decodes, batches and mixed steps projecting some rows give
    the very logits and pools of the model's layer-by-layer path (biases, sliding windows,
    quantized linears, per-head q/k norms included)."""
    from tierserve.workers.backends.stack import KernelLayerStack
    taken = []
    run = KernelLayerStack.run
    monkeypatch.setattr(KernelLayerStack, "run", lambda self, *a: taken.append(
        run(self, *a) is not None) or run(self, *a))
    model = load_model(str(tiny_ckpts[name]), dtype=dtype, backend=kernels,
                       quantization=quant)[1]
    rng = random.Random(4)
    seqs = [_tokens(rng, n, model.config.vocab_size) for n in (7, 19, 2)]
    stacked, plain = PagedRunner(model, seed=3), PagedRunner(model, seed=3)

    def both(works):
        model.model.use_layer_stack = True
        a = stacked.step(works)
        model.model.use_layer_stack = False
        b = plain.step(works)
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    both([Work(f"s{i}", s, 0) for i, s in enumerate(seqs)])
    for step in range(6):
        live = seqs if step % 2 else seqs[:1]  # one row, then the batch
        for s in live:
            s.append(rng.randrange(3, model.config.vocab_size))
        both([Work(f"s{i}", s[-1:], len(s) - 1) for i, s in enumerate(live)])
    # oneDNN's packed half-precision weights take the panel kernel for single rows alone.
    # A mixed step (decodes, then a new prompt) whose last layer projects the kept rows alone.
    seqs.append(_tokens(rng, 9, model.config.vocab_size))
    for s in seqs[:3]:
        s.append(rng.randrange(3, model.config.vocab_size))
    works = [Work(f"s{i}", s[-1:], len(s) - 1) for i, s in enumerate(seqs[:3])]
    model.model.use_layer_stack = True
    a = stacked.step(works + [Work("s3", seqs[3], 0)], keep=[0, 1, 2, 11])
    model.model.use_layer_stack = False
    b = plain.step(works + [Work("s3", seqs[3], 0)], keep=[0, 1, 2, 11])
    assert len(a) == 4 and all(torch.equal(x, y) for x, y in zip(a, b))
    assert len(taken) == 8 and all(taken[1:6:2])
    assert all(taken) or (dtype != torch.float32 and kernels.half_linear_for(dtype) == "onednn")
    for (k1, v1), (k2, v2) in zip(stacked.kv_caches, plain.kv_caches):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)

"""The CUDA path, where a GPU is present (skipped elsewhere): greedy tokens equal transformers'
on tiny Llama / Qwen2 / Mistral checkpoints in fp32 under prefix caching, chunked prefill and
preemption; the CPU and SSD tiers (pinned slots, a copy stream and events) and swap preemption
keep the tokens of the untiered run; n-gram speculation keeps greedy output; bf16 (the CUDA
default dtype) serves and frees every block; seeded sampling repeats; Q8_0 / Q4_1 weights (a GGUF
file, or quantized at load) give the CPU torch backend's tokens."""
from __future__ import annotations

import pytest
import torch

from tests.checkpoints import hf_greedy, load_hf, make_tiny_llama, make_tiny_mistral, \
    make_tiny_qwen2, make_tiny_qwen3, write_llama_gguf
from tierserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = dict(device="cuda", dtype="float32")
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
MODES = {
    "prefix_caching": dict(block_size=4),
    "chunked": dict(max_num_batched_tokens=16, long_prefill_token_threshold=8, block_size=4),
    "preempted": dict(num_kv_blocks=41, block_size=4, max_model_len=80),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda")
    return {"llama": str(make_tiny_llama(root / "llama")),
            "qwen2": str(make_tiny_qwen2(root / "qwen2")),
            "qwen3": str(make_tiny_qwen3(root / "qwen3")),
            "mistral": str(make_tiny_mistral(root / "mistral"))}


def _prompts(vocab: int, n: int = 6) -> list[list[int]]:
    shared = [(7 * i + 3) % (vocab - 3) + 3 for i in range(37)]
    return [shared[:5 + 6 * i] + [(11 * i + j) % (vocab - 3) + 3 for j in range(3 + 4 * i)]
            for i in range(n)]


def _tokens(llm, prompts, params=GREEDY) -> list[list[int]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.outputs[0].token_ids for o in outs]


def _all_blocks_free(llm) -> None:
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    scheduler = getattr(llm.engine, "scheduler", None)
    if scheduler is not None:
        scheduler.check_integrity()


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "mistral"])
def test_greedy_equals_transformers_on_cuda(checkpoints, name, mode):
    hf = load_hf(checkpoints[name])
    prompts = _prompts(hf.config.vocab_size)
    want = [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    with LLM(checkpoints[name], **CUDA, **MODES[mode]) as llm:
        backend = llm.stats()
        for _ in range(2):  # the second pass hits the prefix cache
            assert _tokens(llm, prompts) == want
        _all_blocks_free(llm)
    assert backend["cpu_backend"] == "cuda"


def test_tiers_and_swap_keep_the_tokens_on_cuda(checkpoints, tmp_path):
    path = checkpoints["llama"]
    prompts = _prompts(384, n=10) * 2
    pool = dict(block_size=4, num_kv_blocks=41, max_model_len=120, **CUDA)
    block_bytes = 2 * 3 * 4 * 2 * 16 * 4  # K and V, 3 layers, 4 tokens, 2 heads of 16, fp32
    with LLM(path, **pool) as llm:
        want = [_tokens(llm, prompts[i:i + 4]) for i in range(0, len(prompts), 4)]
    tiered = dict(kv_offload_cpu_bytes=40 * block_bytes, kv_offload_ssd_path=str(tmp_path),
                  kv_offload_ssd_bytes=2000 * block_bytes)
    with LLM(path, **pool, **tiered) as llm:
        got = [_tokens(llm, prompts[i:i + 4]) for i in range(0, len(prompts), 4)]
        stats = llm.stats()
        _all_blocks_free(llm)
    assert got == want
    assert stats["tier_demotions"] > 0 and stats["tier_promotions"] + stats["tier_loads"] > 0
    long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    outs = {}
    for mode in ("recompute", "swap"):
        with LLM(path, block_size=4, num_kv_blocks=61, max_model_len=100, preemption_mode=mode,
                 kv_offload_cpu_bytes=200 * block_bytes, **CUDA) as llm:
            outs[mode] = _tokens(llm, prompts[:6], long)
            stats = llm.stats()
            _all_blocks_free(llm)
    assert stats["tier_swap_outs"] > 0
    assert outs["swap"] == outs["recompute"]


def test_speculation_keeps_greedy_output_on_cuda(checkpoints):
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [20, 21, 22, 20, 21, 22, 20, 21]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1}
    with LLM(checkpoints["llama"], block_size=4, **CUDA) as llm:
        want = _tokens(llm, prompts, params)
    with LLM(checkpoints["llama"], block_size=4, speculative_config=spec, **CUDA) as llm:
        got = _tokens(llm, prompts, params)
        stats = llm.stats()
    assert got == want
    assert stats["spec_num_draft_tokens"] > 0


def test_seeded_speculation_rewinds_its_cuda_generator(checkpoints):
    """Rejected drafts' draws are rewound on the device's generator (get_state / set_state and
    skip_draws on CUDA): the seeded streams repeat, with drafts rejected along the way."""
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [20, 21, 22, 20, 21, 22, 20, 21]]
    params = SamplingParams(temperature=0.2, max_tokens=24, ignore_eos=True, seed=5)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1}
    with LLM(checkpoints["llama"], block_size=4, speculative_config=spec, **CUDA) as llm:
        first = _tokens(llm, prompts, params)
        again = _tokens(llm, prompts, params)
        stats = llm.stats()
    assert first == again
    assert stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]


def test_bf16_default_serves_and_seeded_sampling_repeats(checkpoints):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, seed=7)
    prompts = _prompts(384, n=4)
    with LLM(checkpoints["llama"], block_size=4, **CUDA) as llm:
        fp32_bytes = llm.stats()["weight_bytes"]
    with LLM(checkpoints["llama"], device="cuda", block_size=4) as llm:
        assert llm.stats()["weight_bytes"] < fp32_bytes
        first = _tokens(llm, prompts, seeded)
        again = _tokens(llm, prompts[::-1], seeded)[::-1]
        greedy = _tokens(llm, prompts)
        _all_blocks_free(llm)
    assert first == again
    assert all(len(t) == 12 for t in first) and all(len(t) == 10 for t in greedy)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_quantized_weights_serve_on_cuda(tmp_path, fmt):
    """A GGUF file of block codes and the same weights quantized at load serve on CUDA (decode
    graphs replayed) with the tokens of the CPU's torch backend quantizing at load (the same
    dequantized values); quantized at load, only the codes are kept on the GPU."""
    llama = make_tiny_llama(tmp_path / "llama", tie_word_embeddings=True)
    gguf_file = write_llama_gguf(llama, tmp_path / f"tiny-{fmt}.gguf", quantize=fmt)
    prompts = _prompts(384)
    with LLM(str(llama), device="cpu", dtype="float32", cpu_isa="torch", block_size=4,
             quantization=fmt) as llm:
        want = _tokens(llm, prompts)
    with LLM(str(llama), block_size=4, **CUDA) as llm:
        dense_bytes = llm.stats()["weight_bytes"]
    sources = {"gguf": dict(model=str(gguf_file), tokenizer=str(llama)),
               "at_load": dict(model=str(llama), quantization=fmt)}
    for source, opts in sources.items():
        with LLM(**opts, block_size=4, **CUDA) as llm:
            assert _tokens(llm, prompts) == want, source
            assert _graphs(llm).replays > 0 and _graphs(llm).failed is None
            if source == "at_load":
                assert llm.stats()["weight_bytes"] < dense_bytes / 2.5
            _all_blocks_free(llm)


def _graphs(llm):
    return llm.engine.executor.worker.runner.graphs  # the in-process engine's one rank


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_graphs_replay_with_the_eager_tokens(checkpoints, dtype):
    """Decode steps replay captured graphs (several batch and context buckets, batches that
    shrink as requests finish) and give enforce_eager's tokens (in fp32: bf16 products of a
    padded batch may round differently); every block is freed."""
    prompts = _prompts(384, n=6)
    lengths = [4, 9, 17, 30, 6, 12]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    runs = {}
    for eager in (True, False):
        with LLM(checkpoints["llama"], device="cuda", dtype=dtype, block_size=4,
                 enforce_eager=eager) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            alone = _tokens(llm, prompts[:1], params[3])
            graphs = _graphs(llm)
            _all_blocks_free(llm)
        runs[eager] = ([o.outputs[0].token_ids for o in outs], alone)
        if eager:
            assert graphs is None
    assert graphs.failed is None, graphs.failed
    assert graphs.replays > 30 and len(graphs.graphs) >= 4
    assert {batch for batch, _ in graphs.graphs} >= {1, 2, 8}
    if dtype == "float32":
        assert runs[False] == runs[True]
    assert [len(t) for t in runs[False][0]] == lengths

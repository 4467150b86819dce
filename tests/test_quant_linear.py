"""Linears run from GGUF codes (backends/quant.py, csrc/quant.cpp): the encoder takes exactly the
weights that are dequantized Q4_1 / Q8_0 blocks and nothing else, the product equals the fp32
panel kernel's bit for bit at every batch size the panel kernel takes, and a quantized GGUF
model gives the same logits from its codes alone as from fp32 panels. Quantization at load (the
`quantization` option): the codes equal gguf-py's reference quantizer's on the same weights, and
a GGUF file and the same HF weights quantized at load give the same tokens."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tests.checkpoints import PagedRunner, Work, make_tiny_llama, write_llama_gguf
from tierserve.workers.backends.cpu import kernel_backend
from tierserve.workers.backends.linear import PanelWeight
from tierserve.workers.backends.quant import QuantPanelWeight, dequantize
from tierserve.workers.model.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear
from tierserve.workers.model.loader import load_model

QT = gguf.GGMLQuantizationType


def dequantized(n: int, k: int, qtype, seed: int = 0, scale: float = 0.05) -> torch.Tensor:
    """An fp32 [n, k] weight that is GGUF `qtype` blocks dequantized."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * scale
    raw = gguf.quants.quantize(w, qtype)
    return torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(n, k))


@pytest.mark.parametrize("qtype,fmt", [(QT.Q4_1, "q4_1"), (QT.Q8_0, "q8_0")])
@pytest.mark.parametrize("n,k", [(200, 576), (16, 32), (49, 1536)])
def test_codes_give_the_panel_kernels_result_bit_for_bit(kernels, qtype, fmt, n, k):
    weight = dequantized(n, k, qtype, seed=n + k)
    panel = PanelWeight(weight, kernels)
    quant = QuantPanelWeight.encode(weight, kernels)
    assert quant is not None and quant.format == fmt
    g = torch.Generator().manual_seed(k)
    bias = torch.randn(n, generator=g)
    # Row tiles of every size in registers, then one rebuild per k-slice (9 rows on), row
    # blocks past 192 (AVX2's panel kernel takes them).
    for m in (1, 2, 3, 4, 5, 7, 8, 9, 17, 64, min(kernels.panel_max_rows, 200)):
        x = torch.randn(m, k, generator=g)
        for b in (None, bias):
            want = kernels.linear_f32(x, panel.panels, b, n)
            got = (kernels.ops.linear_q4_1(x, quant.codes, quant.scales, quant.offsets, b, n)
                   if fmt == "q4_1" else kernels.ops.linear_q8_0(x, quant.codes, quant.scales, b, n))
            assert torch.equal(got, want), (m, b is None)
            assert torch.equal(quant.linear(x, b), want)


def test_a_strided_input_row_and_the_routes(kernels):
    weight = dequantized(64, 96, QT.Q4_1)
    panel = PanelWeight(weight, kernels)
    quant = QuantPanelWeight.encode(weight, kernels)
    wide = torch.randn(3, 200)
    x = wide[:, 10:106]  # rows with a stride of 200
    assert torch.equal(quant.linear(x, None), kernels.linear_f32(x.contiguous(), panel.panels, None, 64))
    # Past the panel kernel's rows the codes are rebuilt for the call, then AMX or MKL.
    big = torch.randn(kernels.panel_max_rows + 1, 96)
    assert torch.equal(quant.linear(big, None), panel.linear(big, None))
    assert torch.equal(quant.weight(), weight)


def test_weights_that_are_not_gguf_blocks_are_declined(kernels):
    g = torch.Generator().manual_seed(1)
    plain = torch.randn(64, 64, generator=g)
    assert QuantPanelWeight.encode(plain, kernels) is None
    # One value off by an ulp in one block breaks the exact rebuild.
    weight = dequantized(32, 64, QT.Q8_0)
    weight[5, 40] = torch.nextafter(weight[5, 40], torch.tensor(1.0))
    assert kernels.ops.quant_encode_q8_0(weight)[0].numel() == 0
    for bad in (float("nan"), float("inf")):
        w = dequantized(32, 64, QT.Q4_1)
        w[0, 0] = bad
        assert QuantPanelWeight.encode(w, kernels) is None
    # Rows of one repeated value (zero scale) and of zeros encode.
    flat = torch.zeros(16, 64)
    flat[3] = 0.25
    assert kernels.ops.quant_encode_q4_1(flat)[0].numel() > 0
    # K that is not a multiple of 32, and bf16 weights, keep the panels alone.
    odd = dequantized(16, 64, QT.Q4_1)[:, :48].contiguous()
    assert QuantPanelWeight.encode(odd, kernels) is None


def test_off_switch_and_other_backends(tmp_path):
    from tierserve.runtime import envs
    from tierserve.workers.backends.cpu import plan_for
    from tierserve.workers.backends.cpu_features import detect_cpu_features
    from tierserve.workers.backends.portable import torch_backend

    weight = dequantized(32, 64, QT.Q4_1)
    assert not isinstance(torch_backend().linear_method(weight), QuantPanelWeight)
    features = detect_cpu_features()
    if not features.isas:
        pytest.skip("this CPU runs no kernel backend")
    on = kernel_backend(features.isas[0], envs.cache_dir())
    off = plan_for(on.name, features, on.ops, quant_linear=False)
    assert QuantPanelWeight.encode(weight, off) is None
    assert isinstance(off.linear_method(weight), PanelWeight)
    assert isinstance(on.linear_method(weight), QuantPanelWeight)
    assert "quant_linear" in on.describe()["paths"] and "quant_linear" not in off.describe()["paths"]


@pytest.fixture(scope="module")
def quantized_gguf(tmp_path_factory):
    folder = make_tiny_llama(tmp_path_factory.mktemp("q") / "llama", hidden_size=64,
                             num_heads=4, num_kv_heads=2, tie_word_embeddings=True)
    return write_llama_gguf(folder, folder.parent / "tiny-q.gguf", quantize=True)


def test_quantized_gguf_model_runs_from_codes_with_the_same_logits(kernels, quantized_gguf):
    from tierserve.workers.backends.cpu import plan_for
    from tierserve.workers.backends.cpu_features import detect_cpu_features

    _, model = load_model(str(quantized_gguf), backend=kernels)
    formats = {name: m.method.format for name, m in model.named_modules()
               if isinstance(m, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead))
               and isinstance(m.method, QuantPanelWeight)}
    assert formats and all(f == ("q8_0" if "lm_head" in n else "q4_1") for n, f in formats.items())
    assert len(formats) == 1 + 4 * model.config.num_hidden_layers  # qkv, o, gate_up, down, head
    off = plan_for(kernels.name, detect_cpu_features(), kernels.ops, quant_linear=False)
    _, plain = load_model(str(quantized_gguf), backend=off)
    assert not any(isinstance(m.method, QuantPanelWeight) for m in plain.modules()
                   if isinstance(m, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)))
    # Only the codes are kept: the tied embedding looks its rows up in the head's codes.
    assert model.model.embed_tokens.weight is None
    assert model.weight_bytes() < plain.weight_bytes() / 3
    # A prefill, then decodes of 3 sequences and of 1, on both models.
    prompts = [[5, 9, 17, 33, 2 + i, 40, 41] for i in range(3)]
    logits = []
    for m in (model, plain):
        runner = PagedRunner(m, num_blocks=32, block_size=4)
        steps = [runner.step([Work(f"s{i}", p, 0) for i, p in enumerate(prompts)])]
        steps.append(runner.step([Work(f"s{i}", [7], len(p)) for i, p in enumerate(prompts)]))
        steps.append(runner.step([Work("s0", [8], len(prompts[0]) + 1)]))
        logits.append(steps)
    for got, want in zip(logits[0], logits[1]):
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def _gguf_blocks(w: np.ndarray, qtype) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """gguf-py's quantization of w [N, K] as (codes [N, B, 32], d [N, B], m [N, B] or None)."""
    n, k = w.shape
    raw = gguf.quants.quantize(w, qtype).reshape(n * k // 32, -1)
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(n, -1)
    if qtype == QT.Q8_0:
        return raw[:, 2:].copy().view(np.int8).reshape(n, -1, 32), d, None
    m = raw[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(n, -1)
    nibbles = raw[:, 4:]
    codes = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=1).reshape(n, -1, 32)
    return codes, d, m


@pytest.mark.parametrize("qtype,fmt", [(QT.Q8_0, "q8_0"), (QT.Q4_1, "q4_1")])
def test_codes_at_load_equal_the_gguf_reference_quantizer(qtype, fmt, backend):
    """On every backend (the torch one keeps them in reference layout), random weights with
    blocks of zeros, of one repeated value, of large and of tiny magnitude, and a bf16 weight."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((70, 96)).astype(np.float32) * 0.05
    w[3, :32] = 0
    w[5, 32:64] = 0.125
    w[6, :32] *= 1e4
    w[7, 64:] *= 1e-6
    # Ties: a scale of exactly 1 puts w / d (Q8_0) and (w - min) / d + 0.5 (Q4_1) on halves,
    # which both round away from zero (ggml's roundf, and trunc of a nonnegative value).
    w[8, :32] = np.arange(32) - 15.5 if fmt == "q8_0" else np.arange(32) % 16 - 0.5
    w[8, 0] = 127 if fmt == "q8_0" else 14.5
    for weight in (torch.from_numpy(w), torch.from_numpy(w).bfloat16()):
        codes, d, m = _gguf_blocks(weight.float().numpy(), qtype)
        method = backend.linear_method(weight, fmt)
        got_codes, got_d, got_m = method.reference_codes()
        assert torch.equal(got_codes.to(torch.int16), torch.from_numpy(codes).to(torch.int16))
        assert torch.equal(got_d, torch.from_numpy(d))
        assert (got_m is None) == (m is None) and (m is None or torch.equal(got_m,
                                                                          torch.from_numpy(m)))
        # Only the codes are held (padded panels included), and they rebuild gguf-py's
        # dequantized weight.
        held = sum(t.numel() * t.element_size() for t in method.tensors())
        assert held < weight.numel() * 4 * 0.45
        want = gguf.quants.dequantize(gguf.quants.quantize(weight.float().numpy(), qtype), qtype)
        assert torch.equal(dequantize(*method.reference_codes()),
                           torch.from_numpy(want.reshape(70, 96)))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_a_weight_holding_non_finite_values_is_refused(fmt, backend):
    """Such a weight has no codes: a clear error at load on every backend, not garbage codes."""
    for bad in (float("nan"), float("inf"), float("-inf")):
        w = torch.randn(40, 64) * 0.05
        w[3, 37] = bad
        with pytest.raises(ValueError, match="non-finite"):
            backend.linear_method(w, fmt)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_a_gguf_file_and_quantization_at_load_give_the_same_tokens(kernels, fmt, tmp_path):
    """The same weights as a quantized GGUF (codes found exactly from the dequantized file) and
    as an HF folder quantized at load (codes from the reference quantizer): bit-equal logits,
    so the same greedy tokens; the LM head and the tied embedding keep codes alone."""
    folder = make_tiny_llama(tmp_path / "llama", tie_word_embeddings=True)
    gguf_file = write_llama_gguf(folder, tmp_path / f"tiny-{fmt}.gguf", quantize=fmt)
    _, from_file = load_model(str(gguf_file), backend=kernels)
    _, at_load = load_model(str(folder), backend=kernels, quantization=fmt)
    _, dense = load_model(str(folder), backend=kernels)
    # Decoder linears of Q8_0 run with int8 activations where the backend has the kernel;
    # the LM head keeps the fp32 chain's codes (its greedy route and the embedding read them).
    decoder = "Int8PanelWeight" if fmt == "q8_0" and kernels.int8_linear else "QuantPanelWeight"
    for m in (from_file, at_load):
        formats = {type(sub.method).__name__ for sub in m.modules()
                   if isinstance(sub, (ColumnParallelLinear, RowParallelLinear))}
        assert formats == {decoder} and m.model.embed_tokens.weight is None
        assert isinstance(m.lm_head.method, QuantPanelWeight)
        assert m.lm_head.method.format == "q8_0"
    assert at_load.weight_bytes() == from_file.weight_bytes() < dense.weight_bytes() / 2.5
    prompts = [[5, 9, 17, 33, 2 + i, 40, 41] * (i + 1) for i in range(3)]
    outs = [PagedRunner(m).greedy(prompts, 6) for m in (from_file, at_load)]
    assert outs[0] == outs[1]
    first = [PagedRunner(m).step([Work("s", prompts[2], 0)])[0] for m in (from_file, at_load)]
    assert torch.equal(first[0], first[1])


def test_the_quantization_option_reaches_the_engine(tmp_path):
    from tierserve import LLM, SamplingParams
    folder = make_tiny_llama(tmp_path / "llama", tie_word_embeddings=True)
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    sizes, outs = {}, {}
    for fmt in (None, "q8_0"):
        with LLM(str(folder), block_size=4, quantization=fmt) as llm:
            sizes[fmt] = llm.stats()["weight_bytes"]
            outs[fmt] = llm.generate([[5, 9, 17, 33]], greedy, use_tqdm=False)[0]
    assert sizes["q8_0"] < sizes[None] / 2.5
    assert len(outs["q8_0"].outputs[0].token_ids) == 5
    with pytest.raises(ValueError, match="quantization"):
        LLM(str(folder), quantization="q2_k")


def test_quantized_gguf_head_takes_the_greedy_route_with_the_codes_tokens(kernels,
                                                                          quantized_gguf):
    """The GGUF model's Q8_0 head has the greedy route where the CPU runs the int8 pass, and
    it gives the argmax of the head's own logits on the model's hidden states."""
    _, model = load_model(str(quantized_gguf), backend=kernels)
    head = model.lm_head
    assert isinstance(head.method, QuantPanelWeight) and head.method.format == "q8_0"
    assert (head.greedy_head is not None) == (kernels.greedy_head_route and kernels.int8_head)
    if head.greedy_head is None:
        return
    runner = PagedRunner(model, num_blocks=32, block_size=4)
    prompts = [[5, 9, 17, 33, 2 + i, 40, 41] for i in range(6)]
    hidden = runner.step([Work(f"s{i}", p, 0) for i, p in enumerate(prompts)], hidden=True)
    x = torch.cat([h[-1:] for h in hidden])
    assert torch.equal(head.greedy(x), kernels.argmax_rows(head.method.linear(x, None)))

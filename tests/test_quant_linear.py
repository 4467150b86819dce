"""Linears run from GGUF codes (backends/quant.py, csrc/quant.cpp): the encoder takes exactly the
weights that are dequantized Q4_1 / Q8_0 blocks and nothing else, the product equals the fp32
panel kernel's bit for bit at every batch size, and a quantized GGUF model gives the same logits
with the codes as without them."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tests.checkpoints import PagedRunner, Work, make_tiny_llama, write_llama_gguf
from tierserve.workers.backends.cpu import kernel_backend
from tierserve.workers.model.layers import ColumnParallelLinear, PanelWeight, ParallelLMHead, RowParallelLinear
from tierserve.workers.model.loader import load_model
from tierserve.workers.backends.quant import QuantPanelWeight

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
    quant = QuantPanelWeight.encode(panel, weight, kernels)
    assert quant is not None and quant.format == fmt
    g = torch.Generator().manual_seed(k)
    bias = torch.randn(n, generator=g)
    # Row tiles of every size up to the kernel's limit, past a tile, and the panels' sizes.
    for m in (1, 2, 3, 4, 5, 7, 8, 9, 17, 64):
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
    quant = QuantPanelWeight.encode(panel, weight, kernels)
    wide = torch.randn(3, 200)
    x = wide[:, 10:106]  # rows with a stride of 200
    assert torch.equal(quant.linear(x, None), kernels.linear_f32(x.contiguous(), panel.panels, None, 64))
    big = torch.randn(kernels.quant_max_rows + 1, 96)
    assert torch.equal(quant.linear(big, None), panel.linear(big, None))


def test_weights_that_are_not_gguf_blocks_are_declined(kernels):
    g = torch.Generator().manual_seed(1)
    plain = torch.randn(64, 64, generator=g)
    assert QuantPanelWeight.encode(PanelWeight(plain, kernels), plain, kernels) is None
    # One value off by an ulp in one block breaks the exact rebuild.
    weight = dequantized(32, 64, QT.Q8_0)
    weight[5, 40] = torch.nextafter(weight[5, 40], torch.tensor(1.0))
    assert kernels.ops.quant_encode_q8_0(weight)[0].numel() == 0
    for bad in (float("nan"), float("inf")):
        w = dequantized(32, 64, QT.Q4_1)
        w[0, 0] = bad
        assert QuantPanelWeight.encode(PanelWeight(w, kernels), w, kernels) is None
    # Rows of one repeated value (zero scale) and of zeros encode.
    flat = torch.zeros(16, 64)
    flat[3] = 0.25
    assert kernels.ops.quant_encode_q4_1(flat)[0].numel() > 0
    # K that is not a multiple of 32, and bf16 weights, keep the panels alone.
    odd = dequantized(16, 64, QT.Q4_1)[:, :48].contiguous()
    assert QuantPanelWeight.encode(PanelWeight(odd, kernels), odd, kernels) is None


def test_off_switch_and_other_backends(tmp_path):
    from tierserve.runtime import envs
    from tierserve.workers.backends.cpu import plan_for, torch_backend
    from tierserve.workers.backends.cpu_features import detect_cpu_features

    weight = dequantized(32, 64, QT.Q4_1)
    assert QuantPanelWeight.encode(None, weight, torch_backend()) is None
    features = detect_cpu_features()
    if not features.isas:
        pytest.skip("this CPU runs no kernel backend")
    on = kernel_backend(features.isas[0], envs.cache_dir())
    off = plan_for(on.name, features, on.ops, quant_linear=False)
    assert QuantPanelWeight.encode(PanelWeight(weight, off), weight, off) is None
    assert "quant_linear" in on.describe()["paths"] and "quant_linear" not in off.describe()["paths"]


@pytest.fixture(scope="module")
def quantized_gguf(tmp_path_factory):
    folder = make_tiny_llama(tmp_path_factory.mktemp("q") / "llama", hidden_size=64,
                             num_heads=4, num_kv_heads=2)
    return write_llama_gguf(folder, folder.parent / "tiny-q.gguf", quantize=True)


def test_quantized_gguf_model_runs_from_codes_with_the_same_logits(kernels, quantized_gguf):
    from tierserve.workers.backends.cpu import plan_for
    from tierserve.workers.backends.cpu_features import detect_cpu_features

    _, model = load_model(str(quantized_gguf), backend=kernels)
    formats = {name: m.packed.format for name, m in model.named_modules()
               if isinstance(m, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead))
               and isinstance(m.packed, QuantPanelWeight)}
    assert formats and all(f == ("q8_0" if "lm_head" in n else "q4_1") for n, f in formats.items())
    assert len(formats) == 1 + 4 * model.config.num_hidden_layers  # qkv, o, gate_up, down, head
    off = plan_for(kernels.name, detect_cpu_features(), kernels.ops, quant_linear=False)
    _, plain = load_model(str(quantized_gguf), backend=off)
    assert not any(isinstance(m.packed, QuantPanelWeight) for m in plain.modules()
                   if isinstance(m, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)))
    # A prefill (panels), then decodes of 1 and 3 sequences (codes), on both models.
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

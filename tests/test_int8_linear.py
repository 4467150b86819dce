"""Q8_0 linears with int8 activations (backends/int8_linear.py, csrc/linear_int8.cpp): the
kernel equals its arithmetic written out in torch bit for bit, at every row count and on every
ISA path (so a row's result never depends on its batch or the CPU), keeps only the codes and
fp16 scales, and gives a non-finite row NaN outputs without touching the other rows."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import KERNEL_ISAS, pinned_backend
from tierserve.workers.backends.int8_linear import Int8PanelWeight, reference_int8_linear
from tierserve.workers.backends.quant import QuantPanelWeight, dequantize, reference_quantize


def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes, d, _ = reference_quantize(torch.randn(n, k, generator=g) * 0.05, "q8_0")
    return codes, d


@pytest.mark.parametrize("n,k", [(200, 576), (16, 32), (49, 1536), (33, 64)])
def test_the_kernel_is_its_arithmetic_at_every_row_count(kernels, n, k):
    codes, d = _weight(n, k, seed=n + k)
    linear = Int8PanelWeight.from_codes(codes, d, kernels)
    g = torch.Generator().manual_seed(k)
    bias = torch.randn(n, generator=g)
    # One row (the 256-bit tile), row tiles of 1-4 (vpdpbusd where the CPU has it), row blocks
    # past 64, and x's rows at a stride.
    x = torch.randn(131, k + 32, generator=g)[:, 16:16 + k]
    for m in (1, 2, 3, 4, 5, 9, 64, 65, 131):
        for b in (None, bias):
            got = linear.linear(x[:m], b)
            assert torch.equal(got, reference_int8_linear(x[:m], codes, d, b)), (m, b is None)
            # Each row alone gives its row of the batch, and either tile gives the same bits.
            assert torch.equal(linear.linear(x[m - 1:m], b), got[-1:])
            tiles = (1, 2) if kernels.ops.int8_linear_path() == "avx512_vnni" else (2,)
            for tile in tiles:
                forced = kernels.ops.linear_int8(x[:m], linear.pairs, b, n, tile)
                assert torch.equal(forced, got), tile
    if kernels.ops.int8_linear_path() != "avx512_vnni":
        with pytest.raises(RuntimeError, match="tiles"):
            kernels.ops.linear_int8(x[:1], linear.pairs, None, n, 1)


def test_every_isa_path_gives_the_same_bits():
    if len(KERNEL_ISAS) < 2:
        pytest.skip("this CPU runs one kernel level")
    codes, d = _weight(96, 576, seed=1)
    x = torch.randn(7, 576, generator=torch.Generator().manual_seed(2))
    outs = {}
    for isa in KERNEL_ISAS:
        backend = pinned_backend(isa)
        outs[isa] = (backend.ops.int8_linear_path(),
                     [Int8PanelWeight.from_codes(codes, d, backend).linear(x[:m], None)
                      for m in (1, 7)])
    first = next(iter(outs.values()))[1]
    for path, got in outs.values():
        assert all(torch.equal(a, b) for a, b in zip(got, first)), path


def test_only_codes_and_fp16_scales_are_kept(kernels):
    codes, d = _weight(70, 96, seed=3)
    linear = Int8PanelWeight.from_codes(codes, d, kernels)
    back, scales, offsets = linear.reference_codes()
    assert torch.equal(back, codes) and torch.equal(scales, d) and offsets is None
    assert torch.equal(linear.weight(), dequantize(codes, d, None))
    # Three pairs of 16-feature panels (70 features padded to 96), 3 blocks: 1,088 bytes each.
    assert linear.pairs.shape == (3, 3, 1088) and linear.nbytes == 3 * 3 * 1088
    assert linear.nbytes == 96 * 96 * 17 // 16  # a byte a code, two a block's scale
    with pytest.raises(ValueError, match="fp16"):
        Int8PanelWeight.from_codes(codes, d * (1 + 2 ** -20), kernels)


def test_a_non_finite_row_gives_nan_alone(kernels):
    codes, d = _weight(32, 64, seed=4)
    linear = Int8PanelWeight.from_codes(codes, d, kernels)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
    clean = linear.linear(x, None)
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[1, 40] = bad
        out = linear.linear(y, None)
        assert torch.isnan(out[1]).all()
        assert torch.equal(out[0], clean[0]) and torch.equal(out[2], clean[2])
    zeros = linear.linear(torch.zeros(1, 64), None)
    assert torch.equal(zeros, torch.zeros(1, 32))


def test_the_rows_quantization_is_the_reference_quantizers(kernels):
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(6)) * 3
    x[2, :32] = 0  # a zero block: scale 0, codes 0
    q, dx = kernels.ops.int8_quantize_rows(x)
    blocks = x.view(5, 3, 32)
    want_d = blocks.abs().amax(-1) / 127.0
    assert torch.equal(dx, want_d)
    inv = torch.where(want_d > 0, 1.0 / want_d, torch.zeros_like(want_d))
    want_q = torch.round(blocks * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    assert torch.equal(q.view(5, 3, 32), want_q)
    assert q.abs().max() == 127


def test_backends_route_decoder_q8_0_to_int8_and_keep_heads_on_codes(kernels):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(64, 128, generator=g)
    decoder = kernels.linear_method(w, "q8_0")
    head = kernels.linear_method(w, "q8_0", head=True)
    assert isinstance(decoder, Int8PanelWeight) == kernels.int8_linear
    assert isinstance(head, QuantPanelWeight) and head.format == "q8_0"
    assert torch.equal(decoder.weight(), head.weight())
    assert isinstance(kernels.linear_method(w, "q4_1"), QuantPanelWeight)
    assert "int8_linear" in kernels.describe()["paths"]

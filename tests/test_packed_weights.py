"""Packed linear weights: oneDNN-packed bf16/fp16 ones against F.linear; the fp32 C++ linear
kernel (csrc/linear.cpp) and its panel-packed weights against a float64 reference, rows that do
not depend on the batch around them, input checks; and which layers of a loaded model get which."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.checkpoints import make_tiny_llama
from tierserve.workers import layers
from tierserve.workers.kernels import CpuKernels
from tierserve.workers.layers import (
    ColumnParallelLinear, GreedyHead, PackedWeight, PanelWeight, ParallelLMHead,
    RowParallelLinear, pack_weights,
)
from tierserve.workers.loader import load_model

LINEARS = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 7, 64, 300])
def test_onednn_packed_linear_matches_f_linear(dtype, m):
    torch.manual_seed(m)
    w, x, b = torch.randn(96, 80, dtype=dtype), torch.randn(m, 80, dtype=dtype), torch.randn(96, dtype=dtype)
    got = PackedWeight(w).linear(x, b).float()
    want = F.linear(x.float(), w.float(), b.float())
    # both round once to the output dtype; allow that rounding only
    assert torch.allclose(got, want, rtol=2e-2, atol=2e-2)
    assert torch.allclose(got, F.linear(x, w, b).float(), rtol=1e-2, atol=1e-2)


def _case(m: int, k: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g), torch.randn(m, k, generator=g),
            torch.randn(n, generator=g))


# m: one row, row tiles of every size, the kernel's largest batch and the MKL path beyond it.
# n: whole panels and a padded last one. k: one K block and several (blocks of 256).
@pytest.mark.parametrize("m", [1, 5, 12, 13, 64, PanelWeight.KERNEL_MAX_ROWS,
                               PanelWeight.KERNEL_MAX_ROWS + 1, 300])
@pytest.mark.parametrize("k,n", [(64, 96), (600, 50), (576, 960)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_panel_linear_matches_float64(kernels, m, k, n, with_bias):
    w, x, b = _case(m, k, n, seed=m * 7 + k + n)
    bias = b if with_bias else None
    got = PanelWeight(w).linear(x, bias)
    want = F.linear(x.double(), w.double(), bias.double() if with_bias else None)
    assert got.shape == (m, n) and got.dtype == torch.float32
    # Within the worst-case bound of any fp32 summation order of k products (Higham: (k + 1) u
    # times the sum of magnitudes), and of the order of F.linear's own error.
    u = 2.0 ** -24
    bound = (k + 1) * u * (F.linear(x.double().abs(), w.double().abs(),
                                    b.double().abs() if with_bias else None))
    assert ((got - want).abs() <= bound).all()
    err, ref_err = (got - want).abs().max().item(), (F.linear(x, w, bias) - want).abs().max().item()
    assert err <= 10 * ref_err + 1e-6


@pytest.mark.parametrize("m", [1, 16, 161, 300, 1000])
@pytest.mark.parametrize("k,n", [(33, 50), (600, 96), (576, 960), (1536, 70)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_amx_linear_matches_float64(kernels, m, k, n, with_bias):
    """csrc/linear_amx.cpp (bf16x3 on AMX) to fp32 accuracy: within the fp32 bound of any
    summation order, and no less accurate than MKL's sgemm. Ragged M, K and N (tile padding)."""
    if not kernels.has_amx:
        pytest.skip("no AMX-BF16 on this CPU / build")
    w, x, b = _case(m, k, n, seed=m + 3 * k + n)
    bias = b if with_bias else None
    got = kernels.linear_amx(x, PanelWeight(w).panels, bias, n)
    want = F.linear(x.double(), w.double(), bias.double() if with_bias else None)
    u = 2.0 ** -24
    bound = (k + 1) * u * (F.linear(x.double().abs(), w.double().abs(),
                                    b.double().abs() if with_bias else None))
    assert got.shape == (m, n) and ((got - want).abs() <= bound).all()
    ref_err = (F.linear(x, w, bias) - want).abs().max().item()
    assert (got - want).abs().max().item() <= 2 * ref_err + 1e-6


def test_prefill_sized_inputs_take_amx_where_offered(kernels, monkeypatch):
    if not kernels.has_amx:
        pytest.skip("no AMX-BF16 on this CPU / build")
    w, x, _ = _case(PanelWeight.KERNEL_MAX_ROWS + 1, 64, 40, seed=5)
    calls = []
    monkeypatch.setattr(kernels, "linear_amx", lambda *a: calls.append(a) or torch.zeros(1))
    PanelWeight(w).linear(x, None)
    PanelWeight(w).linear(x[:-1], None)
    assert len(calls) == 1


@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_rows_do_not_depend_on_the_batch(kernels, threads):
    """Every output element is one fixed-order chain over k, whatever the batch size, the row's
    place in it and the thread count: the same request gets bitwise the same result."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        w, x, b = _case(PanelWeight.KERNEL_MAX_ROWS, 600, 200, seed=3)
        packed = PanelWeight(w)
        full = packed.linear(x, b)
        for rows in (slice(0, 1), slice(5, 6), slice(17, 81), slice(100, None)):
            assert torch.equal(packed.linear(x[rows].contiguous(), b), full[rows])
    finally:
        torch.set_num_threads(before)


def test_kernel_takes_strided_rows(kernels):
    w, x, _ = _case(20, 64, 40, seed=1)
    wide = torch.cat([x, torch.randn(20, 16)], dim=1)[:, :64]  # rows with a stride of 80
    assert torch.equal(PanelWeight(w).linear(wide, None), PanelWeight(w).linear(x, None))


@pytest.mark.parametrize("case", ["dtype", "k", "n", "layout", "bias"])
def test_kernel_rejects_bad_inputs(kernels, case):
    w, x, b = _case(4, 64, 40, seed=2)
    panels, n, bias = PanelWeight(w).panels, 40, None
    if case == "dtype":
        x = x.double()
    elif case == "k":
        x = x[:, :32]
    elif case == "n":
        n = 100
    elif case == "layout":
        panels = panels.transpose(1, 2)
    elif case == "bias":
        bias = b[:10]
    with pytest.raises(RuntimeError, match="linear_f32"):
        kernels.linear_f32(x, panels, bias, n)
    if kernels.has_amx:
        with pytest.raises(RuntimeError, match="linear_amx"):
            kernels.linear_amx(x, panels, bias, n)


def test_fp32_linears_switch_to_panels_once_kernels_load(kernels, tmp_path, monkeypatch):
    path = make_tiny_llama(tmp_path / "llama")
    if torch.backends.mkldnn.is_available():
        _, bf16 = load_model(str(path), torch.bfloat16)
        assert all(isinstance(m.packed, PackedWeight)
                   for m in bf16.modules() if isinstance(m, LINEARS))
    # Kernels not loaded yet: fp32 weights stay plain and packing reports it is waiting.
    monkeypatch.setattr(layers, "cpu_kernels", CpuKernels())
    _, fp32 = load_model(str(path), torch.float32)
    assert all(m.packed is None and m.weight is not None
               for m in fp32.modules() if isinstance(m, LINEARS))
    assert pack_weights(fp32) is True
    reference = {name: m.weight.detach().clone() for name, m in fp32.named_modules()
                 if isinstance(m, LINEARS)}
    monkeypatch.setattr(layers, "cpu_kernels", kernels)
    assert pack_weights(fp32) is False
    for name, m in fp32.named_modules():
        if not isinstance(m, LINEARS):
            continue
        assert isinstance(m.packed, PanelWeight)
        # The panels replace the plain weight, except the LM head's (here the embedding's),
        # which also gets its exact greedy route.
        assert (m.weight is not None) == isinstance(m, ParallelLMHead)
        if isinstance(m, ParallelLMHead) and torch.backends.mkldnn.is_available():
            assert isinstance(m.greedy_head, GreedyHead) and m.greedy_head.panel is m.packed
        x = torch.randn(7, reference[name].shape[1])
        torch.testing.assert_close(m.packed.linear(x, None), F.linear(x, reference[name]),
                                   rtol=1e-5, atol=1e-5)


def _lm_head_case(vocab: int, k: int, seed: int) -> torch.Tensor:
    """A head with exact ties (copied rows) and near-ties (a copy nudged by one ulp in one
    element) among random rows."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(vocab, k, generator=g) * 0.05
    w[9], w[40] = w[4], w[4]
    w[41] = w[5]
    w[41, 0] = torch.nextafter(w[5, 0], torch.tensor(1.0))
    w[vocab - 1] = w[5]
    return w


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
@pytest.mark.parametrize("m", [1, 13, 64, PanelWeight.KERNEL_MAX_ROWS])
@pytest.mark.parametrize("vocab,k", [(1000, 64), (3001, 600)])
def test_greedy_head_equals_argmax_of_full_logits(kernels, m, vocab, k):
    """Bit-for-bit the token argmax over linear_f32's logits gives (first index on ties), on
    random rows, rows aimed at tied or near-tied vocabulary rows, and all-zero rows (every
    column a candidate)."""
    w = _lm_head_case(vocab, k, seed=m + vocab)
    panel = PanelWeight(w)
    head = GreedyHead(panel, w)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g) * torch.linspace(0.1, 30, m)[:, None]
    x[0] = w[4] * 50
    if m > 2:
        x[1] = w[5] * 50 + torch.randn(k, generator=g) * 1e-3
        x[2] = 0
    want = kernels.argmax_rows(panel.linear(x, None))
    got = head.tokens(x)
    assert got is not None and torch.equal(got, want)
    assert got[0] == 4
    if m > 2:
        assert got[2] == 0


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
def test_greedy_head_defers_to_full_logits(kernels):
    """None where the full product must decide: more rows than the fp32 kernel takes (MKL
    rounds differently beyond them), or a non-finite input."""
    w = _lm_head_case(500, 64, seed=1)
    head = GreedyHead(PanelWeight(w), w)
    assert head.tokens(torch.randn(PanelWeight.KERNEL_MAX_ROWS + 1, 64)) is None
    x = torch.randn(3, 64)
    x[1, 7] = float("nan")
    assert head.tokens(x) is None
    x[1, 7] = float("inf")
    assert head.tokens(x) is None
    w[3, 3] = float("inf")
    assert not GreedyHead.applies_to(w)

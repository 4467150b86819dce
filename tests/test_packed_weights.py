"""Packed linear weights: oneDNN-packed bf16/fp16 ones against F.linear; the C++ linear kernel
(csrc/linear.cpp) of every kernel backend, its panel-packed fp32 and bf16/fp16 weights against a
float64 reference, rows that do not depend on the batch around them, input checks; and which
layers of a loaded model get which layout on each backend."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tests.checkpoints import make_tiny_llama
from tierserve.workers.backends.cpu import CpuKernelBackend
from tierserve.workers.backends.cpu_features import detect_cpu_features
from tierserve.workers.backends.coded import CodedPanelWeight
from tierserve.workers.backends.greedy import GreedyHead
from tierserve.workers.backends.linear import PackedWeight, PanelWeight, PlainLinear
from tierserve.workers.backends.quant import QuantPanelWeight
from tierserve.workers.backends.portable import torch_backend
from tierserve.workers.model.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear
from tierserve.workers.model.loader import load_model

LINEARS = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 7, 64, 300])
def test_onednn_packed_linear_matches_f_linear(dtype, m):
    """Where oneDNN runs the dtype natively (elsewhere its reorder refuses the weight, and no
    backend packs it so)."""
    if torch_backend().half_linear_for(dtype) != "onednn":
        pytest.skip(f"oneDNN does not run {dtype} natively on this CPU")
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


# m: one row, row tiles of every size (6 rows a tile on AVX2, 12 on AVX-512), the AVX-512
# kernel's largest batch and the MKL / AMX path beyond it, a batch past the AVX2 limit.
# n: whole panels and a padded last one. k: one K block and several (blocks of 256).
@pytest.mark.parametrize("m", [1, 5, 6, 7, 12, 13, 64, 160, 161, 300, 1025])
@pytest.mark.parametrize("k,n", [(64, 96), (600, 50), (576, 960)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_panel_linear_matches_float64(kernels, m, k, n, with_bias):
    w, x, b = _case(m, k, n, seed=m * 7 + k + n)
    bias = b if with_bias else None
    got = PanelWeight(w, kernels).linear(x, bias)
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
    if 1 < m <= kernels.panel_max_rows:  # the panel kernel's rows do not depend on the batch
        assert torch.equal(PanelWeight(w, kernels).linear(x[m // 3:].contiguous(), bias),
                           got[m // 3:])


def _half_layout(kernels, dtype, layout: str):
    """The backend whose PanelWeight packs `dtype` in `layout`: "widen" (panels of the dtype,
    widened to fp32 in registers) or "pairs" (bf16 k pairs for AVX512_BF16's dot product,
    where the backend has it)."""
    if layout == "widen":
        return dataclasses.replace(kernels, bf16_pairs=False)
    if dtype != torch.bfloat16 or not kernels.bf16_pairs:
        pytest.skip(f"the {kernels.name} backend packs no {dtype} pairs on this CPU")
    return kernels


# bf16 / fp16 on the panel kernel: fp32 products and sums, rounded once to the dtype, as
# F.linear rounds; against float64 within one rounding of the output plus the fp32 sum's error.
@pytest.mark.parametrize("layout", ["widen", "pairs"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 6, 7, 64, 300])
@pytest.mark.parametrize("k,n", [(64, 96), (600, 50), (2 * 200, 32)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_half_panel_linear_matches_float64(kernels, layout, dtype, m, k, n, with_bias):
    if kernels.half_linear_for(dtype) != "kernel":
        pytest.skip(f"the {kernels.name} backend runs {dtype} linears on oneDNN here")
    kernels = _half_layout(kernels, dtype, layout)
    w, x, b = (t.to(dtype) for t in _case(m, k, n, seed=m + k + n))
    bias = b if with_bias else None
    packed = PanelWeight(w, kernels)
    assert packed.pairs == (layout == "pairs")
    got = packed.linear(x, bias)
    assert got.dtype == dtype and got.shape == (m, n) and packed.panels.dtype == dtype
    want = F.linear(x.double(), w.double(), bias.double() if with_bias else None)
    magnitude = F.linear(x.double().abs(), w.double().abs(),
                         b.double().abs() if with_bias else None)
    unit = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    assert ((got.double() - want).abs() <= unit * want.abs() + (k + 1) * 2.0 ** -24 * magnitude
            + 1e-30).all()
    # Rows do not depend on the batch around them.
    assert torch.equal(packed.linear(x[m // 2:].contiguous(), bias), got[m // 2:])


@pytest.mark.parametrize("m", [1, 16, 161, 300, 1000])
@pytest.mark.parametrize("k,n", [(33, 50), (600, 96), (576, 960), (1536, 70)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_amx_linear_matches_float64(kernels, m, k, n, with_bias):
    """csrc/linear_amx.cpp (bf16x3 on AMX) to fp32 accuracy: within the fp32 bound of any
    summation order, and no less accurate than MKL's sgemm. Ragged M, K and N (tile padding)."""
    if not kernels.amx_linear:
        pytest.skip(f"the {kernels.name} backend has no AMX linear")
    w, x, b = _case(m, k, n, seed=m + 3 * k + n)
    bias = b if with_bias else None
    got = kernels.linear_amx(x, PanelWeight(w, kernels).panels, bias, n)
    want = F.linear(x.double(), w.double(), bias.double() if with_bias else None)
    u = 2.0 ** -24
    bound = (k + 1) * u * (F.linear(x.double().abs(), w.double().abs(),
                                    b.double().abs() if with_bias else None))
    assert got.shape == (m, n) and ((got - want).abs() <= bound).all()
    ref_err = (F.linear(x, w, bias) - want).abs().max().item()
    assert (got - want).abs().max().item() <= 2 * ref_err + 1e-6


def test_inputs_past_the_panel_limit_take_amx_or_mkl(kernels, monkeypatch):
    """Rows up to the backend's panel_max_rows run the panel kernel; beyond it AMX where the
    backend has it, else MKL (F.linear) on the weight rebuilt from the panels."""
    limit = kernels.panel_max_rows
    w, x, _ = _case(limit + 1, 64, 40, seed=5)
    calls = []
    for name in ("linear_f32", "linear_amx"):
        monkeypatch.setattr(CpuKernelBackend, name,
                            lambda self, *a, name=name: calls.append(name) or torch.zeros(1))
    packed = PanelWeight(w, kernels)
    packed.linear(x[:-1], None)
    assert calls == ["linear_f32"]
    got = packed.linear(x, None)
    if kernels.amx_linear:
        assert calls == ["linear_f32", "linear_amx"]
    else:
        assert calls == ["linear_f32"] and torch.equal(got, F.linear(x, w))
        assert torch.equal(packed.weight(), w)


# n: panels one by one, and groups of them (a single row runs 4 or 8 full panels at once).
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("k,n", [(600, 200), (576, 600)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_rows_do_not_depend_on_the_batch(kernels, threads, k, n, dtype):
    """Every output element is one fixed-order chain over k, whatever the batch size, the row's
    place in it and the thread count: the same request gets bitwise the same result. A single
    half-precision row's panels are claimed by the threads, which take over each other's last
    ones (three threads: uneven runs, taken from two others)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        w, x, b = (t.to(dtype) for t in _case(160, k, n, seed=3))
        packed = PanelWeight(w, kernels)
        full = packed.linear(x, b)
        for rows in (slice(0, 1), slice(5, 6), slice(17, 81), slice(100, None)):
            assert torch.equal(packed.linear(x[rows].contiguous(), b), full[rows])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_onednn_weight_runs_single_rows_on_the_panel_kernel(kernels, dtype):
    """Given a kernel backend, a oneDNN-packed weight keeps panels instead of its plain copy: a
    single row runs the panel kernel (bitwise its result), batches oneDNN."""
    if not PackedWeight.applies_to(torch.empty(1, 1, dtype=dtype)):
        pytest.skip("no oneDNN here")
    w, x, b = (t.to(dtype) for t in _case(9, 576, 600, seed=4))
    try:
        PackedWeight(w)
    except RuntimeError:
        pytest.skip(f"oneDNN does not pack {dtype} on this CPU")
    hybrid, panel = PackedWeight(w, kernels), PanelWeight(w, kernels)
    assert hybrid.plain is None and torch.equal(hybrid.weight(), w)
    assert torch.equal(hybrid.linear(x[:1], b), panel.linear(x[:1], b))
    assert torch.equal(hybrid.linear(x, b), PackedWeight(w).linear(x, b))


def test_kernel_takes_strided_rows(kernels):
    w, x, _ = _case(20, 64, 40, seed=1)
    wide = torch.cat([x, torch.randn(20, 16)], dim=1)[:, :64]  # rows with a stride of 80
    packed = PanelWeight(w, kernels)
    assert torch.equal(packed.linear(wide, None), packed.linear(x, None))


@pytest.mark.parametrize("case", ["dtype", "k", "n", "layout", "bias"])
def test_kernel_rejects_bad_inputs(kernels, case):
    w, x, b = _case(4, 64, 40, seed=2)
    panels, n, bias = PanelWeight(w, kernels).panels, 40, None
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
    with pytest.raises(RuntimeError, match="linear_half"):
        kernels.linear_half(x.bfloat16() if case != "dtype" else x, panels.bfloat16(),
                            None if bias is None else bias.bfloat16(), n)
    if kernels.amx_linear:
        with pytest.raises(RuntimeError, match="linear_amx"):
            kernels.linear_amx(x, panels, bias, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_loaded_linears_take_the_backend_layout(backend, dtype, tmp_path):
    """Each backend gives a model's linears their method once, at load: panels for the
    kernel's dtypes (fp32 ones coded, coded.py), oneDNN copies where oneDNN runs the dtype
    natively, else plain weights; no layer keeps its plain weight beside its method. The
    methods equal F.linear on the loaded weights."""
    path = make_tiny_llama(tmp_path / "llama")
    _, plain = load_model(str(path), dtype, backend=torch_backend())
    _, model = load_model(str(path), dtype, backend=backend)
    assert model.backend is backend
    reference = {name: m.method.weight() for name, m in plain.named_modules()
                 if isinstance(m, LINEARS)}
    kernel = isinstance(backend, CpuKernelBackend)
    route = backend.half_linear_for(dtype) if dtype != torch.float32 else (
        "kernel" if kernel else "torch")
    expected = {"kernel": PanelWeight, "onednn": PackedWeight, "torch": PlainLinear}[route]
    if expected is PanelWeight and dtype == torch.float32 and backend.coded_linear:
        expected = CodedPanelWeight
    for name, m in model.named_modules():
        if not isinstance(m, LINEARS):
            continue
        head = isinstance(m, ParallelLMHead)
        # A kernel backend's head runs the panels its greedy route repeats, in every dtype.
        want = PanelWeight if head and kernel else expected
        assert type(m.method) is want and m.weight is None, name
        if head:
            assert (m.greedy_head is not None) == kernel
            if m.greedy_head is not None:
                assert m.greedy_head.panel is m.method
        x = torch.randn(7, reference[name].shape[1]).to(dtype)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(m.method.linear(x, None).float(),
                                   F.linear(x, reference[name]).float(), rtol=tol, atol=tol)


def test_backends_never_outrun_the_cpu(backend):
    """A backend runs only on a CPU with its ISA, and plans the paths that CPU supports."""
    features = detect_cpu_features()
    assert backend.name == "torch" or features.has(backend.name)
    for dtype, how in backend.half_linear.items():
        assert how != "onednn" or (features.onednn_bf16 if dtype == torch.bfloat16
                                   else features.onednn_fp16)
    if isinstance(backend, CpuKernelBackend) and backend.amx_linear:
        assert features.has("amx") and backend.name == "amx"
        assert backend.ops.build_isa() == backend.name
        assert backend.panel_width == 2 * backend.ops.vector_lanes()
        assert backend.ops.vector_lanes() == (8 if backend.name == "avx2" else 16)


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


def _without_int8(kernels):
    """The backend as on a CPU without AVX512_VNNI: the greedy head's Q8_0 pass."""
    return dataclasses.replace(kernels, int8_head=False)


def _greedy_backend(kernels):
    if not kernels.greedy_head_route:
        pytest.skip(f"the {kernels.name} backend has no greedy head on this CPU")
    return kernels


@pytest.mark.parametrize("route", ["q8_0", "int8"])
@pytest.mark.parametrize("m", [1, 13, 64, 160])
@pytest.mark.parametrize("vocab,k,dtype,layout", [
    (1000, 64, torch.float32, "widen"), (3001, 576, torch.float32, "widen"),
    (3001, 576, torch.bfloat16, "widen"), (3001, 576, torch.bfloat16, "pairs"),
    (1000, 64, torch.float16, "widen")])
def test_greedy_head_equals_argmax_of_full_logits(kernels, m, vocab, k, dtype, layout, route):
    """Bit for bit the token argmax over the panel kernel's logits gives (first index on ties;
    half-precision logits rounded as the kernel rounds them), on random rows, rows aimed at
    tied or near-tied vocabulary rows, and all-zero rows (every column a candidate); from the
    Q8_0 pass (the route of CPUs without the int8 pass) and from the int8 pass, each at every
    size."""
    kernels = _half_layout(_greedy_backend(kernels), dtype, layout)
    if route == "q8_0":
        kernels = _without_int8(kernels)
    w = _lm_head_case(vocab, k, seed=m + vocab).to(dtype)
    panel = PanelWeight(w, kernels)
    head = GreedyHead(panel, w, kernels)
    if route == "int8":
        if head.int8 is None:
            pytest.skip(f"the {kernels.name} backend has no int8 pass on this CPU")
        assert head.max_rows == 0 and head.approx is None  # every size to the int8 pass
    else:
        head.max_rows = kernels.panel_max_rows  # the Q8_0 pass, at every size it could take
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g) * torch.linspace(0.1, 30, m)[:, None]
    x[0] = w[4].float() * 50
    if m > 2:
        x[1] = w[5].float() * 50 + torch.randn(k, generator=g) * 1e-3
        x[2] = 0
    x = x.to(dtype)
    want = kernels.argmax_rows(panel.linear(x, None))
    got = head.tokens(x)
    assert got is not None and torch.equal(got, want)
    assert got[0] == 4
    if m > 2:
        assert got[2] == 0


def test_greedy_head_defers_to_full_logits(kernels):
    """None where the full product must decide: more rows than the fp32 kernel takes (MKL
    rounds differently beyond them), or a non-finite input."""
    kernels = _greedy_backend(kernels)
    w = _lm_head_case(500, 64, seed=1)
    head = GreedyHead(PanelWeight(w, kernels), w, kernels)
    assert head.tokens(torch.randn(kernels.panel_max_rows + 1, 64)) is None
    x = torch.randn(3, 64)
    x[1, 7] = float("nan")
    assert head.tokens(x) is None
    x[1, 7] = float("inf")
    assert head.tokens(x) is None
    w[3, 3] = float("inf")
    assert not GreedyHead.applies_to(w, kernels)


def test_an_fp32_head_takes_the_route_for_few_rows_only(kernels):
    """An fp32 head's full product wins from FP32_MAX_ROWS rows on over the Q8_0 pass (which
    rebuilds its blocks in fp32, where the panel kernel loads fp32 as it is); a half-precision
    head keeps that pass up to the panel kernel's rows. Where the CPU has the int8 pass, it
    takes every head's rows instead, one included."""
    from tierserve.workers.backends.greedy import FP32_MAX_ROWS

    kernels = _greedy_backend(kernels)
    w = _lm_head_case(500, 64, seed=2)
    fp32 = GreedyHead(PanelWeight(w, kernels), w, kernels)
    half = w.to(torch.bfloat16)
    bf16 = GreedyHead(PanelWeight(half, kernels), half, kernels)
    batch = torch.randn(FP32_MAX_ROWS + 1, 64)
    if kernels.int8_head:
        assert fp32.int8 is not None and fp32.max_rows == bf16.max_rows == 0
        assert fp32.tokens(batch) is not None and bf16.tokens(batch.bfloat16()) is not None
    else:
        assert fp32.int8 is None and fp32.max_rows == FP32_MAX_ROWS
        assert fp32.tokens(batch[:-1]) is not None and fp32.tokens(batch) is None
        assert bf16.max_rows == kernels.panel_max_rows
        assert bf16.tokens(batch.bfloat16()) is not None
    assert fp32.tokens(batch[:1]) is not None and bf16.tokens(batch[:1].bfloat16()) is not None


def _quantize(x: torch.Tensor, passes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8_head.cpp's rows in float64: per block of 32, codes at scale max|v| / 127 (rounded
    to fp32), rounded to nearest even, then (a second pass) the remainder the same way ->
    (xhat, the elementwise sum of the passes' absolute values)."""
    m, k = x.shape
    v = x.double().view(m, k // 32, 32)
    terms = []
    for _ in range(passes):
        d = (v.abs().amax(-1, keepdim=True) / 127).float().double()
        q = torch.where(d > 0, torch.round(v / d), torch.zeros_like(v)).clamp(-127, 127)
        terms.append(q * d)
        v = v - q * d
    return sum(terms).view(m, k), sum(t.abs() for t in terms).view(m, k)


@pytest.mark.parametrize("passes", [1, 2])
def test_int8_pass_matches_its_arithmetic_in_float64(kernels, passes):
    """int8_head_logits: each row quantized per block of 32 in one or two passes (the codes,
    then their remainder's), its logits sum_b d_b (dx_b q . c [+ er_b s . c]) to within fp32
    rounding of the float64 value; x_err per row at least (and barely above) ||x - xhat|| and
    the norm of the passes' absolute values; a row holding a non-finite value gets inf, and the
    head defers to the full product."""
    kernels = _greedy_backend(kernels)
    if not kernels.int8_head:
        pytest.skip(f"the {kernels.name} backend has no int8 pass on this CPU")
    vocab, k, m = 1001, 576, 11
    w = _lm_head_case(vocab, k, seed=3)
    head = GreedyHead(PanelWeight(w, kernels), w, kernels)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 2, m)[:, None]
    x[3, 64:96] = 0  # a block of zeros: scale 0
    approx, x_err = kernels.int8_head_logits(x, *head.int8, vocab, passes)
    codes, d, _ = QuantPanelWeight.quantize(w, "q8_0", kernels).reference_codes()
    xhat, terms = _quantize(x, passes)
    what = (codes.double() * d.double()[..., None]).view(vocab, k)
    want = xhat @ what.T
    assert approx.shape == (m, vocab) and x_err.shape == (m, 2)
    assert bool(((approx.double() - want).abs() <= 1e-5 * (terms @ what.abs().T) + 1e-30).all())
    for got, true in ((x_err[:, 0], (x.double() - xhat).norm(dim=1)), (x_err[:, 1],
                                                                        terms.norm(dim=1))):
        assert bool((got.double() >= true).all())
        assert bool((got.double() <= true * (1 + 1e-4) + 1e-30).all())
    # Two passes leave about 2^-16 of x, one about 2^-8.
    assert bool((x_err[:, 0] <= (1e-4 if passes == 2 else 1e-2) * x.norm(dim=1)).all())
    x[5, 7] = float("inf")
    assert kernels.int8_head_logits(x, *head.int8, vocab, passes)[1][5, 0] == float("inf")
    head.max_rows = 0
    assert head.tokens(x) is None


def test_crowded_rows_take_their_own_full_product(kernels):
    """A row whose bound leaves more than MAX_CANDIDATES columns (here every column: an
    all-zero row, whose logits all tie) is decided by its own full product, beside rows the
    route decides."""
    from tierserve.workers.backends import greedy

    kernels = _without_int8(_greedy_backend(kernels))
    w = _lm_head_case(600, 64, seed=5)
    head = GreedyHead(PanelWeight(w, kernels), w, kernels)
    x = torch.randn(3, 64)
    x[1] = 0
    want = kernels.argmax_rows(head.panel.linear(x, None))
    raw = kernels.greedy_tokens(head.approx.linear(x, None), x, head.panel.panels, head.norms,
                                head.devs, 600, head.gamma(64), None, greedy.MAX_CANDIDATES)
    assert raw[1] == -2 and raw[0] == want[0] and raw[2] == want[2]
    assert torch.equal(head.tokens(x), want) and want[1] == 0


def test_bf16_pair_panels_where_the_cpu_has_the_dot_product(kernels):
    """bf16 weights of an even K are packed in k pairs exactly where the backend's library runs
    AVX512_BF16 (an AVX-512 build on a CPU with it); odd K and other dtypes keep the widening
    layout. Both layouts give back the weight and its rows, and their products agree within
    the output's rounding."""
    features = detect_cpu_features()
    assert kernels.bf16_pairs == (kernels.name != "avx2" and "avx512_bf16" in features.flags)
    assert ("bf16_pairs" in kernels.describe()["paths"]) == kernels.bf16_pairs
    g = torch.Generator().manual_seed(3)
    for k, n in [(64, 100), (576, 960), (33, 40)]:
        w = torch.randn(n, k, generator=g).bfloat16()
        x = torch.randn(5, k, generator=g).bfloat16()
        pairs, widen = PanelWeight(w, kernels), PanelWeight(w, _half_layout(kernels, w.dtype,
                                                                            "widen"))
        assert pairs.pairs == (kernels.bf16_pairs and k % 2 == 0) and not widen.pairs
        ids = torch.tensor([0, 31, 32, n - 1])
        for packed in (pairs, widen):
            assert torch.equal(packed.weight(), w) and torch.equal(packed.rows(ids), w[ids])
        torch.testing.assert_close(pairs.linear(x, None).float(), widen.linear(x, None).float(),
                                   rtol=2 ** -7, atol=1e-6)
    assert not PanelWeight(torch.randn(40, 64), kernels).pairs
    assert not PanelWeight(torch.randn(40, 64).half(), kernels).pairs


def test_onednn_weights_leave_decode_batches_to_pair_panels(kernels):
    """Where oneDNN runs bf16 natively, its packed weight still hands single rows to the panel
    kernel, and bf16 pair panels up to PAIR_PANEL_MAX_ROWS rows (they stream the weight once
    at near memory bandwidth, oneDNN's small products do not)."""
    from tierserve.workers.backends.linear import PAIR_PANEL_MAX_ROWS

    if not PackedWeight.applies_to(torch.zeros(2, 2, dtype=torch.bfloat16)):
        pytest.skip("oneDNN is not available")
    w = torch.randn(100, 64).bfloat16()
    for backend in (kernels, _half_layout(kernels, w.dtype, "widen")):
        packed = PackedWeight(w, backend)
        limit = PAIR_PANEL_MAX_ROWS if packed.panel.pairs else 1
        assert packed.panel_takes(1) and packed.panel_takes(limit)
        assert not packed.panel_takes(limit + 1)
        for m in (1, limit, limit + 1):
            x = torch.randn(m, 64).bfloat16()
            torch.testing.assert_close(packed.linear(x, None).float(), F.linear(x, w).float(),
                                       rtol=2 ** -7, atol=1e-5)


@pytest.mark.parametrize("vocab", [600, 5000])
def test_int8_route_gives_crowded_rows_their_full_product(kernels, vocab):
    """The int8 route's all-zero row: past MAX_CANDIDATES after both passes (600 columns), or
    already after the first, which it then does not narrow (5000, past 16 x MAX_CANDIDATES):
    -2 either way, and the head's tokens are the full product's."""
    from tierserve.workers.backends import greedy

    kernels = _greedy_backend(kernels)
    if not kernels.int8_head:
        pytest.skip(f"the {kernels.name} backend has no int8 pass on this CPU")
    w = _lm_head_case(vocab, 64, seed=6)
    head = GreedyHead(PanelWeight(w, kernels), w, kernels)
    x = torch.randn(3, 64)
    x[1] = 0
    want = kernels.argmax_rows(head.panel.linear(x, None))
    raw = kernels.int8_greedy_tokens(x, *head.int8, head.panel.panels, head.norms, head.devs,
                                     vocab, head.gamma(64), greedy.MAX_CANDIDATES)
    assert raw[1] == -2 and raw[0] == want[0] and raw[2] == want[2]
    assert torch.equal(head.tokens(x), want) and want[1] == 0


@pytest.mark.parametrize("m", [1, 13, 64])
@pytest.mark.parametrize("vocab,k", [(1000, 64), (3001, 576)])
def test_a_q8_0_code_head_takes_the_int8_route(kernels, m, vocab, k):
    """A head that runs from Q8_0 codes (a GGUF file's, or quantized at load) takes the int8
    route where the CPU has it: the codes are its approximation with no error of their own,
    and its exact columns rebuild them as linear_q8_0 does, so the token is the one the
    codes' full product gives, bit for bit (ties, near-ties and all-zero rows included).
    Without the int8 pass such a head has no route, nor has a half-precision head of codes
    (its product rounds the logits to its dtype)."""
    kernels = _greedy_backend(kernels)
    w = _lm_head_case(vocab, k, seed=m + vocab + 7)
    method = QuantPanelWeight.quantize(w, "q8_0", kernels)
    half = w.to(torch.bfloat16)
    assert not GreedyHead.applies_to(half, kernels, QuantPanelWeight.quantize(half, "q8_0",
                                                                              kernels))
    if not kernels.int8_head:
        assert not GreedyHead.applies_to(w, kernels, method)
        return
    assert GreedyHead.applies_to(w, kernels, method)
    head = GreedyHead(method, w, kernels)
    assert head.approx is method and float(head.devs.abs().max()) == 0.0
    rebuilt = method.weight()
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g) * torch.linspace(0.1, 30, m)[:, None]
    x[0] = rebuilt[4] * 50
    if m > 2:
        x[1] = rebuilt[5] * 50 + torch.randn(k, generator=g) * 1e-3
        x[2] = 0
    want = kernels.argmax_rows(method.linear(x, None))
    got = head.tokens(x)
    assert got is not None and torch.equal(got, want)
    if m > 2:
        assert got[2] == 0


@pytest.mark.parametrize("narrow", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 7, 64, 300])
def test_fp32_weight_of_half_values_keeps_half_panels_and_the_fp32_products(kernels, narrow, m):
    """An fp32 weight whose every value is a bf16 (fp16) value, as a half-precision checkpoint
    loaded in fp32 has, keeps its panels in that dtype: half the bytes, and products (with or
    without bias, on every route: panel kernel, AMX or MKL) bitwise the fp32 panels'."""
    w, x, b = _case(m, 600, 200, seed=9)
    w = w.to(narrow).float()
    wide, compact = PanelWeight(w, kernels), PanelWeight.half_panels(w, kernels)
    assert compact is not None and compact.panels.dtype == narrow and 2 * compact.nbytes == wide.nbytes
    for bias in (None, b):
        assert torch.equal(compact.linear(x, bias), wide.linear(x, bias))
    assert compact.weight().dtype == torch.float32 and torch.equal(compact.weight(), w)
    ids = torch.tensor([0, 5, 199])
    assert torch.equal(compact.rows(ids), w[ids])


def test_fp32_weights_off_the_half_grid_keep_fp32_panels(kernels):
    w, _, _ = _case(1, 64, 40, seed=3)
    assert PanelWeight.half_panels(w, kernels) is None
    half = w.bfloat16().float()
    off = dataclasses.replace(kernels, quant_linear=False)  # quantized_linears=False
    assert PanelWeight.half_panels(half, off) is None
    half[3, 7] = 1 / 3  # one value on neither grid
    assert PanelWeight.half_panels(half, kernels) is None


def test_a_bf16_checkpoint_in_fp32_runs_from_half_panels_with_the_same_tokens(tmp_path):
    from safetensors.torch import load_file, save_file

    from tierserve import LLM, SamplingParams
    path = make_tiny_llama(tmp_path / "llama")
    weights = path / "model.safetensors"
    save_file({k: v.bfloat16() for k, v in load_file(weights).items()}, weights)
    prompts = [[(5 * i + 3 * j) % 300 + 3 for j in range(4 + 7 * i)] for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs = {}
    for compact in (False, True):
        with LLM(str(path), block_size=4, dtype="float32", quantized_linears=compact) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            runs[compact] = ([o.outputs[0].token_ids for o in outs],
                             llm.stats()["weight_bytes"], llm.stats()["cpu_backend"])
    assert runs[True][0] == runs[False][0]
    if runs[True][2] != "torch":  # kernel backends hold the decoder's linears in bf16
        assert runs[True][1] < 0.75 * runs[False][1]

"""Weights as coded panels (workers/backends/coded.py): fp32 in 28 bits a value
(csrc/linear_coded.cpp), bf16 pair panels in 12 (csrc/linear_coded_pairs.cpp). The weight is
rebuilt exactly and every product is bitwise the uncoded panels', on every kernel ISA and route
(one row, a row tile, several tiles, slices, past the panel kernel's rows)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.checkpoints import make_tiny_llama
from tierserve.workers.backends.coded import MAX_ESCAPE_FRACTION, CodedPairPanels, CodedPanelWeight
from tierserve.workers.backends.linear import PackedWeight, PanelWeight
from tierserve.workers.model.loader import load_model


def _coding(kernels):
    """The backend with coded fp32 panels on: the AVX2 backend builds and runs their kernels
    but does not choose them (slower there than fp32 panels)."""
    return dataclasses.replace(kernels, coded_linear=True)


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    """A trained-looking weight (Gaussian, a few binades) with the values coding must keep:
    zeros of both signs, subnormals, values far below and above the rest."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.03
    special = torch.tensor([0.0, -0.0, 1e-40, -1e-30, 3e-9, 7.5, -2.0 ** 100, 1e38])
    flat = w.view(-1)
    flat[torch.randperm(flat.numel(), generator=g)[: len(special)]] = special
    return w


@pytest.mark.parametrize("k,n", [(64, 96), (600, 50), (576, 960), (1536, 70), (33, 310)])
def test_coded_panels_rebuild_the_weight_bit_for_bit(kernels, k, n):
    kernels = _coding(kernels)
    w = _weight(n, k, seed=k + n)
    coded = CodedPanelWeight.encode(w, kernels)
    assert coded is not None and coded.escapes.shape[0] > 0  # the special values escape
    assert torch.equal(coded.weight().view(torch.int32), w.view(torch.int32))
    plain = PanelWeight(w, kernels)
    assert torch.equal(coded.panels().view(torch.int32), plain.panels.view(torch.int32))
    assert coded.nbytes < 0.9 * plain.nbytes


# 1: a lone row; 5, 12: one row tile; 13, 37: tiles that decode on their own; 64, 193, 300:
# slices; 5000: past every backend's panel rows (MKL, or AMX, on the rebuilt weight).
@pytest.mark.parametrize("m", [1, 5, 12, 13, 37, 64, 193, 300, 5000])
@pytest.mark.parametrize("k,n", [(64, 96), (600, 50), (576, 200)])
def test_coded_products_are_the_fp32_panels_products(kernels, m, k, n):
    kernels = _coding(kernels)
    w = _weight(n, k, seed=m + k)
    g = torch.Generator().manual_seed(m)
    x, bias = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
    coded, plain = CodedPanelWeight.encode(w, kernels), PanelWeight(w, kernels)
    for b in (None, bias):
        assert torch.equal(coded.linear(x, b), plain.linear(x, b))
    # Rows of a strided input (a view of wider rows), as the layer stack hands some over.
    wide = torch.randn(m, k + 8, generator=g)[:, :k]
    assert torch.equal(coded.linear(wide, None), plain.linear(wide, None))


def test_weights_with_many_escapes_or_the_option_off_keep_fp32_panels(kernels):
    chosen = kernels.coded_linear
    assert chosen == (kernels.isa != "avx2")
    kernels = _coding(kernels)
    g = torch.Generator().manual_seed(1)
    # Magnitudes spread over 2^-60 .. 2^60: far more than 16 top bytes in use.
    spread = torch.randn(64, 128, generator=g) * 2.0 ** torch.randint(-60, 60, (64, 128),
                                                                       generator=g)
    assert CodedPanelWeight.encode(spread, kernels) is None
    w = _weight(64, 128, seed=2)
    off = dataclasses.replace(kernels, quant_linear=False)  # quantized_linears=False
    assert CodedPanelWeight.encode(w, off) is None
    assert CodedPanelWeight.encode(w.bfloat16(), kernels) is None
    assert isinstance(off.linear_method(w), PanelWeight)
    assert isinstance(kernels.linear_method(w), CodedPanelWeight)
    assert CodedPanelWeight.encode(w, dataclasses.replace(kernels, coded_linear=False)) is None
    # bf16 values: half panels are narrower still; a head keeps fp32 panels (its embedding
    # looks rows up in them).
    assert isinstance(kernels.linear_method(w.bfloat16().float()), PanelWeight)
    assert isinstance(kernels.linear_method(w, head=True), PanelWeight)
    # None above for the limit's sake: the kernel codes either weight, escaping past it or not.
    spread_escapes = kernels.ops.coded_encode(spread)[2].shape[0]
    assert spread_escapes > MAX_ESCAPE_FRACTION * spread.numel()
    assert 0 < kernels.ops.coded_encode(w)[2].shape[0] <= MAX_ESCAPE_FRACTION * w.numel()


def test_coded_kernel_rejects_bad_inputs(kernels):
    w = _weight(40, 64, seed=3)
    coded = CodedPanelWeight.encode(w, _coding(kernels))
    ops, x = kernels.ops, torch.randn(2, 64)
    body, table, escapes = coded.kernel_tensors()
    with pytest.raises(RuntimeError, match="float32"):
        ops.linear_coded(x.double(), body, table, escapes, None, 40)
    with pytest.raises(RuntimeError, match="body"):
        ops.linear_coded(torch.randn(2, 65), body, table, escapes, None, 40)
    with pytest.raises(RuntimeError, match="body"):
        ops.linear_coded(x, body[:-1].clone(), table, escapes, None, 40)
    with pytest.raises(RuntimeError, match="table"):
        ops.linear_coded(x, body, table[:-1].clone(), escapes, None, 40)
    with pytest.raises(RuntimeError, match="escape"):
        ops.linear_coded(x, body, table, torch.zeros(escapes.shape[0] + 1, 2, dtype=torch.int32),
                         None, 40)
    with pytest.raises(RuntimeError, match="bias"):
        ops.linear_coded(x, body, table, escapes, torch.zeros(39), 40)
    with pytest.raises(RuntimeError, match="float32"):
        coded.linear(x.bfloat16(), None)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_checkpoint_runs_from_coded_panels_with_the_same_tokens(tmp_path, dtype):
    """A dense checkpoint's decoder linears load as coded panels on a kernel backend that takes
    them (fp32: AVX-512; bf16: AVX512_BF16): the engine gives the tokens it gives with them off,
    from fewer weight bytes."""
    from tierserve import LLM, SamplingParams
    path = make_tiny_llama(tmp_path / "llama")
    prompts = [[(5 * i + 3 * j) % 300 + 3 for j in range(4 + 7 * i)] for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs = {}
    for coded in (False, True):
        with LLM(str(path), block_size=4, dtype=dtype, quantized_linears=coded) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            runs[coded] = ([o.outputs[0].token_ids for o in outs],
                           llm.stats()["weight_bytes"], llm.stats()["cpu_backend"])
    assert runs[True][0] == runs[False][0]
    if dtype == "float32" and runs[True][2] not in ("torch", "avx2"):
        assert runs[True][1] < runs[False][1]


def test_a_tiny_fp32_model_loads_its_decoder_linears_coded(tmp_path, kernels):
    kernels = _coding(kernels)
    path = make_tiny_llama(tmp_path / "llama")
    _, model = load_model(str(path), torch.float32, "cpu", kernels)
    methods = [m.method for m in model.modules() if getattr(m, "method", None) is not None]
    coded = [m for m in methods if isinstance(m, CodedPanelWeight)]
    # Every decoder linear (q/k/v, o, gate/up, down per layer); the head keeps its panels.
    assert len(coded) == len(methods) - 1


def _pairs_backend(kernels):
    if not kernels.bf16_pairs:
        pytest.skip("bf16 pair panels need AVX512_BF16")
    return kernels


@pytest.mark.parametrize("m", [1, 5, 12, 13, 64, 193])
@pytest.mark.parametrize("k,n", [(64, 96), (600, 50), (576, 200), (310, 33)])
def test_coded_pair_panels_are_the_pair_panels(kernels, m, k, n):
    kernels = _pairs_backend(kernels)
    w = _weight(n, k, seed=m + n).bfloat16()
    panel = PanelWeight(w, kernels)
    coded = CodedPairPanels.encode(panel, kernels)
    assert coded is not None and coded.escapes.shape[0] > 0
    assert torch.equal(coded.panels().view(torch.int16), panel.panels.view(torch.int16))
    assert torch.equal(coded.weight().view(torch.int16), w.view(torch.int16))
    assert coded.nbytes < 0.8 * panel.nbytes
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g).bfloat16()
    for b in (None, torch.randn(n, generator=g).bfloat16()):
        assert torch.equal(coded.linear(x, b), panel.linear(x, b))


def test_a_bf16_weight_keeps_coded_pair_panels_beside_onednn(kernels):
    kernels = _pairs_backend(kernels)
    w = _weight(96, 128, seed=5).bfloat16()
    method = kernels.linear_method(w)
    assert isinstance(method, PackedWeight) and isinstance(method.panel, CodedPairPanels)
    plain = PackedWeight(w, kernels)  # its own pair panels
    for m in (1, 7, 64, 65):  # pair panels up to 64 rows, oneDNN past them
        x = torch.randn(m, 128).bfloat16()
        assert torch.equal(method.linear(x, None), plain.linear(x, None))
    off = dataclasses.replace(kernels, quant_linear=False)
    assert isinstance(off.linear_method(w).panel, PanelWeight)
    ops, x = kernels.ops, torch.randn(2, 128).bfloat16()
    body, table, escapes = method.panel.kernel_tensors()
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.linear_coded_pairs(x.float(), body, table, escapes, None, 96)
    with pytest.raises(RuntimeError, match="body"):
        ops.linear_coded_pairs(torch.randn(2, 130).bfloat16(), body, table, escapes, None, 96)
    with pytest.raises(RuntimeError, match="table"):
        ops.linear_coded_pairs(x, body, table[:-1].clone(), escapes, None, 96)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_stack_runs_coded_panels_bitwise_as_the_layers(tmp_path, kernels, dtype,
                                                             monkeypatch):
    """The layer stack's coded kinds (csrc/layer_stack.cpp) give the per-layer path's logits
    and pools, on every kernel ISA (coded fp32 panels forced on AVX2, where the backend does not
    choose them): a prefill, then single decodes and a batch."""
    import random

    from tests.checkpoints import PagedRunner, Work
    from tierserve.workers.backends.stack import KernelLayerStack
    kernels = _coding(kernels)
    if dtype == torch.bfloat16 and not kernels.bf16_pairs:
        pytest.skip("coded bf16 pair panels need AVX512_BF16")
    taken = []
    run = KernelLayerStack.run
    monkeypatch.setattr(KernelLayerStack, "run", lambda self, *a: taken.append(
        run(self, *a) is not None) or run(self, *a))
    model = load_model(str(make_tiny_llama(tmp_path / "llama")), dtype, "cpu", kernels)[1]
    coded = [m.method if dtype == torch.float32 else m.method.panel
             for name, m in model.named_modules()
             if getattr(m, "method", None) is not None and "lm_head" not in name]
    assert coded and all(isinstance(c, (CodedPanelWeight, CodedPairPanels)) for c in coded)
    rng = random.Random(2)
    seqs = [[rng.randrange(3, 300) for _ in range(n)] for n in (6, 11)]
    stacked, plain = PagedRunner(model, seed=1), PagedRunner(model, seed=1)

    def both(works):
        model.model.use_layer_stack = True
        a = stacked.step(works)
        model.model.use_layer_stack = False
        b = plain.step(works)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    both([Work(f"s{i}", s, 0) for i, s in enumerate(seqs)])
    for step in range(4):
        live = seqs[: 1 + step % 2]
        for s in live:
            s.append(rng.randrange(3, 300))
        both([Work(f"s{i}", s[-1:], len(s) - 1) for i, s in enumerate(live)])
    assert len(taken) == 5 and all(taken)
    for (k1, v1), (k2, v2) in zip(stacked.kv_caches, plain.kv_caches):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.parametrize("tied", [False, True])
def test_decode_weight_bytes_count_what_a_lone_decode_reads(tmp_path, backend, tied):
    """decode_weight_bytes (stats()' figure): each decoder weight as its single-row route holds
    it, the norms, and the head's greedy route where it has one, never the embedding table. On
    the torch backend the routes are the checkpoint's tensors: all but the embedding, which a
    tied head reads whole. On a kernel backend coded panels and the greedy head's codes read
    fewer bytes than the weights held, and the head's own panels, which only the candidates'
    columns read, are not counted."""
    from safetensors.torch import load_file
    path = make_tiny_llama(tmp_path / "llama", tie_word_embeddings=tied)
    file_bytes = {k: v.numel() * v.element_size()
                  for k, v in load_file(path / "model.safetensors").items()}
    _, model = load_model(str(path), torch.float32, "cpu", backend)
    read = model.decode_weight_bytes()
    if backend.name == "torch":
        assert model.lm_head.greedy_head is None
        embed = 0 if tied else file_bytes["model.embed_tokens.weight"]
        assert read == sum(file_bytes.values()) - embed
        return
    head = model.lm_head
    assert head.greedy_head is not None
    panels = sum(t.numel() * t.element_size() for t in head.method.tensors())
    assert read + panels <= model.weight_bytes()

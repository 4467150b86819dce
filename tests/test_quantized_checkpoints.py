"""GPTQ and AWQ checkpoints: a tiny Llama's linears quantized to 4 (or 8) bit groups and
packed the way AutoGPTQ / GPTQModel / AutoAWQ write them (the packers here follow those
formats), then loaded: the weights the loader makes are the groups' dequantized values, and
greedy tokens equal transformers' on a dense folder of those values."""
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.checkpoints import hf_greedy, load_hf, make_tiny_llama
from tierserve import LLM, SamplingParams
from tierserve.workers.model.loader import iter_weights

_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output of a word's i-th value


def _words(values: np.ndarray) -> np.ndarray:
    return values.astype(np.uint32).view(np.int32)


def _pack_rows(q: np.ndarray, bits: int) -> np.ndarray:
    """[rows, cols] -> words [rows / per, cols], row r * per + i in bits i * bits."""
    per = 32 // bits
    out = np.zeros((q.shape[0] // per, q.shape[1]), dtype=np.uint64)
    for i in range(per):
        out |= q[i::per].astype(np.uint64) << np.uint64(bits * i)
    return _words(out)


def _pack_cols(q: np.ndarray, bits: int, order=None) -> np.ndarray:
    """[rows, cols] -> words [rows, cols / per], value i of word c from column c * per +
    order[i]."""
    per = 32 // bits
    order = order or tuple(range(per))
    out = np.zeros((q.shape[0], q.shape[1] // per), dtype=np.uint64)
    for i in range(per):
        out |= q[:, order[i]::per].astype(np.uint64) << np.uint64(bits * i)
    return _words(out)


def _quantize(w: torch.Tensor, bits: int, group: int, perm: np.ndarray | None):
    """w [out, in] -> codes [in, out], zeros and fp16 scales [groups, out], each input's
    group, and the dequantized weight [out, in] the codes stand for."""
    wt = w.T.numpy().astype(np.float64)                    # [in, out]
    n_in = wt.shape[0]
    order = perm if perm is not None else np.arange(n_in)
    g_idx = np.empty(n_in, dtype=np.int64)
    g_idx[order] = np.arange(n_in) // group
    groups, top = n_in // group, (1 << bits) - 1
    scales = np.zeros((groups, wt.shape[1]), dtype=np.float16)
    zeros = np.zeros((groups, wt.shape[1]), dtype=np.int64)
    for g in range(groups):
        rows = wt[g_idx == g]
        lo, hi = rows.min(0), rows.max(0)
        scales[g] = np.maximum((hi - lo) / top, 1e-4)
        zeros[g] = np.clip(np.round(-lo / scales[g].astype(np.float64)), 0, top)
    s = scales.astype(np.float32)[g_idx]
    q = np.clip(np.round(wt / s + zeros[g_idx]), 0, top).astype(np.int64)
    dense = torch.from_numpy(((q - zeros[g_idx]).astype(np.float32) * s).T.copy())
    return q, zeros, scales, g_idx, dense


def _write(src, dst, fmt: str, bits: int = 4, act_order: bool = False):
    """The quantized folder at dst and the dense one of the same values at dst-dense."""
    rng = np.random.default_rng(0)
    state = load_file(str(src / "model.safetensors"))
    quant, dense = {}, {}
    for name, w in state.items():
        module = name.rsplit(".", 2)[-2]
        if module not in _LINEARS:
            quant[name] = dense[name] = w
            continue
        prefix = name[:-len(".weight")]
        perm = rng.permutation(w.shape[1]) if act_order else None
        q, z, s, g_idx, values = _quantize(w, bits, 32, perm)
        dense[name] = values
        if fmt == "awq":
            quant[f"{prefix}.qweight"] = torch.from_numpy(_pack_cols(q, 4, AWQ_ORDER))
            quant[f"{prefix}.qzeros"] = torch.from_numpy(_pack_cols(z, 4, AWQ_ORDER))
        else:
            quant[f"{prefix}.qweight"] = torch.from_numpy(_pack_rows(q, bits))
            quant[f"{prefix}.qzeros"] = torch.from_numpy(_pack_cols(z - 1, bits))  # zero - 1
            quant[f"{prefix}.g_idx"] = torch.from_numpy(g_idx.astype(np.int32))
        quant[f"{prefix}.scales"] = torch.from_numpy(s)
    config = json.loads((src / "config.json").read_text())
    qc = {"quant_method": fmt, "bits": bits, "group_size": 32}
    qc.update({"version": "gemm", "zero_point": True} if fmt == "awq" else
              {"desc_act": act_order, "sym": False})
    for folder, tensors, cfg in ((dst, quant, dict(config, quantization_config=qc)),
                                 (dst.parent / (dst.name + "-dense"), dense, config)):
        folder.mkdir()
        save_file(tensors, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps(cfg))
        if (src / "generation_config.json").exists():
            shutil.copy(src / "generation_config.json", folder)
    return dst, dst.parent / (dst.name + "-dense")


@pytest.mark.parametrize("fmt, bits, act_order", [("gptq", 4, False), ("gptq", 4, True),
                                                  ("gptq", 8, False), ("awq", 4, False)])
def test_a_quantized_checkpoint_loads_as_its_dequantized_weights(tmp_path, fmt, bits,
                                                                 act_order):
    src = make_tiny_llama(tmp_path / "llama")
    quant, dense = _write(src, tmp_path / fmt, fmt, bits, act_order)
    got = dict(iter_weights(str(quant)))
    want = load_file(str(dense / "model.safetensors"))
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name].to(tensor.dtype), tensor), name
    hf = load_hf(dense)
    prompts = [[5, 9, 31, 77, 12], [200, 201, 3]]
    with LLM(str(quant), block_size=4) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0,
                                                    ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 8) for p in prompts]


def test_other_quantization_methods_are_refused_by_name(tmp_path):
    src = make_tiny_llama(tmp_path / "llama")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(dict(config, quantization_config={
        "quant_method": "bitsandbytes", "load_in_4bit": True})))
    with pytest.raises(ValueError, match="bitsandbytes"):
        dict(iter_weights(str(src)))

